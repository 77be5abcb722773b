"""Data-free, weight-based alignment: the rotation-symmetry paper's matching (docs/design.md §4).

A baseline that moves B towards A *in weight space*: per layer, MLP units by Git Re-Basin weight
matching (one exact assignment on the ``mlp`` space's members, no residual coupling) and heads by
orthogonal Procrustes on the ``qk`` and ``vo`` members (head i to head i as in the paper, or
assigned first with ``match_heads``; ``rotations=False``: permutation only), then optionally the
paper's per-head rescaling. The residual stream is not estimated from weights.

Orientation: with the space axis last, a member's features F become F·M (covariant) or F·M⁻ᵀ
(contravariant), both F·M for permutations and rotations. Head i of B′ is head π(i) of B times R,
so ‖Z_Aⁱ − Z_B^π(i)·R‖ is minimised by R = U·Vᵀ, U·Σ·Vᵀ the SVD of M = (Z_B^π(i))ᵀ·Z_Aⁱ, with
minimum ‖Z_Aⁱ‖² + ‖Z_B^π(i)‖² − 2‖M‖_*.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from huggingface_hub.utils import tqdm
from scipy.optimize import linear_sum_assignment

from raot_hf.adapters.schema import ModelSchema, Space
from raot_hf.config.options import check_field_types, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError
from raot_hf.estimators.head_fit import assign
from raot_hf.estimators.weight_features import SpaceFeatures, space_features
from raot_hf.estimators.weight_shared_kv import align_shared_kv_heads, check_shared_kv_options
from raot_hf.symmetry.transforms import HeadAlignment, HeadRescale, MLPPermutation, Transform, TransformSequence

logger = logging.getLogger("raot_hf.estimators.weight_based")
_F64 = torch.float64
SCOPES = ("mlp", "heads")


def feature_distance(a: SpaceFeatures, b: SpaceFeatures) -> float:
    """Frobenius distance between two models' members of one space."""
    sq = (a.covariant - b.covariant).pow(2).sum() + (a.contravariant - b.contravariant).pow(2).sum()
    return float(sq.sqrt())


# -- MLP units ---------------------------------------------------------------------------------
def match_mlp_units(features_a: torch.Tensor, features_b: torch.Tensor) -> torch.Tensor:
    """The permutation ``perm`` maximising Σⱼ ⟨A unit j, B unit perm[j]⟩ (columns are units): the
    minimiser of ‖A − B·P‖ with ``(B·P)[:, j] = B[:, perm[j]]`` (:class:`MLPPermutation`'s convention)."""
    similarity = (features_a.T @ features_b).numpy()
    rows, cols = linear_sum_assignment(similarity, maximize=True)
    perm = np.empty(len(rows), dtype=np.int64)
    perm[rows] = cols
    return torch.from_numpy(perm)


# -- heads -------------------------------------------------------------------------------------
def head_cross_covariances(features_a: torch.Tensor, features_b: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(H_a, H_b, h, h) blocks ``M[i, j] = (Z_Bʲ)ᵀ·Z_Aⁱ`` for every pair of heads."""
    h = features_a.shape[1] // num_heads
    cross = features_b.T @ features_a  # (d, d): rows B coordinates, columns A coordinates
    blocks = cross.reshape(num_heads, h, num_heads, h)  # [j, :, i, :]
    return blocks.permute(2, 0, 1, 3).contiguous()  # [i, j, :, :]


def procrustes(cross: torch.Tensor) -> torch.Tensor:
    """R ∈ O(h) maximising tr(Rᵀ·M) (batched): R = U·Vᵀ for M = U·Σ·Vᵀ; with M = Bᵀ·A the minimiser
    of ‖A − B·R‖ (reflections allowed: every orthogonal R is a symmetry of attention)."""
    u, _, vh = torch.linalg.svd(cross)
    return u @ vh


def align_heads(
    qk_a: torch.Tensor,
    qk_b: torch.Tensor,
    vo_a: torch.Tensor,
    vo_b: torch.Tensor,
    num_heads: int,
    match_heads: bool,
    rotations: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Head assignment and per-head Q/K and V/O rotations for one layer, from stacked space features.

    Returns ``perm`` (head i of B′ is head ``perm[i]`` of B), the rotations ``qk`` and ``vo``
    (H, h, h) and per head the pair score ‖M_qk‖_* + ‖M_vo‖_* (overlap under its best rotation);
    ``match_heads`` maximises the total score over all pairs (the joint minimiser of the weight
    distance). ``rotations=False`` fixes R = I and scores tr(M_qk) + tr(M_vo): the permutation-only
    (Git Re-Basin style) baseline.
    """
    m_qk = head_cross_covariances(qk_a, qk_b, num_heads)
    m_vo = head_cross_covariances(vo_a, vo_b, num_heads)
    if not rotations:
        h = m_qk.shape[-1]
        score = m_qk.diagonal(dim1=-2, dim2=-1).sum(-1) + m_vo.diagonal(dim1=-2, dim2=-1).sum(-1)
        heads = torch.arange(num_heads)
        perm = assign(score) if match_heads else heads
        eye = torch.eye(h, dtype=_F64).expand(num_heads, h, h).clone()
        return perm, eye, eye.clone(), score[heads, perm]
    if match_heads:
        # One SVD per pair gives both the score (nuclear norm) and the rotation.
        u_qk, s_qk, vh_qk = torch.linalg.svd(m_qk)
        u_vo, s_vo, vh_vo = torch.linalg.svd(m_vo)
        score = s_qk.sum(-1) + s_vo.sum(-1)
        perm = assign(score)
        heads = torch.arange(num_heads)
        r_qk = u_qk[heads, perm] @ vh_qk[heads, perm]
        r_vo = u_vo[heads, perm] @ vh_vo[heads, perm]
        return perm, r_qk, r_vo, score[heads, perm]
    heads = torch.arange(num_heads)
    diag_qk, diag_vo = m_qk[heads, heads], m_vo[heads, heads]
    score = torch.linalg.matrix_norm(diag_qk, ord="nuc") + torch.linalg.matrix_norm(diag_vo, ord="nuc")
    return heads, procrustes(diag_qk), procrustes(diag_vo), score


def _block_transform(features: SpaceFeatures, perm: torch.Tensor, rotations: torch.Tensor) -> SpaceFeatures:
    """Features after a head permutation + per-head rotation (head i ← head perm[i] · Rᵢ)."""
    H, h, _ = rotations.shape
    out = []
    for part in (features.covariant, features.contravariant):
        heads = part.reshape(part.shape[0], H, h)[:, perm, :]  # (rows, H, h)
        out.append(torch.einsum("nih,ihk->nik", heads, rotations).reshape(part.shape[0], H * h))
    return SpaceFeatures(*out)


# -- rescaling ---------------------------------------------------------------------------------
def optimal_head_scale(target: SpaceFeatures, source: SpaceFeatures) -> float:
    """The a > 0 minimising ‖X_A − a·X_B‖² + ‖Y_A − Y_B/a‖² (X covariant, Y contravariant rows).

    With p = ⟨X_A, X_B⟩, s = ‖X_B‖², r = ⟨Y_A, Y_B⟩, t = ‖Y_B‖², the derivative times a³/2 is the
    quartic s·a⁴ − p·a³ + r·a − t (negative at 0, positive at ∞), so the minimiser is its positive
    root of lowest objective, Newton-polished. 1 when either side is zero (no scale identifiable).
    """
    p = float((target.covariant * source.covariant).sum())
    s = float(source.covariant.pow(2).sum())
    r = float((target.contravariant * source.contravariant).sum())
    t = float(source.contravariant.pow(2).sum())
    if s <= 1e-300 or t <= 1e-300:
        return 1.0

    def objective(a: float) -> float:
        return -2 * a * p + a * a * s - 2 * r / a + t / (a * a)

    roots = np.roots([s, -p, 0.0, r, -t])
    candidates = [float(z.real) for z in roots if abs(z.imag) <= 1e-7 * max(1.0, abs(z)) and z.real > 0]
    polished = []
    for a in candidates or [1.0]:
        for _ in range(4):
            g = s * a**4 - p * a**3 + r * a - t
            dg = 4 * s * a**3 - 3 * p * a**2 + r
            if dg == 0:
                break
            step = a - g / dg
            if not step > 0:
                break
            a = step
        polished.append(a)
    return min(polished, key=objective)


def _head_features(features: SpaceFeatures, head: int, h: int) -> SpaceFeatures:
    cols = slice(head * h, (head + 1) * h)
    return SpaceFeatures(features.covariant[:, cols], features.contravariant[:, cols])


def _rescale_layer(target: SpaceFeatures, source: SpaceFeatures, num_heads: int) -> torch.Tensor:
    h = target.covariant.shape[1] // num_heads
    return torch.tensor(
        [optimal_head_scale(_head_features(target, i, h), _head_features(source, i, h)) for i in range(num_heads)],
        dtype=_F64,
    )


# -- the estimator -----------------------------------------------------------------------------
def _check_inputs(
    state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor], schema: ModelSchema, spaces
) -> None:
    missing = sorted({m.name for s in spaces for m in s.members if m.name not in state_a or m.name not in state_b})
    if missing:
        raise RaotError(
            f"weight-based alignment needs every member of the aligned spaces; missing {len(missing)} "
            f"(e.g. {missing[0]}): pass full state dicts (raot_hf.symmetry.model_state(model))."
        )
    for name in {m.name for s in spaces for m in s.members}:
        if tuple(state_a[name].shape) != tuple(state_b[name].shape):
            raise RaotError(
                f"{name} has shape {tuple(state_a[name].shape)} in A but {tuple(state_b[name].shape)} in B: "
                f"the two {schema.model_type} checkpoints must have the same architecture."
            )


def normalise_scope(scope: Iterable[str], estimator: str) -> tuple[str, ...]:
    """``scope`` as a tuple of :data:`SCOPES` (one name or several); ``estimator`` names it in errors."""
    scope = (scope,) if isinstance(scope, str) else tuple(scope)
    unknown = sorted(set(scope) - set(SCOPES))
    if unknown:
        raise RaotError(f"unknown {estimator} scope {unknown}; choose from {', '.join(SCOPES)}")
    return scope


def estimate_weight_alignment(
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    schema: ModelSchema,
    *,
    scope: Iterable[str] = ("mlp", "heads"),
    rescale: bool = False,
    match_heads: bool = False,
    rotations: bool = True,
    return_log: bool = False,
) -> TransformSequence | tuple[TransformSequence, dict[str, Any]]:
    """A symmetry of B moving its weights close to A's (options as in the module docstring): per
    layer MLPPermutation, HeadAlignment, HeadRescale; ``return_log=True`` adds per-layer distances
    before and after, the head assignment, ‖R − I‖_F and the scales."""

    scope = normalise_scope(scope, "weight-alignment")
    check_shared_kv_options(schema, rescale)
    _check_inputs(state_a, state_b, schema, _spaces_needed(schema, scope, rescale))
    parts: list[Transform] = []
    layers_log: list[dict[str, Any]] = []
    for layer in tqdm(range(schema.num_layers), desc="weight alignment", unit="layer", leave=False):
        entry: dict[str, Any] = {"layer": layer}
        if "mlp" in scope and schema.has_mlp(layer):  # a mixture's experts are not matched here (§10)
            entry["mlp"] = _align_mlp_units(state_a, state_b, schema, layer, parts)
        if "heads" in scope or rescale:
            options = {"align": "heads" in scope, "rescale": rescale, "match_heads": match_heads}
            entry["heads"] = _align_layer_heads(state_a, state_b, schema, layer, parts, rotations=rotations, **options)
        layers_log.append(entry)
        logger.debug("layer %d weight alignment: %s", layer, entry)

    transform = TransformSequence(parts)
    logger.info(
        "weight-based alignment (%s%s%s%s): %d transforms over %d layers",
        "+".join(scope) or "none",
        ", matched heads" if match_heads and "heads" in scope else "",
        "" if rotations or "heads" not in scope else ", no rotations",
        ", rescaled" if rescale else "",
        len(parts),
        schema.num_layers,
    )
    if not return_log:
        return transform
    return transform, _estimator_log(scope, match_heads, rotations, rescale, layers_log)


def _estimator_log(scope, match_heads, rotations, rescale, layers_log) -> dict[str, Any]:
    """The log returned with ``return_log=True``: the settings, then per layer and factor."""
    return {
        "estimator": "weight_based",
        "scope": list(scope),
        "match_heads": bool(match_heads),
        "rotations": bool(rotations),
        "rescale": bool(rescale),
        "layers": layers_log,
        "notes": [
            "data-free: weights only; MLP units by per-layer weight matching (no residual coupling)",
            "the residual stream is not estimated from weights",
            "rescaling, when on, is fitted after rotation (sequential, as in the paper)",
        ],
    }


def _spaces_needed(schema: ModelSchema, scope: tuple[str, ...], rescale: bool) -> list[Space]:
    """The spaces whose members the requested factors read, layer by layer."""
    need = []
    for layer in range(schema.num_layers):
        if "mlp" in scope and schema.has_mlp(layer):
            need.append(schema.mlp_space(layer))
        if "heads" in scope or rescale:
            need += [schema.qk_space(layer), schema.vo_space(layer)]
            need += [s for s in (schema.kv_space(layer, "k"), schema.kv_space(layer, "v")) if s is not None]
    return need


def _align_mlp_units(state_a, state_b, schema: ModelSchema, layer: int, parts: list[Transform]) -> dict[str, Any]:
    """Weight-match one layer's MLP units; appends the permutation to ``parts``, returns its log."""
    space = schema.mlp_space(layer)
    fa, fb = space_features(state_a, space), space_features(state_b, space)
    perm = match_mlp_units(fa.stacked(), fb.stacked())
    moved_b = SpaceFeatures(fb.covariant[:, perm], fb.contravariant[:, perm])
    parts.append(MLPPermutation(layer, perm))
    return {
        "distance_before": feature_distance(fa, fb),
        "distance_after": feature_distance(fa, moved_b),
        "units_moved": int((perm != torch.arange(len(perm))).sum()),
    }


def _align_layer_heads(
    state_a,
    state_b,
    schema: ModelSchema,
    layer: int,
    parts: list[Transform],
    *,
    align: bool,
    rescale: bool,
    match_heads: bool,
    rotations: bool,
) -> dict[str, Any]:
    """One layer's head alignment (``align``) then rescaling (``rescale``), appended to ``parts``;
    returns the ``heads`` log. Layers with shared KV heads or RoPE: :func:`align_shared_kv_heads`."""
    structured = schema.qk_structure == "rope" or schema.qk_turns is not None  # Q/K maps with a structure (§8.2, §9)
    if schema.kv_space(layer, "k") is not None or structured:
        if not align:
            return {}
        transform, log = align_shared_kv_heads(
            state_a, state_b, schema, layer, match_heads=match_heads, rotations=rotations
        )
        parts.append(transform)
        return log
    qk_a, qk_b = (space_features(s, schema.qk_space(layer)) for s in (state_a, state_b))
    vo_a, vo_b = (space_features(s, schema.vo_space(layer)) for s in (state_a, state_b))
    heads: dict[str, Any] = {
        "qk_distance_before": feature_distance(qk_a, qk_b),
        "vo_distance_before": feature_distance(vo_a, vo_b),
    }
    if align:
        match = match_heads and schema.head_permutation  # a bias shared by the layers keeps heads in place (§9.7)
        perm, r_qk, r_vo, score = align_heads(
            qk_a.stacked(), qk_b.stacked(), vo_a.stacked(), vo_b.stacked(), schema.num_heads, match, rotations
        )
        parts.append(HeadAlignment(layer, perm, r_qk, r_vo))
        qk_b = _block_transform(qk_b, perm, r_qk)
        vo_b = _block_transform(vo_b, perm, r_vo)
        heads.update(_head_alignment_log(perm, r_qk, r_vo, score, schema.head_size))
        heads["qk_distance_after_rotation"] = feature_distance(qk_a, qk_b)
        heads["vo_distance_after_rotation"] = feature_distance(vo_a, vo_b)
    if rescale:
        a_scale, c_scale = _rescale_layer(qk_a, qk_b, schema.num_heads), _rescale_layer(vo_a, vo_b, schema.num_heads)
        parts.append(HeadRescale(layer, a_scale, c_scale))
        h = schema.head_size
        qk_b = qk_b.rescaled(a_scale.repeat_interleave(h))
        vo_b = vo_b.rescaled(c_scale.repeat_interleave(h))
        heads.update(qk_scale=a_scale.tolist(), vo_scale=c_scale.tolist())
        heads["qk_distance_after_rescale"] = feature_distance(qk_a, qk_b)
        heads["vo_distance_after_rescale"] = feature_distance(vo_a, vo_b)
    heads["qk_distance_after"] = feature_distance(qk_a, qk_b)
    heads["vo_distance_after"] = feature_distance(vo_a, vo_b)
    return heads


def _head_alignment_log(
    perm: torch.Tensor, r_qk: torch.Tensor, r_vo: torch.Tensor, score: torch.Tensor, head_size: int
) -> dict[str, Any]:
    """The head assignment, its pair scores, and the rotations' distance from the identity."""
    eye = torch.eye(head_size, dtype=_F64)
    return {
        "perm": perm.tolist(),
        "heads_moved": int((perm != torch.arange(len(perm))).sum()),
        "pair_score_matched": score.tolist(),
        "qk_rotation_deviation": torch.linalg.matrix_norm(r_qk - eye).tolist(),
        "vo_rotation_deviation": torch.linalg.matrix_norm(r_vo - eye).tolist(),
        "reflections": int((torch.linalg.det(r_qk) < 0).sum() + (torch.linalg.det(r_vo) < 0).sum()),
    }


@register_section
@dataclass
class WeightMatchingOptions(OptionSection):
    """Options of the data-free ``weight`` estimator (the rotation-symmetry paper's baseline)."""

    section = "weight"

    rescale: bool = field(default=False, metadata=meta("Weight-based estimator: rescale heads.", "weight_rescale"))
    match_heads: bool = field(
        default=True,
        metadata=meta(
            "Weight-based estimator: assign heads by their Procrustes score first (default on).", "weight_match_heads"
        ),
    )

    def __post_init__(self) -> None:
        check_field_types(self)
