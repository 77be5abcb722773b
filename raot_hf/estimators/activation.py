"""Activation-estimated alignment: pure functions over calibration statistics (docs/design.md §4).

Estimators return a transform of B and a log dict from the fit moments; :func:`candidate_maps`
maps B's activations for the held-out phase, where the ``*_gains`` functions score each candidate
against the identity, one gain per unit / head / coordinate, for the gate (§5).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from raot_hf.calibration.precision import correlation_error_bound
from raot_hf.calibration.statistics import Moments, PairedDiagonal
from raot_hf.estimators.head_fit import assign, matched_scales, normalised_blocks, procrustes
from raot_hf.estimators.ties import resolve_near_ties, unit_mismatch
from raot_hf.symmetry.experts import ExpertAlignment
from raot_hf.symmetry.group import mean_axis_basis, mean_fixing
from raot_hf.symmetry.transforms import (
    HeadAlignment,
    HeadRescale,
    MLPPermutation,
    ResidualPermutation,
    ResidualRotation,
    ResidualSignedPermutation,
    Transform,
)

_F64 = torch.float64


# -- MLP units (§4: correlation + exact assignment) -----------------------------------------------
def estimate_mlp_permutation(stats: Moments, layer: int, *, return_log: bool = False):
    """P maximising Σᵢ corr(a_i, b_P(i)) over units of one layer's MLP, with the near ties that
    the co-moment's precision cannot order resolved from each unit's exact mean and spread
    (:func:`~raot_hf.estimators.ties.resolve_near_ties`, docs/design.md §4.4)."""
    corr = stats.correlation()
    mean_a, std_a, mean_b, std_b = stats.unit_statistics()

    def mismatch(rows, cols):
        return unit_mismatch(mean_a, std_a, mean_b, std_b, rows, cols)

    perm, ties = resolve_near_ties(corr, assign(corr), correlation_error_bound(stats.product_dtype), mismatch)
    if not return_log:
        return MLPPermutation(layer, perm)
    ar = torch.arange(len(perm))
    log = {
        "units": len(perm),
        "moved": int((perm != ar).sum()),
        "fit_mean_corr_identity": float(corr.diagonal().mean()),
        "fit_mean_corr_estimate": float(corr[ar, perm].mean()),
        "near_ties": ties.to_dict(),
    }
    return MLPPermutation(layer, perm), log


def mlp_gains(sums: PairedDiagonal) -> tuple[torch.Tensor, float]:
    """Per-unit gain in correlation of the candidate permutation (B′ unit j = B unit perm[j],
    paired with A's unit j) over the identity, and the identity's mean correlation."""
    ident = sums.correlation(transformed=False)
    return sums.correlation(transformed=True) - ident, float(ident.mean())


# -- Heads: joint assignment, rotations and scales (§4) -----------------------------------------
def estimate_head_alignment(
    q: Moments,
    k: Moments,
    ctx: Moments,
    layer: int,
    num_heads: int,
    head_size: int,
    *,
    rotations: bool = True,
    scales: bool = True,
    return_log: bool = False,
    num_kv_heads: int | None = None,
    rope: bool = False,
    schema=None,
):
    """Head correspondence, within-head Q/K and V/O rotations and per-head scales as one exact
    assignment; with ``num_kv_heads`` or ``rope`` the decoder solver runs instead
    (:func:`~raot_hf.estimators.shared_kv.estimate_shared_kv_heads`, docs/design.md §8).

    Each pair is scored by the nuclear norm of its scale-invariant cross blocks (QK and VO,
    :func:`~raot_hf.estimators.head_fit.normalised_blocks`); one assignment gives π, the matched
    pairs' SVDs the rotations and their energies the scales (``scales``: a :class:`HeadRescale`
    follows). Returns the transforms (and a log). ``rotations=False``: pairs scored under R = I,
    only π estimated (the permutation-only baseline).
    """
    H, h = num_heads, head_size
    structured = schema is not None and (schema.qk_turns is not None or schema.rotary_dims is not None)
    if rope or structured or (num_kv_heads is not None and num_kv_heads != num_heads):
        from raot_hf.estimators.shared_kv import estimate_shared_kv_heads

        kw = dict(rope=rope, rotations=rotations, scales=scales, return_log=return_log, schema=schema)
        return estimate_shared_kv_heads(q, k, ctx, layer, H, num_kv_heads or H, h, **kw)
    c_qk, c_vo = normalised_blocks(q, k, ctx, H, h, rope=False)
    ar = torch.arange(H)
    permute = schema is None or schema.head_permutation  # a score bias shared by the layers: heads stay (§9.7)
    if rotations:
        score = 0.5 * (torch.linalg.svdvals(c_qk).sum(-1) + torch.linalg.svdvals(c_vo).sum(-1))
        perm = assign(score) if permute else ar.clone()
        r_qk, r_vo = procrustes(c_qk[ar, perm]), procrustes(c_vo[ar, perm])
    else:
        score = 0.5 * (c_qk.diagonal(dim1=-2, dim2=-1).sum(-1) + c_vo.diagonal(dim1=-2, dim2=-1).sum(-1))
        perm = assign(score) if permute else ar.clone()
        r_qk = r_vo = torch.eye(h, dtype=_F64).expand(H, h, h).clone()
    parts: list[Transform] = [HeadAlignment(layer, perm, r_qk, r_vo)]
    if rotations and scales:
        fitted = [matched_scales(q, k, ctx, ar[i : i + 1], perm[i : i + 1], H, h, rope=False) for i in range(H)]
        parts.append(HeadRescale(layer, torch.cat([a for a, _ in fitted]), torch.stack([c for _, c in fitted])))
    if not return_log:
        return parts
    log = {
        "heads": H,
        "perm": perm.tolist(),
        "fit_pair_score_matched": score[ar, perm].tolist(),
        "fit_pair_score_same_index": score.diagonal().tolist(),
    }
    if len(parts) > 1:
        log["qk_scale"], log["vo_scale"] = parts[1].qk_scale.tolist(), parts[1].vo_scale.tolist()
    return parts, log


def head_gains(
    q: PairedDiagonal, k: PairedDiagonal, ctx: PairedDiagonal, num_heads: int, head_size: int
) -> tuple[torch.Tensor, float]:
    """Per-head gain in (QK + VO)/2 cosine of the candidate over the identity, and the identity's
    mean cosine; the QK cosine of head i is Σ(q_Aⁱ·q_B′ⁱ + k_Aⁱ·k_B′ⁱ) / √(E_Aⁱ·E_B′ⁱ) (E: summed
    squares), the VO cosine likewise on the context."""
    H, h = num_heads, head_size

    def per_head(x):
        return x.reshape(H, h).sum(-1)

    def cosine(transformed: bool):
        dot = "dot_t" if transformed else "dot"
        sq = "sq_t" if transformed else "sq_b"
        out = 0.0
        for parts in ((q, k), (ctx,)):
            num = sum(per_head(getattr(p, dot)) for p in parts)
            ea = sum(per_head(p.sq_a) for p in parts)
            eb = sum(per_head(getattr(p, sq)) for p in parts)
            out = out + 0.5 * num / (ea * eb).clamp_min(1e-300).sqrt()
        return out

    ident = cosine(False)
    return cosine(True) - ident, float(ident.mean())


# -- Residual stream (§4: mean-preserving Procrustes; permutation variant) -----------------------
def estimate_residual_map(stats: Moments, *, mode: str = "rotation", return_log: bool = False):
    """The stream map O (x_B·O ≈ x_A) from the centered cross moment M = Σ x_Aᵀ x_B: ``rotation``
    (Bᵤᵀ·M·Bᵤ = UΣVᵀ on the mean axis' complement, R = V·Uᵀ, O = u·uᵀ + Bᵤ·R·Bᵤᵀ so O·1 = 1),
    ``orthogonal`` (Procrustes over O(d), RMSNorm streams, docs/design.md §8) or ``permutation``."""
    d = stats.comoment.shape[0]
    if mode == "orthogonal":
        transform = ResidualRotation(procrustes(stats.raw_cross()))
    elif mode == "rotation":
        b = mean_axis_basis(d)
        transform = ResidualRotation(mean_fixing(procrustes(b.T @ stats.raw_cross() @ b)))
    elif mode == "permutation":
        # new coordinate j of B′ takes B's coordinate perm[j], matched to A's coordinate j
        transform = ResidualPermutation(assign(stats.correlation()))
    elif mode == "signed_permutation":
        # a coordinate matched with its sign flipped correlates at −1: assign on |corr|, keep the sign
        corr = stats.correlation()
        perm = assign(corr.abs())
        matched = corr[torch.arange(d), perm]
        transform = ResidualSignedPermutation(perm, torch.where(matched < 0, -1.0, 1.0).to(_F64))
    else:
        raise ValueError(f"mode must be 'rotation', 'orthogonal', 'permutation' or 'signed_permutation', got {mode!r}")
    if not return_log:
        return transform
    log = {"mode": mode, "dim": d}
    if isinstance(transform, ResidualPermutation):
        # a rotation's fit gain would need Σbᵀb, a second d × d float64 product per stream site and
        # batch for a log line; the gate's held-out gain (residual_gains) scores every stream map
        log["fit_gain"] = float(_fit_permutation_gains(stats, transform).mean())
    return transform, log


def _fit_permutation_gains(stats: Moments, transform: ResidualPermutation) -> torch.Tensor:
    """Per-coordinate gain of a stream permutation on the fit moments (for the log): the cosine of
    A's coordinate j and B′'s, Σa_j·b_perm[j] / √(Σa_j² · Σb_perm[j]²), minus the identity's."""
    d = stats.comoment.shape[0]
    cross = stats.raw_cross()
    ea = stats.sq_a.clamp_min(1e-300)
    est = cross[torch.arange(d), transform.perm] / (ea * stats.sq_b[transform.perm].clamp_min(1e-300)).sqrt()
    if isinstance(transform, ResidualSignedPermutation):
        est = est * transform.signs
    return est - cross.diagonal() / (ea * stats.sq_b.clamp_min(1e-300)).sqrt()


def residual_gains(sums: PairedDiagonal) -> tuple[torch.Tensor, float]:
    """Per-coordinate gain in cosine (A's coordinate j with B′'s) of the candidate stream map over
    the identity on the held-out samples, and the identity's mean score."""

    def cosine(dot, sq_b):
        return dot / (sums.sq_a.clamp_min(1e-300) * sq_b.clamp_min(1e-300)).sqrt()

    ident = cosine(sums.dot, sums.sq_b)
    return cosine(sums.dot_t, sums.sq_t) - ident, float(ident.mean())


# -- The held-out phase: candidates as maps of B's activations ---------------------------------------
def _per_dtype(matrix: torch.Tensor) -> Callable[[torch.dtype], torch.Tensor]:
    """``matrix`` in a requested dtype, converted once per dtype (not once per batch)."""
    cache: dict[torch.dtype, torch.Tensor] = {}

    def get(dtype: torch.dtype) -> torch.Tensor:
        if dtype not in cache:
            cache[dtype] = matrix.to(dtype)
        return cache[dtype]

    return get


def candidate_maps(
    transforms: list[Transform], num_heads: int, head_size: int, *, device=None
) -> dict[tuple, Callable[[torch.Tensor], torch.Tensor]]:
    """Maps taking B's rows at a site to B′'s under the candidates, keyed like the
    :class:`~raot_hf.calibration.collector.StatisticsCollector`'s sites. MLP: B′ unit j = B unit
    perm[j]; heads: B′ head i = (B head π(i))·R_i (R_qk for q and k, R_vo for the context), then
    a :class:`HeadRescale`'s q·a, k/a, context·c; stream: B·O or permuted. Soft plans get no map.
    ``device``: the rows'; each matrix is converted to the rows' dtype once."""
    H, h = num_heads, head_size
    maps: dict[tuple, Callable[[torch.Tensor], torch.Tensor]] = {}

    def permute(perm: torch.Tensor, signs: torch.Tensor | None = None):
        perm = perm.to(device)
        if signs is None:
            return lambda b: b.index_select(1, perm)
        signs = _per_dtype(signs.to(device))
        return lambda b: b.index_select(1, perm) * signs(b.dtype)

    def rotate_heads(perm: torch.Tensor, rot: torch.Tensor):
        perm, rot = perm.to(device), _per_dtype(rot.to(device))

        def rotate(b):
            heads = b.view(-1, H, h).index_select(1, perm)
            return torch.einsum("nhb,hba->nha", heads, rot(b.dtype)).reshape(b.shape)

        return rotate

    def scaled(inner, factor: torch.Tensor):
        factor = _per_dtype(factor.to(device))
        return lambda b: (b if inner is None else inner(b)) * factor(b.dtype)

    for t in transforms:
        if isinstance(t, MLPPermutation):
            maps[("mlp", t.layer)] = permute(t.perm)
        elif isinstance(t, ExpertAlignment):  # the router probabilities of B′'s expert j are B's perm[j]
            maps[("router", t.layer)] = permute(t.perm)
        elif isinstance(t, HeadAlignment):
            maps[("q", t.layer)] = maps[("k", t.layer)] = rotate_heads(t.perm, t.qk)
            maps[("ctx", t.layer)] = rotate_heads(t.perm, t.vo)
        elif isinstance(t, HeadRescale):  # after the layer's alignment: q ← a·q, k ← k/a, ctx ← c·ctx
            qk, vo = t.per_dim(h)
            for site, factor in (("q", qk), ("k", 1 / qk), ("ctx", vo)):
                maps[(site, t.layer)] = scaled(maps.get((site, t.layer)), factor)
        elif isinstance(t, ResidualPermutation):
            maps[("stream", None)] = permute(t.perm, getattr(t, "signs", None))
        elif isinstance(t, ResidualRotation):
            o = _per_dtype(t.matrix.to(device))
            maps[("stream", None)] = lambda b, o=o: b @ o(b.dtype)
    return maps
