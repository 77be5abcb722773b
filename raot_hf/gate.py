"""The gate: the identity competes with every estimate on held-out statistics (docs/design.md §5).

A transform's held-out gains are one number per unit (MLP), head, or stream coordinate:
its alignment objective under the estimate minus under the identity. The transform is
applied only if the mean gain exceeds ``z`` standard errors of that mean — a paired test
across units, whose noise estimate comes from the held-out split itself — and if the
held-out split holds enough tokens for the statistic to mean anything. A floor ``min_gain``
(default 0.01 in cosine / correlation units) keeps statistically real but immaterial gains —
siblings of one initialization whose bases already agree to within 1% — at the identity.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import torch

logger = logging.getLogger("raot_hf.gate")


@dataclass
class GateDecision:
    """One row of the gate table."""

    transform: str  # "mlp" | "heads" | "residual"
    layer: int | None
    identity: float  # held-out objective under the identity
    estimate: float  # held-out objective under the estimate
    gain: float
    stderr: float
    margin: float
    applied: bool
    reason: str
    description: str = ""
    # which objective decided: "alignment" (identity/estimate/gain are the alignment objective,
    # per unit) or "merge" (they are the merged computation's fidelity, per gate example, §5)
    objective: str = "alignment"
    fidelity_identity: float = float("nan")
    fidelity_estimate: float = float("nan")
    alignment_gain: float = float("nan")  # diagnostic under the merge objective
    examples: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def decide(
    transform: str,
    layer: int | None,
    gains: torch.Tensor,
    identity: float,
    *,
    z: float,
    min_gain: float = 0.0,
    heldout_tokens: int,
    min_tokens: int,
    is_identity: bool,
    enabled: bool = True,
    description: str = "",
    sign_test: bool = False,
) -> GateDecision:
    """Decide whether one estimated transform earns its place. ``sign_test``: also accept when the
    gains are positive on so many of the n paired examples that a sign test rejects "no gain" at
    the t-test's own level (docs/design.md §5.2) — heavy-tailed gains (one example that the
    unaligned merge ruins) inflate the standard error without making the estimate worse."""
    gains = gains.to(torch.float64).flatten()
    n = gains.numel()
    gain = float(gains.mean()) if n else 0.0
    stderr = float(gains.std(unbiased=True) / math.sqrt(n)) if n > 1 else float("nan")
    # With a single unit there is no spread to learn noise from: demand a clear 0.05 gain.
    margin = max(z * stderr if n > 1 else 0.05, min_gain)
    if not math.isfinite(gain):
        applied, reason = False, "non-finite statistics (NaN/Inf in activations)"
    elif is_identity:
        applied, reason = False, "estimate is the identity"
    elif heldout_tokens < min_tokens:
        applied, reason = False, f"too few held-out tokens ({heldout_tokens} < {min_tokens})"
        logger.warning("%s%s: %s; keeping the identity", transform, "" if layer is None else f" {layer}", reason)
    elif not enabled:
        applied, reason = True, "gate disabled"
    elif gain > margin and gain > 0:
        applied, reason = True, f"gain {gain:.3g} > margin {margin:.3g}"
    elif sign_test and gain > max(min_gain, 0.0) and sign_test_p(gains) <= one_sided_level(z):
        positive = int((gains > 0).sum())
        applied, reason = True, f"gain {gain:.3g} on {positive}/{n} examples (sign test p = {sign_test_p(gains):.2g})"
    else:
        applied, reason = False, f"gain {gain:.3g} ≤ margin {margin:.3g}"
    return GateDecision(transform, layer, identity, identity + gain, gain, stderr, margin, applied, reason, description)


def one_sided_level(z: float) -> float:
    """The one-sided false-accept rate of a z-standard-error margin: 1 − Φ(z) (z = 3: 0.00135)."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def sign_test_p(gains: torch.Tensor) -> float:
    """One-sided sign-test p-value of "no gain": P(Binomial(n, ½) ≥ k), k the positive gains (a
    zero counts against the estimate)."""
    n, k = gains.numel(), int((gains > 0).sum())
    return sum(math.comb(n, j) for j in range(k, n + 1)) / 2.0**n
