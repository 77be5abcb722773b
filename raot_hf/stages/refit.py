"""Stage: the refit of the merged model, end to end and label-free (docs/design.md §6.11; ``auto``
where the gate moved B and the model is small enough, ``refit.mode``).

After the merge (and its layer-wise correction, §6.7) the merged model's trunk parameters (or only
its norms and biases, ``refit.parameters``) are fitted by Adam so that its predictions follow the
mix of its parents' (KL divergence; or its last stream theirs, ``refit.target="hidden"``), with the
per-model merge weights normalised as the correction's target. The parents' outputs are captured
before the merge writes into the reference's module (:func:`refit_targets`). Half the held-out
examples stop the descent early; on the other half the refit competes with the merge without it
(§5.2's paired test), and it is written only if it wins; else nothing is written.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from huggingface_hub.utils import tqdm
from torch.func import functional_call
from transformers.pytorch_utils import Conv1D

from raot_hf.config.refit import RefitOptions
from raot_hf.errors import RaotError
from raot_hf.gate import paired_test
from raot_hf.gate.fidelity import layer_module_names
from raot_hf.gate.merge import MIN_GATE_EXAMPLES
from raot_hf.hooks import capture_calls, first_tensor, without_cache
from raot_hf.merging import merge_rule_spec
from raot_hf.outputs.record import RefitRecord
from raot_hf.refine import calibration_examples
from raot_hf.stages.calibrate import open_calibration
from raot_hf.stages.context import PairContext, on_device_of
from raot_hf.stages.correct import target_mix
from raot_hf.stages.members import AlignedModel, member_models, model_weights

logger = logging.getLogger("raot_hf.stages.refit")
_STAGE = {"stage": True}  # a line the CLI shows by default (raot_hf.cli.verbosity)

_OFFLOADED = (
    "refit mode 'on' runs the merged model forward and backward in memory, but the models were offloaded "
    "layer by layer (docs/design.md §7.4); load them in memory (offload='never', --offload never) or set refit "
    "mode off"
)
_OTHER_LABELS = (
    "refit target 'output' mixes the parents' predictions, but their heads predict different labels; set refit "
    "target hidden or refit mode off"
)
_TOO_LARGE = (
    "refit target 'output' keeps the parents' distributions over every token, {size:.1f} GiB here (at most 1 GiB); "
    "lower refit examples or the calibration's max length, or set refit target hidden"
)
_NO_SCORES = (
    "refit target 'output' follows the parents' predicted distributions, but {name} returns no logits; set "
    "refit target hidden (the last layer's stream) or refit mode off"
)

#: A merge whose held-out loss is at most this already follows its parents (an exact symmetry's
#: merge is its parent to round-off): nothing to refit.
FOLLOWED = 1e-6
#: The least gain a kept refit makes, relative to the judged loss without it: a refit that moves
#: the merge by less is not written (round-off never passes for a gain).
MIN_GAIN = 0.01

#: The largest model (parameters) the ``auto`` refit runs on: its descent holds the whole model's
#: graph, gradients and Adam's moments (about four copies of the model in float32), and each step is a
#: forward and backward pass of the merged model (docs/design.md §6.11).
AUTO_MAX_PARAMETERS = 50_000_000


#: The most the output target's distributions may take (float32, fit and held-out examples together).
TARGET_BUDGET = 1 << 30


def _prediction_space(model: torch.nn.Module, schema) -> tuple | None:
    """What ``model``'s ``logits`` range over: ``("labels", count, names)`` for a task head,
    ``("vocabulary", size)`` for an LM head; None where it returns no logits (a bare encoder, or a
    question-answering head, whose outputs are two score vectors)."""
    if type(model).__name__.endswith("ForQuestionAnswering"):
        return None
    if schema.head_params:
        names = {int(k): str(v) for k, v in (getattr(model.config, "id2label", None) or {}).items()}
        return ("labels", model.config.num_labels, tuple(sorted(names.items())))
    lm_head = getattr(model, "get_output_embeddings", lambda: None)()
    return None if lm_head is None else ("vocabulary", lm_head.weight.shape[0])


def _output_target_problem(pairs: list[PairContext]) -> tuple[str, str] | None:
    """Why the output target cannot serve these models (None: it can), as the one-line error of a
    requested refit and the reason an ``auto`` refit gives: no logits; parents whose heads predict
    different labels (their predictions do not mix); or distributions beyond
    :data:`TARGET_BUDGET` (``refit.examples`` fit and held-out examples, each at most a
    distribution per token of the calibration's ``max_length``, in float32)."""
    ctx = pairs[0]
    space = _prediction_space(ctx.model_a, ctx.schema)
    if space is None:
        name = type(ctx.model_a).__name__
        return _NO_SCORES.format(name=name), f"{name} returns no logits to follow"
    if any(_prediction_space(p.model_b, ctx.schema) != space for p in pairs):
        return _OTHER_LABELS, "the parents' heads predict different labels; their predictions do not mix"
    size = 2 * ctx.config.refit.examples * ctx.config.calibration.max_length * space[1] * 4 / 2**30
    if size > TARGET_BUDGET / 2**30:
        return _TOO_LARGE.format(size=size), f"the parents' distributions would take {size:.1f} GiB (> 1 GiB)"
    return None


def check_refit(pairs: list[PairContext]) -> None:
    """Refuse, before any work, a refit asked for (``mode="on"``) that cannot run: offloaded models
    (the refit holds the whole model's graph), or an output target the models cannot serve
    (:func:`_output_target_problem`)."""
    ctx = pairs[0]
    cfg: RefitOptions = ctx.config.refit
    if not cfg.requested:
        return
    if len(ctx.working_files):
        raise RaotError(_OFFLOADED)
    problem = _output_target_problem(pairs) if cfg.target == "output" else None
    if problem is not None:
        raise RaotError(problem[0])


def refit_decision(members: list[AlignedModel]) -> tuple[bool, str]:
    """Whether this merge is refitted, and why. ``auto`` refits where the post-merge correction runs
    — the gate moved B (while the one sweep has still to decide, it may) — and the refit is
    affordable and has something to follow: the merge read calibration data and is in memory, the
    model returns scores that the parents' share (for the output target), it has at most
    :data:`AUTO_MAX_PARAMETERS` parameters, and no base-relative rule merges it (siblings keep
    their rule's merge)."""
    ctx = members[0].ctx
    cfg: RefitOptions = ctx.config.refit
    if not cfg.enabled:
        return False, "off"
    if cfg.mode == "on":
        return True, "requested"
    if len(ctx.working_files):
        return False, "auto: the models are offloaded layer by layer; the refit needs the whole model in memory"
    if ctx.dist.is_distributed:  # each process reads its own shard: their refits would differ
        return False, "auto: the calibration is sharded across processes; the refit reads one process's data"
    if ctx.base is not None or merge_rule_spec(ctx.config.merge_rule).needs_base:
        return False, "auto: a base-relative rule merges siblings; no refit"
    if members[0].run is None:
        return False, "auto: the merge read no calibration data"
    problem = _output_target_problem([m.ctx for m in members]) if cfg.target == "output" else None
    if problem is not None:
        return False, f"auto: {problem[1]}"
    count = sum(p.numel() for p in ctx.model_a.parameters())  # tied parameters once
    if count > AUTO_MAX_PARAMETERS:
        return False, f"auto: {count / 1e6:.0f} M parameters > {AUTO_MAX_PARAMETERS / 1e6:.0f} M; opt in with mode on"
    if moved_any(members) is False:
        return False, "auto: A and B share a basis (nothing applied); no refit"
    return True, "auto: the gate moved B (the parents differ in basis)"


def moved_any(members: list[AlignedModel]) -> bool | None:
    """Whether the gate moved any model (None while the one sweep has still to decide)."""
    if any(m.pending is not None for m in members):
        return None
    return any(d.applied for m in members for d in m.alignment.decisions)


@dataclass
class RefitChunk:
    """One calibration batch of the refit: its inputs, real tokens (``(rows, seq)`` bool; one column
    for a classifier's per-example prediction) and the target, the parents' mix (§6.11)."""

    inputs: dict[str, torch.Tensor]
    mask: torch.Tensor
    target: torch.Tensor

    def rows(self, start: int) -> RefitChunk:
        """Every other example from ``start`` (0 or 1)."""
        inputs = {k: v[start::2] for k, v in self.inputs.items()}
        return RefitChunk(inputs, self.mask[start::2], self.target[start::2])


@dataclass
class RefitTargets:
    """What the refit reads, captured before the merge: the fit chunks; the held-out examples in two
    halves, ``stop`` (early stopping chooses the best step on them) and ``judge`` (the competition
    with the merge without the refit, on examples nothing in the refit has seen); and the module of
    the last layer, whose output is the final hidden state."""

    fit: list[RefitChunk]
    stop: list[RefitChunk]
    judge: list[RefitChunk]
    last_layer: str
    source: str = "parents run again"  # or "calibration pass": made from its forwards (§5.7)


def _last_output(model: torch.nn.Module, last: str, inputs: dict, params: dict | None = None) -> torch.Tensor:
    """The stream leaving the last layer (``params``: parameters swapped in, differentiable)."""
    return capture_calls(model, [last], on_device_of(model, inputs), params=params)[0].output


def _model_logits(model: torch.nn.Module, inputs: dict, params: dict | None = None) -> torch.Tensor:
    """The model's output scores (``logits``: ``(rows, classes)`` or ``(rows, seq, vocab)``), with
    ``params`` swapped in (differentiable)."""
    inputs = without_cache(model, on_device_of(model, inputs))
    out = model(**inputs) if params is None else functional_call(model, params, (), inputs)
    return out.logits if hasattr(out, "logits") else first_tensor(out)


def _output(model: torch.nn.Module, target: str, last: str, inputs: dict, params: dict | None = None):
    """What the refit fits: the last layer's stream (``target="hidden"``) or the output scores."""
    if target == "hidden":
        return _last_output(model, last, inputs, params)
    return _model_logits(model, inputs, params)


@torch.no_grad()
def _chunks(ctx: PairContext, run, split: str, count: int, parents: list, mix: list[float], last: str):
    """At most ``count`` examples of ``split``, each chunk with the parents' mix: of their last
    layer's streams ``Σ w_p·y_p`` (``refit.target="hidden"``), or of their predicted
    distributions ``Σ w_p·softmax(z_p)`` (``"output"``, each parent through its own head), one
    parent at a time; or the confident teacher's (:func:`confident_mix`), which holds every
    parent's distributions of one batch at once."""
    target_kind, out = ctx.config.refit.target, []
    for example in calibration_examples(ctx, run, split, count):
        outputs = (_output(m, target_kind, last, example["inputs"]) for m in parents)
        target = teacher_target(outputs, mix, target_kind, ctx.config.refit.teacher)
        out.append(_refit_chunk(example["inputs"], example["mask"], target))
    return out


def teacher_target(outputs, mix: list[float], target_kind: str = "output", teacher: str = "mix") -> torch.Tensor:
    """The refit's target from the parents' ``outputs`` (in the order of ``mix``, an iterable read
    one at a time for the plain mix): of their last layer's streams ``Σ w_p·y_p`` (``"hidden"``),
    or of their predicted distributions ``Σ w_p·softmax(z_p)`` (``"output"``), or the confident
    teacher's (:func:`confident_mix`), which holds every parent's distributions at once."""

    def prepared(y: torch.Tensor) -> torch.Tensor:
        y = y.to(torch.promote_types(y.dtype, torch.float32))  # the mix in float32 at least
        return y.softmax(dim=-1) if target_kind == "output" else y

    if teacher == "confident":  # the output target's only (RefitOptions)
        return confident_mix([prepared(y) for y in outputs], mix)
    target = None
    for y, w in zip(outputs, mix, strict=True):
        y = prepared(y)
        target = w * y if target is None else target.add_(y, alpha=w)
    return target


def _refit_chunk(inputs: dict, mask: torch.Tensor | None, target: torch.Tensor) -> RefitChunk:
    if mask is None or target.dim() == 2:  # every token counts; a classifier's example is one token
        mask = torch.ones(target.shape[:2] if target.dim() == 3 else (target.shape[0], 1), dtype=torch.bool)
    return RefitChunk(inputs, mask.to(target.device), target)


class PredictionCapture:
    """The output target made from the calibration pass's own forwards of A and B (each parent's
    layer runs once per calibration token over the merge, docs/design.md §5.7): the first
    ``refit.examples`` examples of each split, batched as the calibration batches them — the
    batches :func:`refit_targets` would run the parents on again, so the targets are the same. B's
    predictions are B′'s: they do not depend on its basis."""

    def __init__(self, ctx: PairContext):
        self.count, self.teacher = ctx.config.refit.examples, ctx.config.refit.teacher
        self.mix = target_mix(model_weights(ctx.config, 2))
        self.chunks: dict[str, list[RefitChunk]] = {"fit": [], "heldout": []}
        self.taken = {"fit": 0, "heldout": 0}

    def add(self, phase: str, batch, output_a, output_b) -> None:
        """A calibration batch of ``phase`` and both parents' outputs on it."""
        keep = min(self.count - self.taken[phase], len(batch))
        if keep <= 0:
            return
        scores = [_scores(o)[:keep] for o in (output_a, output_b)]
        inputs = {k: v[:keep] for k, v in batch.inputs.items()}
        mask = batch.token_mask[:keep].bool() if batch.token_mask is not None else None
        self.chunks[phase].append(_refit_chunk(inputs, mask, teacher_target(scores, self.mix, teacher=self.teacher)))
        self.taken[phase] += keep


def _scores(out) -> torch.Tensor:
    """A model output's scores, as :func:`_model_logits` reads them."""
    return out.logits if hasattr(out, "logits") else first_tensor(out)


def prediction_capture(ctx: PairContext) -> PredictionCapture | None:
    """The capture of the refit's output target during the calibration pass, where a refit of this
    pair may run on it (:func:`refit_decision`'s conditions that the models and options decide
    before any data is read), else None."""
    cfg = ctx.config.refit
    if not cfg.enabled or cfg.target != "output":
        return None
    if len(ctx.working_files) or ctx.dist.is_distributed or ctx.base is not None:
        return None
    if merge_rule_spec(ctx.config.merge_rule).needs_base or _output_target_problem([ctx]) is not None:
        return None
    if cfg.mode == "auto" and sum(p.numel() for p in ctx.model_a.parameters()) > AUTO_MAX_PARAMETERS:
        return None
    return PredictionCapture(ctx)


def confident_mix(distributions: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The confident teacher (``refit.teacher="confident"``, docs/design.md §6.11): from the parents'
    predicted ``distributions`` (each ``(..., classes)``) and their merge ``weights``, per token
    ``Σ α_p·p_p`` with ``α = softmax_p(log w_p − H(p_p))`` — each parent's weight times ``exp(−H)``
    of its prediction, normalised. Parents as sure as each other keep their merge weights (the
    plain mix ``Σ w_p·p_p``); where one is sure and the other is not (a parent reading data of a
    task it was not trained on), the sure one leads."""
    stacked = torch.stack(distributions)  # (parents, ..., classes)
    entropy = -torch.xlogy(stacked, stacked).sum(dim=-1, keepdim=True)  # 0·log 0 = 0
    log_w = torch.tensor(weights, dtype=stacked.dtype, device=stacked.device).log()
    alpha = (log_w.view(-1, *([1] * (stacked.dim() - 1))) - entropy).softmax(dim=0)
    return (alpha * stacked).sum(dim=0)


def refit_targets(members: list[AlignedModel], calibration=None, early=None) -> RefitTargets | None:
    """The refit's fit and held-out targets (None where the merge is not refitted,
    :func:`refit_decision`): call after every model is aligned and before the merge writes into the
    reference, whose outputs are one parent's (the merge refused a refit that cannot run before any
    work, :func:`check_refit`). While the one sweep has still to align B (docs/design.md §5.7) only
    the output target is made, from B itself: B′ is an exact symmetry of B, so their outputs agree."""
    ctx = members[0].ctx
    cfg: RefitOptions = ctx.config.refit
    if not refit_decision(members)[0]:
        return None
    run = members[0].run or open_calibration(ctx, calibration, early)
    parents = member_models(members)  # the reference before the merge, then every model (aligned, or B itself)
    mix = target_mix(model_weights(ctx.config, len(parents)))  # the correction's target weights (§6.7)
    last = layer_module_names(ctx.model_a, ctx.schema)[-1]
    captured = run.predictions if len(members) == 1 and cfg.target == "output" else None
    run.predictions = None
    with ctx.timer.stage("refit"):  # from the calibration pass where it made them, else the parents run again
        fit = captured.chunks["fit"] if captured is not None and captured.chunks["fit"] else None
        heldout = captured.chunks["heldout"] if captured is not None and captured.chunks["heldout"] else None
        source = "calibration pass" if fit and heldout else "parents run again"
        fit = fit or _chunks(ctx, run, "fit", cfg.examples, parents, mix, last)
        heldout = heldout or _chunks(ctx, run, "heldout", cfg.examples, parents, mix, last)
    if not fit:
        raise RaotError("the refit found no fit examples in the calibration data; give more or set refit steps 0")
    # the held-out examples alternate between the halves, so a batch of one example only stops
    stop = [c.rows(0) for c in heldout]
    judge = [j for j in (c.rows(1) for c in heldout) if j.mask.shape[0]]
    return RefitTargets(fit, stop, judge, last, source)


def refit_parameter_names(model: torch.nn.Module, head: set[str], parameters: str = "norms_biases") -> list[str]:
    """The refit's parameters outside the task head: every norm's weight and bias and every
    Linear's (or GPT-2 ``Conv1D``'s) bias — no weight matrix — or (``parameters="all"``) every
    trunk parameter."""
    if parameters == "all":
        return [n for n, p in model.named_parameters() if n not in head and p.is_floating_point()]
    names = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        kind = type(module).__name__
        if isinstance(module, torch.nn.LayerNorm) or kind.endswith(("LayerNorm", "RMSNorm")):
            names += [prefix + n for n, p in module.named_parameters(recurse=False) if n in ("weight", "bias")]
        elif isinstance(module, (torch.nn.Linear, Conv1D)) and module.bias is not None:
            names.append(prefix + "bias")
    present = dict(model.named_parameters())  # tied or shared parameters once
    return [n for n in dict.fromkeys(names) if n in present and n not in head]


def divergences(scores: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per example, the mean over real tokens of ``KL(p̄ ‖ softmax(scores))``, the parents' mixed
    distribution ``p̄`` against the merged model's (one token per example for a classifier)."""
    if scores.dim() == 2:
        scores, target = scores[:, None], target[:, None]
    logq = scores.to(target.dtype).log_softmax(dim=-1)
    kl = (torch.xlogy(target, target) - target * logq).sum(dim=-1)  # 0·log 0 = 0
    m = mask.to(target.dtype)
    return (kl * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


def relative_errors(out: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per example, the squared error of ``out`` to the parents' mix over real tokens, relative to the
    mix's own square: ``Σ_t ‖m_t − ȳ_t‖² / Σ_t ‖ȳ_t‖²`` (1 − this is the refit's fidelity)."""
    m = mask.to(target.dtype)[..., None]
    err = ((out.to(target.dtype) - target) ** 2 * m).sum(dim=(1, 2))
    return err / (target**2 * m).sum(dim=(1, 2)).clamp_min(1e-30)


class _Refit:
    """The merged model as a function of the refit's parameters (float32 masters, float64 for a
    float64 model; passed to the model in its own dtypes, ``functional_call``)."""

    def __init__(self, ctx: PairContext, targets: RefitTargets):
        self.model, self.last, self.target = ctx.model_a, targets.last_layer, ctx.config.refit.target
        present = dict(self.model.named_parameters())
        names = refit_parameter_names(self.model, set(ctx.schema.head_params), ctx.config.refit.parameters)
        self.params = {n: present[n] for n in names}
        self.masters = {
            n: p.detach().to(torch.promote_types(p.dtype, torch.float32)).clone().requires_grad_(True)
            for n, p in self.params.items()
        }
        self.read: list[str] = []  # those the final hidden state reads (a gradient reaches them)

    def errors(self, chunks: list[RefitChunk], *, merged: bool = False) -> torch.Tensor:
        """Per example :func:`relative_errors` of the last layer's stream, or :func:`divergences` of
        the output (``merged``: of the merge as written, without the refit)."""
        swapped = None if merged else {n: m.to(self.params[n].dtype) for n, m in self.masters.items()}
        if not chunks:
            return torch.zeros(0, dtype=torch.float64)
        error = relative_errors if self.target == "hidden" else divergences
        return torch.cat([error(_output(self.model, self.target, self.last, c.inputs, swapped), c.target, c.mask)
                          for c in chunks])  # fmt: skip

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: m.detach().clone() for n, m in self.masters.items()}

    def restore(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, m in self.masters.items():
                m.copy_(values[n])

    def write(self) -> None:
        """The masters into the model's parameters, in their dtypes."""
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.masters[n].to(p.dtype))


@dataclass
class RefitBudget:
    """How many Adam steps the descent takes (docs/design.md §6.11): the number ``refit.steps``
    gives, or, for ``auto``, the most that take at most ``seconds`` — ``refit.budget`` × ``rest``,
    the time the rest of the merge took on this host — at the measured time of a step (``step_s``)
    and of a held-out score (``score_s``, one every ``refit.eval_every`` steps and one at the last),
    rounded down to ``eval_every`` × a power of two (at most ``limit``,
    :data:`raot_hf.config.refit.AUTO_MAX_STEPS`): repeated merges on one host plan alike unless
    the budget lies at such a boundary. ``planned``: the steps planned (``limit`` until a time is
    known)."""

    limit: int
    seconds: float | None = None
    rest: float | None = None
    planned: int = 0
    step_s: float | None = None
    score_s: float | None = None

    def __post_init__(self):
        self.planned = self.limit

    def plan(self, step_s: float, score_s: float, eval_every: int) -> int:
        """Steps whose time, with their held-out scores, fits in ``seconds`` (at least ``eval_every``)."""
        self.step_s, self.score_s = step_s, score_s
        if self.seconds is None:
            return self.planned

        def cost(n: int) -> float:
            return n * step_s + math.ceil(n / eval_every) * score_s

        if cost(self.limit) <= self.seconds:
            self.planned = self.limit
            return self.planned
        n = eval_every
        while 2 * n < self.limit and cost(2 * n) <= self.seconds:
            n *= 2
        self.planned = n
        return n

    def affords(self, eval_every: int) -> bool:
        """Whether the plan holds :data:`MIN_AUTO_SCORES` held-out scores' steps at least."""
        return self.seconds is None or self.cost(MIN_AUTO_SCORES * eval_every, eval_every) <= self.seconds

    def cost(self, steps: int, eval_every: int) -> float:
        """The time ``steps`` steps take with their held-out scores, at the measured times."""
        return steps * (self.step_s or 0.0) + math.ceil(steps / eval_every) * (self.score_s or 0.0)

    def to_dict(self) -> dict[str, Any]:
        steps = "auto" if self.seconds is not None else self.limit
        times = {"seconds": self.seconds, "rest_s": self.rest, "step_s": self.step_s, "score_s": self.score_s}
        return {"steps": steps, "planned": self.planned, **times}


def _descend(
    refit: _Refit, targets: RefitTargets, cfg, best_loss: float, budget: RefitBudget, progress: bool = False
) -> tuple[dict, int, list, int]:
    """Adam on the fit chunks (one per step, in turn), scored on the held-out ``stop`` half every
    ``eval_every`` steps (and at the last) against the merge's loss there ``best_loss``, for the
    steps ``budget`` plans — from the first step's time, then again from the first ``eval_every``
    steps' and their score's; returns the best values, their step (0: none beat the merge), the
    curve and the steps run."""
    leaves = list(refit.masters.values())
    optimizer = torch.optim.Adam(leaves, lr=cfg.lr)
    best, best_step, curve, waited, step = refit.snapshot(), 0, [], 0, 0
    bar = tqdm(total=budget.planned, desc="refit", disable=not progress)
    start = time.perf_counter()
    score_s = budget.score_s or 0.0
    while step < budget.planned:
        loss = refit.errors([targets.fit[step % len(targets.fit)]]).mean()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)  # no weight matrix's gradient is made
        if not step:
            refit.read = [n for n, g in zip(refit.masters, grads, strict=True) if g is not None]
        for leaf, g in zip(leaves, grads, strict=True):
            leaf.grad = g  # None for a parameter the final hidden state does not read: Adam leaves it
        optimizer.step()
        step += 1
        bar.update(1)
        if step == 1:  # the first step's measured time: the plan, held from here on
            steps = budget.plan(time.perf_counter() - start, score_s, cfg.eval_every)
            _planned(budget, max(steps, 1), bar, cfg.eval_every)
        if step % cfg.eval_every and step < budget.planned:
            continue
        with torch.no_grad():
            value = float(refit.errors(targets.stop).mean())
        curve.append({"step": step, "train": float(loss.detach()), "heldout": value})
        bar.set_postfix(heldout=f"{value:.4g}", refresh=False)
        if value < best_loss:
            best, best_step, best_loss, waited = refit.snapshot(), step, value, 0
        else:
            waited += 1
            if waited >= cfg.patience:
                break
    bar.close()
    return best, best_step, curve, step


def _planned(budget: RefitBudget, steps: int, bar, eval_every: int) -> None:
    """Tell the progress bar and the log how many steps the budget plans, about how long they will
    take, and why."""
    if bar.total != steps:
        bar.total = steps
        bar.refresh()
    if budget.seconds is None:
        why = "refit steps"
    else:
        why = (
            f"at most {budget.seconds / max(budget.rest, 1e-9):g} × the {budget.rest:.1f} s the rest of the merge took"
        )
    logger.info("refit: %d Adam steps at most, about %.1f s (%.3g s a step; %s)", steps,
                budget.cost(steps, eval_every), budget.step_s, why, extra=_STAGE)  # fmt: skip


#: A step's cost in forwards of its examples: the forward, and the backward at about twice it.
STEP_FORWARDS = 3.0
#: The fewest held-out scores (of ``refit.eval_every`` steps each) an ``auto`` budget must afford
#: for the descent to run: fewer steps rarely move the merge, and would cost their time for nothing.
MIN_AUTO_SCORES = 2


def _budget(ctx: PairContext, targets: RefitTargets, cfg, score_s: float) -> RefitBudget:
    """The descent's :class:`RefitBudget`: ``refit.steps`` given, or ``auto`` — ``refit.budget`` ×
    the time every other stage of the merge has taken so far, planned first from the held-out
    score's measured time (a step: :data:`STEP_FORWARDS` forwards of a fit chunk's examples)."""
    if cfg.steps != "auto":
        budget = RefitBudget(int(cfg.steps))
        budget.score_s = score_s
        return budget
    rest = sum(t for name, t in ctx.timer.times.items() if name != "refit")
    budget = RefitBudget(cfg.max_steps, cfg.budget * rest, rest)
    scored = max(1, sum(int(c.mask.shape[0]) for c in targets.stop))
    per_step = max(int(c.mask.shape[0]) for c in targets.fit)
    budget.plan(STEP_FORWARDS * score_s * per_step / scored, score_s, cfg.eval_every)  # before a step is run
    return budget


def refit_merged(members: list[AlignedModel], targets: RefitTargets | None) -> RefitRecord | None:
    """Refit the merged model (the reference's module, after the merge) to ``targets``; keep the refit
    iff it beats the merge without it on the judged half of the held-out examples, else leave every
    parameter as it was. Returns the report's ``refit`` record (None when the refit is off; whether
    it ran and why when ``auto`` chose not to)."""
    ctx = members[0].ctx
    cfg: RefitOptions = ctx.config.refit
    if not cfg.enabled:
        return None
    run, why = refit_decision(members)
    if targets is None or not run:
        return RefitRecord(ran=False, kept=False, reason=why, mode=cfg.mode)
    with ctx.timer.stage("refit"), torch.enable_grad():
        refit = _Refit(ctx, targets)
        budget = None
        with torch.no_grad():
            before = refit.errors(targets.judge, merged=True)
            scored = time.perf_counter()
            before_stop = refit.errors(targets.stop, merged=True)  # timed: a held-out score's cost
            score_s = time.perf_counter() - scored
        few = before.numel() < MIN_GATE_EXAMPLES
        followed = float(before_stop.mean()) <= FOLLOWED if before_stop.numel() else False
        if few:  # nothing to compete on: the refit could not be kept
            logger.warning("refit: fewer than %d held-out examples to judge it; not run", MIN_GATE_EXAMPLES)
        short = False
        if not (few or followed):
            budget = _budget(ctx, targets, cfg, score_s)
            short = not budget.affords(cfg.eval_every)
        if few or followed or short:
            best, best_step, curve, steps = {}, 0, [], 0
        else:
            progress = ctx.dist.is_main
            best, best_step, curve, steps = _descend(refit, targets, cfg, float(before_stop.mean()), budget, progress)
        after, test = before, None
        if best_step:
            refit.restore(best)
            with torch.no_grad():
                after = refit.errors(targets.judge)
            # per judged example the refit's gain over the merge is its loss before − after; the
            # judge half chose nothing, so its test is not optimistic (docs/design.md §6.11)
            test = paired_test(before - after, z=cfg.z, floor=MIN_GAIN * float(before.mean()), sign_test=True)
            if test.passed:
                refit.write()
    kept = bool(test is not None and test.passed)
    if test is not None:
        reason = test.reason
    elif few:
        reason = f"fewer than {MIN_GATE_EXAMPLES} held-out examples"
    elif followed:
        reason = f"the merge already follows its parents (held-out loss ≤ {FOLLOWED:g}); not run"
    elif short:
        reason = (
            f"the budget affords fewer than {MIN_AUTO_SCORES * cfg.eval_every} steps ({budget.seconds:.1f} s = "
            f"{cfg.budget:g} × the rest of the merge, {budget.step_s:.2f} s a step); not run "
            "(refit steps sets a number)"
        )
        logger.info("refit: %s", reason, extra=_STAGE)
    else:
        reason = "no held-out score beat the merge without the refit"
    loss = lambda errors: float(errors.mean()) if errors.numel() else None  # noqa: E731
    record = RefitRecord(
        ran=True, kept=kept, reason=reason, mode=cfg.mode, decision=why, target=cfg.target,
        targets_from=targets.source, teacher=cfg.teacher if cfg.target == "output" else None, steps=steps,
        best_step=best_step, parameters=len(refit.read), values=int(sum(refit.params[n].numel() for n in refit.read)),
        examples=int(sum(c.mask.shape[0] for c in targets.fit)),
        stop_examples=int(sum(c.mask.shape[0] for c in targets.stop)), heldout_examples=int(before.numel()),
        heldout_loss_before=loss(before), heldout_loss_after=loss(after),
        heldout_gain=test.mean if test is not None else None, heldout_stderr=test.stderr if test is not None else None,
        curve=tuple(curve), budget=budget.to_dict() if budget is not None else None,
    )  # fmt: skip
    logger.info("refit: held-out loss %s → %s after %d steps (best %d): %s (%s)", record.heldout_loss_before,
                record.heldout_loss_after, steps, best_step, "kept" if kept else "dropped", reason)  # fmt: skip
    return record
