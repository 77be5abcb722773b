"""Stage: the refit of the merged model, end to end and label-free (docs/design.md §6.11; opt-in,
``refit.steps`` > 0).

After the merge (and its layer-wise correction, §6.7) a low-dimensional subset of the merged
model's parameters — the norms' weights and biases and the Linears' biases, never a weight matrix —
is fitted by Adam so that the merged model's final hidden states follow the mix of its parents'
(the per-model merge weights normalised, as the correction's target). The parents' outputs are
captured before the merge writes into the reference's module (:func:`refit_targets`). Held-out
examples stop the descent early, and the refit competes with the merge without it: it is kept
only if its per-example held-out fidelity beats the merge's by the gate's paired test (§5.2),
else nothing is written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.pytorch_utils import Conv1D

from raot_hf.errors import RaotError
from raot_hf.gate import paired_test
from raot_hf.gate.fidelity import layer_module_names
from raot_hf.gate.merge import MIN_GATE_EXAMPLES
from raot_hf.hooks import capture_calls
from raot_hf.refine import calibration_examples
from raot_hf.stages.calibrate import open_calibration
from raot_hf.stages.context import PairContext, on_device_of
from raot_hf.stages.correct import target_mix
from raot_hf.stages.members import Member, member_models, model_weights

logger = logging.getLogger("raot_hf.stages.refit")

_OFFLOADED = (
    "refit.steps > 0 runs the merged model forward and backward in memory, but the models were offloaded "
    "layer by layer (docs/design.md §7.4); load them in memory (offload='never', --offload never) or set refit steps 0"
)


def refuse_offloaded_refit(ctx: PairContext) -> None:
    """Refuse a refit of offloaded models before any work (the refit holds the whole model's graph)."""
    if ctx.config.refit.steps and len(ctx.working_files):
        raise RaotError(_OFFLOADED)


@dataclass
class RefitChunk:
    """One calibration batch of the refit: its inputs, real tokens (``(rows, seq)`` bool) and the
    target, the parents' mix of their last layer's outputs."""

    inputs: dict[str, torch.Tensor]
    mask: torch.Tensor
    target: torch.Tensor


@dataclass
class RefitTargets:
    """What the refit reads, captured before the merge: the fit and held-out chunks and the module
    of the last layer, whose output is the final hidden state."""

    fit: list[RefitChunk]
    heldout: list[RefitChunk]
    last_layer: str
    seconds: float  # the parents' forwards that made the targets


def _last_output(model: torch.nn.Module, last: str, inputs: dict, params: dict | None = None) -> torch.Tensor:
    """The stream leaving the last layer (``params``: parameters swapped in, differentiable)."""
    return capture_calls(model, [last], on_device_of(model, inputs), params=params)[0].output


@torch.no_grad()
def _chunks(ctx: PairContext, run, split: str, count: int, parents: list, mix: list[float], last: str):
    """At most ``count`` examples of ``split``, each chunk with the parents' mix ``Σ w_p·y_p``."""
    out = []
    for example in calibration_examples(ctx, run, split, count):
        target = None
        for model, w in zip(parents, mix, strict=True):
            y = _last_output(model, last, example["inputs"])
            y = y.to(torch.promote_types(y.dtype, torch.float32))  # the mix in float32 at least
            target = w * y if target is None else target.add_(y, alpha=w)
        mask = example["mask"] if example["mask"] is not None else torch.ones(target.shape[:2], dtype=torch.bool)
        out.append(RefitChunk(example["inputs"], mask.to(target.device), target))
    return out


def refit_targets(members: list[Member], calibration=None, early=None) -> RefitTargets | None:
    """The refit's fit and held-out targets (None when ``refit.steps`` is 0): call after every model is
    aligned and before the merge writes into the reference, whose outputs are one parent's (the
    merge refused an offloaded refit before any work, :func:`refuse_offloaded_refit`)."""
    ctx = members[0].ctx
    cfg = ctx.config.refit
    if cfg.steps == 0:
        return None
    run = members[0].run or open_calibration(ctx, calibration, early)
    parents = member_models(members)  # the reference before the merge, then every aligned model
    mix = target_mix(model_weights(ctx.config, len(parents)))  # the correction's target weights (§6.7)
    last = layer_module_names(ctx.model_a, ctx.schema)[-1]
    started = time.perf_counter()
    with ctx.timer.stage("refit"):
        fit = _chunks(ctx, run, "fit", cfg.examples, parents, mix, last)
        heldout = _chunks(ctx, run, "heldout", cfg.examples, parents, mix, last)
    if not fit:
        raise RaotError("the refit found no fit examples in the calibration data; give more or set refit steps 0")
    return RefitTargets(fit, heldout, last, time.perf_counter() - started)


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
        self.model, self.last = ctx.model_a, targets.last_layer
        present = dict(self.model.named_parameters())
        names = refit_parameter_names(self.model, set(ctx.schema.head_params), ctx.config.refit.parameters)
        self.params = {n: present[n] for n in names}
        self.masters = {
            n: p.detach().to(torch.promote_types(p.dtype, torch.float32)).clone().requires_grad_(True)
            for n, p in self.params.items()
        }
        self.read: list[str] = []  # those the final hidden state reads (a gradient reaches them)

    def errors(self, chunks: list[RefitChunk], *, merged: bool = False) -> torch.Tensor:
        """Per example :func:`relative_errors` (``merged``: of the merge as written, without the refit)."""
        swapped = None if merged else {n: m.to(self.params[n].dtype) for n, m in self.masters.items()}
        if not chunks:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([relative_errors(_last_output(self.model, self.last, c.inputs, swapped), c.target, c.mask)
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


def _descend(refit: _Refit, targets: RefitTargets, cfg, best_loss: float) -> tuple[dict, int, list, int]:
    """Adam on the fit chunks (one per step, in turn), scored on the held-out ones every
    ``eval_every`` steps against the merge's held-out loss ``best_loss``; returns the best values,
    their step (0: none beat the merge), the curve and the steps run."""
    leaves = list(refit.masters.values())
    optimizer = torch.optim.Adam(leaves, lr=cfg.lr)
    best, best_step, curve, waited, step = refit.snapshot(), 0, [], 0, 0
    while step < cfg.steps:
        loss = refit.errors([targets.fit[step % len(targets.fit)]]).mean()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)  # no weight matrix's gradient is made
        if not step:
            refit.read = [n for n, g in zip(refit.masters, grads, strict=True) if g is not None]
        for leaf, g in zip(leaves, grads, strict=True):
            leaf.grad = g  # None for a parameter the final hidden state does not read: Adam leaves it
        optimizer.step()
        step += 1
        if step % cfg.eval_every and step < cfg.steps:
            continue
        with torch.no_grad():
            value = float(refit.errors(targets.heldout).mean())
        curve.append({"step": step, "train": float(loss.detach()), "heldout": value})
        if value < best_loss:
            best, best_step, best_loss, waited = refit.snapshot(), step, value, 0
        else:
            waited += 1
            if waited >= cfg.patience:
                break
    return best, best_step, curve, step


def refit_merged(members: list[Member], targets: RefitTargets | None) -> dict[str, Any] | None:
    """Refit the merged model (the reference's module, after the merge) to ``targets``; keep the refit
    iff it beats the merge without it on the held-out examples, else leave every parameter as it was.
    Returns the report's ``refit`` record (None when the refit is off)."""
    if targets is None:
        return None
    ctx = members[0].ctx
    cfg = ctx.config.refit
    started = time.perf_counter()
    with ctx.timer.stage("refit"), torch.enable_grad():
        refit = _Refit(ctx, targets)
        with torch.no_grad():
            before = refit.errors(targets.heldout, merged=True)
        if before.numel() < MIN_GATE_EXAMPLES:  # nothing to compete on: the refit could not be kept
            logger.warning("refit: fewer than %d held-out examples; not run", MIN_GATE_EXAMPLES)
            best, best_step, curve, steps = {}, 0, [], 0
        else:
            best, best_step, curve, steps = _descend(refit, targets, cfg, float(before.mean()))
        after, test = before, None
        if best_step:
            refit.restore(best)
            with torch.no_grad():
                after = refit.errors(targets.heldout)
            # per held-out example the fidelity is 1 − error: the refit's gain over the merge is before − after
            test = paired_test(before - after, z=ctx.config.gate.z, sign_test=True)
            if test.passed:
                refit.write()
    kept = bool(test is not None and test.passed)
    if test is not None:
        reason = test.reason
    elif before.numel() < MIN_GATE_EXAMPLES:
        reason = f"fewer than {MIN_GATE_EXAMPLES} held-out examples"
    else:
        reason = "no held-out score beat the merge without the refit"
    loss = lambda errors: float(errors.mean()) if errors.numel() else None  # noqa: E731
    record = {
        "kept": kept,
        "reason": reason,
        "steps": steps,
        "best_step": best_step,
        "parameters": len(refit.read),
        "values": int(sum(refit.params[n].numel() for n in refit.read)),
        "examples": int(sum(c.mask.shape[0] for c in targets.fit)),
        "heldout_examples": int(before.numel()),
        "heldout_loss_before": loss(before),
        "heldout_loss_after": loss(after),
        "heldout_gain": test.mean if test is not None else None,
        "heldout_stderr": test.stderr if test is not None else None,
        "curve": curve,
        "seconds": targets.seconds + time.perf_counter() - started,
    }
    logger.info("refit: held-out loss %s → %s after %d steps (best %d): %s (%s)", record["heldout_loss_before"],
                record["heldout_loss_after"], steps, best_step, "kept" if kept else "dropped", reason)  # fmt: skip
    return record
