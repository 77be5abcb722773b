"""Stage: apply the accepted transforms to B and check that B′ computes B's function (docs/design.md §5.5)
on the held-out inputs kept by the calibration pass (synthetic inputs without calibration data)."""

from __future__ import annotations

import logging

import torch

from raot_hf.errors import EquivalenceError
from raot_hf.outputs import Check
from raot_hf.results import Alignment
from raot_hf.stages.context import PairContext, on_device_of
from raot_hf.symmetry import fold_model, needs_folding, norm_affines, stream_actions, transform_model
from raot_hf.symmetry.equivalence import deviation_forms, example_inputs, primary_outputs

logger = logging.getLogger("raot_hf.stages.apply")


#: Tolerated B′ ≡ B deviation of a 16-bit model, in units of its dtype's machine epsilon: storing
#: the transformed weights rounds them, a few eps on a scramble; a broken transform deviates by O(1)
#: (docs/design.md §5.5).
HALF_PRECISION_EPS = 16


def exactness_threshold(dtype: torch.dtype, norm_dtype: str | None = None) -> float:
    """The largest relative deviation an exact transform may show in ``dtype``: 1e-9 (float64),
    1e-4 (float32), 16 machine epsilons for 16-bit floats (bf16 0.125, fp16 0.0156). Norms that
    compute in ``norm_dtype`` whatever the model's dtype (the schema's; transformers' RMSNorm:
    float32) bound the precision: the looser of the two thresholds applies."""
    if norm_dtype is not None:
        return max(exactness_threshold(dtype), exactness_threshold(getattr(torch, norm_dtype)))
    if dtype == torch.float64:
        return 1e-9
    if torch.finfo(dtype).bits <= 16:
        return HALF_PRECISION_EPS * torch.finfo(dtype).eps
    return 1e-4


def check_inputs(ctx: PairContext, run) -> tuple[list[dict], list[dict]]:
    """The check's inputs and B's outputs on them: the held-out rows kept by the calibration
    pass, or synthetic inputs (B runs on them now, before it is transformed)."""
    inputs = list(run.check_inputs) if run is not None else []
    reference = list(run.check_reference) if run is not None else []
    if not inputs:
        inputs = [example_inputs(ctx.model_b, batch=2, seq=8, seed=ctx.config.seed)]
    if len(reference) != len(inputs):
        reference = [primary_outputs(ctx.model_b, on_device_of(ctx.model_b, x)) for x in inputs]
    return inputs, reference


def checked_deviation(
    ctx: PairContext, reference, inputs, actions, exact: bool, what: str
) -> tuple[float, float, float]:
    """(max |r − c| / max |r| over B′'s primary outputs c against B's r — padding masked, the stream
    output mapped by the residual action —, the dtype's exactness threshold, ‖r − c‖ / ‖r‖ over the
    same entries); an ``exact`` alignment above the threshold raises, naming ``what`` changed B."""
    stream = actions["residual"].dense(ctx.schema.hidden_size) if "residual" in actions else None
    value = norm_value = 0.0
    for ref, x in zip(reference, inputs, strict=True):
        cand = primary_outputs(ctx.model_b, on_device_of(ctx.model_b, x))
        forms = deviation_forms(ref, cand, x.get("attention_mask"), stream, relative=True)
        value, norm_value = max(value, forms["max"]), max(norm_value, forms["norm"])
    threshold = exactness_threshold(next(ctx.model_b.parameters()).dtype, ctx.schema.norm_dtype)
    if exact and value > threshold:
        raise EquivalenceError(
            f"{what} changed B's function (relative deviation {value:.3g} > {threshold}); "
            "this is a bug in raot_hf — please report it with raot_report.json"
        )
    return value, threshold, norm_value


def apply_and_check(ctx: PairContext, alignment: Alignment, run) -> list[Check]:
    """Transform B in place (and fold A's LayerNorms when a pre-LN stream rotates), measure
    B′ ≡ B, and return the report's checks; an exact alignment that fails raises."""
    with ctx.timer.stage("apply"):
        inputs, reference = check_inputs(ctx, run)
        actions = stream_actions(alignment.applied, ctx.schema) if len(alignment.applied) else {}
        if len(alignment.applied):
            if needs_folding(ctx.schema, actions):  # both parents fold: record what the fold removes
                ctx.unfolded_norms = (norm_affines(ctx.model_a, ctx.schema), norm_affines(ctx.model_b, ctx.schema))
            transform_model(ctx.model_b, ctx.schema, alignment.applied, working_files=ctx.working_files)
            if needs_folding(ctx.schema, actions):
                fold_model(ctx.model_a, ctx.schema, working_files=ctx.working_files)
        return [equivalence_check(ctx, alignment, inputs, reference)]


def equivalence_check(ctx: PairContext, alignment: Alignment, inputs: list[dict], reference: list) -> Check:
    """The B′ ≡ B check of B as it now is (the alignment applied) on ``inputs``, against B's outputs
    ``reference`` taken before (:func:`check_inputs`); an exact alignment that fails raises."""
    actions = stream_actions(alignment.applied, ctx.schema) if len(alignment.applied) else {}
    exact = alignment.exact
    value, threshold, norm_value = checked_deviation(ctx, reference, inputs, actions, exact, "an exact transform")
    name = "B′ ≡ B on held-out inputs (max relative deviation)"
    check = Check(name, value, threshold, exact, passed=value <= threshold or not exact, norm_value=norm_value)
    if not exact:
        logger.warning(
            "approximate alignment (post-LN rotation, soft transport or RoPE-unrestricted heads): "
            "B′ deviates from B by %.3g",
            value,
        )
    return check
