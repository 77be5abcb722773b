"""The gate: every estimate competes with the identity (docs/design.md §5). ``decision``: the paired
test and a decision's data; ``fidelity`` / ``merge``: the merge objective's gate; ``verdict``: the
basis verdict; ``lineage``: sibling detection."""

from raot_hf.gate.decision import (
    GATE_OBJECTIVES,
    SCORED,
    UNTESTED,
    GateDecision,
    GateOptions,
    PairedTest,
    Status,
    decide,
    one_sided_level,
    paired_test,
    sign_test_p,
    unscored,
)
from raot_hf.gate.verdict import BasisVerdict, Verdict, render_verdict

__all__ = [
    "GATE_OBJECTIVES",
    "SCORED",
    "UNTESTED",
    "BasisVerdict",
    "GateDecision",
    "GateOptions",
    "PairedTest",
    "Status",
    "Verdict",
    "decide",
    "one_sided_level",
    "paired_test",
    "render_verdict",
    "sign_test_p",
    "unscored",
]
