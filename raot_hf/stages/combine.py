"""Stage: merge A and B′ with the configured rule, dispatched through the merge-rule registry (docs/design.md §6).

A rule's registration (:class:`raot_hf.merging.MergeRuleSpec`) says what it reads besides A, B′
and α — Grams, Fishers, a base model, options from the config — and whether it is per-tensor;
this stage gathers exactly that. A per-tensor rule writes the trunk straight into A's parameters
a few tensors at a time, so no merged copy of the whole model is held.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from raot_hf.errors import RaotError
from raot_hf.io.loading import adopt_head
from raot_hf.merging import MergeRuleSpec, add_rule_log, apply_rule, merge_heads, merge_rule_spec, rule_options
from raot_hf.merging.grams import aligned_grams, transposed_weights
from raot_hf.results import Alignment
from raot_hf.stages.context import PairContext
from raot_hf.stages.correct import corrected_merge
from raot_hf.symmetry import load_state, model_state

logger = logging.getLogger("raot_hf.stages.combine")

#: A per-tensor rule is called on chunks of about this many bytes of A's trunk.
CHUNK_BYTES = 16 << 20


def _finite_gram_keys(gram_keys: dict[str, str], grams_a, grams_b) -> dict[str, str]:
    """The RegMean weights whose Grams are finite; the others merge linearly (with a warning)."""
    usable = {
        w: key
        for w, key in gram_keys.items()
        if bool(torch.isfinite(grams_a[key]).all()) and bool(torch.isfinite(grams_b[key]).all())
    }
    if len(usable) < len(gram_keys):
        logger.warning(
            "NaN/Inf in the calibration activations: %d of %d RegMean weights fall back to the linear merge",
            len(gram_keys) - len(usable),
            len(gram_keys),
        )
    return usable


def _fishers(ctx: PairContext, run, names: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Label-free diagonal Fishers of A and of B′ (measured after alignment, since a rotation
    does not map a diagonal Fisher onto a diagonal one) on the calibration set."""
    from raot_hf.merging.fisher import diagonal_fisher

    if run is None:
        raise RaotError("merge_rule='fisher' needs calibration data; pass calibration=... (or --calibration)")

    def batches():
        for batch in run.batches(ctx.preprocessor):
            yield batch.inputs

    with ctx.timer.stage("fisher"):
        kw = dict(names=names, max_examples=ctx.config.fisher.samples, seed=ctx.config.seed)
        return diagonal_fisher(ctx.model_a, batches(), **kw), diagonal_fisher(ctx.model_b, batches(), **kw)


def rule_inputs(ctx: PairContext, spec: MergeRuleSpec, alignment: Alignment, stats, run, trunk: set[str]) -> dict:
    """What ``spec`` declares it reads besides A, B′ and α."""
    cfg = ctx.config
    inputs = rule_options(spec, cfg, names=trunk)
    if spec.needs_grams:
        if stats is None or not stats.grams:
            raise RaotError(f"merge_rule={cfg.merge_rule!r} needs calibration data for its Gram matrices")
        transposed = transposed_weights(ctx.model_a, stats.gram_keys)
        grams_a, grams_b = aligned_grams(
            stats,
            ctx.schema,
            alignment.applied,
            ctx.model_a,
            ctx.model_b,
            transposed=transposed,
            unfolded_norms=ctx.unfolded_norms,
        )
        inputs.update(grams_a=grams_a, grams_b=grams_b, transposed_weights=transposed)
        inputs["linear_weights"] = _finite_gram_keys(stats.gram_keys, grams_a, grams_b)
    if spec.needs_fisher:
        inputs["fisher_a"], inputs["fisher_b"] = _fishers(ctx, run, trunk)
    if spec.needs_base:
        inputs["base"] = ctx.base.state
    return inputs


def _chunks(trunk: dict[str, torch.Tensor]):
    """The trunk's names in runs of about :data:`CHUNK_BYTES`."""
    chunk, size = [], 0
    for name, tensor in trunk.items():
        chunk.append(name)
        size += tensor.numel() * tensor.element_size()
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def merge_in_place(ctx: PairContext, spec: MergeRuleSpec, trunks: list[dict], weighting: dict, inputs: dict) -> dict:
    """Run a per-tensor rule chunk by chunk (``weighting``: see :func:`raot_hf.merging.apply_rule`),
    writing each result straight into the reference's parameters (float64 temporaries stay
    ~100 MB); returns the chunks' logs added up."""
    base = inputs.pop("base", None)
    log: dict[str, Any] = {"rule": spec.name, "settings": {}, "counts": {}}
    for chunk in _chunks(trunks[0]):
        if base is not None:
            inputs["base"] = {k: base[k] for k in chunk if k in base}
        part, part_log = apply_rule(spec, [{k: t[k] for k in chunk} for t in trunks], weighting, **inputs)
        load_state(ctx.model_a, part, working_files=ctx.working_files)
        add_rule_log(log, part_log)
        del part
        ctx.working_files.release_all()  # the chunk's offloaded pages of every model (§7.4)
    return log


def merge_trunks(
    ctx: PairContext, spec: MergeRuleSpec, trunks: list[dict], weighting: dict, inputs: dict, run, method: str,
    parents: dict,
) -> dict:  # fmt: skip
    """The rule's merge of the trunks (the reference's first), written into the reference's module:
    corrected layer by layer when ``method`` is not ``none`` (docs/design.md §6.7; ``parents``:
    side → model, ``"a"`` the reference), a few tensors at a time for a per-tensor rule, else
    whole. Returns the rule's log."""
    if method != "none":
        return corrected_merge(ctx, spec, trunks, weighting, inputs, run, method, parents)
    if spec.per_tensor:
        return merge_in_place(ctx, spec, trunks, weighting, inputs)
    merged, log = apply_rule(spec, trunks, weighting, **inputs)
    log.pop("params", None)
    load_state(ctx.model_a, merged, working_files=ctx.working_files)
    return log


def _merged_heads(ctx: PairContext, state_a: dict, state_b: dict, head: list[str]) -> dict[str, torch.Tensor]:
    """The classifier head by the head policy (``b``: A's module takes B′'s head and label config first)."""
    cfg, ca, cb = ctx.config, ctx.model_a.config, ctx.model_b.config
    if cfg.head == "b":
        adopt_head(ctx.model_a, ctx.model_b, head)
    return merge_heads(
        state_a,
        state_b,
        head,
        policy=cfg.head,
        num_labels_a=ca.num_labels,
        num_labels_b=cb.num_labels,
        id2label_a=getattr(ca, "id2label", None),
        id2label_b=getattr(cb, "id2label", None),
        alpha=cfg.alpha,
    )


def correction_method(ctx: PairContext, alignment: Alignment, spec: MergeRuleSpec, run) -> tuple[str, str]:
    """The post-merge correction this merge runs (docs/design.md §6.7), and why: ``auto`` is
    ``lsq`` when the gate moved B (the parents differ in basis) and there is calibration data,
    ``none`` when they share a basis (siblings keep the merge their rule defines) or the rule
    measures task vectors against a base."""
    requested = ctx.config.correction.method
    if requested != "auto":
        return requested, "requested"
    if spec.needs_base:
        return "none", "auto: a base-relative rule merges siblings; no correction"
    if run is None:
        return "none", "auto: no calibration data"
    if not any(d.applied for d in alignment.decisions):
        return "none", "auto: A and B share a basis (nothing applied); no correction"
    return "lsq", "auto: the gate moved B (the parents differ in basis)"


def merge_weights(ctx: PairContext, alignment: Alignment, stats, run) -> dict[str, Any]:
    """Merge A and B′ into A's module; returns the rule's log for the report."""
    cfg = ctx.config
    spec = merge_rule_spec(cfg.merge_rule)
    method, why = correction_method(ctx, alignment, spec, run)
    corrected = method != "none"
    with ctx.timer.stage("correction" if corrected else "merge"):
        state_a, state_b = model_state(ctx.model_a), model_state(ctx.model_b)
        head = sorted(ctx.schema.head_params)
        trunk_a = {k: v for k, v in state_a.items() if k not in head}
        trunk_b = {k: v for k, v in state_b.items() if k not in head}
        inputs = rule_inputs(ctx, spec, alignment, stats, run, set(trunk_a))
        parents = {"a": ctx.model_a, "b": ctx.model_b}
        log = merge_trunks(ctx, spec, [trunk_a, trunk_b], {"alpha": cfg.alpha}, inputs, run, method, parents)
        if head:
            load_state(ctx.model_a, _merged_heads(ctx, state_a, state_b, head), working_files=ctx.working_files)
    if cfg.correction.method == "auto":
        log.setdefault("correction", {"method": "none"})["auto"] = why
    counts = ", ".join(f"{n} {m}" for m, n in sorted(log["counts"].items()))
    logger.info("%s merge (alpha=%g): %s; written into A", spec.name, cfg.alpha, counts)
    return log
