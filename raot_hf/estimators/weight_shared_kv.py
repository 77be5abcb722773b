"""Weight-based head alignment for decoders: shared KV heads (grouped-query attention) and RoPE
(docs/design.md §8).

The query heads of one KV head share one Q/K and one V/O map (under RoPE the Q/K map commutes with
the position rotations), so the cross blocks of a KV head's readers are summed and fitted once, with
the fits of :mod:`raot_hf.estimators.shared_kv` on weights. With ``match_heads`` the query heads are assigned
within every KV-head pair and one exact assignment over the pairs' fitted overlaps picks the KV map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from raot_hf.adapters.schema import ModelSchema
from raot_hf.errors import RaotError
from raot_hf.estimators.head_fit import assign
from raot_hf.estimators.shared_kv import _identity_fit, _match_query_heads, _orthogonal_fit, qk_fit_for
from raot_hf.estimators.weight_features import space_features
from raot_hf.symmetry.transforms import HeadAlignment

_F64 = torch.float64


def _diagonal_blocks(features_a: torch.Tensor, features_b: torch.Tensor, heads: int) -> torch.Tensor:
    """(heads_a, heads_b, h, h) blocks ``N[i, j] = Z_Aⁱᵀ·Z_Bʲ`` (tr(N·R) is the overlap of A's
    head i with B's head j moved by R)."""
    h = features_a.shape[1] // heads
    cross = features_a.T @ features_b
    return cross.reshape(heads, h, heads, h).permute(0, 2, 1, 3).contiguous()


def _kv_pair_cross(q_blocks, kv_blocks, ga: int, gb: int, tau: torch.Tensor) -> torch.Tensor:
    """Summed cross block of KV head ``ga`` of A against ``gb`` of B: query (or output) head i of
    that KV head against B's ``tau[i]``, plus the KV head's own rows."""
    queries_per_kv = len(tau)
    return (
        q_blocks[ga * queries_per_kv + torch.arange(queries_per_kv), gb * queries_per_kv + tau].sum(0)
        + kv_blocks[ga, gb]
    )


def _query_matching(blocks, ga: int, gb: int, queries_per_kv: int, fit_qk, fit_vo, match: bool) -> torch.Tensor:
    """The query-head matching τ of a KV-head pair (:func:`raot_hf.estimators.shared_kv._match_query_heads`
    on the query and output blocks; the shared key and value rows do not depend on τ)."""
    if not match or queries_per_kv == 1:
        return torch.arange(queries_per_kv)
    rows, cols = (
        torch.arange(ga * queries_per_kv, (ga + 1) * queries_per_kv),
        torch.arange(gb * queries_per_kv, (gb + 1) * queries_per_kv),
    )
    return _match_query_heads(blocks["qk"], blocks["vo"], fit_qk, fit_vo, rows, cols)[0]


def align_shared_kv_heads(
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    schema: ModelSchema,
    layer: int,
    *,
    match_heads: bool,
    rotations: bool,
) -> tuple[HeadAlignment, dict[str, Any]]:
    """One decoder layer's head alignment from weights (per-KV-head maps, with ``match_heads`` a
    KV-head assignment): the transform and its log (KV-head pair scores, chosen and same-index)."""
    H, kv, h = schema.num_heads, schema.kv_heads, schema.head_size
    queries_per_kv = H // kv
    match_heads = match_heads and schema.head_permutation
    blocks = {}
    kv_spaces = schema.kv_space(layer, "k") is not None  # else keys and values are in the qk / vo spaces
    for name in ("qk", "k", "vo", "v") if kv_spaces else ("qk", "vo"):
        space = schema.space(f"layers.{layer}.{name}")
        fa, fb = space_features(state_a, space).stacked(), space_features(state_b, space).stacked()
        blocks[name] = _diagonal_blocks(fa, fb, H if name in ("qk", "vo") else kv)
    if not kv_spaces:
        blocks["k"] = blocks["v"] = torch.zeros(kv, kv, h, h, dtype=_F64)
    fit_qk = qk_fit_for(schema) if rotations else _identity_fit
    fit_vo = _orthogonal_fit if rotations else _identity_fit
    score = torch.zeros(kv, kv, dtype=_F64)
    maps = {}
    for ga in range(kv):
        for gb in range(kv) if match_heads else (ga,):
            tau = _query_matching(blocks, ga, gb, queries_per_kv, fit_qk, fit_vo, match_heads)
            v_qk, r_qk = fit_qk(_kv_pair_cross(blocks["qk"], blocks["k"], ga, gb, tau))
            v_vo, r_vo = fit_vo(_kv_pair_cross(blocks["vo"], blocks["v"], ga, gb, tau))
            score[ga, gb] = v_qk + v_vo
            maps[ga, gb] = (gb * queries_per_kv + tau, r_qk, r_vo)
    kv_perm = assign(score) if match_heads else torch.arange(kv)
    chosen = [maps[g, int(kv_perm[g])] for g in range(kv)]
    perm = torch.cat([c[0] for c in chosen])
    qk = torch.stack([c[1] for c in chosen]).repeat_interleave(queries_per_kv, 0)
    vo = torch.stack([c[2] for c in chosen]).repeat_interleave(queries_per_kv, 0)
    ar = torch.arange(kv)
    log = {
        "kv_heads": kv,
        "rope": schema.qk_structure == "rope",
        "kv_perm": kv_perm.tolist(),
        # per KV-head pair (report keys as earlier versions wrote them)
        "group_score": score[ar, kv_perm].tolist(),
        "group_score_same_index": score.diagonal().tolist(),
    }
    return HeadAlignment(layer, perm, qk, vo), log


def check_shared_kv_options(schema: ModelSchema, rescale: bool) -> None:
    """Refuse the paper's per-head rescaling on a schema with shared KV heads or RoPE (not implemented there)."""
    structured = schema.qk_structure == "rope" or schema.qk_turns is not None
    if rescale and (schema.kv_space(0, "k") is not None or structured):
        raise RaotError(
            f"weight-based rescaling is not implemented for {schema.model_type} (shared-KV / RoPE heads); "
            "turn weight.rescale off (--no-weight-rescale)"
        )
