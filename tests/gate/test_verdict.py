"""Typed gate records: decision statuses, the basis verdict and its one line, the functional checks."""

import json

import pytest

from raot_hf.gate import BasisVerdict, GateDecision, Status, Verdict, render_verdict, unscored
from raot_hf.gate.merge import _alignment_verdict
from raot_hf.gate.verdict import ModelCheckFigures, OffPath
from raot_hf.outputs.report import Check, model_card_context

FIGURES = ModelCheckFigures(identity=0.50594, aligned=0.999996, examples=16, margin=0.0123)

#: Every verdict's line, as the report, the model card and ``raot-hf inspect`` show it.
LINES = [
    (BasisVerdict(Verdict.NOT_REQUESTED), "no alignment requested"),
    (
        BasisVerdict(Verdict.UNTESTED, why="too few held-out tokens (20 < 64)"),
        "no basis verdict: no estimate could be tested (too few held-out tokens (20 < 64)); the identity stands",
    ),
    (
        BasisVerdict(Verdict.UNCHECKED, why="gate disabled", applied=3, estimates=5),
        "no basis verdict (gate disabled): 3 of 5 estimates applied unchecked",
    ),
    (
        BasisVerdict(Verdict.SHARES_BASIS_BY_DEFAULT, why="too few gate examples (3 < 4)"),
        "A and B share a basis by default: too few gate examples (3 < 4), the identity stands",
    ),
    (
        BasisVerdict(Verdict.SHARES_BASIS, why="alignment objective", estimates=7),
        "A and B share a basis: the gate rejected all 7 estimates (alignment objective)",
    ),
    (
        BasisVerdict(Verdict.SHARES_BASIS, check=FIGURES),
        "A and B share a basis: identity merge fidelity 0.5059, aligned merge 1.0000 on 16 held-out examples "
        "(no gain beyond the margin 0.012)",
    ),
    (
        BasisVerdict(Verdict.DIFFERS_IN_BASIS, why="alignment objective", applied=5, estimates=13),
        "A and B differ in basis: 5 of 13 estimates applied (alignment objective)",
    ),
    (
        BasisVerdict(Verdict.DIFFERS_IN_BASIS, check=FIGURES),
        "A and B differ in basis: aligned merge fidelity 1.0000 vs identity merge 0.5059 on 16 held-out examples "
        "(margin 0.012)",
    ),
    (
        BasisVerdict(Verdict.DIFFERS_NOT_EXACT, check=FIGURES, off_path=OffPath(0.3412, 2, 3)),
        "A and B differ in basis: aligned merge fidelity 1.0000 vs identity merge 0.5059 on 16 held-out examples "
        "(margin 0.012); but one token leaves the parents' path by 0.34 (from layer 2, largest at layer 3): "
        "not an exact recovery there",
    ),
    (
        BasisVerdict(Verdict.SIBLINGS, affinity=(0.5841, 0.0471)),
        "A and B share a basis: fine-tuned siblings, the estimates are near the identity (median identity "
        "affinity 0.584, smallest 0.047, none at chance level)",
    ),
    (
        BasisVerdict(Verdict.SIBLINGS, check=ModelCheckFigures(0.5541, 0.6957, 16), affinity=(0.5841, 0.0471)),
        "A and B share a basis: fine-tuned siblings, the estimates are near the identity (median identity "
        "affinity 0.584, smallest 0.047, none at chance level); merge fidelity, evidence only: aligned 0.6957 vs "
        "identity 0.5541 on 16 held-out examples",
    ),
]


@pytest.mark.parametrize("verdict,line", LINES, ids=[f"{v.code.value}-{i}" for i, (v, _) in enumerate(LINES)])
def test_every_verdict_renders_its_line(verdict, line):
    assert render_verdict(verdict) == line == verdict.text


def test_every_verdict_code_has_a_line():
    assert {v.code for v, _ in LINES} == set(Verdict)


def _row(applied: bool, status: Status, reason: str = "r") -> GateDecision:
    return unscored("mlp", 0, applied, status, reason)


def test_the_verdict_without_the_merge_gate_reads_the_decisions():
    """The verdict's code when the merge gate did not run, from the decisions' statuses."""
    untested = [_row(False, Status.TOO_FEW_TOKENS, "too few"), _row(False, Status.NONFINITE)]
    assert _alignment_verdict([], "x").code is Verdict.NOT_REQUESTED
    assert _alignment_verdict(untested, "x") == BasisVerdict(Verdict.UNTESTED, why="too few")
    rejected = [_row(False, Status.BELOW_MARGIN), _row(False, Status.IDENTITY)]
    assert _alignment_verdict(rejected, "x") == BasisVerdict(Verdict.SHARES_BASIS, why="x", estimates=2)
    some = [_row(True, Status.ACCEPTED), _row(False, Status.BELOW_MARGIN)]
    assert _alignment_verdict(some, "x").code is Verdict.DIFFERS_IN_BASIS
    assert _alignment_verdict(some, "x", gated=False) == BasisVerdict(Verdict.UNCHECKED, "x", 1, 2)


def test_statuses_are_their_strings_in_every_rendering():
    d = _row(True, Status.UNGATED)
    assert d.status is Status.UNGATED and d.status == "ungated" and str(d.status) == f"{d.status}" == "ungated"
    row = d.to_dict()
    assert type(row["status"]) is str and json.loads(json.dumps(row))["status"] == "ungated"
    assert GateDecision("mlp", 0, None, None, None, None, None, False, "r", status="vetoed").status is Status.VETOED
    with pytest.raises(ValueError):
        GateDecision("mlp", 0, None, None, None, None, None, False, "r", status="maybe")
    assert _row(False, Status.ACCEPTED).scored and not _row(False, Status.IDENTITY).scored
    assert _row(False, Status.TOO_FEW_EXAMPLES).untested and not _row(False, Status.VETOED).untested


def test_a_check_is_its_report_entry():
    check = Check("B′ ≡ B on held-out inputs (max relative deviation)", 3e-7, 1e-4, True, True, norm_value=1e-8)
    entry = check.to_dict()
    expected = {"name": check.name, "value": 3e-7, "threshold": 1e-4, "exact": True, "passed": True, "norm_value": 1e-8}
    assert entry == expected
    assert list(entry) == ["name", "value", "threshold", "exact", "passed", "norm_value"]
    assert Check.from_dict(json.loads(json.dumps(entry))) == check and check.kind == "exact"
    approximate = Check.from_dict({"name": "n", "value": 0.2, "threshold": 1e-4, "passed": True})
    assert approximate.kind == "approximate" and not approximate.exact
    card = model_card_context({"inputs": {"a": {"id": "a"}, "b": {"id": "b"}}, "checks": [entry]})
    row = {"name": check.name, "value": 3e-7, "norm_value": 1e-8, "threshold": 1e-4, "passed": True, "kind": "exact"}
    assert card["checks"] == [row]
