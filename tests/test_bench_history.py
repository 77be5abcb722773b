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
        "pairs": [
            {"name": PAIR, "family": "(c)", "description": "d", "width": 8, "tasks": ["x", "y"], "seeds": [[0, 1]]}
        ],
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
    assert rows == [f"| {PAIR} | `ties` | (1) | 0 | 0.111 | 0.056 |", f"| {PAIR} | `ties` | (2) | 0 | 0.222 | 0.111 |"]
    assert "1. 2026-01-01 00:00 UTC: `python -m benchmarks.run --methods ties`\n" in earlier
    assert "2. 2026-01-02 00:00 UTC: `python -m benchmarks.run --methods ties --update`\n" in earlier
    assert "1 (pair, method) row(s) have earlier runs" in earlier


def _decoder_run(ppl: float) -> dict:
    row = {"ppl": {"reviews": ppl}, "loss": {"reviews": 1.0}, "exact": True, "deviation": 0.0}
    row.update(applied=0, candidates=0, shares_basis=False, verdict=None)
    parents = {"a": {"reviews": 3.0}, "b": {"reviews": 3.1}}
    return {"pair": "llama-siblings", "run": 0, "models": {}, "parents": parents, "methods": {"ties": row}}


def test_decoder_reruns_keep_the_rows_they_replace(tmp_path):
    full = "python -m benchmarks.decoders.run --workers 1"
    rerun = "python -m benchmarks.decoders.run --pairs llama-siblings --methods ties"
    results = {"runs": [_decoder_run(30.0)], "command": full, "commands": [full], "dates": ["2026-01-01"]}
    for ppl, date in ((20.0, "2026-01-02"), (10.0, "2026-01-03")):
        assert fold_run(results, _decoder_run(ppl), ("ties",)) is None
        results["commands"].append(rerun)
        results["dates"].append(date)
    assert [r["methods"]["ties"]["ppl"]["reviews"] for r in results["runs"]] == [10.0]
    assert [(e["date"], e["command"], e["row"]["ppl"]["reviews"]) for e in results["history"]] == [
        ("2026-01-01", full, 30.0),
        ("2026-01-02", rerun, 20.0),
    ]
    tables, earlier = write_decoder_report(results, tmp_path, markdown_only=True).split("## History")
    assert "| ties | 10.00 |" in tables and "30.00" not in tables
    assert "| llama-siblings | `ties` | (1) | 0 | 30.00 |" in earlier
    assert f"2. 2026-01-02: `{rerun}`" in earlier
    # retrained parents: the rerun is not folded, nothing is replaced
    moved = _decoder_run(5.0)
    moved["parents"]["a"]["reviews"] = 2.0
    assert "parents differ" in fold_run(results, moved, ("ties",))
    assert len(results["history"]) == 2


def test_three_model_reruns_keep_the_rows_they_replace(tmp_path):
    def run(accuracy: float, date: str) -> dict:
        row = {"accuracy": accuracy, "applied": [0, 0], "seconds": 1.0, "date": date, "command": "cmd " + date}
        return {"family": "vit-seeds-d64", "run": 0, "parents": [0.9, 0.9, 0.9], "methods": {"raot3": row}}

    stored, history = [run(0.5, "d1")], []
    for accuracy, date in ((0.6, "d2"), (0.7, "d3")):
        stored, replaced = fold_runs(stored, [run(accuracy, date)])
        history += replaced
    assert [r["methods"]["raot3"]["accuracy"] for r in stored] == [0.7]
    assert [(e["date"], e["row"]["accuracy"]) for e in history] == [("d1", 0.5), ("d2", 0.6)]
    tables, earlier = write_three_model_report(stored, tmp_path, markdown_only=True, history=history).split(
        "## History"
    )
    assert "| raot3 | 0.700 |" in tables and "0.500" not in tables
    assert "| vit-seeds-d64 | `raot3` | (1) | 0 | 0.500 |" in earlier and "2. d2: `cmd d2`" in earlier


def _encoder_row(acc: float, applied: bool, kept: list[int]) -> dict:
    decision = {"transform": "mlp", "layer": 0, "applied": applied}
    return {
        "acc_head_a": acc,
        "gate": {"applied": int(applied), "decisions": [decision]},
        "correction": {"layers_kept": kept, "competition": {"model_check": {"kept": True}}},
    }


def test_sweep_record_marks_where_decisions_or_kept_corrections_differ(tmp_path):
    """The sweep's decision record: rows of two runner results (two code versions) side by side;
    equal decisions read "equal", a differing gate decision or kept-layer list reads "differ", and
    a rerun of one label replaces that label's rows, not the other's."""
    from benchmarks.records import read_history
    from benchmarks.sweep_decisions import record, render

    def results(rows: dict[str, dict], run: int = 0) -> dict:
        return {"meta": {"argv": ["--pairs", PAIR], "date": "d"}, "runs": [{"pair": PAIR, "run": run, "methods": rows}]}

    log = tmp_path / "sweep.json"
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps(results({"default": _encoder_row(0.8, True, [0])})))
    after.write_text(json.dumps(results({"default": _encoder_row(0.8, True, [0]), "x": _encoder_row(0.7, False, [0])})))
    record(before, "before", "c1", log)
    record(after, "after", "c2", log)
    text = render(read_history(log))
    assert "| tiny-pair | 0 | 0.8000 | 0.8000 | 0.7000 | differ: applied 1 / 1 / 0 | equal ([0]) |" in text
    after.write_text(json.dumps(results({"default": _encoder_row(0.9, True, [1]), "x": _encoder_row(0.7, True, [0])})))
    record(after, "after", "c3", log)
    text = render(read_history(log))
    assert "| tiny-pair | 0 | 0.8000 | 0.9000 | 0.7000 | equal | differ: [0] / [1] / [0] |" in text
    assert "c1" in text and "c3" in text


def test_a_paired_record_gives_each_columns_shift_and_whether_it_is_within_one_std(tmp_path):
    """A change recorded with ``paired``: the mean table gives each later column's paired
    difference from the first and says whether its mean lies within one std of the first column's
    runs — a shift of 0.05 against a spread of 0.01 reads "outside", one of 0.005 "within"."""
    from benchmarks.records import read_history
    from benchmarks.sweep_decisions import CHANGES, record, render

    change = CHANGES["token_cap"]
    log = tmp_path / "cap.json"
    runs = []
    for run, (acc, small, large) in enumerate([(0.80, 0.805, 0.85), (0.81, 0.815, 0.86), (0.82, 0.825, 0.87)]):
        rows = {"default": _encoder_row(acc, True, [0]), "near": _encoder_row(small, True, [0]),
                "far": _encoder_row(large, True, [0])}  # fmt: skip
        runs.append({"pair": PAIR, "run": run, "methods": rows})
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"meta": {"argv": ["--pairs", PAIR], "date": "d"}, "runs": runs}))
    record(results, "cap", "c1", log, title=change.title)
    text = render(read_history(log, change.title), change)
    header = next(line for line in text.splitlines() if line.startswith("| pair | cap/default |"))
    assert "cap/far − cap/default" in header and "cap/near − cap/default" in header
    row = next(line for line in text.splitlines() if line.startswith(f"| {PAIR} | 0.8100"))
    assert "+0.0500 ± 0.0000 (outside 1 std)" in row and "+0.0050 ± 0.0000 (within 1 std)" in row
