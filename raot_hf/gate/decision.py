"""The gate: the identity competes with every estimate on held-out statistics (docs/design.md §5).

A transform's held-out gains are one number per unit (MLP), head, or stream coordinate: its
alignment objective under the estimate minus under the identity. It is applied only if the mean
gain exceeds ``z`` standard errors (a paired test across units), the floor ``min_gain`` (cosine /
correlation units) and the held-out split holds enough tokens.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from enum import Enum

import torch

from raot_hf.config.options import check_choice, check_field_types, check_non_negative_int, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError

logger = logging.getLogger("raot_hf.gate")


class TextEnum(str, Enum):
    """An enum whose members are their string values: equal to, formatted and written to JSON as them."""

    def __str__(self) -> str:
        return self.value


class Status(TextEnum):
    """Why a decision stands as it does (:attr:`GateDecision.reason` is the human-readable line)."""

    ACCEPTED = "accepted"  # the paired test passed: applied
    BELOW_MARGIN = "below_margin"  # scored, and the test did not pass
    IDENTITY = "identity"  # the estimate is the identity: nothing to decide
    NONFINITE = "nonfinite"  # NaN/Inf statistics: the identity stands
    TOO_FEW_TOKENS = "too_few_tokens"
    TOO_FEW_EXAMPLES = "too_few_examples"  # the merge gate's set is too small to test on
    GATE_DISABLED = "gate_disabled"  # applied without a test (gate=False)
    UNGATED = "ungated"  # soft transport plans, or no calibration data: applied as estimated
    SIBLINGS = "siblings"  # every estimate near the identity: the identity stands (§5.4)
    VETOED = "vetoed"  # accepted per layer, then the model-level check failed


#: The statuses whose estimates the merge gate scores again (the rest keep their reason).
SCORED = (Status.ACCEPTED, Status.BELOW_MARGIN)
#: The statuses of estimates no test could judge (too little data, NaN statistics): when every
#: decision has one there is no basis verdict, only the identity by default.
UNTESTED = (Status.TOO_FEW_TOKENS, Status.TOO_FEW_EXAMPLES, Status.NONFINITE)


@dataclass(frozen=True)
class PairedTest:
    """One paired test of gains g₁…g_n against zero (docs/design.md §5.2)."""

    mean: float
    stderr: float | None
    margin: float
    n: int
    positive: int
    passed: bool
    reason: str


def paired_test(gains: torch.Tensor, *, z: float, floor: float = 0.0, sign_test: bool = False) -> PairedTest:
    """Pass iff the mean gain exceeds ``max(z·se, floor)`` and 0 (with a single gain: 0.05), or —
    ``sign_test`` — the mean exceeds the floor and the gains are positive on so many of the n
    examples that P(Binomial(n, ½) ≥ k) ≤ 1 − Φ(z): heavy-tailed gains (one example that the
    unaligned merge ruins) inflate the standard error without making the estimate worse."""
    gains = gains.to(torch.float64).flatten()
    n = gains.numel()
    mean = float(gains.mean()) if n else 0.0
    stderr = float(gains.std(unbiased=True) / math.sqrt(n)) if n > 1 else None
    margin = max(z * stderr if stderr is not None else 0.05, floor)
    positive = int((gains > 0).sum())
    if mean > margin and mean > 0:
        return PairedTest(mean, stderr, margin, n, positive, True, f"gain {mean:.3g} > margin {margin:.3g}")
    if sign_test and n > 1 and mean > max(floor, 0.0) and sign_test_p(gains) <= one_sided_level(z):
        why = f"gain {mean:.3g} on {positive}/{n} examples (sign test p = {sign_test_p(gains):.2g})"
        return PairedTest(mean, stderr, margin, n, positive, True, why)
    return PairedTest(mean, stderr, margin, n, positive, False, f"gain {mean:.3g} ≤ margin {margin:.3g}")


@dataclass
class GateDecision:
    """One row of the gate table. ``identity``/``estimate``/``gain``/``stderr``/``margin`` are the
    deciding objective's (None where nothing was scored); ``fidelity_*`` are set under the merge
    objective, ``alignment_gain`` is the alignment objective's gain kept as a diagnostic there."""

    transform: str  # "mlp" | "experts" | "heads" | "residual"
    layer: int | None
    identity: float | None  # held-out objective under the identity
    estimate: float | None  # held-out objective under the estimate
    gain: float | None
    stderr: float | None
    margin: float | None
    applied: bool
    reason: str
    description: str = ""
    # which objective decided: "alignment" (identity/estimate/gain are the alignment objective,
    # per unit) or "merge" (they are the merged computation's fidelity, per gate example, §5)
    objective: str = "alignment"
    fidelity_identity: float | None = None
    fidelity_estimate: float | None = None
    alignment_gain: float | None = None  # diagnostic under the merge objective
    examples: int = 0
    status: Status = Status.BELOW_MARGIN
    # merge objective: the largest deviation of one token of the layer merged with the estimate
    # (unweighted, relative to what the block computes for it: gate.fidelity.worst_token_deviation)
    worst_token: float | None = None

    def __post_init__(self) -> None:
        self.status = Status(self.status)  # a status given by its string value becomes the member

    def to_dict(self) -> dict:
        """The report's row: every field, the status as its string."""
        return {**asdict(self), "status": self.status.value}

    scored = property(lambda self: self.status in SCORED, doc="A paired test decided it (the merge gate re-decides).")
    untested = property(lambda self: self.status in UNTESTED, doc="No test could judge the estimate.")


def unscored(kind: str, layer: int | None, applied: bool, status: Status, reason: str, description: str = ""):
    """A decision no test made (ungated, identity, no data …)."""
    return GateDecision(kind, layer, None, None, None, None, None, applied, reason, description, status=status)


def decide(
    transform: str, layer: int | None, gains: torch.Tensor, identity: float, *, z: float, min_gain: float = 0.0,
    heldout_tokens: int, min_tokens: int, is_identity: bool, enabled: bool = True, description: str = "",
) -> GateDecision:  # fmt: skip
    """Decide whether one estimated transform earns its place (the alignment objective's gate)."""
    test = paired_test(gains, z=z, floor=min_gain)
    where = "" if layer is None else f" {layer}"
    if not math.isfinite(test.mean):
        return unscored(
            transform, layer, False, Status.NONFINITE, "non-finite statistics (NaN/Inf in activations)", description
        )
    if is_identity:
        return unscored(transform, layer, False, Status.IDENTITY, "estimate is the identity", description)
    if heldout_tokens < min_tokens:
        reason = f"too few held-out tokens ({heldout_tokens} < {min_tokens})"
        logger.warning("%s%s: %s; keeping the identity", transform, where, reason)
        return unscored(transform, layer, False, Status.TOO_FEW_TOKENS, reason, description)
    status = Status.GATE_DISABLED if not enabled else Status.ACCEPTED if test.passed else Status.BELOW_MARGIN
    applied = status in (Status.GATE_DISABLED, Status.ACCEPTED)
    reason = "gate disabled" if not enabled else test.reason
    return GateDecision(
        transform, layer, identity, identity + test.mean, test.mean, test.stderr, test.margin, applied, reason,
        description, status=status,
    )  # fmt: skip


def one_sided_level(z: float) -> float:
    """The one-sided false-accept rate of a z-standard-error margin: 1 − Φ(z) (z = 3: 0.00135)."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def sign_test_p(gains: torch.Tensor) -> float:
    """One-sided sign-test p-value of "no gain": P(Binomial(n, ½) ≥ k), k the positive gains (a
    zero counts against the estimate)."""
    n, k = gains.numel(), int((gains > 0).sum())
    return sum(math.comb(n, j) for j in range(k, n + 1)) / 2.0**n


GATE_OBJECTIVES = ("merge", "alignment")


@register_section
@dataclass
class GateOptions(OptionSection):
    """The gate: the identity competes with every estimate on held-out data.

    ``z``: margin in standard errors of the per-unit gains (3 ⇒ ~0.1% one-sided false accepts per
    transform); ``min_gain``: floor on the mean gain (objectives are cosines or correlations in [−1, 1]).
    ``objective``: ``merge`` decides by the merged computation's fidelity to A and B′ on ``examples``
    held-out examples (docs/design.md §5), ``alignment`` by the alignment objective's gain alone (an
    ablation). ``sibling_check``: identity-dominated estimates keep the identity everywhere (§5.4).
    """

    section, switch = "gate", "enabled"

    enabled: bool = field(
        default=True, metadata=meta("Let the identity compete with every estimate (default on).", "gate", flag="--gate")
    )
    objective: str = field(
        default="merge",
        metadata=meta(
            "What the gate scores: merged fidelity to A and B′ (default merge) or the alignment objective.",
            "gate_objective",
            choices=GATE_OBJECTIVES,
        ),
    )
    z: float = field(default=3.0, metadata=meta("Gate margin in standard errors (default 3).", "gate_z"))
    min_gain: float = field(default=0.01, metadata=meta("Gate floor on the mean gain (default 0.01).", "gate_min_gain"))
    min_heldout_tokens: int = field(
        default=64,
        metadata=meta("Below this, estimates lose to the identity.", "min_heldout_tokens", flag="--min-heldout-tokens"),
    )
    examples: int = field(
        default=16, metadata=meta("Held-out examples the merge gate scores (default 16).", "gate_examples")
    )
    sibling_check: bool = field(
        default=True,
        metadata=meta(
            "Keep the identity when the estimates are near it: fine-tuned siblings (default on).",
            "sibling_check",
            flag="--sibling-check",
        ),
    )

    sweep: bool = field(
        default=True,
        metadata=meta(
            "Decide, correct and apply in one sweep over the layers where the merge allows it (default on; "
            "off: the gate, the apply and the correction as three passes).",
            "gate_sweep",
            flag="--gate-sweep",
        ),
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if not 0.0 <= self.min_gain <= 2.0:
            raise RaotError(f"gate_min_gain={self.min_gain} must lie in [0, 2] (a gain in cosine units)")
        check_choice("gate_objective", self.objective, GATE_OBJECTIVES)
        if self.examples < 4:
            raise RaotError(f"gate_examples={self.examples} must be ≥ 4 (held-out examples the merge gate scores)")
        if self.z < 0:
            raise RaotError(f"gate_z={self.z} must be ≥ 0 (standard errors of margin)")
        check_non_negative_int("min_heldout_tokens", self.min_heldout_tokens)
