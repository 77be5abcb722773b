"""Same inputs, options and seed give byte-identical weights and the same report, apart from
timings (and the command line, which names the output directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from raot_hf import scramble
from raot_hf.cli import main
from raot_hf.testing import (
    clone,
    tiny_image_dataset,
    tiny_image_processor,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
)

#: Report fields that legitimately differ between two runs of the same merge.
RUN_SPECIFIC = ("timings", "command")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A scrambled BERT pair (post-LN) and ViT pair (pre-LN: rotation and folding), saved with
    their preprocessors and calibration data."""
    root = tmp_path_factory.mktemp("determinism")
    for model_type, head in (("bert", "sequence"), ("vit", "image")):
        a = tiny_model(model_type, head, dtype=torch.float32, seed=3)
        b = clone(a)
        scramble(b, seed=4)
        pre = tiny_image_processor() if model_type == "vit" else tiny_tokenizer()
        for name, model in (("a", a), ("b", b)):
            model.save_pretrained(root / model_type / name)
            pre.save_pretrained(root / model_type / name)
    tiny_text_dataset(80, seed=5).to_csv(root / "bert" / "cal.csv")
    tiny_image_dataset(96, seed=5).save_to_disk(str(root / "vit" / "cal"))
    return root


def _args(pairs, model_type, out, extra):
    src = pairs / model_type
    cal = src / ("cal" if model_type == "vit" else "cal.csv")
    # the default refit plans its steps from the host's measured time; a number makes the merge repeatable
    steps = ["--refit-steps", "30"]
    return ["-q", "merge", str(src / "a"), str(src / "b"), "--calibration", str(cal), *steps, *extra, "--out", str(out)]


def _snapshot(out):
    """Every file's bytes, with the report parsed and its run-specific fields dropped."""
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    report = json.loads(files.pop("raot_report.json"))
    command = report.get("command")
    if command and "README.md" in files:  # the card's reproduction line repeats it
        files["README.md"] = files["README.md"].replace(command.encode(), b"<command>")
    for key in RUN_SPECIFIC:
        report.pop(key, None)
    if isinstance(report.get("refit"), dict):  # the refit's measured step and score times
        budget = report["refit"].get("budget") or {}
        for key in ("seconds", "rest_s", "step_s", "score_s"):
            budget.pop(key, None)
    return files, report


@pytest.mark.parametrize(
    "model_type, extra",
    [
        ("bert", ["--merge-rule", "regmean", "--seed", "7"]),
        # weight matching has no residual map: on this residual-scrambled pair the merge gate
        # rejects it (rightly); the alignment-objective gate keeps an applied alignment here
        (
            "bert",
            ["--alignment", "weight", "--merge-rule", "fisher", "--fisher-samples", "4"]
            + ["--gate-objective", "alignment"],
        ),
        ("vit", ["--max-shard-size", "4000"]),
    ],
)
def test_same_merge_twice_is_byte_identical(pairs, tmp_path, model_type, extra):
    runner = CliRunner()
    for name in ("first", "second"):
        res = runner.invoke(main, _args(pairs, model_type, tmp_path / name, extra))
        assert res.exit_code == 0, (res.output, repr(res.exception))
    files_1, report_1 = _snapshot(tmp_path / "first")
    files_2, report_2 = _snapshot(tmp_path / "second")
    assert [n for n in files_1 if n.endswith(".safetensors")], files_1.keys()
    assert files_1.keys() == files_2.keys()
    for name in files_1:
        assert files_1[name] == files_2[name], f"{name} differs between two identical runs"
    assert report_1 == report_2
    assert report_1["decisions"] and any(d["applied"] for d in report_1["decisions"])  # a real alignment ran


@pytest.mark.slow
def test_a_fresh_process_writes_the_same_bytes(pairs, tmp_path):
    """A second interpreter (another hash seed, cold caches) reproduces the in-process merge."""
    extra = ["--merge-rule", "regmean"]
    res = CliRunner().invoke(main, _args(pairs, "bert", tmp_path / "here", extra))
    assert res.exit_code == 0, res.output
    env = dict(
        os.environ,
        PYTHONHASHSEED="12345",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS=str(torch.get_num_threads()),
    )
    cmd = [sys.executable, "-m", "raot_hf", *_args(pairs, "bert", tmp_path / "there", extra)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _snapshot(tmp_path / "here") == _snapshot(tmp_path / "there")


def test_a_different_calibration_seed_changes_the_report(pairs, tmp_path):
    """The comparisons above are not vacuous: another calibration sample shows in the report."""
    from raot_hf import RaotConfig

    runner = CliRunner()
    for name, seed in (("seed0", 0), ("seed1", 1)):
        config = tmp_path / f"{name}.json"
        config.write_text(RaotConfig(calibration={"num_samples": 40, "seed": seed}).to_json())
        res = runner.invoke(main, _args(pairs, "bert", tmp_path / name, ["--config", str(config)]))
        assert res.exit_code == 0, res.output
    _, report_0 = _snapshot(tmp_path / "seed0")
    _, report_1 = _snapshot(tmp_path / "seed1")
    assert report_0["calibration"]["sha256"] != report_1["calibration"]["sha256"]
