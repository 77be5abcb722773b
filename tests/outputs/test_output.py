"""Writing a merged model as a directory that ``from_pretrained`` loads (raot_hf.outputs)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
import yaml
from safetensors import safe_open

from raot_hf.errors import RaotError
from raot_hf.outputs import (
    file_sha256,
    hash_checkpoint_files,
    parse_size,
    render_model_card,
    shards,
    write_merged_repo,
)
from raot_hf.outputs.card import _FALLBACK_TEMPLATE
from raot_hf.testing import example_inputs, tiny_model

CARD = {
    "model_a": "org/model-a",
    "model_b": "org/model-b",
    "revision_a": "abc123",
    "revision_b": "def456",
    "method": "RaOT (activation statistics)",
    "merge_rule": "linear",
    "alpha": 0.5,
    "scope": "heads, MLP units, residual stream",
    "gate_rows": [
        {"transform": "mlp", "layer": 0, "identity": 0.91, "estimate": 0.12, "margin": 0.05, "applied": True},
        {"transform": "heads", "layer": 1, "identity": 0.2, "estimate": 0.19, "margin": 0.05, "applied": False},
        {"transform": "residual", "layer": None, "identity": 0.5, "estimate": 0.1, "margin": 0.05, "applied": True},
    ],
    "checks": [{"name": "max |B′ − B|", "kind": "exact", "value": 3.2e-7, "threshold": 1e-5, "passed": True}],
    "summary": "A test merge.",
    "command": "raot-hf merge org/model-a org/model-b --out merged",
    "pipeline_tag": "text-classification",
    "version": "0.1.0",
}
AUTO = {
    "sequence": transformers.AutoModelForSequenceClassification,
    "mlm": transformers.AutoModelForMaskedLM,
    "image": transformers.AutoModelForImageClassification,
}


def _write(out, model, **kwargs):
    kwargs.setdefault("report", {"settings": {"alpha": 0.5}})
    kwargs.setdefault("card", CARD)
    return write_merged_repo(out, model, **kwargs)


def _reload_and_compare(out: Path, model, head: str):
    reloaded, info = AUTO[head].from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(reloaded) is type(model) and reloaded.dtype == model.dtype
    inputs = example_inputs(model)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(**inputs).logits, model(**inputs).logits)
    return reloaded


def _weight_map(out: Path) -> dict[str, str]:
    return json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]


def _siblings(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


@pytest.mark.parametrize(
    "model_type, head",
    [("bert", "sequence"), ("bert", "mlm"), ("vit", "image"), ("roberta", "mlm"), ("deberta", "mlm")],
)
def test_reloads_with_same_keys_as_save_pretrained(tmp_path, model_type, head):
    model = tiny_model(model_type, head, seed=3)
    out = _write(tmp_path / "merged", model)
    assert (out / "config.json").is_file() and (out / "README.md").is_file() and (out / "raot_report.json").is_file()
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(model).__name__]
    assert set(_weight_map(out).values()) == {"model.safetensors"}
    _reload_and_compare(out, model, head)

    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    with safe_open(str(reference / "model.safetensors"), framework="pt") as handle:
        assert set(_weight_map(out)) == set(handle.keys())


def test_tied_embeddings_written_once_and_tied_after_reload(tmp_path):
    model = tiny_model("bert", "mlm", dtype=torch.float32)
    out = _write(tmp_path / "out", model)
    keys = set(_weight_map(out))
    assert "bert.embeddings.word_embeddings.weight" in keys
    assert "cls.predictions.decoder.weight" not in keys
    reloaded = _reload_and_compare(out, model, "mlm")
    decoder = reloaded.cls.predictions.decoder.weight
    assert decoder.data_ptr() == reloaded.bert.embeddings.word_embeddings.weight.data_ptr()


def test_small_shards_make_an_index_and_reload(tmp_path):
    model = tiny_model("bert", "sequence", dtype=torch.float32)
    limit = 3000
    out = _write(tmp_path / "out", model, max_shard_size=limit)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shard_files) > 2
    assert sorted(set(index["weight_map"].values())) == shard_files
    assert shard_files[0] == f"model-00001-of-{len(shard_files):05d}.safetensors"
    total = 0
    for name in shard_files:
        tensors = safetensors.torch.load_file(str(out / name))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= limit or len(tensors) == 1
        total += size
    assert index["metadata"]["total_size"] == total
    _reload_and_compare(out, model, "sequence")


def test_writing_twice_gives_identical_bytes(tmp_path):
    model = tiny_model("vit", "image")
    first = _write(tmp_path / "one", model, max_shard_size="4KB")
    second = _write(tmp_path / "two", model, max_shard_size="4KB")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_model_card_front_matter_and_tables(tmp_path):
    out = _write(tmp_path / "out", tiny_model("bert", "sequence"))
    text = (out / "README.md").read_text(encoding="utf-8")
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["base_model"] == ["org/model-a", "org/model-b"]
    assert meta["tags"] == ["merge", "raot"]
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-classification"
    assert "| mlp | 0 | 0.91 | 0.12 | 0.05 | yes |" in text
    assert "| heads | 1 | 0.2 | 0.19 | 0.05 | no |" in text
    assert "| residual | — | 0.5 | 0.1 | 0.05 | yes |" in text
    assert "2 of 3 transforms beat the identity" in text
    assert "3.2e-07" in text and "exact" in text
    assert CARD["command"] in text and "abc123" in text and "def456" in text
    assert "{{" not in text


def test_model_card_all_rejected_local_paths_and_fallback_template():
    rows = [dict(row, applied=False) for row in CARD["gate_rows"]]
    card = dict(CARD, model_b="/local/checkpoints/b", gate_rows=rows, pipeline_tag=None)
    for template in (None, _FALLBACK_TEMPLATE):
        text = render_model_card(card, template=template)
        meta = yaml.safe_load(text.split("---\n")[1])
        assert meta["base_model"] == ["org/model-a"]  # a local path is no Hub id
        assert "pipeline_tag" not in meta and meta["tags"] == ["merge", "raot"]
        assert "already share a basis" in text
        assert "/local/checkpoints/b" in text and "{{" not in text


def test_model_card_front_matter_quotes_ambiguous_scalars():
    text = render_model_card(dict(CARD, model_a="2024", model_b="true"))
    assert yaml.safe_load(text.split("---\n")[1])["base_model"] == ["2024", "true"]


def test_model_card_errors():
    with pytest.raises(RaotError, match="model_b"):
        render_model_card({"model_a": "org/a"})
    with pytest.raises(RaotError, match="unknown placeholder"):
        render_model_card(CARD, template="{{front_matter}} {{nonsense}}")


def test_existing_directory_is_refused_and_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(RaotError, match="exists; pass --overwrite"):
        _write(out, tiny_model("bert", "sequence"))
    assert _siblings(tmp_path) == ["out"]
    assert _siblings(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"


def test_overwrite_replaces_a_previous_output(tmp_path):
    out = tmp_path / "out"
    _write(out, tiny_model("bert", "sequence", seed=1), max_shard_size=3000)
    (out / "stale.txt").write_text("from the old run")
    newer = tiny_model("bert", "sequence", seed=2)
    _write(out, newer, overwrite=True)
    assert _siblings(tmp_path) == ["out"]
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    _reload_and_compare(out, newer, "sequence")


def test_overwrite_refuses_a_directory_that_is_no_model(tmp_path):
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("not a model")
    with pytest.raises(RaotError, match="not a model directory"):
        _write(out, tiny_model("bert", "sequence"), overwrite=True)
    assert _siblings(out) == ["notes.txt"]


def test_the_streaming_writer_writes_the_bytes_safetensors_writes(tmp_path):
    """Tensor by tensor, every dtype a model holds, views and non-contiguous tensors included:
    the same file, byte for byte, as safetensors' own writer, and the same tensors read back."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g, dtype=torch.float64)
    tensors = {
        "z.f64": base,
        "a.f32.transposed": torch.randn(5, 7, generator=g).T,
        "m.bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "m.f16": torch.randn(3, 3, generator=g).to(torch.float16),
        "b.view": base[2:4, 1:],
        "ids": torch.arange(5, dtype=torch.int64),
        "i32": torch.arange(3, dtype=torch.int32),
        "i8": torch.arange(3, dtype=torch.int8),
        "u8": torch.arange(7, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    ours = tmp_path / "ours"
    ours.mkdir()
    shards.write_safetensors_shards(ours, tensors, 10**9)
    reference = {k: v.contiguous().clone() for k, v in tensors.items()}
    safetensors.torch.save_file(reference, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    (written,) = ours.glob("*.safetensors")
    assert written.read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    with safe_open(str(written), "pt") as handle:
        assert all(torch.equal(handle.get_tensor(k), v) for k, v in tensors.items())


def _fail_on_second_shard(monkeypatch):
    """The second shard's file write fails (a full disk), after the first shard was written."""
    real_write = shards._write_shard
    calls = []

    def write_shard(path, tensors, names, metadata, *rest):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"partial")
            raise OSError("disk full (injected)")
        return real_write(path, tensors, names, metadata, *rest)

    monkeypatch.setattr(shards, "_write_shard", write_shard)
    return calls


def test_failure_mid_write_leaves_nothing_behind(tmp_path, monkeypatch):
    calls = _fail_on_second_shard(monkeypatch)
    with pytest.raises(OSError, match="injected"):
        _write(tmp_path / "out", tiny_model("bert", "sequence"), max_shard_size=3000)
    assert len(calls) == 2
    assert _siblings(tmp_path) == []


def test_failure_mid_overwrite_keeps_the_old_output(tmp_path, monkeypatch):
    out = tmp_path / "out"
    old = tiny_model("bert", "sequence", seed=1)
    _write(out, old)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _fail_on_second_shard(monkeypatch)
    with pytest.raises(OSError, match="injected"):
        _write(out, tiny_model("bert", "sequence", seed=2), max_shard_size=3000, overwrite=True)
    assert _siblings(tmp_path) == ["out"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_validation_happens_before_any_write(tmp_path, monkeypatch):
    with pytest.raises(RaotError, match="max shard size"):
        _write(tmp_path / "out", tiny_model("bert", "sequence"), max_shard_size=0)
    with pytest.raises(RaotError, match="no transformers config"):
        _write(tmp_path / "out", torch.nn.Linear(2, 2))
    with pytest.raises(RaotError, match="model_a"):
        _write(tmp_path / "out", tiny_model("bert", "sequence"), card={"model_b": "x"})
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RaotError, match="not a directory"):
        _write(blocker, tiny_model("bert", "sequence"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(RaotError, match=f"{tmp_path.name}.*not writable"):
        _write(tmp_path / "out", tiny_model("bert", "sequence"))
    assert _siblings(tmp_path) == ["file"]


@pytest.fixture
def tokenizer_dir(tmp_path):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "merge", "two", "models"]
    tokenizer = transformers.BertTokenizerFast(vocab={word: i for i, word in enumerate(words)})
    directory = tmp_path / "model_a"
    tokenizer.save_pretrained(directory)
    return directory


def test_tokenizer_saved_from_a_directory_and_from_an_object(tmp_path, tokenizer_dir):
    model = tiny_model("bert", "sequence")
    expected = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)("merge two models")["input_ids"]
    assert expected == [2, 5, 6, 7, 3]
    from_path = _write(tmp_path / "from_path", model, preprocessor_source=tokenizer_dir)
    from_object = _write(
        tmp_path / "from_object", model, preprocessor_source=transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    )
    for out in (from_path, from_object):
        assert transformers.AutoTokenizer.from_pretrained(out)("merge two models")["input_ids"] == expected
        assert json.loads((out / "config.json").read_text())["model_type"] == "bert"


def test_image_processor_saved(tmp_path):
    source = tmp_path / "vit_a"
    transformers.ViTImageProcessor(size={"height": 8, "width": 8}).save_pretrained(source)
    out = _write(tmp_path / "out", tiny_model("vit", "image"), preprocessor_source=source)
    processor = transformers.AutoImageProcessor.from_pretrained(out)
    assert processor.size == {"height": 8, "width": 8}


def test_unloadable_preprocessor_is_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="raot_hf.outputs.save"):
        out = _write(tmp_path / "out", tiny_model("bert", "sequence"), preprocessor_source=tmp_path / "missing")
    assert any("no tokenizer or processor" in record.getMessage() for record in caplog.records)
    assert not list(out.glob("tokenizer*"))
    _reload_and_compare(out, tiny_model("bert", "sequence"), "sequence")


def test_report_json_is_sorted_and_converts_scalars(tmp_path):
    report = {"z": 1, "a": {"score": np.float32(0.25), "count": np.int64(3), "t": torch.tensor(2.5)}, "m": [Path("x")]}
    out = _write(tmp_path / "out", tiny_model("bert", "sequence"), report=report)
    text = (out / "raot_report.json").read_text()
    assert text.endswith("}\n") and text.index('"a"') < text.index('"m"') < text.index('"z"')
    assert json.loads(text) == {"a": {"count": 3, "score": 0.25, "t": 2.5}, "m": ["x"], "z": 1}
    with pytest.raises(TypeError, match="object"):
        _write(tmp_path / "bad", tiny_model("bert", "sequence"), report={"x": object()})
    assert not (tmp_path / "bad").exists()


def test_hashes(tmp_path):
    out = _write(tmp_path / "out", tiny_model("bert", "sequence"), max_shard_size=3000)
    hashes = hash_checkpoint_files(out)
    expected_names = sorted(["config.json", *(p.name for p in out.glob("*.safetensors"))])
    assert list(hashes) == expected_names
    for name, digest in hashes.items():
        assert digest == hashlib.sha256((out / name).read_bytes()).hexdigest()
    assert file_sha256(out / "README.md") == hashlib.sha256((out / "README.md").read_bytes()).hexdigest()
    with pytest.raises(RaotError, match="not a local directory"):
        hash_checkpoint_files(tmp_path / "nowhere")


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("500mb") == 500 * 10**6
    assert parse_size("1GiB") == 2**30
    assert parse_size(4096) == 4096
    for bad in ("lots", "2XB", -1, "0"):
        with pytest.raises(RaotError):
            parse_size(bad)
