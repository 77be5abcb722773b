"""The typed provenance report (docs/design.md §6.4): built once, its JSON round-trips, and the
reports earlier versions wrote (``inputs.a`` / ``inputs.b``) still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raot_hf import RaotMerger, scramble
from raot_hf.outputs.record import MergeReport
from raot_hf.outputs.report import report_to_json
from raot_hf.testing import clone, tiny_data, tiny_model

EARLIER = Path(__file__).parent / "earlier_reports"


@pytest.fixture(scope="module")
def three_model_report():
    a = tiny_model("bert", "sequence", dtype=torch.float32)
    b, c = clone(a), clone(a)
    scramble(b, seed=1)
    scramble(c, seed=2)
    pre, data = tiny_data("bert", 64)
    return (
        RaotMerger.from_models(clone(a), b, c, preprocessor=pre)
        .merge(calibration=data, command="raot-hf merge …")
        .report
    )


def test_the_report_is_typed_and_its_json_round_trips(three_model_report):
    report = three_model_report
    assert isinstance(report, MergeReport) and [m.index for m in report.models] == [1, 2, 3]
    assert report.models[0].alignment is None and all(m.alignment is not None for m in report.models[1:])
    assert report.settings.merge_rule == "linear" and report.command == "raot-hf merge …"
    written = json.loads(report_to_json(report))
    again = MergeReport.from_dict(written)
    assert again == report
    assert json.loads(report_to_json(again)) == written


def test_the_report_reads_as_its_json_form_and_cannot_be_changed(three_model_report):
    report = three_model_report
    assert report["verdict"] == report.to_dict()["verdict"] and "Model 3:" in report["verdict"]
    assert [d["model"] for d in report["decisions"]] == sorted(d["model"] for d in report["decisions"])
    with pytest.raises(TypeError):
        report["command"] = "changed"  # type: ignore[index]
    with pytest.raises(AttributeError):
        report.command = "changed"  # type: ignore[misc]


@pytest.mark.parametrize("name", ["two_models", "three_models", "streamed"])
def test_reports_of_earlier_versions_still_load(name):
    """Reports written by this project before ``models`` listed every model (commit 2ce5e84)."""
    earlier = json.loads((EARLIER / f"{name}.json").read_text())
    report = MergeReport.from_dict(earlier)
    listed = earlier["inputs"].get("models") or [earlier["inputs"]["a"], earlier["inputs"]["b"]]
    assert [m.checkpoint.id for m in report.models] == [m["id"] for m in listed]
    for key in ("decisions", "verdict", "shares_basis", "summary", "applied_exact", "execution", "merge"):
        assert json.loads(json.dumps(report[key], default=str)) == earlier[key], key
    assert report.settings.to_dict()["task_vectors"]["density"] == earlier["settings"]["base_rules"]["density"]
    assert MergeReport.from_dict(json.loads(report_to_json(report))) == report


def test_the_refit_record_round_trips_and_says_what_it_ran():
    from raot_hf.outputs.record import RefitRecord

    skipped = RefitRecord(ran=False, kept=False, reason="off by the rule", mode="auto")
    assert skipped.to_dict() == {"ran": False, "kept": False, "reason": "off by the rule", "mode": "auto"}
    ran = RefitRecord(ran=True, kept=True, reason="gain", mode="auto", target="hidden", teacher=None, steps=40,
                      curve=({"step": 20, "loss": 0.5},), budget={"steps": 40})  # fmt: skip
    data = ran.to_dict()
    assert "teacher" not in data and data["budget"] == {"steps": 40} and data["curve"] == [{"step": 20, "loss": 0.5}]
    assert RefitRecord.from_dict(data) == ran
    assert RefitRecord.from_dict(skipped.to_dict()) == skipped
