"""The gate: every estimate competes with the identity (docs/design.md §5).

* :mod:`raot_hf.gate.decision` — a decision's data (:class:`GateDecision`, :class:`Status`), the
  paired test and the alignment objective's rule;
* :mod:`raot_hf.gate.fidelity` — merged computations without a third model (the merge objective);
* :mod:`raot_hf.gate.merge` — the merge objective's gate: per layer, then the model-level check;
* :mod:`raot_hf.gate.verdict` — the basis verdict (:class:`Verdict`, :class:`BasisVerdict`) and its line;
* :mod:`raot_hf.gate.lineage` — sibling detection from the estimates' identity affinities.
"""

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
