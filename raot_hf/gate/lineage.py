"""Sibling detection: are A and B fine-tunes of one initialization? (docs/design.md §5.4)

Between independent models an estimate is as far from the identity as a random map; between
siblings it is the identity plus drift. The *identity affinity* of an estimate: for a permutation,
its fraction of fixed points (chance ≈ 1/n); for a residual rotation O, tr(O)/d (Haar: E tr = 0,
sd 1); for a head alignment, the mean over heads of [head i ↦ head i] · ½(tr(R_qkⁱ) + tr(R_voⁱ))/h.
The pair is *siblings* when the median affinity is ≥ ``threshold`` and every one is ≥
``chance_multiple``/n (benchmark pairs: siblings' median 0.58–1.00, independent pairs' largest
single affinity 0.05); the gate then keeps the identity everywhere — detection, not repair.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raot_hf.symmetry import (
    ExpertAlignment,
    HeadAlignment,
    MLPPermutation,
    ResidualPermutation,
    ResidualRotation,
    Transform,
)

#: The estimates are identity-dominated when their median affinity is at or above this
#: (independent pairs measure ≤ 0.05 for any single estimate) ...
SIBLING_AFFINITY = 0.1
#: ... and every one is at or above this many times the chance level 1/n of a map of size n.
CHANCE_MULTIPLE = 4.0


@dataclass
class LineageEvidence:
    """Per-estimate identity affinities and the sibling verdict drawn from them."""

    affinities: list[dict] = field(default_factory=list)  # {"transform", "layer", "affinity", "chance"}
    threshold: float = SIBLING_AFFINITY

    @property
    def siblings(self) -> bool:
        """At least one estimate, the median identity-dominated, and none at chance level."""
        return (
            bool(self.affinities)
            and self.median >= self.threshold
            and all(a["affinity"] >= a["chance"] for a in self.affinities)
        )

    @property
    def smallest(self) -> float:
        return min((a["affinity"] for a in self.affinities), default=float("nan"))

    @property
    def median(self) -> float:
        """The median affinity (NaN without estimates, like :attr:`smallest`)."""
        values = sorted(a["affinity"] for a in self.affinities)
        if not values:
            return float("nan")
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])

    def to_dict(self) -> dict:
        return {
            "siblings": self.siblings,
            "median_affinity": self.median,
            "smallest_affinity": self.smallest,
            "threshold": self.threshold,
            "estimates": self.affinities,
        }


def _fixed_fraction(perm: torch.Tensor) -> torch.Tensor:
    return (perm == torch.arange(perm.numel(), device=perm.device)).double()


def _normalised_traces(maps: torch.Tensor) -> torch.Tensor:
    return torch.diagonal(maps.double(), dim1=-2, dim2=-1).sum(-1) / maps.shape[-1]


def identity_affinity(t: Transform) -> tuple[str, int | None, float, int] | None:
    """(kind, layer, affinity, size) of one estimate, or None for a transform that is not a
    change of basis (head rescales, soft transport)."""
    if isinstance(t, MLPPermutation):
        return "mlp", t.layer, float(_fixed_fraction(t.perm).mean()), t.perm.numel()
    if isinstance(t, ExpertAlignment):  # an expert kept in its slot, weighted by its units kept in place
        units = (t.units == torch.arange(t.units.shape[1])).double().mean(1)
        return "experts", t.layer, float((_fixed_fraction(t.perm) * units).mean()), t.units.numel()
    if isinstance(t, ResidualPermutation):
        return "residual", None, float(_fixed_fraction(t.perm).mean()), t.perm.numel()
    if isinstance(t, ResidualRotation):
        return "residual", None, float(_normalised_traces(t.matrix)), t.matrix.shape[0]
    if isinstance(t, HeadAlignment):
        fixed = _fixed_fraction(t.perm)
        qk, vo = _normalised_traces(t.qk), _normalised_traces(t.vo)
        # shared KV heads may carry one Q/K or V/O map per KV head: then their mean trace
        per_head = qk.shape == vo.shape == fixed.shape
        rotation = 0.5 * (qk + vo) if per_head else 0.5 * (qk.mean() + vo.mean())
        return "heads", t.layer, float((fixed * rotation).mean()), t.perm.numel() * t.qk.shape[-1]
    return None


def detect_siblings(
    parts: list[Transform], *, threshold: float = SIBLING_AFFINITY, chance_multiple: float = CHANCE_MULTIPLE
) -> LineageEvidence:
    """The affinities of ``parts`` and the sibling verdict drawn from them."""
    evidence = LineageEvidence(threshold=threshold)
    for t in parts:
        measured = identity_affinity(t)
        if measured is None:
            continue
        kind, layer, affinity, size = measured
        chance = chance_multiple / max(size, 1)
        evidence.affinities.append({"transform": kind, "layer": layer, "affinity": affinity, "chance": chance})
    return evidence
