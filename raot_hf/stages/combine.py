"""Stage: merge the reference and every aligned model with the configured rule, dispatched through
the merge-rule registry (docs/design.md §6, §6.9): two models are the case N = 2.

This stage gathers what the rule's :class:`raot_hf.merging.MergeRuleSpec` says it reads (Grams,
Fishers, a base, options); a per-tensor rule writes the trunk into A's parameters a few tensors at
a time, so no merged copy of the whole model is held.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from raot_hf.errors import RaotError
from raot_hf.io.loading import adopt_head
from raot_hf.merging import MergeRuleSpec, RuleLog, apply_rule, merge_heads, merge_rule_spec, rule_options
from raot_hf.merging.grams import aligned_grams, transposed_weights
from raot_hf.stages.apply import apply_and_check
from raot_hf.stages.context import PairContext
from raot_hf.stages.correct import corrected_merge
from raot_hf.stages.decide import decide
from raot_hf.stages.members import AlignedModel, member_models, model_weights
from raot_hf.stages.sweep import sweep_merge
from raot_hf.symmetry import load_state, model_state, storage_of

logger = logging.getLogger("raot_hf.stages.combine")

#: A per-tensor rule is called on chunks of about this many bytes of A's trunk.
CHUNK_BYTES = 16 << 20


def _finite_gram_keys(gram_keys: dict[str, str], grams: list[dict]) -> dict[str, str]:
    """The RegMean weights whose Grams are finite in every model; the others merge linearly (with a warning)."""
    finite = {key for key in set(gram_keys.values()) if all(bool(torch.isfinite(g[key]).all()) for g in grams)}
    usable = {w: key for w, key in gram_keys.items() if key in finite}
    if len(usable) < len(gram_keys):
        message = "NaN/Inf in the calibration activations: %d of %d RegMean weights fall back to the linear merge"
        logger.warning(message, len(gram_keys) - len(usable), len(gram_keys))
    return usable


def _grams(members: list[AlignedModel], folded: bool) -> tuple[list[dict], dict[str, str], set[str]]:
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
    return grams, _finite_gram_keys(keys, grams), transposed


def _fishers(members: list[AlignedModel], names: set[str]) -> list[dict]:
    """Label-free diagonal Fishers of every model (measured after alignment, since a rotation does
    not map a diagonal Fisher onto a diagonal one) on the calibration set."""
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
        return [diagonal_fisher(model, batches(), **kw) for model in member_models(members)]


def rule_inputs(members: list[AlignedModel], spec: MergeRuleSpec, folded: bool, trunk: set[str]) -> dict[str, Any]:
    """What the rule reads besides the models and their weights."""
    inputs = rule_options(spec, members[0].ctx.config, len(members) + 1, names=trunk)
    if spec.needs_grams:
        grams, usable, transposed = _grams(members, folded)
        inputs.update(grams=grams, linear_weights=usable, transposed_weights=transposed)
    if spec.needs_fisher:
        inputs["fishers"] = _fishers(members, trunk)
    if spec.needs_base:
        inputs["base"] = members[0].ctx.base.state
    return inputs


def chunks_of(sizes: dict[str, int]) -> list[list[str]]:
    """The names of ``sizes`` (name → bytes) in runs of about :data:`CHUNK_BYTES`."""
    chunks, chunk, size = [], [], 0
    for name, nbytes in sizes.items():
        chunk.append(name)
        size += nbytes
        if size >= CHUNK_BYTES:
            chunks.append(chunk)
            chunk, size = [], 0
    return [*chunks, chunk] if chunk else chunks


def merge_by_chunks(spec: MergeRuleSpec, chunks, read, write) -> RuleLog:
    """Run a per-tensor rule a chunk of names at a time, so float64 temporaries stay ~100 MB.
    ``chunks`` yields ``(names, weights, inputs)``: the names, one weight per model and the rule's
    keywords for them (``inputs["base"]`` may be any mapping, read after ``read``); ``read(names)``
    gives every model's tensors of the chunk (the reference's first), ``write(merged)`` stores the
    merged ones (into the reference's parameters, or output shards when streamed, §7.3). Returns
    the chunks' logs added up."""
    log = RuleLog(spec.name)
    for names, weights, inputs in chunks:
        states = read(names)
        inputs = dict(inputs)
        if inputs.get("base") is not None:
            base = inputs["base"]
            inputs["base"] = {k: base[k] for k in names if k in base}
        part, part_log = apply_rule(spec, states, weights, **inputs)
        write(part)
        log.add(part_log)
        del part
    return log


def merge_trunks(
    ctx: PairContext, spec: MergeRuleSpec, trunks: list[dict], weights: list, inputs: dict, run, method: str,
    parents: dict,
) -> RuleLog:  # fmt: skip
    """The rule's merge of the trunks (the reference's first) written into the reference's module, and
    its log: corrected layer by layer unless ``method`` is ``none`` (§6.7; ``parents``: side → model,
    ``"a"`` the reference), a few tensors at a time for a per-tensor rule, else whole."""
    if method != "none":
        return corrected_merge(ctx, spec, trunks, weights, inputs, run, method, parents)
    if spec.per_tensor:  # into the reference's parameters a chunk at a time
        keep = storage_of(t for trunk in trunks for t in trunk.values())  # copied, never taken

        def write(part: dict) -> None:
            load_state(ctx.model_a, part, working_files=ctx.working_files, keep=keep)
            ctx.working_files.release_all()  # the chunk's offloaded pages of every model (§7.4)

        sizes = {name: t.numel() * t.element_size() for name, t in trunks[0].items()}
        read = lambda names: [{k: t.pop(k) for k in names} for t in trunks]  # noqa: E731  (each read once)
        return merge_by_chunks(spec, ((names, weights, inputs) for names in chunks_of(sizes)), read, write)
    merged, log = apply_rule(spec, trunks, weights, **inputs)
    load_state(
        ctx.model_a, merged, working_files=ctx.working_files, keep=storage_of(t for tr in trunks for t in tr.values())
    )
    return log


def merged_heads(members: list[AlignedModel], states: list[dict], head: list[str], weights: list[float]) -> dict:
    """The classifier head by the head policy (:func:`raot_hf.merging.merge_heads`): the reference's,
    the weighted average, or (two models) B′'s, for which A's module takes B′'s head and label config first."""
    ref = members[0].ctx
    if ref.config.head == "b":
        adopt_head(ref.model_a, ref.model_b, head)
    labels = [(m.config.num_labels, getattr(m.config, "id2label", None)) for m in member_models(members)]
    return merge_heads(states, head, weights, policy=ref.config.head, labels=labels)


def correction_method(ctx: PairContext, moved: bool, spec: MergeRuleSpec, run) -> tuple[str, str]:
    """The post-merge correction this merge runs (docs/design.md §6.7), and why: ``auto`` is ``lsq``
    when the gate moved a model (``moved``) and there is calibration data, ``none`` when they share a
    basis (siblings keep their rule's merge) or the rule measures task vectors against a base."""
    requested = ctx.config.correction.method
    if requested != "auto":
        return requested, "requested"
    if spec.needs_base:
        return "none", "auto: a base-relative rule merges siblings; no correction"
    if run is None:
        return "none", "auto: no calibration data"
    if not moved:
        return "none", "auto: A and B share a basis (nothing applied); no correction"
    return "lsq", "auto: the gate moved B (the parents differ in basis)"


def _swept(members: list[AlignedModel], spec: MergeRuleSpec, weights: list[float]) -> RuleLog | None:
    """The one sweep (docs/design.md §5.7) of a model whose gate waited for it: the member gets its
    alignment and checks; returns the rule's log of the merge it wrote, or None when the merge is
    still to be written (the gate vetoed, or too few gate examples: then the gate and apply ran
    as stages, and nothing of the sweep was written)."""
    member = members[0]
    ctx, pending = member.ctx, member.pending
    requested = ctx.config.correction.method
    with ctx.timer.stage("sweep"):
        trunk = set(model_state(ctx.model_a)) - set(ctx.schema.head_params)
        inputs = rule_options(spec, ctx.config, 2, names=trunk)
        method = "lsq" if requested == "auto" else requested  # while the gate may still move B
        swept = sweep_merge(ctx, pending, member.run, spec, weights, inputs, method)
    if swept is None:
        alignment = decide(ctx, pending.parts, pending.logs, pending.stats, member.run)
        checks = apply_and_check(ctx, alignment, member.run)
    else:
        alignment, checks = swept.alignment, swept.checks
    members[0] = dataclasses.replace(member, alignment=alignment, checks=checks, pending=None)
    if swept is None or swept.vetoed:
        return None
    if requested == "auto":
        swept.log.correction["auto"] = "auto: the gate moved B (the parents differ in basis)"
    return swept.log


def merge_weights(members: list[AlignedModel], folded: bool) -> RuleLog:
    """Merge the reference and every aligned model into the reference's module; returns the rule's log."""
    ref = members[0].ctx
    cfg = ref.config
    spec = merge_rule_spec(cfg.merge_rule)
    models = member_models(members)
    weights = model_weights(cfg, len(models))
    if members[0].pending is not None:
        log = _swept(members, spec, weights)
        if log is not None:
            with ref.timer.stage("sweep"):
                _write_heads(members, weights)
            return _logged(members, log, spec, weights)
    moved = any(d.applied for m in members for d in m.alignment.decisions)
    method, why = correction_method(ref, moved, spec, members[0].run)
    with ref.timer.stage("correction" if method != "none" else "merge"):
        states = [model_state(m) for m in models]
        head = sorted(ref.schema.head_params)
        trunks = [{k: v for k, v in s.items() if k not in head} for s in states]
        del states  # the trunks' tensors are let go as merged; the heads are read again
        inputs = rule_inputs(members, spec, folded, set(trunks[0]))
        sides = ["b"] if len(members) == 1 else [f"b{i}" for i in range(2, len(models) + 1)]
        parents = {"a": ref.model_a, **{side: m.ctx.model_b for side, m in zip(sides, members, strict=True)}}
        log = merge_trunks(ref, spec, trunks, weights, inputs, members[0].run, method, parents)
        _write_heads(members, weights)
    if cfg.correction.method == "auto":
        if log.correction is None:
            log.correction = {"method": "none"}
        log.correction["auto"] = why
    return _logged(members, log, spec, weights)


def _write_heads(members: list[AlignedModel], weights: list[float]) -> None:
    """The classifier heads merged by the head policy into the reference's module."""
    ref = members[0].ctx
    head = sorted(ref.schema.head_params)
    if head:
        states = [
            {k: v for k, v in model_state(m).items() if k in ref.schema.head_params} for m in member_models(members)
        ]
        load_state(ref.model_a, merged_heads(members, states, head, weights), working_files=ref.working_files)


def _logged(members: list[AlignedModel], log: RuleLog, spec: MergeRuleSpec, weights: list[float]) -> RuleLog:
    cfg = members[0].ctx.config
    models = member_models(members)
    if len(models) > 2:
        log.settings["weights"] = weights
    if len(models) == 2:
        counts = ", ".join(f"{n} {m}" for m, n in sorted(log.counts.items()))
        logger.info("%s merge (alpha=%g): %s; written into A", spec.name, cfg.alpha, counts)
    else:
        logger.info("%s merge of %d models: written into the reference", spec.name, len(models))
    return log
