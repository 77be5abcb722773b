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
from raot_hf.estimators.head_fit import assign, matched_scales, normalised_blocks, per_dim, procrustes
from raot_hf.symmetry.transforms import (
    HeadAlignment,
    HeadRescale,
    Transform,
    partial_rope_blocks,
    rope_blocks,
    turn_blocks,
)

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


def structured_fit(rotary: int, turns: int | None):
    """The Q/K fit of a head whose first ``rotary`` dims rotate in pairs (p, p + rotary/2) and whose
    other dims take any orthogonal map (docs/design.md §9.4), with each pair turned by a multiple of
    2π/``turns`` only when per-head Q/K norms allow no more (§9.1): per pair, tr(N_p·R(φ)) =
    a·cos φ + b·sin φ is maximised over the allowed φ; the free dims take the Procrustes map."""

    def fit(n: torch.Tensor, maps: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, half = n.shape[-1], rotary // 2
        p = torch.arange(half)
        a = n[..., p, p] + n[..., p + half, p + half]
        b = n[..., p + half, p] - n[..., p, p + half]
        if turns is None:
            value, angle = torch.hypot(a, b), torch.atan2(b, a)
        else:
            steps = torch.arange(turns, dtype=_F64) * (2 * torch.pi / turns)
            options = a[..., None] * torch.cos(steps) + b[..., None] * torch.sin(steps)
            value, best = options.max(-1)
        total = value.sum(-1)
        free = n[..., rotary:, rotary:]
        if rotary < h:
            total = total + torch.linalg.svdvals(free).sum(-1)
        if not maps:
            return total, None
        rotation = rope_blocks(angle) if turns is None else turn_blocks(best, turns)
        return total, rotation if rotary == h else partial_rope_blocks(rotation, procrustes(free))

    return fit


def qk_fit_for(schema, *, rope: bool = True):
    """The Q/K fit a schema's group allows (the Llama family's ``_rope_fit`` unchanged; partial
    rotary heads and per-head Q/K norms their structured fits); ``rope`` False: the free Procrustes
    (the RoPE ablation)."""
    if schema.qk_turns is not None or (rope and schema.qk_structure == "rope" and schema.rotary_dims is not None):
        return structured_fit(schema.rotary_size if schema.qk_structure == "rope" else 0, schema.qk_turns)
    return _rope_fit if rope and schema.qk_structure == "rope" else _orthogonal_fit


def _orthogonal_fit(n: torch.Tensor, maps: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.linalg.svdvals(n).sum(-1), procrustes(n) if maps else None


def _identity_fit(n: torch.Tensor, maps: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    eye = torch.eye(n.shape[-1], dtype=_F64).expand(n.shape).clone() if maps else None
    return n.diagonal(dim1=-2, dim2=-1).sum(-1), eye


def _match_query_heads(c_qk, c_vo, fit_qk, fit_vo, rows, cols, permute: bool = True):
    """Query heads ``rows`` of A against ``cols`` of B (one KV head each): the matching τ, the
    two maps they share and their objective values Σᵢ tr(C_iτ(i)·R), alternating an assignment under
    fixed maps with the Procrustes fit of the summed blocks under a fixed matching. ``permute``
    False: τ is the identity (heads kept in place)."""
    if not permute:
        tau = torch.arange(len(rows))
        v_qk, r_qk = fit_qk(c_qk[rows, cols[tau]].sum(0))
        v_vo, r_vo = fit_vo(c_vo[rows, cols[tau]].sum(0))
        return tau, r_qk, r_vo, v_qk, v_vo
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
    schema=None,
):
    """KV-head assignment, query-head matching within each KV head, per-KV-head maps and scales (§8.3):
    each KV-head pair is scored by the mean cosine of its best shared fit and one exact assignment
    picks the KV map. ``scales``: a :class:`HeadRescale` follows (per rotary pair on Q/K under
    RoPE); ``rotations=False``: identity maps, no scale. ``schema``: the fits follow its group
    (partial rotary heads, per-head Q/K norms, heads kept in place; docs/design.md §9). Returns the
    transforms (and a log)."""
    H, kv, h = num_heads, num_kv_heads, head_size
    queries_per_kv = H // kv
    rotary = schema.rotary_dims if schema is not None and rope else None
    permute = schema is None or schema.head_permutation
    qk_scales = schema is None or schema.qk_scales
    c_qk, c_vo = normalised_blocks(q, k, ctx, H, h, rope=rope, rotary=rotary)
    if not rotations:
        fit_qk = _identity_fit
    elif schema is not None:
        fit_qk = qk_fit_for(schema, rope=rope)
    else:
        fit_qk = _rope_fit if rope else _orthogonal_fit
    fit_vo = _orthogonal_fit if rotations else _identity_fit
    score = torch.zeros(kv, kv, dtype=_F64)
    plans = {}
    for ga in range(kv):
        rows = torch.arange(ga * queries_per_kv, (ga + 1) * queries_per_kv)
        for gb in range(kv) if permute else (ga,):
            cols = torch.arange(gb * queries_per_kv, (gb + 1) * queries_per_kv)
            tau, r_qk, r_vo, v_qk, v_vo = _match_query_heads(c_qk, c_vo, fit_qk, fit_vo, rows, cols, permute)
            score[ga, gb] = 0.5 * (v_qk + v_vo) / queries_per_kv
            plans[ga, gb] = (cols[tau], r_qk, r_vo)
    kv_perm = assign(score) if permute else torch.arange(kv)
    chosen = [plans[g, int(kv_perm[g])] for g in range(kv)]
    perm = torch.cat([c[0] for c in chosen])
    qk = torch.stack([c[1] for c in chosen]).repeat_interleave(queries_per_kv, 0)
    vo = torch.stack([c[2] for c in chosen]).repeat_interleave(queries_per_kv, 0)
    parts: list[Transform] = [HeadAlignment(layer, perm, qk, vo)]
    if rotations and scales:
        fitted = [
            matched_scales(
                q, k, ctx, torch.arange(g * queries_per_kv, (g + 1) * queries_per_kv), c[0], H, h, rope=rope,
                rotary=rotary,
            )
            for g, c in enumerate(chosen)
        ]  # fmt: skip
        if not qk_scales:  # a Q/K norm absorbs them (docs/design.md §9.1)
            qk_scale = torch.ones(H, dtype=_F64)
        elif rotary is not None:  # per dim: a rotary pair's two dims share one, the free dims another
            qk_scale = torch.stack([per_dim(a, h, rotary) for a, _ in fitted]).repeat_interleave(queries_per_kv, 0)
        else:
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
