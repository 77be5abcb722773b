"""Reruns keep history: folding a rerun into results appends the rows it replaces (with the
invocation that produced them) and the report shows the latest values, the earlier ones below.
Tiny hand-made results: no model runs."""

import copy
import json

from benchmarks.decoders.report import write_report as write_decoder_report
from benchmarks.decoders.run import fold_run
from benchmarks.report import write_report
from benchmarks.run import main as run_main
from benchmarks.three_models import fold_runs
from benchmarks.three_models import write_report as write_three_model_report
from benchmarks.update import merge_results

PAIR = "tiny-pair"


def _results(acc: float, date: str, argv: list[str]) -> dict:
    row = {"acc_head_a": acc, "acc_head_b": acc / 2, "exact": True}
    return {
        "meta": {
            "suite": "tiny",
            "workers": 1,
            "alphas": [0.0, 1.0],
            "seconds": 1.0,
            "versions": {"raot_hf": "0"},
            "argv": argv,
            "date": date,
            "source_digest": "abc",
            "notes": [],
        },
        "methods": [{"name": "ties", "label": "TIES", "options": {}, "group": "rules"}],
        "pairs": [{"name": PAIR, "family": "(c)", "description": "d", "width": 8, "tasks": ["x", "y"], "seeds": [[0, 1]]}],
        "runs": [
            {
                "pair": PAIR,
                "run": 0,
                "parents": {"a": {"accuracy": 0.9, "loss": 0.3}, "b": {"accuracy": 0.8, "loss": 0.4}},
                "distance_before": 0.5,
                "methods": {"ties": copy.deepcopy(row)},
            }
        ],
    }


def test_two_folds_keep_both_earlier_runs_and_the_table_shows_the_latest(tmp_path):
    first = _results(0.111, "2026-01-01 00:00 UTC", ["--methods", "ties"])
    second = _results(0.222, "2026-01-02 00:00 UTC", ["--methods", "ties", "--update"])
    third = _results(0.333, "2026-01-03 00:00 UTC", ["--methods", "ties", "--update"])
    (tmp_path / "results.json").write_text(json.dumps(merge_results(first, second, [PAIR])))
    (tmp_path / "rerun.json").write_text(json.dumps(third))
    assert run_main(["--out", str(tmp_path), "--fold", str(tmp_path / "rerun.json")]) == 0
    folded = json.loads((tmp_path / "results.json").read_text())
    assert folded["runs"][0]["methods"]["ties"]["acc_head_a"] == 0.333
    history = folded["history"]
    assert [e["row"]["acc_head_a"] for e in history] == [0.111, 0.222]
    assert [e["date"] for e in history] == ["2026-01-01 00:00 UTC", "2026-01-02 00:00 UTC"]
    assert history[1]["command"] == "python -m benchmarks.run --methods ties --update"
    text = (tmp_path / "RESULTS.md").read_text()
    assert text == write_report(folded, tmp_path, markdown_only=True)
    tables, earlier = text.split("## History: earlier runs of rerun rows")
    assert "| `ties` | 0.333 | 0.167 |" in tables and "0.111" not in tables and "0.222" not in tables
    rows = [line for line in earlier.splitlines() if line.startswith(f"| {PAIR} |")]
    assert rows == [
        f"| {PAIR} | `ties` | 0 | 2026-01-01 00:00 UTC: `python -m benchmarks.run --methods ties` | 0.111 | 0.056 |",
        f"| {PAIR} | `ties` | 0 | 2026-01-02 00:00 UTC: `python -m benchmarks.run --methods ties --update` "
        "| 0.222 | 0.111 |",
    ]
    assert "1 (pair, method) row(s) have earlier runs" in earlier
