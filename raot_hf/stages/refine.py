"""Stage: the learned alignment, after the estimate is applied and before the merge (docs/design.md §5.6).

The refinement Δ is fitted on B′, applied in place when it beats the estimated alignment, appended to
the applied transforms (the report, transform file and Grams see the whole map), and B″ ≡ B is checked.
"""

from __future__ import annotations

from raot_hf.outputs import Check
from raot_hf.refine import refine_alignment
from raot_hf.results import Alignment
from raot_hf.stages.apply import check_inputs, checked_deviation
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
        inputs, reference = check_inputs(ctx, run)
        actions = stream_actions(alignment.applied, ctx.schema)
        value, threshold, norm_value = checked_deviation(
            ctx, reference, inputs, actions, alignment.exact, "the learned alignment"
        )
        name = "B″ ≡ B after the learned alignment (max relative deviation)"
        return [Check(name, value, threshold, alignment.exact, passed=True, norm_value=norm_value)]
