"""Data-parallel calibration (docs/design.md §7): two CPU processes (accelerate's debug launcher:
fork + gloo) each run their shard; the all-reduced statistics, the merged weights and the CLI's
output equal a single-process run."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from accelerate import debug_launcher

from raot_hf import RaotConfig, RaotMerger, scramble
from raot_hf.calibration import CalibrationConfig
from raot_hf.distributed import DistributedContext
from raot_hf.stages.solve import solve
from raot_hf.symmetry import model_state
from raot_hf.testing import clone, tiny_model, tiny_text_dataset, tiny_tokenizer

pytestmark = pytest.mark.slow

WORLD = 2


def _pair(dtype=torch.float64):
    a = tiny_model("bert", "sequence", dtype=dtype, seed=0)
    b = clone(a)
    scramble(b, seed=1)
    return a, b


def _config(examples: int, batch_size: int) -> RaotConfig:
    cal = CalibrationConfig(num_samples=examples, batch_size=batch_size, heldout_every=4)
    return RaotConfig(calibration=cal, gate={"min_heldout_tokens": 16})


def _statistics(merger, data) -> dict:
    """Both phases: the fit moments, then the held-out sums under the main process's candidates."""
    stats, run = merger.collect_statistics(data)
    fit = [t.clone() for t in stats.tensors()]
    parts, _ = solve(merger.pair, stats)  # the main process solves and broadcasts
    assert parts  # something to score
    merger.collect_heldout(stats, run, parts)
    fingerprint = run.fingerprint
    fingerprint["heldout_tokens"] = int(stats.heldout.tokens)
    return {"tensors": fit + stats.heldout.tensors(), "examples": stats.examples, "fingerprint": fingerprint}


def _merged(result) -> dict:
    return {
        "state": {k: v.clone() for k, v in model_state(result.model).items()},
        "decisions": [(d["transform"], d["layer"], d["applied"]) for d in result.report["decisions"]],
        "examples": result.report["calibration"]["examples"],
        "refit": result.report.get("refit"),
    }


def _worker(out_dir: str, examples: int, batch_size: int, task: str) -> None:
    """Runs in each launched process: its shard of the job, results saved per rank."""
    torch.set_num_threads(1)
    ctx = DistributedContext.detect()
    assert ctx.world_size == WORLD and ctx.is_distributed
    a, b = _pair()
    merger = RaotMerger.from_models(a, b, preprocessor=tiny_tokenizer(), config=_config(examples, batch_size))
    data = tiny_text_dataset(examples)
    result = _statistics(merger, data) if task == "statistics" else _merged(merger.merge(calibration=data))
    result["rank"] = merger.dist.rank
    torch.save(result, Path(out_dir) / f"rank{merger.dist.rank}.pt")


def _single(examples: int, batch_size: int, task: str) -> dict:
    a, b = _pair()
    merger = RaotMerger.from_models(a, b, preprocessor=tiny_tokenizer(), config=_config(examples, batch_size))
    assert not merger.dist.is_distributed
    data = tiny_text_dataset(examples)
    return _statistics(merger, data) if task == "statistics" else _merged(merger.merge(calibration=data))


def _launch(tmp_path, examples, batch_size, task) -> list[dict]:
    debug_launcher(_worker, args=(str(tmp_path), examples, batch_size, task), num_processes=WORLD)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max().clamp_min(1e-300))


# 7 examples over 2 ranks: shards of 4 and 3, a partial last batch, and rank 1 holds no
# held-out example at all (ids 0 and 4 are held out); 29 examples: several batches per rank.
@pytest.mark.parametrize("examples,batch_size", [(7, 2), (29, 4)])
def test_sharded_statistics_equal_single_process(tmp_path, examples, batch_size):
    reference = _single(examples, batch_size, "statistics")
    ranks = _launch(tmp_path, examples, batch_size, "statistics")
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    for got in ranks:  # every process holds the full-data sums after the all-reduce
        assert got["examples"] == reference["examples"] == examples
        assert got["fingerprint"]["fit_tokens"] == reference["fingerprint"]["fit_tokens"]
        assert got["fingerprint"]["heldout_tokens"] == reference["fingerprint"]["heldout_tokens"]
        assert len(got["tensors"]) == len(reference["tensors"])
        worst = max(_relative_error(x, y) for x, y in zip(got["tensors"], reference["tensors"], strict=True))
        assert worst <= 1e-10


def test_distributed_merge_equals_single_process(tmp_path):
    reference = _single(29, 4, "merge")
    ranks = _launch(tmp_path, 29, 4, "merge")
    assert any(applied for _, _, applied in reference["decisions"])  # the pair really gets aligned
    for got in ranks:
        assert got["decisions"] == reference["decisions"]
        assert got["examples"] == 29
        # each process holds its own shard, so the default refit does not run (docs/design.md §6.11)
        assert not got["refit"]["ran"] and "sharded" in got["refit"]["reason"]
        for name, want in reference["state"].items():
            assert _relative_error(got["state"][name], want) <= 1e-10, name


def _cli_worker(args: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)
    from raot_hf.cli import main

    rank = torch.distributed.get_rank()
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        main(args, standalone_mode=False)
    (Path(out_dir) / f"stdout{rank}.txt").write_text(buffer.getvalue())


def test_cli_merge_under_two_processes_writes_once(tmp_path):
    a, b = _pair(torch.float32)
    tok = tiny_tokenizer()
    for name, model in (("a", a), ("b", b)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    tiny_text_dataset(29).to_json(tmp_path / "cal.jsonl")
    work = tmp_path / "work"
    work.mkdir()
    out = work / "merged"
    # not -q: under -q a successful merge prints nothing, and the main process's "wrote" line is the evidence here
    args = ["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--calibration", str(tmp_path / "cal.jsonl")]
    args += ["--batch-size", "4", "--min-heldout-tokens", "16", "--out", str(out)]
    debug_launcher(_cli_worker, args=(args, str(tmp_path)), num_processes=WORLD)

    assert sorted(p.name for p in work.iterdir()) == ["merged"]  # one output, no stray temporary dirs
    assert "wrote" in (tmp_path / "stdout0.txt").read_text()
    assert (tmp_path / "stdout1.txt").read_text() == ""  # the other process only added its shard
    report = json.loads((out / "raot_report.json").read_text())
    assert report["calibration"]["examples"] == 29  # both shards counted

    single = RaotMerger.from_pretrained(tmp_path / "a", tmp_path / "b", config=build_single_config(tmp_path))
    expected = single.merge()
    assert [d["applied"] for d in report["decisions"]] == [d["applied"] for d in expected.report["decisions"]]
    from transformers import BertForSequenceClassification

    written = model_state(BertForSequenceClassification.from_pretrained(out))
    for name, want in model_state(expected.model).items():
        assert _relative_error(written[name].double(), want.double()) <= 1e-4, name


def build_single_config(tmp_path) -> RaotConfig:
    cal = CalibrationConfig(source=str(tmp_path / "cal.jsonl"), batch_size=4)
    return RaotConfig(calibration=cal, gate={"min_heldout_tokens": 16})
