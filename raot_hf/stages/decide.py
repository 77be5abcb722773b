"""Stage: the gate — every candidate competes with the identity (docs/design.md §5): first by its
held-out alignment-objective gain, then (merge objective) :func:`raot_hf.gate.merge.merge_gate`."""

from __future__ import annotations

from raot_hf.estimators import estimator_spec, is_identity
from raot_hf.estimators.activation import head_gains, mlp_gains, residual_gains
from raot_hf.gate import GateDecision, Status, unscored
from raot_hf.gate import decide as decide_one
from raot_hf.gate.merge import merge_gate
from raot_hf.results import Alignment
from raot_hf.stages.context import PairContext
from raot_hf.symmetry import (
    ExpertAlignment,
    HeadAlignment,
    HeadRescale,
    MLPPermutation,
    SoftTransport,
    Transform,
    TransformSequence,
    is_exact,
)

_SPACE_KIND = {"mlp": "mlp", "qk": "heads", "vo": "heads", "residual": "residual", "experts": "experts"}


def _kind_and_layer(t: Transform) -> tuple[str, int | None]:
    if isinstance(t, MLPPermutation):
        return "mlp", t.layer
    if isinstance(t, ExpertAlignment):
        return "experts", t.layer
    if isinstance(t, HeadAlignment):
        return "heads", t.layer
    return "residual", None


def _ungated(kind: str, layer: int | None, applied: bool, reason: str, t: Transform) -> GateDecision:
    status = Status.UNGATED if applied else Status.IDENTITY
    return unscored(kind, layer, applied, status, reason, t.describe())


def _scored(ctx: PairContext, t: Transform, stats, unchanged: bool) -> GateDecision:
    """The held-out alignment-objective decision of one exact candidate (``unchanged``: it and
    whatever follows it — a layer's head scales — leave B as it is)."""
    cfg, ho = ctx.config, stats.heldout
    H, h = ctx.schema.num_heads, ctx.schema.head_size
    kind, layer = _kind_and_layer(t)
    if kind == "mlp":
        gains, identity = mlp_gains(ho.mlp[layer])
    elif kind == "experts":  # per expert: the correlation of its router probabilities with A's (§10)
        gains, identity = mlp_gains(ho.experts[layer])
    elif kind == "heads":
        gains, identity = head_gains(ho.q[layer], ho.k[layer], ho.ctx[layer], H, h)
    else:
        gains, identity = residual_gains(ho.stream)
    gate = cfg.gate
    return decide_one(kind, layer, gains, identity, z=gate.z, min_gain=gate.min_gain, heldout_tokens=int(ho.tokens),
                      min_tokens=gate.min_heldout_tokens, is_identity=unchanged, enabled=gate.enabled,
                      description=t.describe())  # fmt: skip


def alignment_decisions(ctx: PairContext, parts: list[Transform], stats) -> list[GateDecision]:
    """One row per candidate (head rescales follow their layer's heads): the alignment objective's
    decision, or why it is not gated."""
    decisions = []
    scaled = {t.layer for t in parts if isinstance(t, HeadRescale) and not is_identity(t)}
    for t in parts:
        if isinstance(t, HeadRescale):
            continue
        if isinstance(t, SoftTransport):
            space = ctx.schema.space(t.space)
            reason = "soft transport baseline: not a symmetry, not gated"
            decisions.append(_ungated(_SPACE_KIND[space.kind], space.layer, True, reason, t))
            continue
        identity = is_identity(t) and not (isinstance(t, HeadAlignment) and t.layer in scaled)
        if stats is None:
            decisions.append(_ungated(*_kind_and_layer(t), not identity, "no calibration: gate skipped", t))
        else:
            decisions.append(_scored(ctx, t, stats, identity))
    return decisions


def applied_transforms(parts: list[Transform], decisions: list[GateDecision]) -> TransformSequence:
    """The candidates whose decision applied them (a head rescale goes with its layer's heads)."""
    applied = {(d.transform, d.layer) for d in decisions if d.applied}
    chosen = []
    for t in parts:
        if isinstance(t, SoftTransport):
            chosen.append(t)
        elif isinstance(t, HeadRescale):
            if ("heads", t.layer) in applied:
                chosen.append(t)
        elif _kind_and_layer(t) in applied:
            chosen.append(t)
    return TransformSequence(chosen)


def decide(ctx: PairContext, parts: list[Transform], logs: dict, stats, run) -> Alignment:
    """Gate every candidate and return the alignment (nothing is applied to the models yet)."""
    cfg = ctx.config
    if cfg.alignment == "none" or not cfg.scope:
        return Alignment([], TransformSequence([]), True)
    with ctx.timer.stage("gate"):
        gated = estimator_spec(cfg.alignment).gated
        gate = merge_gate(ctx, run, parts, stats, alignment_decisions(ctx, parts, stats), gated)
    applied = applied_transforms(parts, gate.decisions)
    return Alignment(gate.decisions, applied, is_exact(applied, ctx.schema), logs, gate.verdict, gate.model_fidelity)
