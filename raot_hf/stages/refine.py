"""Stage: the learned alignment, after the estimate is applied and before the merge (docs/design.md §5.6).

The refinement Δ is fitted on B′, applied to it in place when it beats the estimated alignment,
appended to the alignment's applied transforms (so the report, the transform file and RegMean's
Grams see the whole map), and B″ ≡ B is checked again on the held-out inputs.
"""

from __future__ import annotations

from raot_hf.errors import EquivalenceError
from raot_hf.outputs import Check
from raot_hf.refine import refine_alignment
from raot_hf.results import Alignment
from raot_hf.stages.apply import _check_inputs, deviation, exactness_threshold
from raot_hf.stages.context import PairContext
from raot_hf.symmetry import TransformSequence, stream_actions, transform_model


def refine_and_check(ctx: PairContext, alignment: Alignment, run) -> list[Check]:
    """Run the refinement when ``config.refine.steps`` > 0 and something continuous was applied;
    returns the extra check (empty when nothing changed)."""
    if ctx.config.refine.steps == 0 or run is None or not len(alignment.applied):
        return []
    with ctx.timer.stage("refine"):
        delta, log = refine_alignment(ctx, alignment, run)
        alignment.logs["refine"] = log
        if not delta:
            return []
        transform_model(ctx.model_b, ctx.schema, TransformSequence(delta), working_files=ctx.working_files)
        alignment.applied = TransformSequence([*alignment.applied.transforms, *delta])
        inputs, reference = _check_inputs(ctx, run)
        value = deviation(ctx, reference, inputs, stream_actions(alignment.applied, ctx.schema))
        threshold = exactness_threshold(next(ctx.model_b.parameters()).dtype, ctx.schema.norm_dtype)
        if alignment.exact and value > threshold:
            raise EquivalenceError(
                f"the learned alignment changed B's function (relative deviation {value:.3g} > {threshold}); "
                "this is a bug in raot_hf — please report it with raot_report.json"
            )
        name = "B″ ≡ B after the learned alignment (max relative deviation)"
        return [Check(name, value, threshold, alignment.exact, passed=True)]
