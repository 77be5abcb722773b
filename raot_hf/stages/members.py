"""Stage: each model aligned to one reference basis, gated on its own (docs/design.md §6.9).

Model 1 (or the most central, ``models.reference="central"``) is the reference; every other model
runs calibration, solve, gate, apply and the B′ᵢ ≡ Bᵢ check against it. When any alignment folded
the reference's LayerNorms (§3.3), every model is folded (exactly), so all merge in one parametrisation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from raot_hf.calibration.statistics import CalibrationStatistics
from raot_hf.errors import RaotError
from raot_hf.memory import release_freed_memory
from raot_hf.merging import merge_rule_spec, nary_merge_rules
from raot_hf.merging.siblings import refuse_moved_b
from raot_hf.outputs import Check
from raot_hf.results import Alignment
from raot_hf.stages.align import calibrate_and_solve
from raot_hf.stages.apply import apply_and_check
from raot_hf.stages.calibrate import CalibrationRun, open_calibration
from raot_hf.stages.context import PairContext
from raot_hf.stages.decide import alignment_decisions, decide
from raot_hf.stages.quality import ParentOutputs, merge_quality, quality_inputs, reference_outputs
from raot_hf.stages.refine import refine_and_check
from raot_hf.stages.sweep import PendingGate, keeps_parents, sweep_applies
from raot_hf.symmetry import fold_model, norm_affines

logger = logging.getLogger("raot_hf.stages.members")
_STAGE = {"stage": True}  # a line the CLI shows by default (raot_hf.cli.verbosity)


@dataclass
class AlignedModel:
    """One non-reference model after its alignment: pair context, alignment, the statistics RegMean
    reads, calibration run, checks, and both models' norm affines for RegMean's Grams (§6.2)."""

    ctx: PairContext
    alignment: Alignment
    stats: CalibrationStatistics | None
    run: CalibrationRun | None
    checks: list[Check]
    norms: tuple[dict, dict] | None
    # the gate still to run, in the merge's one sweep (docs/design.md §5.7): then ``alignment`` is
    # None and ``checks`` empty until the merge stage has run
    pending: PendingGate | None = None

    fingerprint = property(lambda self: self.run.fingerprint if self.run is not None else None)


def model_weights(config, n: int) -> list[float]:
    """The per-model weights: ``(1 − α, α)`` for two models (``models.weights`` set α, see
    :func:`two_model_config`), else ``models.weights`` (one per model) or equal weights."""
    if n == 2 and not config.models.weights:
        return [1.0 - config.alpha, config.alpha]
    weights = list(config.models.weights) or [1.0 / n] * n
    if len(weights) != n:
        raise RaotError(f"--weights gives {len(weights)} weights for {n} models; give one weight per model, in order")
    return weights


def check_models(config, n: int, distributed: bool = False) -> None:
    """Everything a merge of ``n`` ≥ 3 models refuses, checked before any weights are read."""
    spec = merge_rule_spec(config.merge_rule)
    if spec.max_models is not None and n > spec.max_models:
        raise RaotError(
            f"merge_rule={config.merge_rule!r} merges two models only; for {n} models use one of: "
            f"{', '.join(nary_merge_rules())}"
        )
    model_weights(config, n)
    if config.models.densities and len(config.models.densities) != n:
        raise RaotError(f"--densities gives {len(config.models.densities)} values for {n} models; give one per model")
    if config.head == "b":
        raise RaotError(f"--head b names one of two models; with {n} models use --head a (the reference's) or average")
    if distributed:
        raise RaotError(f"a merge of {n} models runs in one process; run it without accelerate launch")


def align_member(ctx: PairContext, calibration, early, like=None, alone: bool = False, predict=None) -> AlignedModel:
    """Align one model to the reference, nothing merged; ``like``: an earlier member's calibration
    run; ``alone``: the only model besides the reference, whose gate may then run in the merge's
    one sweep (:func:`raot_hf.stages.sweep.sweep_applies`) instead of here, and whose predictions
    the calibration pass may keep for the refit (``predict``, :func:`calibrate_and_solve`)."""
    norms = (norm_affines(ctx.model_a, ctx.schema), norm_affines(ctx.model_b, ctx.schema)) if ctx.plan.grams else None
    keep = alone and keeps_parents(ctx)  # the pass keeps what the sweep would run the parents for (§5.7)
    stats, run, parts, logs = calibrate_and_solve(ctx, calibration, early, like, keep=keep,
                                                  predict=predict if alone else None)  # fmt: skip
    rows = alignment_decisions(ctx, parts, stats) if stats is not None else []
    if sweep_applies(ctx, parts, rows, stats, run, alone):
        return AlignedModel(ctx, None, None, run, [], norms, pending=PendingGate(parts, logs, rows, stats))
    if run is not None and run.kept is not None:  # what the pass kept for the sweep: nothing reads it
        run.kept.store.close()
        run.kept = None
    alignment = decide(ctx, parts, logs, stats, run)
    release_freed_memory(ctx.working_files)  # the gate's captured layer calls
    if not ctx.plan.grams:
        stats = None  # only RegMean reads statistics after the gate: free them before apply/merge
        release_freed_memory(ctx.working_files)
    if ctx.base is not None:  # task vectors need B in the base's basis (docs/design.md §6)
        refuse_moved_b(alignment.decisions, ctx.config.merge_rule)
    if run is None and ctx.config.correction.method not in ("none", "auto"):  # the correction reads data
        run = open_calibration(ctx, calibration, early, like)
    checks = apply_and_check(ctx, alignment, run) + refine_and_check(ctx, alignment, run)
    return AlignedModel(ctx, alignment, stats, run, checks, norms)


def align_all(pairs: list[PairContext], calibration, early, like=None, predict=None) -> list[AlignedModel]:
    """Align every model to the reference in turn, on one calibration sample read once. Once an
    alignment has folded the reference's norms (§3.3), each later model is folded before its own pass,
    so its gate compares merges of one parametrisation; at the end, if any folded, every model is."""
    members: list[AlignedModel] = []
    for i, ctx in enumerate(pairs, start=2):
        if len(pairs) > 1:
            logger.info("aligning model %d of %d to the reference", i, len(pairs) + 1, extra=_STAGE)
        if members_folded(members):
            fold_model(ctx.model_b, ctx.schema, working_files=ctx.working_files)
        members.append(align_member(ctx, calibration, early, like, alone=len(pairs) == 1, predict=predict))
        like = like or members[-1].run
    if members_folded(members):
        for m in members:
            if m.ctx.unfolded_norms is None:
                fold_model(m.ctx.model_b, m.ctx.schema, working_files=m.ctx.working_files)
    return members


def members_folded(members: list[AlignedModel]) -> bool:
    """Whether an alignment folded the reference's norms (§3.3)."""
    return any(m.ctx.unfolded_norms is not None for m in members)


def member_models(members: list[AlignedModel]) -> list[torch.nn.Module]:
    """The reference, then every aligned model, in order."""
    return [members[0].ctx.model_a, *(m.ctx.model_b for m in members)]


def parents_before_merge(members: list[AlignedModel]) -> tuple[list, list]:
    """Each pair's check rows and the reference's outputs on them (before the merge writes into it):
    those the calibration pass kept, where it kept them for these rows, else run now."""
    sets = [quality_inputs(m.ctx, m.run) for m in members]
    outputs = []
    for m, x in zip(members, sets, strict=True):
        kept = m.run.check_reference_a if m.run is not None else []
        if x and len(kept) == len(x) and not m.ctx.schema.expert_layers:  # a dense model routes nothing
            outputs.append(ParentOutputs(list(kept), [{} for _ in kept]))
        else:
            outputs.append(reference_outputs(m.ctx, x))
    return sets, outputs


def merged_quality(members: list[AlignedModel], sets: list, parents: list) -> list[dict | None]:
    """The merged model against the reference (``parents``: its outputs from before the merge) and
    against each aligned model (one record per model)."""
    return [merge_quality(m.ctx, x, p) for m, x, p in zip(members, sets, parents, strict=True)]


#: Examples the central-reference choice reads (one forward of every model).
CENTRAL_EXAMPLES = 32


def _linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of two (n, d) representations: invariant to orthogonal maps and isotropic scale."""
    x, y = x - x.mean(0), y - y.mean(0)
    cross = (x.T @ y).pow(2).sum()
    return float(cross / ((x.T @ x).pow(2).sum().sqrt() * (y.T @ y).pow(2).sum().sqrt()).clamp_min(1e-300))


@torch.no_grad()
def _representations(model: torch.nn.Module, batches: list) -> list[torch.Tensor]:
    """Every hidden state (embeddings and each layer's output) over the real tokens, float64."""
    device = next(model.parameters()).device
    per_layer: list[list[torch.Tensor]] = []
    for batch in batches:
        out = model(**{k: v.to(device) for k, v in batch.inputs.items()}, output_hidden_states=True)
        for i, h in enumerate(out.hidden_states):
            mask = batch.token_mask
            rows = h[mask.to(h.device)] if mask is not None else h.reshape(-1, h.shape[-1])
            if len(per_layer) <= i:
                per_layer.append([])
            per_layer[i].append(rows.to("cpu", torch.float64))
    return [torch.cat(rows) for rows in per_layer]


def central_index(models: list[torch.nn.Module], ctx: PairContext, run) -> tuple[int, dict[str, Any]]:
    """The index of the model whose representations agree most with the others' (mean linear CKA over
    layers and models, first :data:`CENTRAL_EXAMPLES` examples) and the affinities for the report."""
    batches, taken = [], 0
    for batch in run.batches(ctx.preprocessor, split="fit"):
        batches.append(batch)
        taken += len(batch)
        if taken >= CENTRAL_EXAMPLES:
            break
    reps = [_representations(m, batches) for m in models]
    n = len(models)
    affinity = [[1.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            value = sum(_linear_cka(x, y) for x, y in zip(reps[i], reps[j], strict=True)) / len(reps[i])
            affinity[i][j] = affinity[j][i] = value
    means = [(sum(row) - 1.0) / (n - 1) for row in affinity]
    index = max(range(n), key=lambda i: (means[i], -i))
    logger.info("reference: model %d (mean CKA to the others %.4f)", index + 1, means[index], extra=_STAGE)
    return index, {"rule": "central", "chosen": index + 1, "mean_cka": means, "cka": affinity, "examples": taken}


def two_model_config(config):
    """Per-model weights of a two-model merge as the two-model rules' options: α = w₂/(w₁ + w₂),
    and for task arithmetic (whose weights mergekit does not normalise) the task scale times
    w₁ + w₂, so ``base + λ·(w₁τ₁ + w₂τ₂)`` as with more models."""
    weights = model_weights(config, 2)
    total = sum(weights)
    changes: dict[str, Any] = {"alpha": weights[1] / total}
    if config.merge_rule == "task_arithmetic":
        scale = 1.0 if config.task_vectors.scale is None else config.task_vectors.scale
        changes["task_vectors"] = {**config.task_vectors.to_dict(), "scale": scale * total}
    if config.models.densities:
        raise RaotError("--densities sets one density per model for three or more; with two use --density")
    return config.replace(**changes, models={**config.models.to_dict(), "weights": []})


def prepare_config(config, n: int, has_base: bool):
    """The config of a merge of ``n`` models, checked before any weights are read (two models' weights as α)."""
    from raot_hf.distributed import DistributedContext
    from raot_hf.stages.load import check_base_matches_rule

    if n < 2:
        raise RaotError(f"give at least two models, got {n}")
    check_base_matches_rule(config, has_base)
    most = merge_rule_spec(config.merge_rule).max_models
    if most is not None and n > most:
        raise RaotError(
            f"merge_rule={config.merge_rule!r} merges at most {most} model(s), got {n}; pick another rule"
            + (" (passthrough copies one model: use a merge file's slices to stack layers)" if most == 1 else "")
        )
    if n > 2:
        check_models(config, n, DistributedContext.detect().is_distributed)
        return config
    return two_model_config(config) if config.models.weights else config
