"""Stage: decide, correct and apply in one sweep over the layers (docs/design.md §5.7).

After the solve, one pass over the layers does what the gate, the apply and the correction
stages otherwise do in three. At layer l:

1. A's and B's layer l run once on the gate's held-out examples (their own paths, §5.3);
2. the gate decides the layer's estimates, block-local at those calls, as in the gate stage;
3. B′'s layer l is built once, from the configuration that won, and written into B's module;
4. the rule merges A's layer with it; the correction fits the merged layer on the inputs that the
   corrected layers before it give, and competes with the rule's layer on the same held-out
   examples, whose parent outputs step 1 computed (B's mapped into A's basis);
5. the winner is written into A's module, and every path moves on.

The model-level check then compares the merge as written — corrected upstream — with the identity
merge. A veto (or nothing accepted) writes A's and B's original parameters, held since the start,
back into their modules, and the merge runs as for a pair that shares a basis.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from huggingface_hub.utils import tqdm

from raot_hf.correction import Carried, KeptParents
from raot_hf.correction.builtin import stored_in_out
from raot_hf.correction.carry import layer_calls
from raot_hf.estimators import estimator_spec
from raot_hf.gate import GateDecision
from raot_hf.gate.fidelity import (
    MergedModelRun,
    MergedParameters,
    gate_chunks,
    layer_module_names,
    worst_token_deviation,
)
from raot_hf.gate.lineage import detect_siblings
from raot_hf.gate.merge import (
    MIN_GATE_EXAMPLES,
    LayerGate,
    gate_eligible,
    gate_result,
    model_check,
    residual_candidate,
    transforms_by_decision,
)
from raot_hf.io.offload import release_mapped
from raot_hf.merging import MergeRuleSpec, RuleLog, apply_rule, merge_rule_spec
from raot_hf.outputs import Check
from raot_hf.results import Alignment
from raot_hf.stages.apply import check_inputs, equivalence_check
from raot_hf.stages.context import PairContext
from raot_hf.stages.correct import CorrectionPass, HeldoutPaths, ParameterStash, fit_chunks
from raot_hf.stages.decide import applied_transforms
from raot_hf.symmetry import (
    Transform,
    TransformSequence,
    is_exact,
    load_state,
    map_output_rows,
    model_state,
    norm_affines,
    output_map,
    storage_of,
)

logger = logging.getLogger("raot_hf.stages.sweep")


@dataclass
class PendingGate:
    """A model whose gate runs in the merge's sweep: its candidates, the estimators' logs, the
    alignment objective's decisions and the statistics (read only if the sweep cannot run)."""

    parts: list[Transform]
    logs: dict
    rows: list[GateDecision]
    stats: Any


def sweep_may_apply(ctx: PairContext) -> bool:
    """What of :func:`sweep_applies` the options and the models decide before any data is read: a
    per-tensor rule without a base, the merge gate on with a post-merge correction that competes,
    one process, and no step that reads B′ whole between the gate and the merge (the learned
    alignment, the refit towards the last stream)."""
    cfg = ctx.config
    gate, correction = cfg.gate, cfg.correction
    if not (gate.sweep and gate.enabled and gate.objective == "merge"):
        return False
    if cfg.alignment == "none" or not cfg.scope or not estimator_spec(cfg.alignment).gated:
        return False
    if ctx.dist.is_distributed or ctx.base is not None:
        return False
    spec = merge_rule_spec(cfg.merge_rule)
    if not spec.per_tensor or spec.needs_base or spec.needs_grams or spec.needs_fisher:
        return False
    return not (correction.method == "none" or not correction.compete or cfg.refit.reads_aligned or cfg.refine.steps)


def sweep_applies(ctx: PairContext, parts: list[Transform], rows: list[GateDecision], stats, run, alone: bool) -> bool:
    """Whether the one sweep serves this merge: two models (in memory or layer by layer) merged by a per-tensor rule
    without a base, the merge gate on with a post-merge correction that competes, data, and no
    step that reads B′ whole between the gate and the merge (the learned alignment, the refit).
    Fine-tuned siblings keep the identity without a sweep (§5.4)."""
    if not (alone and sweep_may_apply(ctx)) or stats is None or run is None:
        return False
    if ctx.config.gate.sibling_check and detect_siblings(parts).siblings:
        return False
    return any(gate_eligible(d) for d in rows)


def _heldout_paths(ctx: PairContext, chunks, rest: dict, stream, mix: dict) -> HeldoutPaths:
    """The correction's held-out paths over the gate's examples, chunk for chunk: M's layer calls
    (A's module with the merged trunk ``rest``) and the parents' states entering layer 0 (B's
    mapped into A's basis); the parents' layer outputs come from the gate's paths as the sweep
    reaches each layer."""
    model_a = ctx.model_a
    names = layer_module_names(model_a, ctx.schema)
    device = next(model_a.parameters()).device
    carried, tails = [], {}
    for c in chunks:
        calls, hidden = layer_calls(model_a, names, {k: v.to(device) for k, v in c.inputs.items()}, rest, tails)
        starts = {"a": c.a.start, "b": _mapped(c.b.start, stream), "m": hidden}
        carried.append(Carried(c.mask, {"m": calls[0]}, starts, {"m": calls}))
    return HeldoutPaths(carried, {"a": model_a, "b": ctx.model_b}, mix, ctx.config.correction.z)


def _mapped(x: torch.Tensor, stream: torch.Tensor | None) -> torch.Tensor:
    """B's stream states in A's basis (B′'s)."""
    return x if stream is None else x @ stream.to(x.device, x.dtype)


@dataclass
class SweepResult:
    """What the sweep decided and wrote: the alignment, the B′ ≡ B check, and the rule's log with
    the correction's record (None: too few gate examples — nothing was written, the stages run)."""

    alignment: Alignment
    checks: list[Check]
    log: RuleLog
    vetoed: bool


@torch.no_grad()
def sweep_merge(
    ctx: PairContext, pending: PendingGate, run, spec: MergeRuleSpec, weights: list[float], inputs: dict, method: str
) -> SweepResult | None:
    """Gate, apply and correct layer by layer (see the module docstring); ``method``: the correction
    to run while the gate may still move B (``auto`` runs ``lsq``). Writes the merged trunk into A's
    module and B′ into B's; returns None, having written nothing, when the gate set is too small."""
    cfg = ctx.config
    model_a, model_b, schema = ctx.model_a, ctx.model_b, ctx.schema
    names = layer_module_names(model_a, schema)
    rows = {(d.transform, d.layer): d for d in pending.rows}
    residual = residual_candidate(pending.parts, rows)
    alpha = weights[1] / sum(weights)
    store = run.kept.store if run.kept is not None and run.kept.store.usable else None
    heldout = run.batches(ctx.preprocessor, split="heldout")
    chunks = gate_chunks(model_a, model_b, names, heldout, cfg.gate.examples, kept=store)
    if store is not None and not _gate_kept(chunks, len(names)):  # the pass kept another gate set: run the parents
        store = _drop(run, "the gate's examples are not those the calibration kept")
        chunks = gate_chunks(model_a, model_b, names, run.batches(ctx.preprocessor, split="heldout"), cfg.gate.examples)
    if sum(int(c.mask.shape[0]) for c in chunks) < MIN_GATE_EXAMPLES:
        _drop(run)
        return None
    merged = MergedParameters(model_a, model_b, schema, names, residual, alpha)
    gate = LayerGate(model_a, names, merged, chunks, alpha, cfg.gate.z, cfg.gate.min_gain)
    identity = MergedModelRun(model_a, names, merged, chunks, aligned=False)
    check_rows, check_reference = check_inputs(ctx, run)  # B's outputs, before B changes
    if merged.fold:  # both parents fold (§3.3): record what the fold removes
        ctx.unfolded_norms = (norm_affines(model_a, schema), norm_affines(model_b, schema))
    files = ctx.working_files
    originals = {"a": model_state(model_a), "b": model_state(model_b)}
    keep = storage_of(t for state in originals.values() for t in state.values())  # copied, never taken
    parents = {"a": model_a, "b": model_b}
    # A's and B's own parameters, held as each is first written over, for a veto to write back:
    # references in memory (the models take new tensors), a file for offloaded models (in place)
    stashes = {side: ParameterStash(len(files) > 0, "raot-sweep-") for side in parents}

    def write(side: str, state: dict) -> None:
        stashes[side].hold({k: originals[side][k] for k in state})
        load_state(parents[side], state, working_files=files, keep=keep)

    in_layer = tuple(n + "." for n in names)
    own_outside = [{k: v for k, v in originals[s].items() if not k.startswith(in_layer)} for s in "ab"]

    def outside_layers() -> tuple[dict, dict]:
        """A's (folded) and B′'s embeddings, final norm and head, made from the parents' own (which
        nothing writes before the last layer): the same bits whenever they are made."""
        return merged.mapped(*own_outside)

    outside_a, outside_b = outside_layers()
    # B′'s embeddings, final norm and head (and A's, folded) are written after the last layer: a
    # parent path's layer calls may hold a non-layer parameter itself (DeBERTa's relative
    # embeddings), which must read the parent's own until then; the fit examples compute with them
    outside = {"b": outside_b, **({"a": outside_a} if merged.fold else {})}
    head = set(schema.head_params)
    trunk = [k for k in outside_a if k not in head]
    rest, log = apply_rule(spec, [{k: s[k] for k in trunk} for s in (outside_a, outside_b)], weights, **inputs)
    mix = {"a": 1 - alpha, "b": alpha}
    held = _heldout_paths(ctx, chunks, rest, gate.stream, mix)
    fit = fit_chunks(ctx, run, parents, rest, outside, parents_run=store is None)
    if store is not None and not _fit_kept(store, fit, run.kept.plan):  # another fit set: run the parents
        store = _drop(run, "the correction's examples are not those the calibration kept")
        fit = fit_chunks(ctx, run, parents, rest, outside)
    kept_bytes = 0 if store is None else store.nbytes
    correction = CorrectionPass(ctx, method, parents, mix, fit, held)
    # not held through the layers: made again after the last one (a mapped embedding table each)
    del outside_a, outside_b, outside
    # the parents' own non-layer parameters are read again only after the last layer: a loaded
    # checkpoint's pages go back to its file until then (the embeddings: a fifth of BERT-base)
    release_mapped(t for own in own_outside for t in own.values())
    # the merged trunk, read again only after the last layer: layer by layer, on disk until then (§7.4)
    rest = files.park(rest, "merged-trunk")
    per_layer = transforms_by_decision(pending.parts)
    decided: dict[tuple, GateDecision] = {}
    worst: list[float] = []
    for i in tqdm(range(len(names)), desc=f"sweep ({method})", disable=not ctx.dist.is_main):
        outs = {"a": [c.a.at(i).output for c in chunks], "b": [_mapped(c.b.at(i).output, gate.stream) for c in chunks]}
        layer_decisions, chosen, estimates = gate.decide_at(i, rows, per_layer)
        decided.update(layer_decisions)
        identity.advance(merged.merged(i, aligned=False))
        merged.forget()  # the layer's scored parameters are not read again
        taken = {id(t) for t in chosen}
        layer_a, layer_b = merged.written(i, [t for t in pending.parts if t is residual or id(t) in taken])
        if merged.fold:
            write("a", layer_a)
        write("b", layer_b)  # B′'s layer, built once
        rule, part = apply_rule(spec, [layer_a, layer_b], weights, **inputs)
        # B′'s layer lives in B's module now (an offloaded one: in its working file), A's in A's
        del layer_a, layer_b
        log.add(part)
        kept = None
        if store is not None:  # the parents' outputs on the fit examples, from the calibration pass
            on_b = [t for t in pending.parts if t is residual or id(t) in taken]
            kept = _kept_parents(ctx, store, fit, i, on_b, merged.scoring, gate.stream)
        write("a", correction.layer(i, rule, outs, kept))
        worst.append(_worst_token(held, outs, alpha))
        for c in chunks:
            c.advance()
        for t in estimates:
            t.forget()  # the layer's actions are not asked for again: made again if they are
        files.release_all()  # the layer's offloaded pages, read and written (§7.4)
    outside_a, outside_b = outside_layers()
    for side, state in {"b": outside_b, **({"a": outside_a} if merged.fold else {})}.items():
        write(side, state)  # the final readers' refit reads B′'s final norm
    del outside_a, outside_b
    rest, record = correction.finish(rest, keep)
    check = model_check(held.written_scores(), identity.scores(alpha), worst, z=cfg.gate.z, floor=cfg.gate.min_gain)
    moved = residual is not None or any(d.applied for d in decided.values())
    passed = moved and check.applied
    gate_decided = gate_result(rows, decided, check, passed, residual is not None, worst)
    if cfg.gate.sibling_check:
        gate_decided.model_fidelity["siblings"] = detect_siblings(pending.parts).to_dict()
    if not passed:  # the identity stands: A and B as they were
        for side, stash in stashes.items():
            stash.restore(parents[side], files, keep)
        ctx.unfolded_norms = None
        applied = TransformSequence([])
    else:
        write("a", rest)
        # where the parents' outputs came from: the calibration pass (each parent layer once per
        # token over the merge), or their layers run again (docs/design.md §5.7)
        record["parent_outputs"] = "calibration pass" if kept_bytes else "parents run again"
        if kept_bytes:
            record["kept_bytes"] = kept_bytes
        log.correction = record
        applied = applied_transforms(pending.parts, gate_decided.decisions)
    for stash in stashes.values():
        stash.drop()
    _drop(run)
    files.release_all()
    alignment = Alignment(gate_decided.decisions, applied, is_exact(applied, schema), pending.logs,
                          gate_decided.verdict, gate_decided.model_fidelity)  # fmt: skip
    logger.info("merge gate (one sweep): %s", alignment.verdict)
    checks = [equivalence_check(ctx, alignment, check_rows, check_reference)]
    return SweepResult(alignment, checks, log, vetoed=not passed)


#: The corrections whose parents' outputs the calibration pass keeps: every site they read is a
#: Linear of the layer (custom corrections may read others, and run the parents' layers).
KEPT_CORRECTIONS = ("auto", "lsq", "repair")


def keeps_parents(ctx: PairContext) -> bool:
    """Whether the calibration pass keeps the parents' outputs for the one sweep (docs/design.md §5.7)."""
    # the kept outputs are a dense layer's Linears, mapped by the action on their output axis: a
    # mixture of experts' sites (the router, the fused experts) and a writer that a LayerScale folds
    # into (§9.8: its outputs scaled by λ) are read from a run of the parents instead
    schema = ctx.schema
    kept = not schema.expert_layers and not any(fold.writers for fold in schema.folds)
    return kept and sweep_may_apply(ctx) and ctx.config.correction.method in KEPT_CORRECTIONS


def _drop(run, why: str | None = None) -> None:
    """Free what the calibration pass kept for the sweep (``why``: logged, the sweep runs the
    parents instead; None: it has read them); returns None."""
    if run.kept is not None:
        run.kept.store.drop(why) if why is not None else run.kept.store.close()
        run.kept = None


def _gate_kept(chunks, layers: int) -> bool:
    """Whether the pass kept every gate chunk's parent outputs, each shaped as the chunk's states."""
    try:
        for c in chunks:
            for path in (c.a, c.b):
                if path.kept is None or tuple(path.kept(0).shape) != tuple(path.start.shape):
                    return False
                path.kept(layers - 1)
    except KeyError:
        return False
    return True


def _fit_kept(store, chunks, plan) -> bool:
    """Whether the pass kept the parents' outputs on exactly the correction's fit tokens."""
    tokens = sum(int(c.mask.sum()) for c in chunks)
    for side in ("a", "b"):
        if not store.has(("final", side)):
            return False
        if sum(p.shape[0] for p in store.index[("final", side)]) != tokens:
            return False
        for i, sites in enumerate(plan.sites):
            if not all(store.has(("site", side, i, n)) or not _per_token_site(store, i, n) for n in sites):
                return False
    return True


def _per_token_site(store, layer: int, name: str) -> bool:
    """A site missing from the store for one parent only is missing by accident (not one row per position)."""
    return store.has(("site", "a", layer, name)) or store.has(("site", "b", layer, name))


def _kept_parents(ctx, store, chunks, i: int, on_b: list[Transform], precision, stream) -> KeptParents:
    """Layer ``i``'s parents' outputs on the fit chunks, read from ``store``: A's as kept, B's mapped
    into B′'s basis (``on_b``: the residual candidate and the layer's accepted transforms; every
    Linear's outputs move by the action on its output axis, :func:`raot_hf.symmetry.output_map`),
    the last layer's states by the stream map ``stream``."""
    schema, model_a = ctx.schema, ctx.model_a
    name = layer_module_names(model_a, schema)[i]
    last = i == schema.num_layers - 1
    actions = dict(TransformSequence(list(on_b)).space_actions(schema)) if on_b else {}
    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + int(c.mask.sum()))
    maps: dict[str, list] = {}

    def rows(side: str, chunk: int, site: str):
        key = ("site", side, i, site)
        if not store.has(key):
            return None
        y = store.rows(key, offsets[chunk], offsets[chunk + 1])
        if side != "b" or not actions:
            return y
        if site not in maps:
            full = f"{name}.{site}"
            maps[site] = output_map(schema, actions, f"{full}.weight", 1 if stored_in_out(model_a, full) else 0)
        return map_output_rows(y, maps[site], precision)

    def states(side: str, chunk: int):
        if not last:
            return None
        y = store.rows(("final", side), offsets[chunk], offsets[chunk + 1])
        if side == "b":
            y = _mapped(y, stream)
        mask = chunks[chunk].mask
        out = y.new_zeros(*mask.shape, y.shape[-1])
        out[mask.to(out.device)] = y
        return out

    return KeptParents(rows, states)


def _worst_token(held: HeldoutPaths, outs: dict, alpha: float) -> float:
    """The written merge's worst-token deviation from the parents' mix at the layer just run."""
    worst = 0.0
    for c, a, b in zip(held.chunks, outs["a"], outs["b"], strict=True):
        ref = torch.lerp(a.to(torch.float64), b.to(torch.float64), alpha)
        worst = max(worst, float(worst_token_deviation(c.hidden["m"], ref, c.mask).max()))
    return worst
