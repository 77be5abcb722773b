"""The merge-fidelity gate: an estimate is applied only if it makes a better merge (docs/design.md §5).

The alignment objective (activation correlation / cosine under an estimate) says how well B′
matches A; it does not say whether averaging A with B′ gives a better model than averaging A
with B. For siblings of one initialization it does not: a head rotation that raises the
correlation of the fine-tuning drift also rotates the shared pre-trained weights, and the
average of W0 with a rotated W0 is damaged. So the gate scores each estimate by the quantity
the merge is for — how closely the merged computation follows both parents — on a small fixed
set of held-out examples (the *gate set*):

* **per layer, block-local**: layer l's merged parameters ``(1−α)·θ_A + α·T(θ_B)`` with all its
  estimates against the same without one of them — each estimate judged given the others,
  backward elimination — evaluated on A's layer at A's captured call and at B′'s (B's in A's
  basis); the residual candidate (it touches every layer) is part of both sides. Fidelity per example is
  defined in :mod:`raot_hf.gate.fidelity` (1 − relative squared error of the merged block's
  output to each parent's, over real tokens, weighted 1−α and α);
* **model level**: the merged model with the accepted set (residual map included) against the
  identity merge (the plain average), fidelity of the last layer's output to A's and B′'s. This
  decides the residual map and can veto everything: then the verdict is "shares a basis".

Each decision is a paired test across gate examples: apply iff the mean gain exceeds ``z``
standard errors of the per-example gains and is positive; the identity wins ties. The model-level
check also needs a gain of at least ``gate.min_gain`` (fidelity is a fraction of what the layers
compute, so 0.01 = 1%): a real but immaterial gain — parents that barely differ — keeps the
identity.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
from huggingface_hub.utils import tqdm

from raot_hf.adapters.schema import ModelSchema
from raot_hf.gate import GateDecision, Status, paired_test
from raot_hf.gate.fidelity import (
    GateChunk,
    LayerFidelity,
    MergedModelRun,
    MergedParameters,
    gate_chunks,
    layer_fidelity,
    layer_module_names,
    scored_calls,
    stream_matrix,
)
from raot_hf.gate.lineage import LineageEvidence, detect_siblings
from raot_hf.gate.verdict import BasisVerdict, ModelCheckFigures, OffPath, Verdict, affinity_phrase
from raot_hf.io.offload import WorkingFiles
from raot_hf.symmetry import (
    ExpertAlignment,
    HeadAlignment,
    HeadRescale,
    MLPPermutation,
    ResidualPermutation,
    ResidualRotation,
    Transform,
)

logger = logging.getLogger("raot_hf.gate.merge")

#: Below this many gate examples there is no spread to learn the noise from: the identity stands.
MIN_GATE_EXAMPLES = 4

#: A merge whose state leaves its parents' by more than this on some token is no exact recovery,
#: whatever its fidelity (which weighs tokens by 1/rms², so hardly sees massive-activation tokens).
WORST_TOKEN_NOTE = 1e-2


def _paired(
    kind, layer, with_, without, *, z, description, alignment: GateDecision | None, floor: float = 0.0
) -> GateDecision:
    """The merge objective's decision: the per-example fidelity gains of an estimate, one paired
    test (§5.2, with the sign test)."""
    test = paired_test(with_ - without, z=z, floor=floor, sign_test=True)
    identity = float(without.mean())
    status = Status.ACCEPTED if test.passed else Status.BELOW_MARGIN
    return GateDecision(
        kind,
        layer,
        identity,
        identity + test.mean,
        test.mean,
        test.stderr,
        test.margin,
        test.passed,
        test.reason,
        description,
        objective="merge",
        fidelity_identity=identity,
        fidelity_estimate=float(with_.mean()),
        alignment_gain=None if alignment is None else alignment.gain,
        examples=int(with_.numel()),
        status=status,
    )


def _with_worst_token(d: GateDecision, worst: float) -> GateDecision:
    """``d`` with its layer's worst-token deviation; an accepted estimate whose fidelity reads as
    exact while one token is far off says so in its reason (docs/design.md §5.3)."""
    reason = d.reason
    if d.applied and d.fidelity_estimate >= 1 - WORST_TOKEN_NOTE and worst > WORST_TOKEN_NOTE:
        reason += f"; not exact: one token deviates by {worst:.2g}"
    return dataclasses.replace(d, worst_token=worst, reason=reason)


def _reject(d: GateDecision, reason: str, status: Status) -> GateDecision:
    return dataclasses.replace(d, applied=False, reason=reason, status=status)


@dataclass
class MergeGateResult:
    """What the gate stage decided: the final decisions, the basis verdict, and the model-level
    check's numbers (empty when it did not run)."""

    decisions: list[GateDecision]
    verdict: BasisVerdict
    model_fidelity: dict


def gate_eligible(d: GateDecision) -> bool:
    """Alignment-gate rows the merge gate re-decides (the rest keep their reason: identity, NaN, tokens)."""
    return d.applied or d.scored


def transforms_by_decision(parts: list[Transform]) -> dict[tuple, list[Transform]]:
    """("heads" | "mlp" | "experts", layer) → the transforms that decision covers (a head rescale
    follows its heads)."""
    out: dict[tuple, list[Transform]] = {}
    for t in parts:
        if isinstance(t, (HeadAlignment, HeadRescale)):
            out.setdefault(("heads", t.layer), []).append(t)
        elif isinstance(t, MLPPermutation):
            out.setdefault(("mlp", t.layer), []).append(t)
        elif isinstance(t, ExpertAlignment):  # the whole block: experts, their units, the router's rows
            out.setdefault(("experts", t.layer), []).append(t)
    return out


@dataclass
class LayerGate:
    model_a: torch.nn.Module
    layer_names: list[str]
    merged: MergedParameters
    chunks: list[GateChunk]
    alpha: float
    z: float
    floor: float

    def __post_init__(self):
        # the residual candidate's dense map, shared by every layer's block-local scores
        self.stream = stream_matrix(self.merged.residual, self.merged.schema)

    def decide_layer(self, i: int, keys: list[tuple], per_layer: dict, rows: dict) -> tuple[dict, list[Transform]]:
        """Layer ``i``'s decisions, block-local, each estimate judged *given the others*: the
        layer merged with every estimate against the same without that one (the MLP reads what
        the attention wrote and the attention's error reaches the MLP's output, so each is judged
        with the other aligned as it will be merged). A rejected estimate — the one with the
        smallest gain first — is dropped and the rest are judged again without it (backward
        elimination: at most four layer configurations for heads and MLP). Returns the decisions
        and the accepted transforms."""
        name = self.layer_names[i]
        module = self.model_a.get_submodule(name)
        scores: dict[tuple, LayerFidelity] = {}
        calls = scored_calls(self.chunks, i, self.stream, self.alpha, self.merged.schema.hidden_size)

        def score(chosen: tuple) -> LayerFidelity:
            if chosen not in scores:
                transforms = [t for key in chosen for t in per_layer[key]]
                scores[chosen] = layer_fidelity(module, name, self.merged.merged(i, transforms), calls)
            return scores[chosen]

        chosen, decided = tuple(keys), {}
        while chosen:
            for key in chosen:  # a prefix first, so the merged parameters of the longer set are reused
                score(tuple(k for k in chosen if k != key))
            with_ = score(chosen)
            for key in chosen:
                without = score(tuple(k for k in chosen if k != key))
                description = rows[key].description
                decided[key] = _paired(
                    key[0], i, with_.scores, without.scores, z=self.z, description=description, alignment=rows[key]
                )
                decided[key] = _with_worst_token(decided[key], float(with_.worst_token.max()))
            rejected = [key for key in chosen if not decided[key].applied]
            if not rejected:
                break
            worst = min(rejected, key=lambda k: decided[k].gain)
            chosen = tuple(k for k in chosen if k != worst)
        return decided, [t for key in chosen for t in per_layer[key]]

    def decide_at(self, i: int, rows: dict, per_layer: dict) -> tuple[dict, list[Transform], list[Transform]]:
        """Layer ``i``'s decisions (:meth:`decide_layer`) over its re-decidable estimates, the
        accepted transforms and every re-decided estimate's (none: nothing to decide there)."""
        keys = [(kind, i) for kind in ("heads", "mlp", "experts")]
        keys = [k for k in keys if k in rows and k in per_layer and gate_eligible(rows[k])]
        if not keys:
            return {}, [], []
        decided, chosen = self.decide_layer(i, keys, per_layer, rows)
        return decided, chosen, [t for key in keys for t in per_layer[key]]

    def start_check(self) -> None:
        """The model-level check's merged models, carried through the layers as they are decided:
        the identity merge, the aligned merge with the accepted set (residual map included), and —
        while the check could still need it (no residual map, nothing accepted yet) — the aligned
        merge with every re-decided estimate. Without a residual map an aligned merge computes
        what the identity merge does until its first transformed layer: it goes on from the
        identity merge's states there (:meth:`MergedModelRun.fork`) instead of repeating them."""
        runs = dict(model_a=self.model_a, layer_names=self.layer_names, merged=self.merged, chunks=self.chunks)
        self.identity = MergedModelRun(**runs, aligned=False)
        self.accepted = MergedModelRun(**runs, aligned=True) if self.merged.residual is not None else None
        self.every: MergedModelRun | None = None

    def advance_check(self, i: int, chosen: list[Transform], every: list[Transform]) -> None:
        """Layer ``i`` of the check's merged models, right after its decisions: its merged
        parameters are those just scored (B′'s layer is reused, not transformed again)."""
        if chosen and self.accepted is None:
            self.accepted = self.identity.fork()
        if self.accepted is not None:  # something is accepted: the check compares that set
            self.every = None
            self.accepted.advance(self.merged.merged(i, chosen))
        elif every:
            self.every = self.every or self.identity.fork()
            self.every.advance(self.merged.merged(i, every))
        elif self.every is not None:
            self.every.advance(self.merged.merged(i))
        self.identity.advance(self.merged.merged(i, aligned=False))

    def check(self) -> tuple[GateDecision, bool, list[float]]:
        """The model-level check: the aligned merge (accepted set, residual map included) against
        the identity merge. With nothing accepted it still measures every re-decided estimate at
        once, as the verdict's evidence, and passes nothing. Also returns, per layer, the worst
        token's deviation of the measured merge's state from the parents' mix: where the merged
        model leaves their path."""
        identity = self.identity.scores(self.alpha)
        measured = self.accepted if self.accepted is not None else self.every
        aligned = identity if measured is None else measured.scores(self.alpha)
        worst = [] if measured is None else measured.worst_token
        check = model_check(aligned, identity, worst, z=self.z, floor=self.floor)
        return check, self.accepted is not None and check.applied, worst


def model_check(
    aligned: torch.Tensor, identity: torch.Tensor, worst: list[float], *, z: float, floor: float
) -> GateDecision:
    """The model-level check's paired test: per held-out example, the aligned merge's fidelity
    against the identity merge's; ``worst``: the aligned merge's worst-token deviation per layer."""
    check = _paired(
        "model", None, aligned, identity, z=z, floor=floor, description="merged model vs identity merge", alignment=None
    )
    return dataclasses.replace(check, worst_token=max(worst, default=None))


def residual_candidate(parts: list[Transform], rows: dict) -> Transform | None:
    """The residual map the gate decides (at the model level), or None: none was estimated, or its
    alignment-objective row left it out (identity, not finite, too few tokens)."""
    residual = next((t for t in parts if isinstance(t, (ResidualPermutation, ResidualRotation))), None)
    res_row = rows.get(("residual", None))
    if residual is not None and (res_row is None or not gate_eligible(res_row)):
        return None
    return residual


def run_merge_gate(
    model_a,
    model_b,
    schema: ModelSchema,
    parts: list[Transform],
    alignment_rows: list[GateDecision],
    chunks: list[GateChunk],
    *,
    alpha: float,
    z: float,
    floor: float = 0.0,
    layer_names: list[str] | None = None,
    progress: bool = False,
    working_files: WorkingFiles | None = None,
) -> MergeGateResult:
    """Re-decide every transform by merge fidelity (see the module docstring); ``layer_names``:
    the layer modules' names when the caller has them already; ``progress``: a progress bar over
    the layers (rank 0); ``working_files``: the models' when they are offloaded (§7.4)."""
    layer_names = layer_names or layer_module_names(model_a, schema)
    working_files = working_files or WorkingFiles()  # in memory: nothing to release
    rows = {(d.transform, d.layer): d for d in alignment_rows}
    n = sum(int(c.mask.shape[0]) for c in chunks)
    if n < MIN_GATE_EXAMPLES:
        reason = f"too few gate examples ({n} < {MIN_GATE_EXAMPLES})"
        logger.warning("merge gate: %s; keeping the identity for every transform", reason)
        verdict = BasisVerdict(Verdict.SHARES_BASIS_BY_DEFAULT, why=reason)
        return MergeGateResult([_reject(d, reason, Status.TOO_FEW_EXAMPLES) for d in alignment_rows], verdict, {})
    residual = residual_candidate(parts, rows)
    merged = MergedParameters(model_a, model_b, schema, layer_names, residual, alpha)
    run = LayerGate(model_a, layer_names, merged, chunks, alpha, z, floor)
    per_layer = transforms_by_decision(parts)
    decided: dict[tuple, GateDecision] = {}
    run.start_check()
    for i in tqdm(range(len(layer_names)), desc="gate", disable=not progress):
        layer_decisions, chosen, every = run.decide_at(i, rows, per_layer)
        decided.update(layer_decisions)
        run.advance_check(i, chosen, every)
        for c in chunks:  # the parents move on to the next layer
            c.advance()
        working_files.release_all()  # an offloaded layer's pages, read to merge it, go back to their files (§7.4)
    check, passed, worst = run.check()
    return gate_result(rows, decided, check, passed, residual is not None, worst)


def gate_result(
    rows: dict, decided: dict, check: GateDecision, passed: bool, has_residual: bool, worst: list[float]
) -> MergeGateResult:
    """Final decisions (the check decides the residual map and can veto the rest) and the verdict."""
    out = []
    for key, d in rows.items():
        if key == ("residual", None) and has_residual:
            d = dataclasses.replace(check, transform="residual", description=d.description, alignment_gain=d.gain)
            if not passed:
                d = _reject(d, f"model-level check: {check.reason}", Status.BELOW_MARGIN)
        elif key in decided:
            d = decided[key]
            if d.applied and not passed:
                d = _reject(d, f"vetoed by the model-level check ({check.reason})", Status.VETOED)
        out.append(d)
    fi, fa, k, margin = check.fidelity_identity, check.fidelity_estimate, check.examples, check.margin
    figures = ModelCheckFigures(identity=fi, aligned=fa, examples=k, margin=margin)
    verdict = BasisVerdict(Verdict.DIFFERS_IN_BASIS if passed else Verdict.SHARES_BASIS, check=figures)
    info = {"identity": fi, "aligned": fa, "gain": fa - fi, "stderr": check.stderr, "margin": margin}
    info.update({"examples": k, "passed": passed, "worst_token_by_layer": worst})
    if passed and fa >= 1 - WORST_TOKEN_NOTE and worst and max(worst) > WORST_TOKEN_NOTE:
        # a near-exact fidelity with one token far off (a massive-activation token): not an exact recovery
        layer = max(range(len(worst)), key=worst.__getitem__)
        first = next(i for i, w in enumerate(worst) if w > WORST_TOKEN_NOTE)
        off_path = OffPath(deviation=worst[layer], first_layer=first, worst_layer=layer)
        verdict = BasisVerdict(Verdict.DIFFERS_NOT_EXACT, check=figures, off_path=off_path)
        logger.warning("merge gate: %s", verdict.text)
    return MergeGateResult(out, verdict, info)


def _alignment_verdict(decisions: list[GateDecision], why: str, *, gated: bool = True) -> BasisVerdict:
    """The verdict when the merge gate did not run: from the decisions as they stand."""
    n = sum(d.applied for d in decisions)
    if not decisions:
        return BasisVerdict(Verdict.NOT_REQUESTED)
    if n == 0 and all(d.untested for d in decisions):
        return BasisVerdict(Verdict.UNTESTED, why=decisions[0].reason)
    code = Verdict.UNCHECKED if not gated else Verdict.SHARES_BASIS if n == 0 else Verdict.DIFFERS_IN_BASIS
    return BasisVerdict(code, why=why, applied=n, estimates=len(decisions))


def as_siblings(result: MergeGateResult, evidence: LineageEvidence) -> MergeGateResult:
    """Detection, not repair (docs/design.md §5.4): every estimate is identity-dominated, so the
    identity stands everywhere; the merge-fidelity comparison stays in the report as evidence."""
    why = f"siblings: the estimates are near the identity ({affinity_phrase(evidence.median, evidence.smallest)})"
    decisions = [_reject(d, why, Status.SIBLINGS) if d.applied else d for d in result.decisions]
    info = dict(result.model_fidelity, passed=False)
    # the merge-fidelity comparison, when it ran, stays as evidence
    figures = None
    if "aligned" in info:
        figures = ModelCheckFigures(identity=info["identity"], aligned=info["aligned"], examples=info["examples"])
    verdict = BasisVerdict(Verdict.SIBLINGS, check=figures, affinity=(evidence.median, evidence.smallest))
    return MergeGateResult(decisions, verdict, info)


def merge_gate(
    ctx, run, parts: list[Transform], stats, decisions: list[GateDecision], gated: bool = True
) -> MergeGateResult:
    """The gate stage's second step: re-decide ``decisions`` (the alignment objective's) by merge
    fidelity when the merge objective is in force, then the sibling check (§5.4). ``ctx`` is the
    :class:`raot_hf.stages.context.PairContext`, ``run`` the calibration run (None without data),
    ``gated`` False for an estimator whose candidates are not symmetries."""
    cfg = ctx.config
    gate_on = cfg.gate.enabled
    if not gate_on or stats is None or run is None or not gated:
        why = "gate disabled" if not gate_on else "soft transport, not gated" if stats else "no calibration data"
        return MergeGateResult(decisions, _alignment_verdict(decisions, why, gated=False), {})
    if cfg.gate.objective != "merge":
        return MergeGateResult(decisions, _alignment_verdict(decisions, "alignment objective"), {})
    if not any(gate_eligible(d) for d in decisions):
        why = "every estimate is the identity or unusable"
        return MergeGateResult(decisions, _alignment_verdict(decisions, why), {})
    start = time.perf_counter()
    names = layer_module_names(ctx.model_a, ctx.schema)
    heldout = run.batches(ctx.preprocessor, split="heldout")
    chunks = gate_chunks(ctx.model_a, ctx.model_b, names, heldout, cfg.gate.examples)
    ctx.timer.times["gate_capture"] = time.perf_counter() - start  # a part of the "gate" stage
    gate = cfg.gate
    result = run_merge_gate(
        ctx.model_a,
        ctx.model_b,
        ctx.schema,
        parts,
        decisions,
        chunks,
        alpha=cfg.alpha,
        z=gate.z,
        floor=gate.min_gain,
        layer_names=names,
        progress=ctx.dist.is_main,
        working_files=ctx.working_files,
    )
    if gate.sibling_check:
        evidence = detect_siblings(parts)
        result = as_siblings(result, evidence) if evidence.siblings else result
        result.model_fidelity["siblings"] = evidence.to_dict()
    logger.info("merge gate: %s", result.verdict.text)
    return result
