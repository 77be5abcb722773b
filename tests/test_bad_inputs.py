"""User mistakes get a one-line RaotError before heavy work."""

import inspect
import json
import os

import pytest
import torch
import transformers
from click.testing import CliRunner

from raot_hf import RaotError, RaotMerger
from raot_hf.adapters import supported_model_types
from raot_hf.cli import main
from raot_hf.gate import BasisVerdict, Verdict, render_verdict
from raot_hf.io.loading import ModelSource
from raot_hf.testing import (
    tiny_image_dataset,
    tiny_image_processor,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
)


@pytest.fixture
def saved_pair(tmp_path):
    for name, seed in (("a", 0), ("b", 1)):
        model = tiny_model("bert", "sequence", dtype=torch.float32, seed=seed)
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    return tmp_path / "a", tmp_path / "b"


def test_pickle_checkpoint_refused_unless_allowed(saved_pair):
    a, b = saved_pair
    state = {k: v for k, v in tiny_model("bert", "sequence", dtype=torch.float32, seed=1).state_dict().items()}
    (b / "model.safetensors").unlink()
    torch.save(state, b / "pytorch_model.bin")
    with pytest.raises(RaotError, match="pickle.*--allow-pickle"):
        RaotMerger.from_pretrained(a, b, alignment="none")


def test_missing_shard_and_bad_index(saved_pair):
    a, b = saved_pair
    (b / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(RaotError, match="not a valid index"):
        RaotMerger.from_pretrained(a, b, alignment="none")
    (b / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(RaotError, match="missing"):
        RaotMerger.from_pretrained(a, b, alignment="none")


def test_truncated_safetensors(saved_pair):
    a, b = saved_pair
    data = (b / "model.safetensors").read_bytes()
    (b / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(RaotError, match="model B"):
        RaotMerger.from_pretrained(a, b, alignment="none")


def test_nan_weights_refused(saved_pair, tmp_path):
    a, _ = saved_pair
    model = tiny_model("bert", "sequence", dtype=torch.float32, seed=1)
    with torch.no_grad():
        model.bert.encoder.layer[0].output.dense.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    tiny_tokenizer().save_pretrained(tmp_path / "nan")
    with pytest.raises(RaotError, match="NaN/Inf"):
        RaotMerger.from_pretrained(a, tmp_path / "nan", alignment="none")


def test_cli_errors_are_one_line_exit_2(saved_pair, tmp_path):
    a, b = saved_pair
    runner = CliRunner()
    res = runner.invoke(main, ["merge", str(a), str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert res.stderr.strip().startswith("Error:") and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    res = runner.invoke(main, ["merge", str(a), str(b), "--alpha", "3", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "alpha" in res.stderr
    res = runner.invoke(main, ["merge", str(a), str(b), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "calibration" in res.stderr
    assert not (tmp_path / "o").exists()


def test_head_average_needs_same_label_space(tmp_path):
    a = tiny_model("bert", "sequence", dtype=torch.float32)
    b = tiny_model("bert", "sequence", dtype=torch.float32, num_labels=5)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    with pytest.raises(RaotError, match="same label space"):
        RaotMerger.from_pretrained(tmp_path / "a", tmp_path / "b", head="average")


# --------------------------------------------------------------------------------------------
# Through the CLI: exit code 2, one "Error:" line, no traceback, no output directory.

BERT, VIT = ("bert", "sequence"), ("vit", "image")


def _save(path, kind=BERT, *, seed=0, tokenizer_vocab=40, **config):
    """A tiny float32 checkpoint with its tokenizer (or image processor) in ``path``."""
    model = tiny_model(*kind, dtype=torch.float32, seed=seed, **config)
    model.save_pretrained(path)
    if kind == VIT:
        tiny_image_processor().save_pretrained(path)
    else:
        tiny_tokenizer(tokenizer_vocab).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """Model A, a bert and a ViT calibration set, and one B per way a pair can be incompatible."""
    root = tmp_path_factory.mktemp("zoo")
    _save(root / "a")
    _save(root / "a2", seed=1)
    _save(root / "vit_a", VIT)
    _save(root / "vit_b", VIT, seed=1)
    tiny_text_dataset(48).to_csv(root / "text.csv")
    tiny_image_dataset(16).save_to_disk(str(root / "images"))
    return root


def _merge(*args, out, catch=True):
    return CliRunner().invoke(main, ["-q", "merge", *map(str, args), "--out", str(out)], catch_exceptions=catch)


def _assert_clean_error(res, out, *needles):
    """Exit 2, exactly one 'Error:' line naming the problem, no traceback, nothing written."""
    assert res.exit_code == 2, (res.exit_code, res.output, repr(res.exception))
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, res.stderr
    noise = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("Error:")]
    assert all("%|" in line or "examples [" in line for line in noise), noise  # progress bars only
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return errors[0]


@pytest.fixture
def weights_loaded(monkeypatch):
    """Records every parent whose weights are loaded (the real loader still runs)."""
    from raot_hf.io import loading
    from raot_hf.stages import load

    calls = []
    real = loading.load_model

    def recording_load_model(source, label, **kwargs):
        calls.append(label)
        return real(source, label, **kwargs)

    monkeypatch.setattr(load, "load_model", recording_load_model)
    return calls


@pytest.mark.parametrize(
    "name, b_kwargs, needles",
    [
        ("tokenizer", {"tokenizer_vocab": 41}, ("different tokenizers",)),
        ("vocab", {"vocab_size": 41}, ("vocab_size", "40 vs 41")),
        ("hidden", {"hidden_size": 32}, ("hidden_size",)),
        ("layers", {"num_layers": 3}, ("num_hidden_layers",)),
        ("heads", {"num_heads": 2}, ("num_attention_heads",)),
        ("labels", {"num_labels": 5}, ("label space", "--head a")),
    ],
)
def test_cli_incompatible_pair_fails_before_weights(zoo, tmp_path, weights_loaded, name, b_kwargs, needles):
    b = _save(tmp_path / name, seed=1, **b_kwargs)
    extra = ["--head", "average"] if name == "labels" else []
    res = _merge(zoo / "a", b, "--calibration", zoo / "text.csv", *extra, out=tmp_path / "out")
    _assert_clean_error(res, tmp_path / "out", *needles)
    assert weights_loaded == []


def test_cli_architecture_mismatch_and_unsupported_type(zoo, tmp_path, weights_loaded):
    res = _merge(zoo / "a", zoo / "vit_a", "--calibration", zoo / "text.csv", out=tmp_path / "out")
    _assert_clean_error(res, tmp_path / "out", "bert", "vit")
    cfg = transformers.OPTConfig(hidden_size=16, num_attention_heads=4, num_hidden_layers=2, ffn_dim=32, vocab_size=40)
    for name in ("opt_a", "opt_b"):
        transformers.OPTForCausalLM(cfg).save_pretrained(tmp_path / name)
    res = _merge(tmp_path / "opt_a", tmp_path / "opt_b", "--calibration", zoo / "text.csv", out=tmp_path / "out")
    line = _assert_clean_error(res, tmp_path / "out", "'opt'", "no adapter")
    assert all(t in line for t in supported_model_types())  # the message lists what is supported
    assert weights_loaded == []


def _custom_code_checkpoint(path, marker, model_type="raot_custom_arch"):
    """A local checkpoint whose config asks for custom code; importing that code creates ``marker``."""
    path.mkdir()
    config = {
        "model_type": model_type,
        "architectures": ["CustomModel"],
        "auto_map": {"AutoConfig": "custom_code.CustomConfig", "AutoModel": "custom_code.CustomModel"},
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "custom_code.py").write_text(
        f"open({str(marker)!r}, 'w').write('custom code ran')\n"
        "from transformers import PretrainedConfig\n\n\n"
        f"class CustomConfig(PretrainedConfig):\n    model_type = {model_type!r}\n"
    )
    return path


def test_remote_code_is_never_run_by_default(zoo, tmp_path):
    marker = tmp_path / "custom_code_ran"
    a = _custom_code_checkpoint(tmp_path / "custom_a", marker)
    b = _custom_code_checkpoint(tmp_path / "custom_b", marker)
    res = _merge(a, b, "--calibration", zoo / "text.csv", out=tmp_path / "out")
    _assert_clean_error(res, tmp_path / "out", "custom code", "bert")
    with pytest.raises(RaotError, match="custom code"):
        RaotMerger.from_pretrained(a, b, alignment="none")
    # Even when allowed, an architecture without an adapter is refused before its code is imported.
    with pytest.raises(RaotError, match="no adapter"):
        RaotMerger.from_pretrained(a, b, alignment="none", trust_remote_code=True)
    assert not marker.exists()
    assert inspect.signature(RaotMerger.from_pretrained).parameters["trust_remote_code"].default is False
    assert ModelSource("x").trust_remote_code is False
    for command in ("merge", "inspect"):
        context = main.get_command(None, command).make_context(
            command, ["a", "b", "--out", "o"][: 4 if command == "merge" else 2]
        )
        assert context.params["trust_remote_code"] is False and context.params["allow_pickle"] is False


@pytest.mark.parametrize(
    "config_text, needle",
    [("{not json", "not valid JSON"), (json.dumps({"hidden_size": 4}), "no model_type")],
)
def test_cli_broken_config_json(zoo, tmp_path, config_text, needle):
    b = _save(tmp_path / "b", seed=1)
    (b / "config.json").write_text(config_text)
    res = _merge(zoo / "a", b, "--calibration", zoo / "text.csv", out=tmp_path / "out")
    _assert_clean_error(res, tmp_path / "out", "model B", needle)


def test_cli_pickle_refused_unless_allowed(zoo, tmp_path, weights_loaded):
    b = _save(tmp_path / "b", seed=1)
    state = tiny_model("bert", "sequence", dtype=torch.float32, seed=1).state_dict()
    (b / "model.safetensors").unlink()
    torch.save(state, b / "pytorch_model.bin")
    res = _merge(zoo / "a", b, "--alignment", "none", out=tmp_path / "out")
    _assert_clean_error(res, tmp_path / "out", "pickle", "--allow-pickle")
    assert weights_loaded == []  # B's files are checked before A's weights are read
    res = _merge(zoo / "a", b, "--alignment", "none", "--allow-pickle", out=tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_cli_debug_shows_the_traceback(zoo, tmp_path):
    res = _merge(zoo / "a", tmp_path / "nowhere", "--alpha", "0.5", "--debug", out=tmp_path / "out")
    assert isinstance(res.exception, RaotError) and res.exit_code == 1


# --------------------------------------------------------------------------------- calibration


@pytest.mark.parametrize(
    "models, data, extra, needles",
    [
        (("a", "a2"), "empty.csv", [], ("no rows",)),
        (("a", "a2"), "text.csv", ["--column", "sentence"], ("column 'sentence'", "--column")),
        (("a", "a2"), "numbers.csv", [], ("no text column", "text dataset")),
        (("a", "a2"), "images", [], ("no text column", "takes text")),
        (("vit_a", "vit_b"), "text.csv", [], ("no image column", "takes images")),
        (("a", "a2"), "missing.csv", [], ("not found",)),
        (("a", "a2"), "one_row.csv", [], ("at least 2",)),
    ],
)
def test_cli_bad_calibration_data_fails_before_weights(zoo, tmp_path, weights_loaded, models, data, extra, needles):
    (tmp_path / "empty.csv").write_text("text\n")
    (tmp_path / "numbers.csv").write_text("label\n1\n2\n3\n")
    (tmp_path / "one_row.csv").write_text("text\nw5 w6 w7\n")
    source = zoo / data if (zoo / data).exists() else tmp_path / data
    a, b = (zoo / m for m in models)
    res = _merge(a, b, "--calibration", source, *extra, out=tmp_path / "out")
    _assert_clean_error(res, tmp_path / "out", *needles)
    assert weights_loaded == []  # the data is checked before any weights are read


def test_too_few_tokens_lose_to_identity_with_a_warning(zoo, tmp_path, caplog):
    """8 rows leave ~20 held-out tokens (< 64 by default): every estimate loses to the identity,
    so the output is exactly the plain merge — no transform fitted to noise is applied."""
    tiny_text_dataset(8).to_csv(tmp_path / "few.csv")
    res = _merge(zoo / "a", zoo / "a2", "--calibration", tmp_path / "few.csv", out=tmp_path / "gated")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "gated" / "raot_report.json").read_text())
    assert report["decisions"] and not any(d["applied"] for d in report["decisions"])
    reasons = [d["reason"] for d in report["decisions"]]
    assert any("too few held-out tokens" in r for r in reasons)
    assert "too few held-out tokens" in caplog.text
    # no test could be run: no basis verdict (the pair is not declared to share a basis)
    assert all("too few held-out tokens" in r for r in reasons), reasons
    untested = BasisVerdict(Verdict.UNTESTED, why=reasons[0])
    assert report["shares_basis"] is False and report["verdict"] == render_verdict(untested)
    assert "could be tested" in report["summary"] and "shares a basis" not in report["summary"]
    plain = _merge(zoo / "a", zoo / "a2", "--alignment", "none", out=tmp_path / "plain")
    assert plain.exit_code == 0, plain.output
    weights = "model.safetensors"
    assert (tmp_path / "gated" / weights).read_bytes() == (tmp_path / "plain" / weights).read_bytes()


@pytest.mark.parametrize("merge_rule", ["linear", "regmean", "fisher"])
def test_nan_activations_lose_to_identity_and_never_reach_the_weights(zoo, tmp_path, caplog, merge_rule):
    """B's weights are finite, but one token's embedding overflows float32 inside LayerNorm, so
    B's activations are NaN on every row that holds it: the estimates must lose to the identity
    with a warning, and the merge must finish with finite weights."""
    b = tiny_model("bert", "sequence", dtype=torch.float32, seed=1)
    with torch.no_grad():
        for word in tiny_tokenizer().convert_tokens_to_ids(["w7", "w8"]):
            b.bert.embeddings.word_embeddings.weight[word] = 3e38
    b.save_pretrained(tmp_path / "b")
    tiny_tokenizer().save_pretrained(tmp_path / "b")
    probe = tiny_tokenizer()(["w7 w8", "w9 w10"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = b(**probe).logits
    assert not torch.isfinite(logits[0]).any() and torch.isfinite(logits[1]).all()  # the fault is real
    rows = tiny_text_dataset(96)
    assert 0 < sum(bool({"w7", "w8"} & set(text.split())) for text in rows["text"]) < len(rows)
    rows.to_csv(tmp_path / "cal.csv")

    options = ["--merge-rule", merge_rule, "--fisher-samples", "4"]
    res = _merge(zoo / "a", tmp_path / "b", "--calibration", tmp_path / "cal.csv", *options, out=tmp_path / "o")
    assert res.exit_code == 0, (res.output, repr(res.exception))
    assert "NaN/Inf in fit activations" in caplog.text
    if merge_rule == "regmean":
        assert "fall back to the linear merge" in caplog.text
    if merge_rule == "fisher":
        assert "NaN/Inf outputs were skipped" in caplog.text
    report = json.loads((tmp_path / "o" / "raot_report.json").read_text())
    assert report["decisions"] and not any(d["applied"] for d in report["decisions"])
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "o")
    assert all(torch.isfinite(p).all() for p in merged.parameters())


# ------------------------------------------------------------------------------------- output


def test_cli_output_under_a_regular_file_is_refused(zoo, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    res = _merge(zoo / "a", zoo / "a2", "--alignment", "none", out=blocker / "sub")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert blocker.read_text() == "not a directory"
    res = _merge(zoo / "a", zoo / "a2", "--alignment", "none", out=blocker)
    assert res.exit_code == 2 and "is a file" in res.stderr  # click's own check of --out


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes through chmod 0o500")
def test_cli_read_only_parent_is_refused(zoo, tmp_path):
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        res = _merge(zoo / "a", zoo / "a2", "--alignment", "none", out=parent / "out")
        _assert_clean_error(res, parent / "out", "not writable")
    finally:
        parent.chmod(0o700)


@pytest.mark.parametrize(
    "fault, exit_code, needle",
    [(KeyboardInterrupt(), 130, "Interrupted"), (OSError(28, "No space left on device"), 2, "No space left")],
)
def test_cli_fault_mid_write_leaves_no_directory(zoo, tmp_path, monkeypatch, fault, exit_code, needle):
    from raot_hf.outputs import shards

    real_write = shards._write_shard
    calls = []

    def failing_write(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise fault
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(shards, "_write_shard", failing_write)
    out = tmp_path / "out"
    res = _merge(zoo / "a", zoo / "a2", "--alignment", "none", "--max-shard-size", "3000", out=out)
    assert len(calls) == 2  # the fault struck between two shards
    assert res.exit_code == exit_code, (res.output, repr(res.exception))
    assert needle in res.stderr and "Traceback" not in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no directory, no temporary sibling


def test_failed_merge_leaves_no_new_parent_directories(zoo, tmp_path):
    """--out under directories that do not exist yet: they are made only when the output is
    written, so a merge that fails first leaves nothing behind."""
    out = tmp_path / "new" / "deeper" / "merged"
    res = _merge(zoo / "a", zoo / "a2", "--calibration", str(tmp_path / "missing.csv"), out=out)
    assert res.exit_code != 0
    assert not (tmp_path / "new").exists()
    res = _merge(zoo / "a", zoo / "a2", "--alignment", "none", out=out)
    assert res.exit_code == 0, res.output
    assert (out / "config.json").is_file()


def test_out_below_a_file_is_refused(zoo, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = _merge(zoo / "a", zoo / "a2", "--alignment", "none", out=blocker / "sub" / "merged")
    assert res.exit_code == 2 and "is not a directory" in res.stderr, res.output
    assert blocker.read_text() == "x"


def test_text_the_tokenizer_cannot_read_is_refused_before_any_forward(tmp_path):
    """A word-level tokenizer saved beside a Qwen2 config is reloaded by AutoTokenizer as Qwen2's
    byte-level class, which encodes "w5 w17 …" to no tokens: every example would be the same
    [CLS] [SEP], nothing is identified, and the gate cannot notice (a merge went through at a
    relative error of 0.44). Refused in one line, from the CLI's early check too; and data that
    encodes every text alike is refused as well."""
    from raot_hf import scramble
    from raot_hf.testing import clone

    a = tiny_model("qwen2", "causal", dtype=torch.float32)
    b = clone(a)
    scramble(b, seed=1)
    for name, model in (("a", a), ("b", b)):
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer(100).save_pretrained(tmp_path / name)
    merger = RaotMerger.from_pretrained(tmp_path / "a", tmp_path / "b")
    assert type(merger.preprocessor).__name__ == "Qwen2Tokenizer"
    called = []
    merger.model_b.register_forward_hook(lambda *_: called.append(1))
    with pytest.raises(RaotError, match="no tokens at all") as err:
        merger.merge(calibration=tiny_text_dataset(64, vocab_size=100))
    assert "\n" not in str(err.value) and not called
    tiny_text_dataset(32, vocab_size=100).to_csv(tmp_path / "cal.csv")
    out = CliRunner().invoke(
        main,
        [
            "merge",
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--calibration",
            str(tmp_path / "cal.csv"),
            "--out",
            str(tmp_path / "m"),
        ],
    )
    assert out.exit_code != 0 and "no tokens at all" in out.output and not (tmp_path / "m").exists()
    import datasets

    same = datasets.Dataset.from_dict({"text": ["w5 w6 w7"] * 40})
    bert = RaotMerger.from_models(
        tiny_model("bert", "sequence"), tiny_model("bert", "sequence", seed=1), preprocessor=tiny_tokenizer()
    )
    with pytest.raises(RaotError, match="same ids"):
        bert.merge(calibration=same)
