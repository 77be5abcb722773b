"""The built-in estimators and their registrations (docs/design.md §4.4–§4.5): ``activation`` (RaOT,
from the fit moments), ``weight`` (data-free weight matching, a baseline) and ``soft_ot`` (Sinkhorn
plans, a baseline; not a symmetry, so never gated)."""

from __future__ import annotations

from typing import Any

import torch
from huggingface_hub.utils import tqdm

from raot_hf.estimators.activation import estimate_head_alignment, estimate_mlp_permutation, estimate_residual_map
from raot_hf.estimators.experts import estimate_expert_alignment
from raot_hf.estimators.registry import EstimationRequest, finite, register_estimator
from raot_hf.estimators.soft_ot import SoftOTOptions
from raot_hf.estimators.weight_based import WeightMatchingOptions
from raot_hf.symmetry import (
    ExpertAlignment,
    HeadAlignment,
    HeadRescale,
    MLPPermutation,
    ResidualPermutation,
    ResidualRotation,
    Transform,
    UnrestrictedHeadAlignment,
)

#: What an estimate whose fit statistics are not finite is logged as; the identity stands in.
SKIPPED = {"skipped": "NaN/Inf in the fit statistics: the identity stands in for the estimate"}


def residual_mode(schema, requested: str) -> str:
    """``auto`` → the mean-fixing rotation where it is exact, the permutation otherwise; a
    rotation of an RMSNorm stream ranges over all of O(d) (``"orthogonal"``, docs/design.md §8)."""
    if requested in ("auto", "rotation") and schema.residual.exact == "orthogonal":
        return "orthogonal"
    if requested == "auto" and schema.residual.exact == "signed_permutation":
        return "signed_permutation"  # an RMSNorm stream with norm weights in it (docs/design.md §9.2)
    if requested == "auto":
        return "rotation" if schema.residual.exact == "mean_fixing" else "permutation"
    return requested


def is_identity(t: Transform) -> bool:
    """True when ``t`` is exactly the identity (the gate then has nothing to decide)."""
    if isinstance(t, (MLPPermutation, ResidualPermutation)):
        signs = getattr(t, "signs", None)
        same_signs = signs is None or bool(torch.all(signs == 1))
        return bool(torch.equal(t.perm, torch.arange(len(t.perm)))) and same_signs
    if isinstance(t, HeadAlignment):
        eye = torch.eye(t.qk.shape[-1], dtype=torch.float64)
        return (
            bool(torch.equal(t.perm, torch.arange(len(t.perm))))
            and torch.allclose(t.qk, eye, atol=1e-12)
            and torch.allclose(t.vo, eye, atol=1e-12)
        )
    if isinstance(t, ResidualRotation):
        return torch.allclose(t.matrix, torch.eye(len(t.matrix), dtype=torch.float64), atol=1e-12)
    if isinstance(t, HeadRescale):
        return bool(torch.all(t.qk_scale == 1)) and bool(torch.all(t.vo_scale == 1))
    if isinstance(t, ExpertAlignment):
        return t.is_identity()
    return False


def _layer_candidates(request: EstimationRequest, i: int) -> tuple[list[Transform], dict[str, Any]]:
    """Layer ``i``'s MLP permutation and head alignment (identity where the moments are not finite)."""
    cfg, schema, fit = request.config, request.schema, request.stats.fit
    H, h = schema.num_heads, schema.head_size
    parts, logs = [], {}
    if "mlp" in cfg.scope and schema.has_mlp(i):
        if finite(fit.mlp[i]):
            t, log = estimate_mlp_permutation(fit.mlp[i], i, return_log=True)
        else:
            t, log = MLPPermutation(i, torch.arange(schema.mlp_space(i).size)), SKIPPED
        parts.append(t)
        logs[f"layers.{i}.mlp"] = log
    if "mlp" in cfg.scope and i in fit.experts:  # a mixture-of-experts block (docs/design.md §10)
        if finite(*fit.experts[i].moments()):
            t, log = estimate_expert_alignment(fit.experts[i], i, return_log=True)
        else:
            block = schema.layers[i].experts
            identity = torch.arange(block.units).expand(block.num_experts, -1)
            t, log = ExpertAlignment(i, torch.arange(block.num_experts), identity), SKIPPED
        parts.append(t)
        logs[f"layers.{i}.experts"] = log
    if "heads" in cfg.scope:
        if finite(fit.q[i], fit.k[i], fit.ctx[i]):
            rope = schema.qk_structure == "rope"
            options = {"rotations": cfg.rotations, "scales": cfg.head_scales, "return_log": True}
            options.update(num_kv_heads=schema.num_kv_heads, rope=rope and cfg.rope_restricted, schema=schema)
            fitted, log = estimate_head_alignment(fit.q[i], fit.k[i], fit.ctx[i], i, H, h, **options)
            t, *rescale = fitted
            if rope and not cfg.rope_restricted:  # the ablation: free Q/K maps, inexact under RoPE
                t = UnrestrictedHeadAlignment(t.layer, t.perm, t.qk, t.vo)
            parts += [t, *rescale]
        else:
            eye = torch.eye(h, dtype=torch.float64).expand(H, h, h)
            parts.append(HeadAlignment(i, torch.arange(H), eye, eye))
            log = SKIPPED
        logs[f"layers.{i}.heads"] = log
    return parts, logs


def solve_layer_early(stats, schema, config, i: int, solved: dict[int, tuple]) -> None:
    """Layer ``i``'s candidates from its complete fit moments, kept in ``solved`` (the solve stage's
    record, :attr:`EstimationRequest.solved_layers`); its co-moments are then freed (the
    layer-by-layer calibration pass, docs/design.md §7.4)."""
    solved[i] = _layer_candidates(EstimationRequest(stats, schema, {}, {}, config, False), i)
    fit = stats.fit
    experts = fit.experts[i].units if i in fit.experts else []
    for moments in (fit.mlp[i], fit.q[i], fit.k[i], fit.ctx[i], *experts):
        moments.comoment = moments.comoment.new_zeros(0, 0)


def activation_candidates(request: EstimationRequest) -> tuple[list[Transform], dict[str, Any]]:
    """RaOT's candidates from the fit moments: the residual map first, then every layer."""
    cfg, schema, fit = request.config, request.schema, request.stats.fit
    parts: list[Transform] = []
    logs: dict[str, Any] = {}
    if "residual" in cfg.scope:
        if finite(fit.stream):
            t, log = estimate_residual_map(fit.stream, mode=residual_mode(schema, cfg.residual), return_log=True)
        else:
            t, log = ResidualPermutation(torch.arange(schema.hidden_size)), SKIPPED
        parts.append(t)
        logs["residual"] = log
    solved = request.solved_layers
    for i in tqdm(range(schema.num_layers), desc="solving", disable=not request.progress):
        layer_parts, layer_logs = solved[i] if i in solved else _layer_candidates(request, i)
        parts += layer_parts
        logs.update(layer_logs)
    return parts, logs


def weight_candidates(request: EstimationRequest) -> tuple[list[Transform], dict[str, Any]]:
    """Weight matching of B to A (no calibration data): MLP permutations and head maps."""
    from raot_hf.estimators.weight_based import estimate_weight_alignment

    cfg = request.config
    t, log = estimate_weight_alignment(
        request.state_a,
        request.state_b,
        request.schema,
        scope=request.scope("mlp", "heads"),
        rescale=request.options.rescale,
        match_heads=request.options.match_heads,
        return_log=True,
        **({} if cfg.rotations else {"rotations": False}),
    )
    return list(t.transforms), {"weight": log}


def soft_ot_candidates(request: EstimationRequest) -> tuple[list[Transform], dict[str, Any]]:
    """Sinkhorn plans on MLP units and heads from the fit moments (a baseline, not a symmetry)."""
    from raot_hf.estimators.soft_ot import estimate_soft_ot

    scope = request.scope("mlp", "heads")
    t, log = estimate_soft_ot(request.stats, request.schema, scope=scope, reg=request.options.reg, return_log=True)
    return list(t.transforms), {"soft_ot": log}


register_estimator(
    "activation",
    activation_candidates,
    needs_statistics=True,
    description="RaOT: activation-estimated alignment from one calibration pass, gated against the identity",
)
register_estimator(
    "weight",
    weight_candidates,
    needs_statistics=False,
    config=WeightMatchingOptions,
    description="weight-based matching (rotation-symmetry paper baseline, no data)",
)
register_estimator(
    "soft_ot",
    soft_ot_candidates,
    needs_statistics=True,
    gated=False,
    config=SoftOTOptions,
    description="soft transport plans (Sinkhorn, OT-fusion baseline; not a symmetry, approximate)",
)
