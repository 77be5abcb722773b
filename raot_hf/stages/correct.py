"""Stage: merge with a post-merge correction, layer by layer (docs/design.md §6.7).

Called by the combine stage in place of writing the rule's merge at once when
``correction.method`` is not ``none``: the rule merges the non-layer trunk and each layer as
before, and each merged layer is corrected on the carried states of A, B′ and M before it is
written into A's module (A's own layer serves A's forward until then, so no copy of A is made).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.utils import tqdm
from safetensors.torch import load_file, save_file
from torch.func import functional_call

from raot_hf.adapters.schema import ModelSchema
from raot_hf.correction import CorrectionRequest, KeptParents, LayerPass, Site, capture, get_correction, linear_out
from raot_hf.correction.builtin import stored_in_out
from raot_hf.errors import RaotError
from raot_hf.gate import PairedTest, paired_test
from raot_hf.gate.fidelity import layer_module_names, relative_squared_error
from raot_hf.gate.merge import MIN_GATE_EXAMPLES
from raot_hf.merging import MergeRuleSpec, RuleLog, apply_rule
from raot_hf.stages.context import PairContext
from raot_hf.symmetry import load_state, storage_of

logger = logging.getLogger("raot_hf.stages.correct")


def target_mix(weights: list[float]) -> list[float]:
    """Each model's weight in the target of a post-merge step (the correction §6.7, the refit §6.11):
    the per-model weights normalised to sum 1 ((1 − α, α) for two models)."""
    total = sum(weights)
    return [w / total for w in weights]


def final_readers(parents: dict, schema: ModelSchema, rest: dict):
    """The trunk Linears that read the final norm's output (an untied causal-LM head: the head
    policy's classifiers and tied heads are left alone), with that norm: ``(({side: norm module},
    merged norm parameters), [(site, {side: (weight, bias)})])`` over the parents (side → model),
    or None."""
    params = {side: dict(model.named_parameters()) for side, model in parents.items()}
    for fold in schema.folds:
        readers = [(w, b) for w, b in fold.readers if w in rest]
        if not readers or fold.norm_weight not in rest:  # layers' norms are not in the non-layer trunk
            continue
        module = fold.norm_weight[: -len(".weight")]
        norm_params = {k[len(module) + 1 :]: v for k, v in rest.items() if k.startswith(module + ".")}
        sites = []
        for w, b in readers:
            reader = w[: -len(".weight")]
            site = Site(reader, w, b, stored_in_out(parents["a"], reader))
            sites.append((site, {side: (p[w], p[b] if b else None) for side, p in params.items()}))
        return ({side: m.get_submodule(module) for side, m in parents.items()}, norm_params), sites
    return None


def same_parameters(rule: dict, corrected: dict) -> bool:
    """Whether a correction returned the rule's merged tensors themselves (it refitted nothing):
    M's layer then computes with them exactly what it computes with the rule's, so a run of it is
    not repeated."""
    return rule.keys() == corrected.keys() and all(corrected[k] is v for k, v in rule.items())


def _rule(spec: MergeRuleSpec, inputs: dict, trunks: list[dict], merged_all: dict | None, weights: list):
    """The rule's merge of a subset of the trunk: per tensor (:func:`raot_hf.merging.apply_rule`),
    or sliced from a whole-trunk merge."""

    def merge(keys: list[str]) -> tuple[dict, RuleLog]:
        if merged_all is not None:  # logged once, by the whole-trunk merge
            return {k: merged_all[k] for k in keys}, RuleLog(spec.name)
        kw = dict(inputs)
        if "base" in kw:
            kw["base"] = {k: kw["base"][k] for k in keys if k in kw["base"]}
        # read once: the trunks let go of each tensor once merged, so that a parameter the merge
        # replaces (load_state takes the merged tensor) no longer holds its old memory
        return apply_rule(spec, [{k: t.pop(k) for k in keys} for t in trunks], weights, **kw)

    return merge


@torch.no_grad()
def corrected_merge(
    ctx: PairContext, spec: MergeRuleSpec, trunks: list[dict], weights: list, inputs: dict, run, method: str,
    parents: dict,
) -> RuleLog:  # fmt: skip
    """The rule's merge of ``trunks`` (``weights``: one per model, :func:`raot_hf.merging.apply_rule`),
    corrected layer by layer (``method``: a registered correction, e.g. ``lsq`` or ``repair``) to
    the mix of ``parents`` (side → model, ``"a"`` the reference, in the trunks' order) and written
    into the reference's module; returns the rule's log (summed over the calls) with the
    correction's record in its ``correction``."""
    log = RuleLog(spec.name)
    merged_all = None
    if not spec.per_tensor:  # RegMean, Fisher: the whole trunk at once (as without correction)
        merged_all, rule_log = apply_rule(spec, trunks, weights, **inputs)
        log.add(rule_log)
    merge = _rule(spec, inputs, trunks, merged_all, weights)
    mix = dict(zip(parents, target_mix(weights), strict=True))  # each parent's weight in the target
    return _corrected(ctx, parents, mix, merge, list(trunks[0]), run, method, log)


class HeldoutPaths:
    """The merge with and without each layer's correction, carried over held-out examples
    (docs/design.md §6.7, "the correction competes"): the parents run their own layers, and two
    merged models run A's modules with merged parameters — the *written* path (each layer as
    decided so far) and the *rule* path (the rule's merge everywhere, what the merge would be
    without any correction), both from the merged trunk's states.

    At each layer the corrected layer competes with the rule's own on the written path's states:
    per held-out example, the fidelity of the layer's output to the parents' mix is
    ``1 − Σ_p w_p·RSE(out, y_p)`` (the gate's relative squared error, §5.3, relative to what the
    parents computed since layer 0's input), and the correction is kept iff its gains pass the
    gate's paired test (z standard errors, or the sign test). The identity — the rule's merge —
    wins ties."""

    def __init__(self, chunks: list, parents: dict, mix: dict, z: float):
        self.chunks = chunks
        self.mix, self.z, self.parents = mix, z, parents
        self.starts = [{side: c.hidden[side] for side in parents} for c in self.chunks]
        # the rule's merge, never corrected; None while every layer so far kept the rule's merge,
        # so that the rule path is the written path (its states are then the written ones)
        self.rule_states: list[torch.Tensor] | None = None

    def fidelity(self, outs: list[torch.Tensor], targets: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        """Per held-out example, 1 − Σ_p w_p·RSE of ``outs`` to the parents' outputs ``targets``."""
        scores = []
        for i, (c, out) in enumerate(zip(self.chunks, outs, strict=True)):
            err = sum(
                w * relative_squared_error(out, targets[side][i], c.mask, self.starts[i][side])
                for side, w in self.mix.items()
            )
            scores.append(1 - err)
        return torch.cat(scores).cpu()

    @classmethod
    def captured(cls, parents: dict, names: list[str], batches, rest: dict, examples: int, mix: dict, z: float):
        """The paths over the first ``examples`` rows of ``batches``, every parent running its own layers."""
        return cls(capture(parents, names, batches, rest, examples), parents, mix, z)

    def decide(
        self, name: str, rule: dict, corrected: dict, parent_outs: dict | None = None
    ) -> tuple[bool, dict, PairedTest]:
        """Layer ``name``: whether its correction is kept; moves every path on to the next layer.
        ``parent_outs``: the parents' outputs of the layer on the chunks (side → one per chunk),
        when another pass computed them already (the one sweep, §5.7); else the parents run here."""
        layer = LayerPass(self.chunks, name, {side: m.get_submodule(name) for side, m in self.parents.items()})
        if parent_outs is None:
            layer.parents([], lambda *_: None)
        else:
            layer.outs = parent_outs
        out_rule = layer.merged(rule, [], lambda *_: None)
        score_rule = self.fidelity(out_rule, layer.outs)
        out_corrected, score = out_rule, score_rule  # nothing refitted: the corrected layer computes the rule's
        if not same_parameters(rule, corrected):
            out_corrected = layer.merged(corrected, [], lambda *_: None)
            score = self.fidelity(out_corrected, layer.outs)
        test = paired_test(score - score_rule, z=self.z, sign_test=True)
        if self.rule_states is not None:  # the rule path has left the written one: its own layer run
            rel = {k[len(name) + 1 :]: v for k, v in rule.items()}
            self.rule_states = [
                c.calls["m"](layer.module_a, state, rel) for c, state in zip(self.chunks, self.rule_states, strict=True)
            ]
        elif test.passed:  # the written path leaves the rule's here; the rule's output is the one just run
            self.rule_states = out_rule
        layer.advance(out_corrected if test.passed else out_rule)
        return test.passed, (corrected if test.passed else rule), test

    def decide_readers(self, norms: tuple, rule: dict, corrected: dict, sites: list) -> tuple[bool, PairedTest]:
        """The final readers' refit (an untied LM head) against the rule's readers: their outputs
        on the written path's final states through M's final norm, per held-out example, against
        each parent's readers on its own final states."""
        modules, norm_params = norms
        scores = {"rule": [], "corrected": []}
        for c in self.chunks:
            xm = functional_call(modules["a"], norm_params, (c.hidden["m"],)).double()
            x_parent = {side: modules[side](c.hidden[side]).double() for side in self.mix}
            for name, params in (("rule", rule), ("corrected", corrected)):
                err = 0.0
                for site, weights in sites:
                    ym = linear_out(xm, site, (params[site.weight], params[site.bias] if site.bias else None))
                    for side, w in self.mix.items():
                        y = linear_out(x_parent[side], site, weights[side])
                        err = err + w * relative_squared_error(ym, y, c.mask)
                scores[name].append(1 - err / len(sites))
        gains = torch.cat(scores["corrected"]) - torch.cat(scores["rule"])
        test = paired_test(gains.cpu(), z=self.z, sign_test=True)
        return test.passed, test

    def final(self) -> tuple[dict[str, float], PairedTest | None]:
        """The last layer's fidelity, as written and with the rule alone (the report's evidence), and
        the model-level test of the written merge against the rule's (None: the paths never parted)."""
        written = self.written_scores()
        rule = written if self.rule_states is None else self.fidelity(self.rule_states, self._finals())
        test = None if self.rule_states is None else paired_test(written - rule, z=self.z, sign_test=True)
        figures = {"written": float(written.mean()), "rule": float(rule.mean()), "examples": int(written.numel())}
        return figures, test

    def _finals(self) -> dict[str, list[torch.Tensor]]:
        return {side: [c.hidden[side] for c in self.chunks] for side in self.mix}

    def written_scores(self) -> torch.Tensor:
        """Per held-out example, the fidelity of the written path's current states (after the last
        layer: the merge's output) to the parents'."""
        return self.fidelity([c.hidden["m"] for c in self.chunks], self._finals())

    def restore_rule(self) -> None:
        """The written path becomes the rule path (the whole correction dropped)."""
        if self.rule_states is not None:
            for c, state in zip(self.chunks, self.rule_states, strict=True):
                c.hidden = {**c.hidden, "m": state}
            self.rule_states = None


class ParameterStash:
    """Parameters written over in a model, until a later check has decided whether they come back:
    the rule's merge of each layer whose correction was kept, until the correction's model-level
    check (docs/design.md §6.7); A's and B's own layers, until the one sweep's (§5.7). Held in
    memory as references (``on_disk`` False: a model in memory takes new tensors and leaves the
    old ones as they are, so holding them costs nothing the model did not already hold), or copied
    to a temporary file (``on_disk``: parameters of offloaded models, written in place, §7.4, and
    the rule's layers, which nothing else holds), read back only to restore; ``drop`` frees it."""

    def __init__(self, on_disk: bool, prefix: str = "raot-stash-"):
        self.tensors: dict[str, torch.Tensor] = {}
        self.on_disk, self.prefix = on_disk, prefix
        self.directory: tempfile.TemporaryDirectory | None = None  # made at the first file
        self.files: list[Path] = []
        self.names: set[str] = set()

    def hold(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hold ``tensors`` (full parameter names) as they are now; a name held already keeps the
        value it was first held with."""
        tensors = {k: v for k, v in tensors.items() if k not in self.names}
        self.names.update(tensors)
        if not self.on_disk:
            self.tensors.update(tensors)
        elif tensors:
            if self.directory is None:
                self.directory = tempfile.TemporaryDirectory(prefix=self.prefix)
            self.files.append(Path(self.directory.name) / f"{len(self.files)}.safetensors")
            save_file({k: v.contiguous() for k, v in tensors.items()}, self.files[-1])

    def restore(self, model: torch.nn.Module, working_files, keep: set[int]) -> None:
        """Write the held tensors back into ``model``; ``keep``: the storages
        :func:`raot_hf.symmetry.load_state` copies from rather than takes."""
        load_state(model, self.tensors, working_files=working_files, keep=keep)
        for file in self.files:
            load_state(model, load_file(file), working_files=working_files, keep=keep)

    def drop(self) -> None:
        self.tensors, self.names, self.files = {}, set(), []
        if self.directory is not None:
            self.directory.cleanup()
            self.directory = None


class CorrectionPass:
    """The layer-by-layer correction (``method``: a registered correction, :func:`raot_hf.correction.get_correction`)
    over the fit ``chunks`` of the parents (side → model, ``"a"`` the reference, whose module M's
    layers compute with) and M, each layer's correction competing with the rule's merge of that
    layer on the held-out paths ``held`` (None: kept untested). Used by the correction stage and by
    the one sweep (§5.7), which feed it each layer's rule merge in order (:meth:`layer`) and write
    what it returns; :meth:`finish` decides the whole correction and the final readers."""

    def __init__(
        self, ctx: PairContext, method: str, parents: dict, mix: dict, chunks: list, held: HeldoutPaths | None
    ):
        self.ctx, self.method, self.parents, self.mix, self.chunks, self.held = ctx, method, parents, mix, chunks, held
        self.spec = get_correction(method)
        self.layers: list[dict] = []
        self.skipped: list[str] = []
        self.memo: dict[str, Any] = {}  # what the correction keeps over the layers of this merge
        # the rule's layers replaced by a kept correction: nothing else holds them, so in a file,
        # not beside the merge in memory (a whole trunk's layers at the end of the pass)
        self.stash = ParameterStash(True, "raot-rule-") if held is not None else None
        self.names = layer_module_names(ctx.model_a, ctx.schema)

    def layer(self, i: int, rule: dict, parent_outs: dict | None = None, kept: KeptParents | None = None) -> dict:
        """Layer ``i``'s parameters to write (the correction's or the rule's ``rule``); every path
        moves on. ``parent_outs``: the parents' held-out outputs, when computed already; ``kept``:
        their outputs on the fit examples, kept from the calibration pass (docs/design.md §5.7)."""
        ctx, name = self.ctx, self.names[i]
        modules = {side: m.get_submodule(name) for side, m in self.parents.items()}
        layer = LayerPass(self.chunks, name, modules, kept=kept)
        request = CorrectionRequest(
            layer, rule, i, name, self.mix, ctx.model_a, ctx.schema, ctx.config.correction, self.memo, self.skipped
        )
        merged, outputs, fits = self.spec.fn(request)
        entry: dict[str, Any] = {"layer": i, "sites": fits}
        if self.held is not None:
            unchanged = same_parameters(rule, merged)  # then ``outputs`` are already the rule's layer's
            kept, merged, test = self.held.decide(name, rule, merged, parent_outs)
            entry.update(kept=kept, heldout_gain=test.mean, heldout_stderr=test.stderr, reason=test.reason)
            if kept:
                self.stash.hold({k: v for k, v in rule.items() if merged[k] is not v})  # the rule's, replaced
            if not kept and not unchanged:  # the fit examples' merged states follow the layer as written
                outputs = layer.merged(rule, [], lambda *_: None)
        layer.advance(outputs)
        self.layers.append(entry)
        return merged

    def finish(self, rest: dict, keep: set[int]) -> tuple[dict, dict]:
        """After the last layer: the whole correction against the rule's merge alone (restored into
        A's module if it loses), then the final readers' refit; returns the non-layer trunk to write
        (``rest``, the rule's, or with refitted readers) and the correction's record."""
        ctx, held, cfg = self.ctx, self.held, self.ctx.config
        model_test = figures = None
        if held is not None:  # the whole correction against the rule's merge alone, on the final states
            figures, model_test = held.final()
            if model_test is not None and not model_test.passed:
                self.stash.restore(ctx.model_a, ctx.working_files, keep)
                held.restore_rule()
                why = f"dropped with the whole correction: the model-level check {model_test.reason}"
                for entry in self.layers:
                    if entry.get("kept"):
                        entry.update(kept=False, reason=why)
            self.stash.drop()
        dropped = model_test is not None and not model_test.passed
        spec = self.spec
        readers = final_readers(self.parents, ctx.schema, rest) if spec.readers is not None and not dropped else None
        if readers is not None:  # an untied LM head reads the final stream: refitted like the layers' Linears
            norms, sites = readers
            refit, fits = spec.readers(self.chunks, norms, rest, sites, mix=self.mix, options=cfg.correction)
            entry = {"layer": "final", "sites": fits}
            kept = True
            if held is not None:
                kept, test = held.decide_readers(norms, rest, refit, sites)
                entry.update(kept=kept, heldout_gain=test.mean, heldout_stderr=test.stderr, reason=test.reason)
            rest = refit if kept else rest
            self.layers.append(entry)
        tokens = int(sum(int(c.mask.sum()) for c in self.chunks))
        record = {
            "method": self.method,
            "examples": int(sum(c.mask.shape[0] for c in self.chunks)),
            "examples_per_forward": max((int(c.mask.shape[0]) for c in self.chunks), default=0),
            "tokens": tokens,
            "layers": self.layers,
            "skipped": self.skipped,
            **(spec.report(self.memo, cfg.correction) if spec.report is not None else {}),
        }
        if held is not None:
            kept = sum(1 for e in self.layers if e.get("kept") and e["layer"] != "final")
            competition = {**figures, "layers_kept": kept, "layers": len(self.names), "model_check": None}
            if model_test is not None:
                competition["model_check"] = {"kept": model_test.passed, "gain": model_test.mean,
                                              "stderr": model_test.stderr, "reason": model_test.reason}  # fmt: skip
                if dropped:  # the rule's merge is what was written; the corrected merge's figure stays as evidence
                    competition.update(corrected=competition["written"], written=competition["rule"])
            record["competition"] = competition
            logger.info("correction %s: kept in %d of %d layers (held-out fidelity %.4f, rule alone %.4f)",
                        self.method, kept, len(self.names), competition["written"], competition["rule"])  # fmt: skip
        logger.info("correction %s: %d layers on %d tokens", self.method, len(self.layers), tokens)
        return rest, record


def fit_chunks(
    ctx: PairContext, run, parents: dict, rest: dict, parent_params: dict | None = None, parents_run: bool = True
) -> list:
    """The correction's fit examples: every parent (computing with ``parent_params[side]`` where
    given; none when ``parents_run`` is False, their outputs kept from the calibration pass) and M
    (A's module with the merged non-layer trunk ``rest``) captured at layer 0."""
    cfg = ctx.config.correction
    batch_size = cfg.examples_per_forward(len(ctx.working_files) > 0)
    batches = run.batches(ctx.preprocessor, batch_size=batch_size, split="fit")
    names = layer_module_names(ctx.model_a, ctx.schema)
    return capture(parents, names, batches, rest, cfg.examples, parent_params, parents_run)


def _corrected(
    ctx: PairContext, parents: dict, mix: dict, merge, names_all: list[str], run, method: str, log: RuleLog
) -> RuleLog:
    """The layer-by-layer pass shared by two and N models: ``merge(keys)`` gives the rule's merge of
    those trunk tensors, ``parents`` the models (side → model, ``"a"`` the reference) and ``mix``
    their weights in the target. Each layer's correction competes with the rule's merge of that
    layer on held-out examples (:class:`HeldoutPaths`) when the gate is on and there are enough."""
    cfg = ctx.config
    get_correction(method)  # an unknown name fails before any work
    if run is None:
        raise RaotError(f"correction {method!r} needs calibration data; pass calibration=... (or --calibration)")
    names = layer_module_names(ctx.model_a, ctx.schema)
    keep = storage_of(p for model in parents.values() for p in model.parameters())  # copied, never taken
    in_layer = tuple(n + "." for n in names)
    rest, part = merge([k for k in names_all if not k.startswith(in_layer)])
    log.add(part)
    chunks = fit_chunks(ctx, run, parents, rest)
    held = None
    if cfg.gate.enabled and cfg.correction.compete:
        batch_size = cfg.correction.examples_per_forward(len(ctx.working_files) > 0)
        heldout = run.batches(ctx.preprocessor, batch_size=batch_size, split="heldout")
        held = HeldoutPaths.captured(parents, names, heldout, rest, cfg.gate.examples, mix, cfg.correction.z)
        if sum(c.mask.shape[0] for c in held.chunks) < MIN_GATE_EXAMPLES:
            logger.warning("correction: fewer than %d held-out examples; every layer's correction is kept untested",
                           MIN_GATE_EXAMPLES)  # fmt: skip
            held = None
    correction = CorrectionPass(ctx, method, parents, mix, chunks, held)
    rest = ctx.working_files.park(rest, "merged-trunk")  # read again after the last layer (§7.4)
    for i, name in enumerate(tqdm(names, desc=f"correction ({method})", disable=not ctx.dist.is_main)):
        rule, part = merge([k for k in names_all if k.startswith(name + ".")])
        log.add(part)
        load_state(ctx.model_a, correction.layer(i, rule), working_files=ctx.working_files, keep=keep)
        ctx.working_files.release_all()  # the layer's offloaded pages, read by the parents and the merge (§7.4)
    rest, log.correction = correction.finish(rest, keep)
    # A's own non-layer parameters served its forward until now
    load_state(ctx.model_a, rest, working_files=ctx.working_files, keep=keep)
    return log
