"""The pieces both head solvers share (docs/design.md §4.4, §8.3).

A head pair is scored on cross blocks *normalised* by the pair's energies, so that B = g·A for any
g of the head group (permutation, rotations, positive scales) gives the true match 1 and every
other pair less (Cauchy–Schwarz). Under RoPE the normalisation is per rotary pair (dims p and
p + h/2: the admissible Q/K map is a complex scalar per pair, §8.2), weighted by energy share.
"""

from __future__ import annotations

import numpy
import torch
from scipy.optimize import linear_sum_assignment

from raot_hf.calibration.statistics import Moments

_F64 = torch.float64
_TINY = 1e-300


def assign(score: torch.Tensor) -> torch.Tensor:
    """Exact maximum-weight assignment: returns perm with row i matched to column perm[i]."""
    cost = score.detach().cpu()
    if cost.dtype != _F64 or not cost.is_contiguous():
        rows, cols = linear_sum_assignment(cost.numpy(), maximize=True)
    else:  # the solver maximises by negating a copy: negated in place and back (exact) instead —
        # at a 4,096-unit MLP the copy is 128 MiB, at the calibration pass's peak
        array = cost.numpy()
        numpy.negative(array, out=array)
        try:
            rows, cols = linear_sum_assignment(array)
        finally:
            numpy.negative(array, out=array)
    perm = torch.empty(score.shape[0], dtype=torch.long)
    perm[torch.as_tensor(rows)] = torch.as_tensor(cols)
    return perm


def blocks(m: torch.Tensor, H: int, h: int) -> torch.Tensor:
    """(H·h)² → (H, H, h, h): block [i, j] = rows of head i (A), columns of head j (B)."""
    return m.reshape(H, h, H, h).permute(0, 2, 1, 3)


def procrustes(n: torch.Tensor) -> torch.Tensor:
    """argmax over orthogonal R of tr(N·R): with N = UΣVᵀ, R = V·Uᵀ (batched)."""
    u, _, vh = torch.linalg.svd(n)
    return vh.transpose(-1, -2) @ u.transpose(-1, -2)


def scale_unit_energy(sq: torch.Tensor, H: int, h: int, rope: bool, rotary: int | None = None) -> torch.Tensor:
    """(H, g) summed squares per scale unit (the dims one positive scale acts on): each rotary pair
    (dims p, p + r/2; r = ``rotary``, the whole head by default) under RoPE, and the dims that do
    not rotate together (docs/design.md §9.4); else the whole head (g = 1)."""
    e = sq.to(_F64).reshape(H, h)
    if rope:
        r = h if rotary is None else rotary
        half = r // 2
        pairs = e[:, :half] + e[:, half:r]
        return pairs if r == h else torch.cat([pairs, e[:, r:].sum(-1, keepdim=True)], -1)
    return e.sum(-1, keepdim=True)


def per_dim(e: torch.Tensor, h: int, rotary: int | None = None) -> torch.Tensor:
    """(…, g) scale-unit values → (…, h): each dimension carries its unit's value."""
    if e.shape[-1] == 1:
        return e.expand(*e.shape[:-1], h)
    if rotary is None or rotary == h:
        return torch.cat([e, e], -1)
    pairs, free = e[..., :-1], e[..., -1:]
    return torch.cat([pairs, pairs, free.expand(*free.shape[:-1], h - rotary)], -1)


def _normalised(m: Moments, H: int, h: int, rope: bool, rotary: int | None = None) -> torch.Tensor:
    """Cross blocks of one site divided by √(E_A·E_B) of the row's and the column's scale unit."""
    ea = per_dim(scale_unit_energy(m.sq_a, H, h, rope, rotary), h, rotary)
    eb = per_dim(scale_unit_energy(m.sq_b, H, h, rope, rotary), h, rotary)
    z = (ea[:, None, :, None] * eb[None, :, None, :]).clamp_min(_TINY).sqrt()
    return blocks(m.raw_cross(), H, h) / z


def pair_weights(q: Moments, k: Moments, H: int, h: int, rotary: int | None = None) -> torch.Tensor:
    """(H, H, g) weights of the scale units (rotary pairs; the dims that do not rotate) of each head
    pair, summing to 1: the unit's scale-invariant energy (E_q,A·E_k,A·E_q,B·E_k,B)^¼ over the head
    pair's total."""
    eqa, eka = scale_unit_energy(q.sq_a, H, h, True, rotary), scale_unit_energy(k.sq_a, H, h, True, rotary)
    eqb, ekb = scale_unit_energy(q.sq_b, H, h, True, rotary), scale_unit_energy(k.sq_b, H, h, True, rotary)
    g = ((eqa * eka)[:, None, :] * (eqb * ekb)[None, :, :]).clamp_min(0).pow(0.25)
    return g / g.sum(-1, keepdim=True).clamp_min(_TINY)


def normalised_blocks(q: Moments, k: Moments, ctx: Moments, H: int, h: int, *, rope: bool, rotary: int | None = None):
    """(C_qk, C_vo), each (H, H, h, h): C_qk = ½·(N_q/√(E_q,A·E_q,B) + N_k/√(E_k,A·E_k,B)) per
    scale unit (rotary pairs weighted by :func:`pair_weights` under RoPE), C_vo = N_ctx/√(…)
    per head. Their best-rotation values (nuclear norm, or Σ over pairs of the pair optimum)
    lie in [0, 1] and are 1 for the true match of an exact symmetry, scales included."""
    c_qk = 0.5 * (_normalised(q, H, h, rope, rotary) + _normalised(k, H, h, rope, rotary))
    if rope:
        w = pair_weights(q, k, H, h, rotary)
        c_qk = c_qk * per_dim(w, h, rotary)[..., None]
    return c_qk, _normalised(ctx, H, h, False)


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where both are positive and finite, else 1 (no evidence: no scale)."""
    ok = (num > 0) & (den > 0) & torch.isfinite(num) & torch.isfinite(den)
    return torch.where(ok, num / den.clamp_min(_TINY), torch.ones_like(num))


def matched_scales(
    q: Moments, k: Moments, ctx: Moments, rows: torch.Tensor, cols: torch.Tensor, H: int, h: int, *, rope: bool,
    rotary: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The scales that undo B's for A's query heads ``rows`` matched to B's ``cols``: ``(qk_scale,
    vo_scale)``, qk_scale of shape (g,) (g = h/2 under RoPE, else 1), acting on B′ *after* the
    rotations (q ← a·q, k ← k/a, v ← c·v). By energy balance s⁴ = (E_q,B/E_q,A)·(E_k,A/E_k,B),
    a = 1/s and c = √(E_ctx,A/E_ctx,B): exact on an exact symmetry."""
    eqa = scale_unit_energy(q.sq_a, H, h, rope, rotary)[rows].sum(0)
    eka = scale_unit_energy(k.sq_a, H, h, rope, rotary)[rows].sum(0)
    eqb = scale_unit_energy(q.sq_b, H, h, rope, rotary)[cols].sum(0)
    ekb = scale_unit_energy(k.sq_b, H, h, rope, rotary)[cols].sum(0)
    s4 = _ratio(eqb, eqa) * _ratio(eka, ekb)
    eva = scale_unit_energy(ctx.sq_a, H, h, False)[rows].sum()
    evb = scale_unit_energy(ctx.sq_b, H, h, False)[cols].sum()
    return s4.pow(-0.25), _ratio(eva, evb).sqrt()
