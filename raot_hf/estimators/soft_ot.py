"""Soft optimal-transport alignment: the OT-fusion baseline (Sinkhorn plans, not a symmetry).

Transport-based fusion (Singh & Jaggi; Imfeld et al.) aligns B to A with an entropic transport
plan; only permutations are symmetries, so B′ no longer computes B's function: every plan is a
:class:`~raot_hf.symmetry.SoftTransport` with ``exact`` False, and the merger reports B′'s deviation.

From the fit statistics: MLP units by the A×B Pearson correlation (cost = 1 − similarity); heads
by the mean Q/K and V/O cosine under the identity rotation, the H×H plan expanded to plan ⊗ I_h on
the ``qk`` and ``vo`` spaces. Orientation: ``plan[i, j]`` is the mass between unit i of **B** and
unit j of **A**, unit j of B′ = Σᵢ plan[i, j]·(unit i of B); as ``reg → 0`` the plan tends to the
assignment's permutation matrix (``plan[perm[j], j] = 1``, the :class:`MLPPermutation` convention).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from raot_hf.adapters.schema import ModelSchema
from raot_hf.calibration.statistics import CalibrationStatistics, Moments, SplitStatistics
from raot_hf.config.options import check_field_types, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError
from raot_hf.estimators.weight_based import normalise_scope
from raot_hf.symmetry.transforms import SoftTransport, Transform, TransformSequence

logger = logging.getLogger("raot_hf.estimators.soft_ot")
_F64 = torch.float64


def _require_pot():
    try:
        import ot
    except ImportError:  # pragma: no cover - depends on the environment
        raise RaotError("alignment='soft_ot' needs POT; install it with: pip install pot") from None
    return ot


#: Below this regularisation exp(−cost/reg) can underflow (cost ≤ 2): Sinkhorn runs in the log domain.
LOG_DOMAIN_BELOW = 0.005


def sinkhorn_plan(similarity: torch.Tensor, reg: float, *, max_iter: int = 2000, tol: float = 1e-7) -> torch.Tensor:
    """The column-stochastic transport plan between B's units (rows) and A's (columns), from
    ``similarity[i, j]`` (B unit i against A unit j): Sinkhorn with uniform marginals on cost
    1 − similarity (log domain below :data:`LOG_DOMAIN_BELOW`), scaled so each column sums to 1."""
    if similarity.ndim != 2 or similarity.shape[0] != similarity.shape[1]:
        raise RaotError(f"soft OT needs a square similarity matrix, got shape {tuple(similarity.shape)}")
    if not reg > 0:
        raise RaotError(f"reg={reg} must be > 0 (Sinkhorn's entropic regularisation)")
    ot = _require_pot()
    n = similarity.shape[0]
    cost = (1.0 - similarity.detach().to(_F64).cpu()).numpy()
    cost = np.nan_to_num(cost, nan=1.0, posinf=2.0, neginf=2.0)
    marginal = np.full(n, 1.0 / n)
    method = "sinkhorn_log" if reg < LOG_DOMAIN_BELOW else "sinkhorn"
    plan = ot.sinkhorn(
        marginal, marginal, cost, float(reg), method=method, numItermax=max_iter, stopThr=tol, warn=False
    )
    plan = torch.as_tensor(np.ascontiguousarray(plan), dtype=_F64) * n
    # Normalise columns exactly (Sinkhorn stops at a tolerance): each new unit is a barycentre.
    return plan / plan.sum(0, keepdim=True).clamp_min(1e-300)


def _head_similarity(q: Moments, k: Moments, ctx: Moments, num_heads: int, head_size: int) -> torch.Tensor:
    """(H_B, H_A) similarity: mean of the QK and VO cosines of each head pair under R = I."""
    H, h = num_heads, head_size

    def trace_blocks(cross: torch.Tensor) -> torch.Tensor:  # [i_A, j_B] = tr(block)
        return cross.reshape(H, h, H, h).diagonal(dim1=1, dim2=3).sum(-1)

    def energy(sq: torch.Tensor) -> torch.Tensor:
        return sq.reshape(H, h).sum(-1)

    def cosine(cross, sq_a, sq_b):
        z = torch.outer(energy(sq_a), energy(sq_b)).clamp_min(1e-300).sqrt()
        return trace_blocks(cross) / z

    qk = cosine(q.raw_cross() + k.raw_cross(), q.sq_a + k.sq_a, q.sq_b + k.sq_b)
    vo = cosine(ctx.raw_cross(), ctx.sq_a, ctx.sq_b)
    return (0.5 * (qk + vo)).T


def _plan_log(plan: torch.Tensor, similarity: torch.Tensor) -> dict[str, Any]:
    """How far a plan is from a permutation, and whether its mass sits on the assignment."""
    rows, cols = linear_sum_assignment(similarity.numpy(), maximize=True)
    perm = np.empty(len(rows), dtype=np.int64)
    perm[cols] = rows  # column j (A unit) ← row perm[j] (B unit)
    ar = torch.arange(plan.shape[1])
    column_max = plan.max(0).values
    entropy = -(plan * plan.clamp_min(1e-300).log()).sum(0)
    return {
        "units": int(plan.shape[0]),
        "mean_column_max": float(column_max.mean()),
        "mean_column_entropy": float(entropy.mean()),
        "mass_on_assignment": float(plan[torch.from_numpy(perm), ar].mean()),
        "argmax_agrees_with_assignment": float((plan.argmax(0) == torch.from_numpy(perm)).double().mean()),
        "fit_similarity_identity": float(similarity.diagonal().mean()),
        "fit_similarity_transported": float((plan * similarity).sum(0).mean()),
    }


def estimate_soft_ot(
    stats: CalibrationStatistics,
    schema: ModelSchema,
    *,
    scope: Iterable[str] = ("mlp", "heads"),
    reg: float = 0.05,
    return_log: bool = False,
) -> TransformSequence | tuple[TransformSequence, dict[str, Any]]:
    """Soft transport plans aligning B to A, per layer, from the fit calibration statistics.

    ``scope``: ``"mlp"`` and/or ``"heads"``; ``reg``: Sinkhorn's entropic regularisation in units of
    the cost (in [0, 2]). The residual stream is not transported. With ``return_log=True`` also a
    dict with, per plan, its closeness to a permutation (``mean_column_max``) and fit similarity.
    """
    if stats is None:
        raise RaotError("soft OT alignment needs calibration statistics; pass calibration=... to the merge")
    scope = normalise_scope(scope, "soft-OT")
    parts: list[Transform] = []
    layers_log = [_layer_plans(stats.fit, schema, layer, scope, reg, parts) for layer in range(schema.num_layers)]
    transform = TransformSequence(parts)
    message = "soft OT (%s, reg=%g): %d plans over %d layers (approximate: B′ ≠ B)"
    logger.info(message, "+".join(scope) or "none", reg, len(parts), schema.num_layers)
    if not return_log:
        return transform
    log = {
        "estimator": "soft_ot",
        "scope": list(scope),
        "reg": float(reg),
        "layers": layers_log,
        "notes": [
            "baseline: a soft transport plan is not a symmetry, so B′ only approximates B",
            "plans from fit statistics; uniform marginals; columns scaled to sum to 1",
            "the residual stream is not transported",
        ],
    }
    return transform, log


def _layer_plans(
    fit: SplitStatistics, schema: ModelSchema, layer: int, scope: tuple[str, ...], reg: float, parts: list[Transform]
) -> dict[str, Any]:
    """One layer's plans (MLP units, then heads), appended to ``parts``; returns its log entry."""
    H, h = schema.num_heads, schema.head_size
    entry: dict[str, Any] = {"layer": layer}
    if "mlp" in scope and schema.has_mlp(layer):  # a mixture's experts get no plan (§10)
        similarity = fit.mlp[layer].correlation().T  # rows: B units, columns: A units
        plan = sinkhorn_plan(similarity, reg)
        parts.append(SoftTransport(schema.mlp_space(layer).name, plan))
        entry["mlp"] = _plan_log(plan, similarity)
    if "heads" in scope:
        similarity = _head_similarity(fit.q[layer], fit.k[layer], fit.ctx[layer], H, h)
        head_plan = sinkhorn_plan(similarity, reg)
        block = torch.kron(head_plan.contiguous(), torch.eye(h, dtype=_F64))
        parts.append(SoftTransport(schema.qk_space(layer).name, block))
        parts.append(SoftTransport(schema.vo_space(layer).name, block.clone()))
        entry["heads"] = {**_plan_log(head_plan, similarity), "head_plan": head_plan.tolist()}
    return entry


@register_section
@dataclass
class SoftOTOptions(OptionSection):
    """Options of the ``soft_ot`` baseline (Sinkhorn plans on MLP units and heads)."""

    section = "soft_ot"

    reg: float = field(
        default=0.05, metadata=meta("Entropic regularisation of --alignment soft_ot (default 0.05).", "soft_ot_reg")
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.reg > 0:
            raise RaotError(f"soft_ot_reg={self.reg} must be > 0 (Sinkhorn's entropic regularisation)")
