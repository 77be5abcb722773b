"""RegMean Gram matrices after alignment (docs/design.md §6): B′'s Grams are B's under the same
transforms — transformed, never re-measured — and pre-LN folding is accounted for."""

from __future__ import annotations

import torch

from raot_hf.adapters.schema import ModelSchema
from raot_hf.calibration.statistics import CalibrationStatistics, Gram
from raot_hf.symmetry.apply import needs_folding
from raot_hf.symmetry.transforms import TransformSequence

_F64 = torch.float64


def _input_space(schema: ModelSchema, weight: str, transposed: bool = False):
    """The space whose vectors a Linear weight reads: its contravariant member on the input axis
    (axis 1; axis 0 for a weight stored (in, out), GPT-2's ``Conv1D``)."""
    axis = 0 if transposed else 1
    for space in schema.spaces.values():
        for m in space.members:
            if m.name == weight and m.axis == axis and not m.covariant and m.index is None:
                return space
    return None


def transposed_weights(model: torch.nn.Module, weights) -> set[str]:
    """The names among ``weights`` whose module stores its weight (in, out) (``Conv1D``)."""
    from transformers.pytorch_utils import Conv1D

    return {name for name in weights if isinstance(model.get_submodule(name.rsplit(".", 1)[0]), Conv1D)}


def _unfold(g: torch.Tensor, s: torch.Tensor, n: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor):
    """Gram of z = (y − β)/γ from the Gram G and sum s of y: D⁻¹(G − β sᵀ − s βᵀ + n ββᵀ)D⁻¹."""
    inv = 1.0 / gamma.to(_F64)
    beta = beta.to(_F64)
    gz = g - torch.outer(beta, s) - torch.outer(s, beta) + n * torch.outer(beta, beta)
    return inv[:, None] * gz * inv[None, :]


def aligned_grams(
    stats: CalibrationStatistics, schema: ModelSchema, applied: TransformSequence, model_a: torch.nn.Module,
    model_b: torch.nn.Module, *, folded: bool | None = None, transposed: set[str] | None = None,
    unfolded_norms: tuple[dict, dict] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:  # fmt: skip
    """Grams of A and of B′ keyed like ``stats.grams``.

    Inputs were recorded before any folding. If the models are now folded (a pre-LN residual
    rotation was applied), a reader's input became z = (y − β)/γ of its LayerNorm, so each Gram
    is re-expressed through the recorded sums; then B's Gram of an input space acted on by M
    becomes Mᵀ·G·M. ``transposed``: the weights stored (in, out) (default: found in ``model_a``,
    :func:`transposed_weights`). ``unfolded_norms``: A's and B's norm affines from before the fold
    (:func:`raot_hf.symmetry.norm_affines`); without them the models' current ones are used.
    """
    actions = applied.actions(schema) if len(applied) else {}
    if transposed is None:
        transposed = transposed_weights(model_a, stats.gram_keys)
    if folded is None:
        folded = needs_folding(schema, actions)
    folds = schema.folds if folded else ()
    fold_of = {w: (fold.norm_weight, fold.norm_bias, fold.offset) for fold in folds for w, _ in fold.readers}
    grams_a, grams_b = {}, {}
    for weight, key in stats.gram_keys.items():
        gram: Gram = stats.grams[key]
        ga, gb = gram.a.to(torch.float64, copy=True), gram.b.to(torch.float64, copy=True)
        if weight in fold_of:
            wn, bn, offset = fold_of[weight]
            norms_a, norms_b = unfolded_norms or ({}, {})
            ga = _unfold(ga, gram.sum_a, gram.n, *_original_norm(model_a, norms_a, wn, bn, offset))
            gb = _unfold(gb, gram.sum_b, gram.n, *_original_norm(model_b, norms_b, wn, bn, offset))
        space = _input_space(schema, weight, weight in transposed)
        if space is not None and space.name in actions:
            m = actions[space.name].dense(space.size)
            gb = m.T @ gb @ m
        grams_a[key], grams_b[key] = ga, gb
    return grams_a, grams_b


def _original_norm(model: torch.nn.Module, saved: dict, weight: str, bias: str | None, offset: float = 0.0):
    """The norm's affine from before the fold (``saved``), else the model's current one; an
    RMSNorm (``bias`` None) has a zero shift; ``offset``: the norm scales by offset + weight."""
    params = dict(model.named_parameters())
    gamma = saved[weight] if weight in saved else params[weight].detach()
    if offset:
        gamma = gamma.to(torch.float64) + offset
    if bias is None:
        return gamma, torch.zeros_like(gamma)
    return gamma, saved[bias] if bias in saved else params[bias].detach()
