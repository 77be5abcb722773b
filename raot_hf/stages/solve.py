"""Stage: solve — the configured estimator proposes candidate symmetries (docs/design.md §4.4); with
sharded statistics the main process solves and broadcasts them (§7.1)."""

from __future__ import annotations

from typing import Any

from raot_hf.estimators import EstimationRequest, estimator_spec
from raot_hf.stages.context import PairContext, one_thread
from raot_hf.symmetry import Transform, model_state


def solve(ctx: PairContext, stats, solved: dict | None = None) -> tuple[list[Transform], dict[str, Any]]:
    """The candidates and the estimator's logs (empty without alignment or scope); ``solved``: the
    layers a layer-by-layer fit phase already solved (:func:`raot_hf.stages.calibrate.fit_phase`)."""
    cfg = ctx.config
    if cfg.alignment == "none" or not cfg.scope:
        return [], {}
    spec = estimator_spec(cfg.alignment)
    shared = stats is not None and ctx.dist.is_distributed
    parts: list[Transform] = []
    logs: dict[str, Any] = {}
    with ctx.timer.stage("solve"):
        if ctx.dist.is_main or not shared:
            states = model_state(ctx.model_a), model_state(ctx.model_b)
            options = cfg.lookup(spec.options) if spec.options else None
            request = EstimationRequest(stats, ctx.schema, *states, cfg, ctx.dist.is_main, options, solved or {})
            with one_thread():
                parts, logs = spec.fn(request)
        if shared:
            parts, logs = ctx.dist.broadcast_object((parts, logs) if ctx.dist.is_main else None)
    return parts, logs
