"""Stage: a merge of N models — each aligned to one reference basis and gated on its own, then one
N-ary merge (docs/design.md §6.9).

Model 1 (or the most central model, ``group.reference="central"``) is the reference. Every other
model i runs the two-model pipeline against it — calibration pass, solve, gate, apply, B′ᵢ ≡ Bᵢ —
so a sibling of the reference is detected as one and left as it is. When any alignment folded the
reference's LayerNorms (a pre-LN stream rotation, §3.3), every model is folded, so all of them are
merged in one parametrisation; folding is exact. Then the rule's N-ary form
(:mod:`raot_hf.merging.nary`) merges the reference and every B′ᵢ into the reference's module, and
a post-merge correction, when one runs, fits the merged layers to the weighted mix of all parents.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from raot_hf.errors import RaotError
from raot_hf.merging import merge_heads_n, merge_rule_spec, nary_merge_rules, rule_options
from raot_hf.merging.grams import aligned_grams, transposed_weights
from raot_hf.merging.siblings import refuse_moved_b
from raot_hf.outputs.card import alignment_summary
from raot_hf.results import Alignment
from raot_hf.stages.align import calibrate_solve_decide
from raot_hf.stages.apply import apply_and_check
from raot_hf.stages.calibrate import open_calibration
from raot_hf.stages.combine import _finite_gram_keys, correction_method, merge_trunks
from raot_hf.stages.context import PairContext
from raot_hf.stages.provenance import build_report, inputs_of
from raot_hf.stages.quality import merge_quality, parent_outputs, quality_inputs
from raot_hf.stages.refine import refine_and_check
from raot_hf.symmetry import fold_model, load_state, model_state, norm_affines

logger = logging.getLogger("raot_hf.stages.group")
_STAGE = {"stage": True}  # a line the CLI shows by default (raot_hf.cli.verbosity)


@dataclass
class Member:
    """One non-reference model after its alignment: its pair context (reference, model), what the
    gate decided and applied, the statistics RegMean reads, the calibration run, the checks, and
    the norm affines of both models when its calibration pass ran (RegMean's Grams, §6.2)."""

    ctx: PairContext
    alignment: Alignment
    stats: Any
    run: Any
    checks: list[dict]
    norms: tuple[dict, dict] | None


def group_weights(config, n: int) -> list[float]:
    """The per-model weights: ``group.weights`` (one per model) or equal weights."""
    weights = list(config.group.weights) or [1.0 / n] * n
    if len(weights) != n:
        raise RaotError(f"--weights gives {len(weights)} weights for {n} models; give one weight per model, in order")
    return weights


def check_group(config, n: int, distributed: bool = False) -> None:
    """Everything a merge of ``n`` ≥ 3 models refuses, checked before any weights are read."""
    spec = merge_rule_spec(config.merge_rule)
    if spec.nary is None:
        raise RaotError(
            f"merge_rule={config.merge_rule!r} merges two models only; for {n} models use one of: "
            f"{', '.join(nary_merge_rules())}"
        )
    group_weights(config, n)
    if config.group.densities and len(config.group.densities) != n:
        raise RaotError(f"--densities gives {len(config.group.densities)} values for {n} models; give one per model")
    if config.head == "b":
        raise RaotError(f"--head b names one of two models; with {n} models use --head a (the reference's) or average")
    if distributed:
        raise RaotError(f"a merge of {n} models runs in one process; run it without accelerate launch")


def align_member(ctx: PairContext, calibration, early, like=None) -> Member:
    """Align one model to the reference: the two-model pipeline up to B′ ≡ B (nothing merged);
    ``like``: an earlier member's calibration run, whose sample and tokens are reused."""
    norms = (norm_affines(ctx.model_a, ctx.schema), norm_affines(ctx.model_b, ctx.schema)) if ctx.plan.grams else None
    alignment, stats, run = calibrate_solve_decide(ctx, calibration, early, like)
    if ctx.base is not None:
        refuse_moved_b(alignment.decisions, ctx.config.merge_rule)
    if run is None and ctx.config.correction.method not in ("none", "auto"):
        run = open_calibration(ctx, calibration, early, like)
    checks = apply_and_check(ctx, alignment, run) + refine_and_check(ctx, alignment, run)
    return Member(ctx, alignment, stats if ctx.plan.grams else None, run, checks, norms)


def align_all(pairs: list[PairContext], calibration, early, like=None) -> list[Member]:
    """Align every model to the reference in turn, on one calibration sample read and tokenized
    once (``like``: a run that already opened it). Once an alignment has folded the reference's
    norms (§3.3), each later model is folded before its own pass (exact), so that its gate
    compares merges of one parametrisation."""
    members: list[Member] = []
    for i, ctx in enumerate(pairs, start=2):
        logger.info("aligning model %d of %d to the reference", i, len(pairs) + 1, extra=_STAGE)
        if any(m.ctx.unfolded_norms is not None for m in members):
            fold_model(ctx.model_b, ctx.schema, working_files=ctx.working_files)
        members.append(align_member(ctx, calibration, early, like))
        like = like or members[-1].run
    return members


def fold_all_if_any(members: list[Member]) -> bool:
    """When an alignment folded the reference's norms, fold every model that is not yet (exact);
    returns whether the models are now folded."""
    folded = any(m.ctx.unfolded_norms is not None for m in members)
    if folded:
        for m in members:
            if m.ctx.unfolded_norms is None:
                fold_model(m.ctx.model_b, m.ctx.schema, working_files=m.ctx.working_files)
    return folded


def _group_grams(members: list[Member], folded: bool) -> tuple[list[dict], dict[str, str], set[str]]:
    """Every model's Grams in the reference basis (the reference's from the first pass), the
    RegMean weights whose Grams are finite in all of them, and the weights stored (in, out)."""
    ref = members[0].ctx
    if any(m.stats is None or not m.stats.grams for m in members):
        raise RaotError(f"merge_rule={ref.config.merge_rule!r} needs calibration data for its Gram matrices")
    keys = members[0].stats.gram_keys
    transposed = transposed_weights(ref.model_a, keys)
    grams = []
    for i, m in enumerate(members):
        g_a, g_b = aligned_grams(
            m.stats, m.ctx.schema, m.alignment.applied, m.ctx.model_a, m.ctx.model_b,
            folded=folded, transposed=transposed, unfolded_norms=m.norms,
        )  # fmt: skip
        grams += [g_a, g_b] if i == 0 else [g_b]
    usable = dict(keys)
    for g in grams[1:]:
        usable = _finite_gram_keys(usable, grams[0], g)
    return grams, usable, transposed


def _group_fishers(members: list[Member], names: set[str]) -> list[dict]:
    from raot_hf.merging.fisher import diagonal_fisher

    ref = members[0]
    if ref.run is None:
        raise RaotError("merge_rule='fisher' needs calibration data; pass calibration=... (or --calibration)")

    def batches():
        for batch in ref.run.batches(ref.ctx.preprocessor):
            yield batch.inputs

    cfg = ref.ctx.config
    kw = dict(names=names, max_examples=cfg.fisher.samples, seed=cfg.seed)
    with ref.ctx.timer.stage("fisher"):
        return [diagonal_fisher(model, batches(), **kw) for model in group_models(members)]


def group_models(members: list[Member]) -> list[torch.nn.Module]:
    """The reference, then every aligned model, in order."""
    return [members[0].ctx.model_a, *(m.ctx.model_b for m in members)]


def group_rule_inputs(members: list[Member], spec, folded: bool, trunk: set[str]) -> dict[str, Any]:
    """What the N-ary rule reads besides the models and their weights."""
    inputs = rule_options(spec, members[0].ctx.config, len(members) + 1, names=trunk)
    if spec.needs_grams:
        grams, usable, transposed = _group_grams(members, folded)
        inputs.update(grams=grams, linear_weights=usable, transposed_weights=transposed)
    if spec.needs_fisher:
        inputs["fishers"] = _group_fishers(members, trunk)
    if spec.needs_base:
        inputs["base"] = members[0].ctx.base.state
    return inputs


def merge_group_weights(members: list[Member], folded: bool) -> dict[str, Any]:
    """Merge the reference and every aligned model into the reference's module; returns the rule's log."""
    ref = members[0].ctx
    cfg = ref.config
    spec = merge_rule_spec(cfg.merge_rule)
    models = group_models(members)
    weights = group_weights(cfg, len(models))
    moved = Alignment([d for m in members for d in m.alignment.decisions], members[0].alignment.applied, True)
    method, why = correction_method(ref, moved, spec, members[0].run)
    with ref.timer.stage("correction" if method != "none" else "merge"):
        states = [model_state(m) for m in models]
        head = sorted(ref.schema.head_params)
        trunks = [{k: v for k, v in s.items() if k not in head} for s in states]
        inputs = group_rule_inputs(members, spec, folded, set(trunks[0]))
        parents = {"a": ref.model_a, **{f"b{i}": m.ctx.model_b for i, m in enumerate(members, start=2)}}
        log = merge_trunks(ref, spec, trunks, {"weights": weights}, inputs, members[0].run, method, parents)
        if head and cfg.head == "average":
            load_state(ref.model_a, merge_heads_n(states, head, weights), working_files=ref.working_files)
    log.pop("params", None)
    log.setdefault("settings", {})["weights"] = weights
    if cfg.correction.method == "auto":
        log.setdefault("correction", {"method": "none"})["auto"] = why
    logger.info("%s merge of %d models: written into the reference", spec.name, len(models))
    return log


def group_quality(members: list[Member]) -> tuple[list, list]:
    """Each pair's check rows and its parents' outputs on them (before the merge writes into the reference)."""
    sets = [quality_inputs(m.ctx, m.run) for m in members]
    return sets, [parent_outputs(m.ctx, x) for m, x in zip(members, sets, strict=True)]


def merged_quality(members: list[Member], sets: list, parents: list) -> list[dict | None]:
    """The merged model against the reference and against each aligned model (one record per model)."""
    return [merge_quality(m.ctx, x, p) for m, x, p in zip(members, sets, parents, strict=True)]


# ----------------------------------------------------------------------------- the reference

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
    """The model whose representations agree most with all the others': mean linear CKA over
    layers and over the other models, on the first :data:`CENTRAL_EXAMPLES` calibration examples.
    Returns its index and the affinity matrix for the report."""
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


# ----------------------------------------------------------------------------- the report


def _member_record(index: int, m: Member, quality: dict | None) -> dict[str, Any]:
    a = m.alignment
    return {
        "model": index,
        "decisions": [d.to_dict() for d in a.decisions],
        "shares_basis": a.shares_basis,
        "verdict": a.verdict,
        "model_fidelity": a.model_fidelity,
        "summary": alignment_summary(a.decisions),
        "applied_transform": {
            "file": transform_file(index) if len(a.applied) else None,
            "transforms": [t.describe() for t in a.applied.transforms],
        },
        "applied_exact": a.exact,
        "checks": m.checks,
        "quality": quality,
        "calibration": m.run.fingerprint if m.run is not None else None,
    }


def transform_file(index: int) -> str:
    """The file of model ``index``'s alignment (model 2's keeps the two-model name)."""
    from raot_hf.symmetry.io import TRANSFORM_NAME

    return TRANSFORM_NAME if index == 2 else TRANSFORM_NAME.replace(".safetensors", f".model{index}.safetensors")


def group_report(members, sources, merge_log, quality, reference_log) -> dict[str, Any]:
    """The two-model report of (reference, model 2), with every model listed: its source, its
    alignment, gate decisions, verdict, B′ ≡ B checks and the merged model's agreement with it."""
    first = members[0]
    report = build_report(
        first.ctx, (sources[0], sources[1]), first.alignment,
        first.run.fingerprint if first.run is not None else None, first.checks, merge_log, quality[0],
    )  # fmt: skip
    records = [_member_record(i, m, q) for i, (m, q) in enumerate(zip(members, quality, strict=True), start=2)]
    inputs = report["inputs"]  # A's and B's entries are described (and their files hashed) once
    described = [inputs["a"], inputs["b"], *(inputs_of(s, m.ctx.model_b) for s, m in zip(sources[2:], members[1:]))]
    inputs["models"] = [
        {"model": i, "role": "reference" if i == 1 else "aligned", **info} for i, info in enumerate(described, start=1)
    ]
    report["models"] = records
    report["reference"] = reference_log or {"rule": "first", "chosen": 1}
    report["decisions"] = [{**d, "model": r["model"]} for r in records for d in r["decisions"]]
    report["checks"] = [{**c, "name": f"model {r['model']}: {c['name']}"} for r in records for c in r["checks"]]
    report["verdict"] = " ".join(f"Model {r['model']}: {r['verdict']}" for r in records if r["verdict"])
    report["summary"] = "; ".join(f"model {r['model']}: {r['summary']}" for r in records)
    report["shares_basis"] = all(r["shares_basis"] for r in records)
    report["applied_exact"] = all(r["applied_exact"] for r in records)
    report["applied_transform"] = {
        "files": [r["applied_transform"]["file"] for r in records if r["applied_transform"]["file"]]
    }
    return report


def two_model_config(config):
    """Per-model weights of a two-model merge as the two-model rules' options: α = w₂/(w₁ + w₂),
    and for task arithmetic (whose weights mergekit does not normalise) the task scale times
    w₁ + w₂, so ``base + λ·(w₁τ₁ + w₂τ₂)`` as with more models."""
    weights = group_weights(config, 2)
    total = sum(weights)
    changes: dict[str, Any] = {"alpha": weights[1] / total}
    if config.merge_rule == "task_arithmetic":
        changes["base_rules"] = {**config.base_rules.to_dict(), "task_scale": config.base_rules.task_scale * total}
    if config.group.densities:
        raise RaotError("--densities sets one density per model for three or more; with two use --density")
    return config.replace(**changes, group={**config.group.to_dict(), "weights": []})


def prepare_config(config, n: int, has_base: bool):
    """The config of a merge of ``n`` models, checked before any weights are read: at least two
    models; a base exactly when the rule reads one; the N-model refusals; two models' weights as α."""
    from raot_hf.distributed import DistributedContext
    from raot_hf.stages.load import check_base_matches_rule

    if n < 2:
        raise RaotError(f"give at least two models, got {n}")
    check_base_matches_rule(config, has_base)
    if n > 2:
        check_group(config, n, DistributedContext.detect().is_distributed)
        return config
    return two_model_config(config) if config.group.weights else config
