"""The decoder head solver: grouped-query attention and RoPE (docs/design.md §8).

Keys are observed per query head (each query head sees its KV head's keys), so the moments
are those of the encoders' solver, (H·h)² each. The group structure enters the solve: a KV
head of A is matched to a KV head of B together with a matching of their query heads and one
Q/K and one V/O map for the whole group, estimated from the cross blocks summed over the
group's matched query heads. Under RoPE the Q/K map is restricted to one 2×2 rotation per
rotary pair (dims p and p + h/2): the pair-restricted Procrustes maximises
tr(N_p·R(φ)) = a·cos φ + b·sin φ with a = N_pp + N_qq, b = N_qp − N_pq (q = p + h/2), so
φ = atan2(b, a) and the optimum is √(a² + b²).
"""

from __future__ import annotations

import torch

from raot_hf.calibration.statistics import Moments
from raot_hf.estimators.activation import _assign, _blocks, _head_energy, _procrustes
from raot_hf.symmetry.transforms import HeadAlignment, rope_blocks

_F64 = torch.float64
_REFINE_STEPS = 3


def _trace(n: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """tr(N·R) over the trailing h×h dims."""
    return torch.einsum("...ij,ji->...", n, r)


def _rope_fit(n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Best per-pair rotations for cross blocks ``n`` (…, h, h): the objective and the maps."""
    half = n.shape[-1] // 2
    p = torch.arange(half)
    a = n[..., p, p] + n[..., p + half, p + half]
    b = n[..., p + half, p] - n[..., p, p + half]
    return torch.hypot(a, b).sum(-1), rope_blocks(torch.atan2(b, a))


def _orthogonal_fit(n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.linalg.svdvals(n).sum(-1), _procrustes(n)


def _identity_fit(n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    eye = torch.eye(n.shape[-1], dtype=_F64).expand(n.shape).clone()
    return n.diagonal(dim1=-2, dim2=-1).sum(-1), eye


def _match_groups(n_qk, n_vo, z_qk, z_vo, fit_qk, fit_vo, rows, cols):
    """Query heads ``rows`` of A against ``cols`` of B (one KV head each): the matching τ, the
    two group maps and their objective values Σᵢ tr(N_iτ(i)·R), alternating an assignment under
    fixed maps with the group Procrustes under a fixed matching."""
    pair = 0.5 * (fit_qk(n_qk[rows][:, cols])[0] / z_qk + fit_vo(n_vo[rows][:, cols])[0] / z_vo)
    tau = _assign(pair)
    for _ in range(_REFINE_STEPS):
        v_qk, r_qk = fit_qk(n_qk[rows, cols[tau]].sum(0))
        v_vo, r_vo = fit_vo(n_vo[rows, cols[tau]].sum(0))
        lin = 0.5 * (_trace(n_qk[rows][:, cols], r_qk) / z_qk + _trace(n_vo[rows][:, cols], r_vo) / z_vo)
        new = _assign(lin)
        if torch.equal(new, tau):
            break
        tau = new
    else:
        v_qk, r_qk = fit_qk(n_qk[rows, cols[tau]].sum(0))
        v_vo, r_vo = fit_vo(n_vo[rows, cols[tau]].sum(0))
    return tau, r_qk, r_vo, v_qk, v_vo


def estimate_grouped_heads(
    q: Moments,
    k: Moments,
    ctx: Moments,
    layer: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    *,
    rope: bool,
    rotations: bool = True,
    return_log: bool = False,
):
    """KV-head assignment, query-head matching within groups and per-group maps (docs/design.md §8).

    Every (KV head of A, KV head of B) pair is scored by the cosine of its best group fit —
    Σ over matched query heads of tr(N·R), normalised by the groups' energies, for QK and VO —
    and one exact assignment on that score picks the KV correspondence. ``rotations=False``
    keeps every map the identity (the permutation-only baseline)."""
    H, kv, h = num_heads, num_kv_heads, head_size
    group = H // kv
    n_qk = _blocks(q.cross.to(_F64) + k.cross.to(_F64), H, h)
    n_vo = _blocks(ctx.cross.to(_F64), H, h)
    e_qk_a, e_qk_b = _head_energy(q.sq_a + k.sq_a, H, h), _head_energy(q.sq_b + k.sq_b, H, h)
    e_vo_a, e_vo_b = _head_energy(ctx.sq_a, H, h), _head_energy(ctx.sq_b, H, h)
    fit_qk = (_rope_fit if rope else _orthogonal_fit) if rotations else _identity_fit
    fit_vo = _orthogonal_fit if rotations else _identity_fit
    score = torch.zeros(kv, kv, dtype=_F64)
    plans = {}
    for ga in range(kv):
        rows = torch.arange(ga * group, (ga + 1) * group)
        for gb in range(kv):
            cols = torch.arange(gb * group, (gb + 1) * group)
            z_qk = torch.outer(e_qk_a[rows], e_qk_b[cols]).clamp_min(1e-300).sqrt()
            z_vo = torch.outer(e_vo_a[rows], e_vo_b[cols]).clamp_min(1e-300).sqrt()
            tau, r_qk, r_vo, v_qk, v_vo = _match_groups(n_qk, n_vo, z_qk, z_vo, fit_qk, fit_vo, rows, cols)
            zg_qk = (e_qk_a[rows].sum() * e_qk_b[cols].sum()).clamp_min(1e-300).sqrt()
            zg_vo = (e_vo_a[rows].sum() * e_vo_b[cols].sum()).clamp_min(1e-300).sqrt()
            score[ga, gb] = 0.5 * (v_qk / zg_qk + v_vo / zg_vo)
            plans[ga, gb] = (cols[tau], r_qk, r_vo)
    kv_perm = _assign(score)
    chosen = [plans[g, int(kv_perm[g])] for g in range(kv)]
    perm = torch.cat([c[0] for c in chosen])
    qk = torch.stack([c[1] for c in chosen]).repeat_interleave(group, 0)
    vo = torch.stack([c[2] for c in chosen]).repeat_interleave(group, 0)
    transform = HeadAlignment(layer, perm, qk, vo)
    if not return_log:
        return transform
    ar = torch.arange(kv)
    log = {
        "heads": H,
        "kv_heads": kv,
        "rope": rope,
        "perm": perm.tolist(),
        "kv_perm": kv_perm.tolist(),
        "fit_group_score_matched": score[ar, kv_perm].tolist(),
        "fit_group_score_same_index": score.diagonal().tolist(),
    }
    return transform, log
