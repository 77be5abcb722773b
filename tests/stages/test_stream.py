"""Merges that read no data, streamed from the checkpoints' files (docs/design.md §7.3): the same
bytes as the in-memory merge, no model ever loaded, refusals before anything is written."""

import json

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file

from raot_hf import RaotError, merge_checkpoints
from raot_hf.cli import main
from raot_hf.testing import clone, tiny_model, tiny_tokenizer

HEADS = {"gpt2": "causal", "llama": "causal", "vit": "image"}


def _family(root, model_type):
    """A base and three small drifts of it, saved as checkpoints."""
    base = tiny_model(model_type, HEADS.get(model_type, "sequence"), dtype=torch.float32)
    paths = []
    for i, name in enumerate(("base", "a", "b", "c")):
        model = clone(base)
        if i:
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g))
        model.save_pretrained(root / name)
        if model_type != "vit":
            tiny_tokenizer().save_pretrained(root / name)
        paths.append(root / name)
    return paths


def _weights(directory):
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


CASES = {
    "linear-2": lambda p: dict(models=p[1:3], alpha=0.3),
    "linear-3": lambda p: dict(models=p[1:], weights=[0.5, 0.3, 0.2]),
    "ties-3": lambda p: dict(models=p[1:], base=p[0], merge_rule="ties", density=0.5, weights=[0.5, 0.3, 0.2]),
    "dare_ties-3": lambda p: dict(models=p[1:], base=p[0], merge_rule="dare_ties", density=0.5),
    "task_arithmetic-2": lambda p: dict(models=p[1:3], base=p[0], merge_rule="task_arithmetic", task_scale=1.3),
    "average-head": lambda p: dict(models=p[1:], head="average"),
    "bfloat16": lambda p: dict(models=p[1:], dtype="bfloat16"),
}


@pytest.mark.parametrize("model_type", ["bert", "gpt2", "llama", "deberta-v2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_merge_is_the_in_memory_merge_bit_for_bit(tmp_path, model_type, case):
    options = CASES[case](_family(tmp_path, model_type))
    models = options.pop("models")
    streamed, report = merge_checkpoints(*models, out=tmp_path / "s", alignment="none", **options)
    loaded, _ = merge_checkpoints(*models, out=tmp_path / "m", alignment="none", stream=False, **options)
    assert report["execution"] == "streamed"
    a, b = _weights(streamed), _weights(loaded)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    config = {
        k: v for k, v in json.loads((streamed / "config.json").read_text()).items() if k != "transformers_version"
    }
    other = {k: v for k, v in json.loads((loaded / "config.json").read_text()).items() if k != "transformers_version"}
    assert config == other
    causal = model_type in ("gpt2", "llama")
    cls = transformers.AutoModelForCausalLM if causal else transformers.AutoModelForSequenceClassification
    _, info = cls.from_pretrained(streamed, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]


def test_no_model_is_loaded_while_streaming(tmp_path, monkeypatch):
    paths = _family(tmp_path, "llama")
    from raot_hf.io import loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr(loading, "load_base_model", refuse)
    out, report = merge_checkpoints(*paths[1:], out=tmp_path / "o", base=paths[0], alignment="none", merge_rule="ties")
    assert report["execution"] == "streamed" and [m["model"] for m in report["models"]] == [1, 2, 3]
    assert "ties" in (out / "README.md").read_text()


def test_renamed_checkpoint_keys_fall_back_to_memory(tmp_path):
    """ViT stores legacy key names: the streamed path declines and the in-memory merge runs."""
    paths = _family(tmp_path, "vit")
    _, report = merge_checkpoints(*paths[1:], out=tmp_path / "o", alignment="none")
    assert report["execution"] == "in memory" and report["model_type"] == "vit"


def test_an_unrelated_base_is_refused_and_nothing_is_written(tmp_path):
    paths = _family(tmp_path, "bert")
    other = tiny_model("bert", "sequence", dtype=torch.float32, seed=7)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(RaotError, match="A is not a fine-tune of the base"):
        merge_checkpoints(*paths[1:], out=tmp_path / "o", base=tmp_path / "other", alignment="none", merge_rule="ties")
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".o")]


def test_alignment_keeps_the_in_memory_path(tmp_path):
    from raot_hf import RaotConfig
    from raot_hf.io.loading import ModelSource
    from raot_hf.stages.execution import stream_blocker

    sources = [ModelSource(str(p)) for p in _family(tmp_path, "bert")[1:]]
    assert stream_blocker(RaotConfig(), sources) == "an alignment reads the models' activations"
    assert stream_blocker(RaotConfig(alignment="none", merge_rule="regmean"), sources) is not None
    assert stream_blocker(RaotConfig(alignment="none"), sources) is None


def test_cli_streams_and_no_stream_gives_the_same_bytes(tmp_path):
    paths = [str(p) for p in _family(tmp_path, "bert")[1:]]
    args = ["-q", "merge", *paths, "--alignment", "none", "--weights", "2,1,1"]
    assert CliRunner().invoke(main, [*args, "--out", str(tmp_path / "s")]).exit_code == 0
    assert CliRunner().invoke(main, [*args, "--no-stream", "--out", str(tmp_path / "m")]).exit_code == 0
    a, b = _weights(tmp_path / "s"), _weights(tmp_path / "m")
    assert all(torch.equal(a[k], b[k]) for k in a) and set(a) == set(b)
    report = json.loads((tmp_path / "s" / "raot_report.json").read_text())
    assert report["execution"] == "streamed" and report["command"].startswith("raot-hf ")


def test_memory_caps_are_refused_before_any_work_and_shrink_the_shards(tmp_path):
    paths = [str(p) for p in _family(tmp_path, "llama")[1:]]
    out = tmp_path / "o"
    res = CliRunner().invoke(main, ["merge", *paths, "--alignment", "none", "--max-memory", "1MiB", "--out", str(out)])
    assert res.exit_code == 2 and "below what one tensor of every model needs" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not out.exists()
    from raot_hf.io.loading import ModelSource
    from raot_hf.stages.execution import _checkpoint_sizes
    from raot_hf.stages.offload import RUNTIME_BYTES

    total, largest = _checkpoint_sizes(ModelSource(paths[0]))
    cap = RUNTIME_BYTES + 4 * (len(paths) + 2) * largest + total // 3  # room for a third of the output
    _, report = merge_checkpoints(*paths, out=out, alignment="none", max_memory=cap)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert report["execution"] == "streamed" and len(shards) > 1  # shards shrink to keep under the cap
    whole, _ = merge_checkpoints(*paths, out=tmp_path / "w", alignment="none")
    a, b = _weights(out), _weights(whole)
    assert all(torch.equal(a[k], b[k]) for k in a) and set(a) == set(b)
