"""Sibling detection: are A and B fine-tunes of one initialization? (docs/design.md §5.4)

A symmetry estimate is a map from B's coordinates to A's. Between independently trained
models it is as far from the identity as a random map; between fine-tuned siblings it is the
identity plus drift, because both models kept the coordinates of their common ancestor. The
*identity affinity* of an estimate measures that:

* a unit or coordinate permutation: the fraction of fixed points (a random permutation of n
  has one fixed point on average, so chance is ≈ 1/n);
* a residual rotation O: tr(O)/d (a Haar-random orthogonal matrix has E tr = 0, sd 1);
* a head alignment: the mean over heads of [head i ↦ head i] · ½(tr(R_qkⁱ) + tr(R_voⁱ))/h.

The pair is *siblings* when every estimate is identity-dominated: affinity ≥ ``threshold``
and ≥ ``chance_multiple``/n for its size n (so small maps cannot pass by chance). Measured on
the benchmark pairs (docs/design.md §5.4): siblings' smallest affinity 0.14–0.99, independent
and recipe-different pairs' largest 0.05. Then the gate keeps the identity everywhere —
detection, not repair — whatever the merge-fidelity comparison says (it stays in the report as
evidence), because a map fitted to fine-tuning drift also moves the shared ancestor's weights
and makes B's task vector against the base meaningless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raot_hf.symmetry import HeadAlignment, MLPPermutation, ResidualPermutation, ResidualRotation, Transform

#: An estimate is identity-dominated at or above this affinity (independent pairs measure ≤ 0.05).
SIBLING_AFFINITY = 0.1
#: ... and at or above this many times the chance level 1/n of a map of size n.
CHANCE_MULTIPLE = 4.0


@dataclass
class LineageEvidence:
    """Per-estimate identity affinities and the sibling verdict drawn from them."""

    affinities: list[dict] = field(default_factory=list)  # {"transform", "layer", "affinity", "needed"}

    @property
    def siblings(self) -> bool:
        """At least one estimate, and every one identity-dominated."""
        return bool(self.affinities) and all(a["affinity"] >= a["needed"] for a in self.affinities)

    @property
    def smallest(self) -> float:
        """The smallest affinity (NaN without estimates)."""
        return min((a["affinity"] for a in self.affinities), default=float("nan"))

    def to_dict(self) -> dict:
        return {"siblings": self.siblings, "smallest_affinity": self.smallest, "estimates": self.affinities}


def _fixed_fraction(perm: torch.Tensor) -> torch.Tensor:
    return (perm == torch.arange(perm.numel(), device=perm.device)).double()


def _normalised_traces(maps: torch.Tensor) -> torch.Tensor:
    return torch.diagonal(maps.double(), dim1=-2, dim2=-1).sum(-1) / maps.shape[-1]


def identity_affinity(t: Transform) -> tuple[str, int | None, float, int] | None:
    """(kind, layer, affinity, size) of one estimate, or None for a transform that is not a
    change of basis (head rescales, soft transport)."""
    if isinstance(t, MLPPermutation):
        return "mlp", t.layer, float(_fixed_fraction(t.perm).mean()), t.perm.numel()
    if isinstance(t, ResidualPermutation):
        return "residual", None, float(_fixed_fraction(t.perm).mean()), t.perm.numel()
    if isinstance(t, ResidualRotation):
        return "residual", None, float(_normalised_traces(t.matrix)), t.matrix.shape[0]
    if isinstance(t, HeadAlignment):
        fixed = _fixed_fraction(t.perm)
        qk, vo = _normalised_traces(t.qk), _normalised_traces(t.vo)
        # grouped attention may carry one Q/K or V/O map per KV head: then their mean trace
        per_head = qk.shape == vo.shape == fixed.shape
        rotation = 0.5 * (qk + vo) if per_head else 0.5 * (qk.mean() + vo.mean())
        return "heads", t.layer, float((fixed * rotation).mean()), t.perm.numel() * t.qk.shape[-1]
    return None


def detect_siblings(
    parts: list[Transform], *, threshold: float = SIBLING_AFFINITY, chance_multiple: float = CHANCE_MULTIPLE
) -> LineageEvidence:
    """Siblings iff there is at least one estimate and every one is identity-dominated."""
    evidence = LineageEvidence()
    for t in parts:
        measured = identity_affinity(t)
        if measured is None:
            continue
        kind, layer, affinity, size = measured
        needed = max(threshold, chance_multiple / max(size, 1))
        evidence.affinities.append({"transform": kind, "layer": layer, "affinity": affinity, "needed": needed})
    return evidence
