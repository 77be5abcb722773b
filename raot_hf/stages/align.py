"""Stage: one model's alignment to the reference — the calibration pass (fit, candidates, held-out)
and the gate (docs/design.md §4–§5); nothing is applied to the models here."""

from __future__ import annotations

from typing import Any

from raot_hf.distributed import statistics_pass_needed
from raot_hf.memory import release_freed_memory
from raot_hf.results import Alignment
from raot_hf.stages.calibrate import CalibrationRun, fit_phase, heldout_phase, keep_outputs, open_calibration
from raot_hf.stages.context import PairContext
from raot_hf.stages.decide import decide
from raot_hf.stages.solve import solve


def calibrate_and_solve(
    ctx: PairContext, calibration, early=None, like: CalibrationRun | None = None, keep: bool = False,
    predict=None,
) -> tuple[Any, CalibrationRun | None, list, dict]:  # fmt: skip
    """The fit phase, the candidates (§7), then the held-out phase that scores them: the statistics
    (the fit moments freed), the run, the candidates and the logs; ``like``: another pair's run;
    ``keep``: the pass keeps the parents' outputs the one sweep reads (``run.kept``, §5.7);
    ``predict(ctx)``: what keeps their predictions, the refit's target (``run.predictions``, §6.11;
    :func:`raot_hf.stages.refit.prediction_capture`), or None."""
    stats = run = None
    solved: dict[int, tuple] = {}  # layers the layer-by-layer fit phase solves as it completes them (§7.4)
    if statistics_pass_needed(ctx.config, calibration):
        with ctx.timer.stage("calibration"):
            run = open_calibration(ctx, calibration, early, like)
            run.kept = keep_outputs(ctx, run) if keep else None
            if predict is not None:  # the refit's output target, from the same forwards (docs/design.md §6.11)
                run.predictions = predict(ctx)
            stats = fit_phase(ctx, run, solved)
    parts, logs = solve(ctx, stats, solved)
    if stats is not None:
        stats.fit = None  # the estimators are done with the fit moments: free them before the held-out phase
        release_freed_memory(ctx.working_files)
        with ctx.timer.stage("calibration"):
            heldout_phase(ctx, run, stats, parts)
        release_freed_memory(ctx.working_files)
        run.fingerprint.update({"examples": stats.examples, "heldout_tokens": int(stats.heldout.tokens)})
    if run is not None and run.kept is not None:
        run.kept.close()  # its hooks: nothing more is kept; what was stays readable
    return stats, run, parts, logs


def calibrate_solve_decide(
    ctx: PairContext, calibration, early=None, like: CalibrationRun | None = None
) -> tuple[Alignment, Any, CalibrationRun | None]:
    """:func:`calibrate_and_solve`, then the gate: the alignment, the statistics and the run."""
    stats, run, parts, logs = calibrate_and_solve(ctx, calibration, early, like)
    alignment = decide(ctx, parts, logs, stats, run)
    release_freed_memory(ctx.working_files)  # the gate's captured layer calls
    return alignment, stats, run
