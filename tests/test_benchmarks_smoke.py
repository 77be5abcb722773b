"""Smoke test of the evidence harness (benchmarks/) on tiny inputs: files, rows, and the checks
that make its numbers mean what the tables say."""

import copy
import json

import pytest
import torch

from benchmarks.metrics import max_abs_difference, with_head_of
from benchmarks.pairs import build_model, calibration_set, suite
from benchmarks.report import write_report
from benchmarks.run import run_benchmarks
from benchmarks.update import contributing, live_notes, merge_results
from raot_hf import RaotMerger, schema_for
from raot_hf.testing import example_inputs


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    messages = []
    results = run_benchmarks(
        suite_name="tiny",
        out=out,
        workers=1,
        alphas=3,
        method_names=["average", "raot"],
        cache_dir=str(out / "cache"),
        echo=messages.append,
    )
    return out, results, messages


def test_files_and_rows(tiny_results):
    out, results, messages = tiny_results
    for name in ("RESULTS.md", "results.json", "barrier_curves.png", "gate_gains.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    text = (out / "RESULTS.md").read_text()
    for heading in ("## Headline", "## Where alignment does not help", "## Gate decisions", "## Time per stage"):
        assert heading in text
    pair_section = text.split("### tiny-vit-scrambled")[1]
    rows = [line for line in pair_section.splitlines() if line.startswith("| `")]
    assert [r.split("|")[1].strip() for r in rows] == ["`average`", "`raot`"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["meta"]["alphas"] == [0.0, 0.5, 1.0]
    assert [r["pair"] for r in saved["runs"]] == ["tiny-vit-scrambled"]
    assert any("wrote" in m for m in messages)


def test_numbers_mean_what_they_say(tiny_results):
    """B is a scrambled copy of A: RaOT must align it back exactly (distance 0, every transform
    applied, flat path), while plain averaging stays far from A."""
    _, results, _ = tiny_results
    run = results["runs"][0]
    raot, average = run["methods"]["raot"], run["methods"]["average"]
    assert raot["exact"] and raot["gate"]["applied"] == raot["gate"]["total"] > 0
    assert raot["distance_after"] < 1e-5 < 0.1 < average["distance_after"] == pytest.approx(run["distance_before"])
    assert raot["path_check"] < 1e-5 and average["path_check"] < 1e-5
    assert abs(raot["barrier_a"]) < 1e-4
    losses = raot["path_loss"]["a"]
    assert max(losses) - min(losses) < 1e-4  # every point of the aligned path is A's function
    assert raot["acc_head_a"] == pytest.approx(run["parents"]["a"]["accuracy"])
    # The RaOT merge is ≈ A, far from the plain average (A + B) / 2 of a scrambled pair.
    assert "max_abs_vs_average" not in average and raot["max_abs_vs_average"] > 0.01


def test_max_abs_difference():
    a = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(3)}
    assert max_abs_difference(a, copy.deepcopy(a)) == 0.0
    assert max_abs_difference({**a, "w": torch.tensor([1.0, 2.5])}, a) == 0.5
    assert max_abs_difference({"w": a["w"]}, a) is None  # keys differ
    assert max_abs_difference({**a, "w": torch.zeros(3)}, a) is None  # shapes differ


def test_update_keeps_what_is_not_rerun(tiny_results, tmp_path):
    """A rerun of one method replaces that method's rows only, keeps the values it replaced, and
    the report says which run each number comes from."""
    _, results, _ = tiny_results
    rerun = copy.deepcopy(results)
    rerun["methods"] = [m for m in rerun["methods"] if m["name"] == "raot"]
    row = rerun["runs"][0]["methods"] = {"raot": rerun["runs"][0]["methods"]["raot"]}
    row["raot"]["acc_head_a"] = -1.0
    rerun["meta"]["argv"] = ["--methods", "raot", "--update"]
    merged = merge_results(results, rerun, ["tiny-vit-scrambled"])
    run = merged["runs"][0]
    assert run["methods"]["average"] == results["runs"][0]["methods"]["average"]
    assert run["methods"]["raot"]["acc_head_a"] == -1.0
    assert run["previous"]["raot"]["acc_head_a"] == results["runs"][0]["methods"]["raot"]["acc_head_a"]
    assert [m["name"] for m in merged["methods"]] == ["average", "raot"]
    assert [u["methods"] for u in merged["meta"]["updates"]] == [["average", "raot"], ["raot"]]
    write_report(merged, tmp_path)
    assert "--methods raot --update` — pairs tiny-vit-scrambled; methods raot" in (tmp_path / "RESULTS.md").read_text()
    # Other parents (retrained elsewhere): no row of the previous parents stays beside the rerun's.
    rerun["runs"][0]["parents"]["a"]["accuracy"] += 0.01
    merged = merge_results(results, rerun, ["tiny-vit-scrambled"])
    assert list(merged["runs"][0]["methods"]) == ["raot"]
    assert set(merged["runs"][0]["previous"]) == {"average", "raot"}
    assert "parents differ" in merged["meta"]["notes"][-1]


def test_head_swap_equals_the_products_head_b_policy(tmp_path):
    """The harness reads B's-head accuracy from the head="a" merge with B′'s head put back;
    that must be exactly the product's head="b" merge."""
    pair = suite("tiny", str(tmp_path))[0]
    spec_a, _ = pair.runs()[0]
    dir_a, dir_b = build_model(spec_a), build_model(spec_a.with_seed(1))  # two independent tiny ViTs
    calibration = calibration_set(pair)
    merger = RaotMerger.from_pretrained(dir_a, dir_b, head="a", refit={"mode": "off"})
    merged_a = merger.merge(calibration=calibration).model
    swapped = with_head_of(merged_a, merger.model_b, schema_for(merged_a))
    product_b = (
        RaotMerger.from_pretrained(dir_a, dir_b, head="b", refit={"mode": "off"}).merge(calibration=calibration).model
    )
    x = example_inputs(product_b)
    with torch.no_grad():
        assert torch.allclose(swapped(**x).logits, product_b(**x).logits, atol=1e-6)
        assert not torch.allclose(merged_a(**x).logits, product_b(**x).logits, atol=1e-3)


def test_a_failure_note_goes_once_the_method_reruns_without_error(tiny_results):
    _, results, _ = tiny_results
    failed = copy.deepcopy(results)
    failed["runs"][0]["methods"]["raot"] = {"error": "RaotError: boom"}
    note = "pair tiny-vit-scrambled run 0: method raot failed: RaotError: boom"
    failed["meta"]["notes"] = [note]
    failed["meta"].pop("updates", None)
    still_failing = merge_results(failed, copy.deepcopy(failed), ["tiny-vit-scrambled"])
    assert note in still_failing["meta"]["notes"]
    fixed = merge_results(failed, copy.deepcopy(results), ["tiny-vit-scrambled"])
    assert note not in fixed["meta"]["notes"]


def test_a_dropped_rows_note_goes_once_they_are_rerun_and_replaced_invocations_are_not_listed(tiny_results, tmp_path):
    """Retrained parents drop the rows not rerun (a note says which); rerunning them on the new
    parents retires the note, and the report no longer lists the first invocation, none of whose
    numbers remain."""
    _, results, _ = tiny_results
    rerun = copy.deepcopy(results)
    rerun["methods"] = [m for m in rerun["methods"] if m["name"] == "raot"]
    rerun["runs"][0]["methods"] = {"raot": rerun["runs"][0]["methods"]["raot"]}
    rerun["runs"][0]["parents"]["a"]["accuracy"] += 0.01
    rerun["meta"]["argv"] = ["--methods", "raot", "--update"]
    partial = merge_results(results, rerun, ["tiny-vit-scrambled"])
    assert any("rows not rerun were dropped" in n for n in live_notes(partial))
    assert contributing(partial["meta"]["updates"]) == [True, True]  # average still comes from the first
    complete = copy.deepcopy(results)
    complete["runs"][0]["parents"] = rerun["runs"][0]["parents"]
    complete["meta"]["argv"] = ["--update"]
    full = merge_results(partial, complete, ["tiny-vit-scrambled"])
    assert not any("rows not rerun were dropped" in n for n in live_notes(full))
    assert contributing(full["meta"]["updates"]) == [False, False, True]
    write_report(full, tmp_path)
    text = (tmp_path / "RESULTS.md").read_text()
    assert "2 earlier invocation(s) whose rows have all been rerun since" in text
    assert "rows not rerun were dropped" not in text


def test_a_plain_rerun_into_existing_results_keeps_the_replaced_rows_as_history(tiny_results, tmp_path):
    """Without --update a run replaces the results, but every row it replaces stays in the history
    with the invocation that produced it: nothing measured is overwritten."""
    out, first, _ = tiny_results
    (tmp_path / "results.json").write_text((out / "results.json").read_text())
    second = run_benchmarks(
        suite_name="tiny", out=tmp_path, workers=1, alphas=3, method_names=["average"],
        cache_dir=str(out / "cache"), echo=lambda *_: None,
    )  # fmt: skip
    assert [set(r["methods"]) for r in second["runs"]] == [{"average"}] * len(first["runs"])
    kept = {(e["pair"], e["run"], e["method"]): e for e in second["history"]}
    for run in first["runs"]:
        for method, row in run["methods"].items():
            entry = kept[(run["pair"], run["run"], method)]
            assert entry["row"] == json.loads(json.dumps(row, default=str)) and entry["date"] == first["meta"]["date"]


def test_rows_record_what_the_correction_did(tiny_results):
    """Each row says whether a correction ran and, when it did, which layers kept it and the
    held-out competition's figures, so a table can be traced to the correction's decisions."""
    _, results, _ = tiny_results
    for run in results["runs"]:
        for method, row in run["methods"].items():
            assert "correction" in row, method
            if row["correction"] is not None:
                assert set(row["correction"]) == {"method", "layers_kept", "layers", "competition"}


def test_the_correction_summary_reads_a_corrected_merge():
    """On independent tiny decoders the least-squares correction runs: the summary names it, the
    layers that kept it (of the three) and the model-level check."""
    from benchmarks.metrics import correction_summary
    from raot_hf.testing import tiny_data, tiny_model, trained_like

    shape = dict(hidden_size=32, num_heads=4, num_layers=3, intermediate_size=64, vocab_size=100)
    pre, data = tiny_data("llama", 96, vocab_size=100)

    def report(correction: str) -> dict:
        a, b = (trained_like(tiny_model("llama", "causal", seed=s, **shape), seed=s).float() for s in (0, 1))
        return RaotMerger.from_models(a, b, preprocessor=pre, correction=correction).merge(calibration=data).report

    summary = correction_summary(report("lsq"))
    assert summary["method"] == "lsq" and summary["layers"] == 3
    assert set(summary["layers_kept"]) <= {0, 1, 2} and summary["competition"]["model_check"] is not None
    assert correction_summary(report("none")) is None
