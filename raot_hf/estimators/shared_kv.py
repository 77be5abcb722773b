"""The decoder head solver: shared KV heads (grouped-query attention) and RoPE (docs/design.md §8.3).

The moments are the encoders' ((H·h)², keys observed per query head); a KV head of A is matched to
one of B with a matching of their query heads and one Q/K and one V/O map per KV head, from the
scale-invariant cross blocks summed over the matched query heads. Under RoPE the Q/K map is one
2×2 rotation per rotary pair (dims p, q = p + h/2): tr(N_p·R(φ)) = a·cos φ + b·sin φ with
a = N_pp + N_qq, b = N_qp − N_pq, so φ = atan2(b, a) and the optimum is √(a² + b²).
"""

from __future__ import annotations

import torch

from raot_hf.calibration.statistics import Moments
from raot_hf.estimators.head_fit import assign, matched_scales, normalised_blocks, procrustes
from raot_hf.symmetry.transforms import HeadAlignment, HeadRescale, Transform, rope_blocks

_F64 = torch.float64
_REFINE_STEPS = 3


def _trace(n: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """tr(N·R) over the trailing h×h dims."""
    return torch.einsum("...ij,ji->...", n, r)


# Each fit takes cross blocks ``n`` (…, h, h) and returns the objective's optimum and, with
# ``maps``, the maps that reach it (None without: the pair scores need the values only).


def _rope_fit(n: torch.Tensor, maps: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Best per-pair rotations: the objective and the maps."""
    half = n.shape[-1] // 2
    p = torch.arange(half)
    a = n[..., p, p] + n[..., p + half, p + half]
    b = n[..., p + half, p] - n[..., p, p + half]
    return torch.hypot(a, b).sum(-1), rope_blocks(torch.atan2(b, a)) if maps else None


def _orthogonal_fit(n: torch.Tensor, maps: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.linalg.svdvals(n).sum(-1), procrustes(n) if maps else None


def _identity_fit(n: torch.Tensor, maps: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    eye = torch.eye(n.shape[-1], dtype=_F64).expand(n.shape).clone() if maps else None
    return n.diagonal(dim1=-2, dim2=-1).sum(-1), eye


def _match_query_heads(c_qk, c_vo, fit_qk, fit_vo, rows, cols):
    """Query heads ``rows`` of A against ``cols`` of B (one KV head each): the matching τ, the
    two maps they share and their objective values Σᵢ tr(C_iτ(i)·R), alternating an assignment under
    fixed maps with the Procrustes fit of the summed blocks under a fixed matching."""
    pair = 0.5 * (fit_qk(c_qk[rows][:, cols], maps=False)[0] + fit_vo(c_vo[rows][:, cols], maps=False)[0])
    tau = assign(pair)
    for _ in range(_REFINE_STEPS):
        v_qk, r_qk = fit_qk(c_qk[rows, cols[tau]].sum(0))
        v_vo, r_vo = fit_vo(c_vo[rows, cols[tau]].sum(0))
        new = assign(0.5 * (_trace(c_qk[rows][:, cols], r_qk) + _trace(c_vo[rows][:, cols], r_vo)))
        if torch.equal(new, tau):
            break
        tau = new
    else:
        v_qk, r_qk = fit_qk(c_qk[rows, cols[tau]].sum(0))
        v_vo, r_vo = fit_vo(c_vo[rows, cols[tau]].sum(0))
    return tau, r_qk, r_vo, v_qk, v_vo


def estimate_shared_kv_heads(
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
    scales: bool = True,
    return_log: bool = False,
):
    """KV-head assignment, query-head matching within each KV head, per-KV-head maps and scales (§8.3):
    each KV-head pair is scored by the mean cosine of its best shared fit and one exact assignment
    picks the KV map. ``scales``: a :class:`HeadRescale` follows (per rotary pair on Q/K under
    RoPE); ``rotations=False``: identity maps, no scale. Returns the transforms (and a log)."""
    H, kv, h = num_heads, num_kv_heads, head_size
    queries_per_kv = H // kv
    c_qk, c_vo = normalised_blocks(q, k, ctx, H, h, rope=rope)
    fit_qk = (_rope_fit if rope else _orthogonal_fit) if rotations else _identity_fit
    fit_vo = _orthogonal_fit if rotations else _identity_fit
    score = torch.zeros(kv, kv, dtype=_F64)
    plans = {}
    for ga in range(kv):
        rows = torch.arange(ga * queries_per_kv, (ga + 1) * queries_per_kv)
        for gb in range(kv):
            cols = torch.arange(gb * queries_per_kv, (gb + 1) * queries_per_kv)
            tau, r_qk, r_vo, v_qk, v_vo = _match_query_heads(c_qk, c_vo, fit_qk, fit_vo, rows, cols)
            score[ga, gb] = 0.5 * (v_qk + v_vo) / queries_per_kv
            plans[ga, gb] = (cols[tau], r_qk, r_vo)
    kv_perm = assign(score)
    chosen = [plans[g, int(kv_perm[g])] for g in range(kv)]
    perm = torch.cat([c[0] for c in chosen])
    qk = torch.stack([c[1] for c in chosen]).repeat_interleave(queries_per_kv, 0)
    vo = torch.stack([c[2] for c in chosen]).repeat_interleave(queries_per_kv, 0)
    parts: list[Transform] = [HeadAlignment(layer, perm, qk, vo)]
    if rotations and scales:
        fitted = [
            matched_scales(q, k, ctx, torch.arange(g * queries_per_kv, (g + 1) * queries_per_kv), c[0], H, h, rope=rope)
            for g, c in enumerate(chosen)
        ]
        qk_scale = torch.stack([a if rope else a[0] for a, _ in fitted]).repeat_interleave(queries_per_kv, 0)
        vo_scale = torch.stack([c for _, c in fitted]).repeat_interleave(queries_per_kv, 0)
        parts.append(HeadRescale(layer, qk_scale, vo_scale))
    if not return_log:
        return parts
    ar = torch.arange(kv)
    log = {
        "heads": H,
        "kv_heads": kv,
        "rope": rope,
        "perm": perm.tolist(),
        "kv_perm": kv_perm.tolist(),
        # per KV-head pair (report keys as earlier versions wrote them)
        "fit_group_score_matched": score[ar, kv_perm].tolist(),
        "fit_group_score_same_index": score.diagonal().tolist(),
    }
    if len(parts) > 1:
        log["qk_scale"], log["vo_scale"] = parts[1].qk_scale.tolist(), parts[1].vo_scale.tolist()
    return parts, log
