"""Assignments that the precision of their scores cannot flip (docs/design.md §4.4).

A correlation from finite-precision co-moments lies within ε of the exact one
(:func:`raot_hf.calibration.precision.correlation_error_bound`), and near-twin units score closer
than that. Such **near ties** are resolved from each unit's exact float64 mean and standard
deviation, which an exact permutation carries over unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from raot_hf.estimators.head_fit import assign

_F64 = torch.float64

#: Magnitude mismatch (in log-std plus standardized-mean units) at which the tie penalty is whole.
MISMATCH_SCALE = 0.05


@dataclass(frozen=True)
class TieResolution:
    """What the near-tie rule saw and did: the units with a rival within 2ε of their match, the
    units whose match it changed, the smallest margin of a match over its best rival, and ε."""

    near_tied: int
    changed: int
    smallest_margin: float
    tolerance: float

    def to_dict(self) -> dict:
        return asdict(self)


def match_margins(score: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Per row i: score[i, perm[i]] minus the best rival — another column of row i, or another
    row of column perm[i] (inf for a 1 × 1 problem). The matches are masked in ``score`` itself and
    put back bit for bit: no k × k copy (128 MiB at a 4,096-unit MLP, at the calibration's peak)."""
    n = score.shape[0]
    ar = torch.arange(n)
    matched = score[ar, perm]
    score[ar, perm] = -torch.inf
    try:
        best = torch.maximum(score.max(1).values, score.max(0).values[perm])
    finally:
        score[ar, perm] = matched
    return matched - best


def unit_mismatch(mean_a, std_a, mean_b, std_b, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Per (row, col) pair: how unlike unit ``row`` of A and unit ``col`` of B are in their exact
    float64 statistics, in [0, 1] — |log σ_a − log σ_b| + |μ_a/σ_a − μ_b/σ_b| over
    :data:`MISMATCH_SCALE`, capped at 1; 0 for an exact permutation's pairs."""
    tiny = torch.finfo(_F64).tiny
    sa, sb = std_a[rows].clamp_min(tiny), std_b[cols].clamp_min(tiny)
    spread = (sa.log() - sb.log()).abs() + (mean_a[rows] / sa - mean_b[cols] / sb).abs()
    return (spread / MISMATCH_SCALE).clamp_max(1.0)


def resolve_near_ties(score: torch.Tensor, perm: torch.Tensor, tolerance: float, mismatch) -> tuple:
    """The assignment ``perm`` of ``score`` with its near ties resolved, and a :class:`TieResolution`.

    The **band** holds the pairs within 2ε (ε = ``tolerance``) of their row's or column's match.
    Rows and columns with more than one band pair are near-tied; their band pairs lose 4ε·mismatch
    (``mismatch(rows, cols)`` in [0, 1]) and the assignment is solved again: a rival with mismatch
    1 then falls below the exact match whatever the rounding, and a match with no rival within 2ε
    never moves."""
    margins = match_margins(score, perm)
    smallest = float(margins.min()) if margins.numel() else float("inf")
    if tolerance <= 0 or score.numel() == 0:
        return perm, TieResolution(0, 0, smallest, tolerance)
    ar = torch.arange(score.shape[0])
    inverse = torch.empty_like(perm)
    inverse[perm] = ar
    matched = score[ar, perm]
    band = (score >= (matched - 2 * tolerance)[:, None]) | (score >= (matched[inverse] - 2 * tolerance)[None, :])
    tied_rows, tied_cols = band.sum(1) > 1, band.sum(0) > 1
    band &= tied_rows[:, None] | tied_cols[None, :]
    near = int(tied_rows.sum())
    if not band.any():
        return perm, TieResolution(0, 0, smallest, tolerance)
    rows, cols = band.nonzero(as_tuple=True)
    del band
    # the band penalised in the float64 scores themselves (``score``, or its float64 copy) and put
    # back bit for bit: no k × k copy
    penalised = score if score.dtype == _F64 else score.to(_F64)
    unpenalised = penalised[rows, cols]
    penalised[rows, cols] = unpenalised - 4 * tolerance * mismatch(rows, cols)
    try:
        resolved = assign(penalised)
    finally:
        penalised[rows, cols] = unpenalised
    return resolved, TieResolution(near, int((resolved != perm).sum()), smallest, tolerance)
