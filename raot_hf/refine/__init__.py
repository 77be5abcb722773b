"""Learned alignment: gradient steps on the continuous symmetries of B′, label-free (docs/design.md §5.6).

A refinement Δ (:mod:`raot_hf.refine.parameters`) is fitted so that the merge ``(1−α)·A + α·Δ(B′)``
follows its parents more closely (the gate's model-level fidelity, §5.3). Held-out examples stop
it early, and it must beat the unrefined alignment by the gate's paired test, or nothing changes.
Every step is an exact symmetry, so B″ ≡ B by construction (and checked after it is applied).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.config.options import check_field_types, check_non_negative_int, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError
from raot_hf.gate import paired_test
from raot_hf.gate.fidelity import capture_layers, layer_module_names, relative_squared_error
from raot_hf.hooks import capture_calls
from raot_hf.refine.parameters import RefineParameters, as_transforms, dense_actions, transformed
from raot_hf.symmetry import HeadAlignment, ResidualRotation, Transform, model_state

logger = logging.getLogger("raot_hf.refine")


def _what_to_refine(alignment, schema) -> tuple[list[int], bool]:
    """The layers whose head alignment was applied, and whether the stream rotation was."""
    applied = list(alignment.applied.transforms)
    layers = sorted({t.layer for t in applied if isinstance(t, HeadAlignment)})
    stream = any(isinstance(t, ResidualRotation) for t in applied) and schema.residual.exact in (
        "mean_fixing",
        "orthogonal",
    )
    return layers, stream


def calibration_examples(ctx, run, split: str, count: int) -> list[dict]:
    """At most ``count`` examples of ``split``, by calibration batch: ``{"inputs", "mask"}`` (the
    real tokens, None where every position is one)."""
    out, taken = [], 0
    for batch in run.batches(ctx.preprocessor, split=split):
        keep = min(count - taken, len(batch))
        if keep <= 0:
            break
        inputs = {k: v[:keep] for k, v in batch.inputs.items()}
        mask = batch.token_mask[:keep].bool() if batch.token_mask is not None else None
        out.append({"inputs": inputs, "mask": mask})
        taken += keep
    return out


def _targets(ctx, names: list[str], chunks: list[dict]) -> None:
    """A's and B′'s stream entering layer 0 and leaving the last layer, per chunk (no gradient)."""
    for c in chunks:
        for side, model in (("a", ctx.model_a), ("b", ctx.model_b)):
            device = next(model.parameters()).device
            ends = [names[0], names[-1]] if len(names) > 1 else names[:1]
            calls = capture_layers(model, ends, {k: v.to(device) for k, v in c["inputs"].items()})
            c[side] = (calls[0].hidden.detach(), calls[-1].output.detach())
        if c["mask"] is None:
            c["mask"] = torch.ones(c["a"][1].shape[:2], dtype=torch.bool)


def _merged_output(ctx, last: str, params: dict, inputs: dict) -> torch.Tensor:
    """The merged model's last-layer output (A's module computing with ``params``), differentiable."""
    return capture_calls(ctx.model_a, [last], inputs, params=params)[0].output


class _Objective:
    """Per-example fidelity loss of the merged model as a function of Δ's parameters."""

    def __init__(self, ctx, p: RefineParameters, names: list[str]):
        self.ctx, self.p, self.last = ctx, p, names[-1]
        head = set(ctx.schema.head_params)
        self.state_a = {k: v for k, v in model_state(ctx.model_a).items() if k not in head}
        self.state_b = {k: v for k, v in model_state(ctx.model_b).items() if k not in head}
        self.alpha = ctx.config.alpha

    def merged_params(self) -> dict[str, torch.Tensor]:
        moved = transformed(self.state_b, self.ctx.schema, dense_actions(self.p))
        out = {}
        for k, a in self.state_a.items():
            b = moved.get(k)
            if b is None:
                out[k] = torch.lerp(a, self.state_b[k].to(a.dtype), self.alpha)
            else:
                out[k] = ((1 - self.alpha) * a.to(torch.float64) + self.alpha * b).to(a.dtype)
        return out

    def errors(self, chunks: list[dict], params: dict | None = None) -> torch.Tensor:
        """Per example (1−α)·RSE to A + α·RSE to B″ (the model-level error of §5.3)."""
        params = self.merged_params() if params is None else params
        stream = self.p.stream_matrix()
        out = []
        for c in chunks:
            y = _merged_output(self.ctx, self.last, params, c["inputs"])
            (xa, ya), (xb, yb) = c["a"], c["b"]
            if stream is not None:  # B″ = Δ(B′) computes B′'s stream mapped by Δ's rotation
                xb, yb = xb.to(torch.float64) @ stream, yb.to(torch.float64) @ stream
            err_a = relative_squared_error(y, ya, c["mask"], xa)
            err = (1 - self.alpha) * err_a + self.alpha * relative_squared_error(y, yb, c["mask"], xb)
            out.append(err)
        return torch.cat(out)


def refine_alignment(ctx, alignment, run) -> tuple[list[Transform], dict[str, Any]]:
    """Fit Δ (``config.refine``: steps, learning rate, examples); returns Δ's transforms — empty
    when there is nothing to refine or the refined alignment does not beat the unrefined one on
    held-out examples — and the log for the report."""
    cfg = ctx.config.refine
    layers, stream = _what_to_refine(alignment, ctx.schema)
    if not layers and not stream:
        return [], {"applied": False, "reason": "no applied rotation or head map to refine"}
    started = time.perf_counter()
    names = layer_module_names(ctx.model_a, ctx.schema)
    fit = calibration_examples(ctx, run, "fit", cfg.examples)
    heldout = calibration_examples(ctx, run, "heldout", ctx.config.gate.examples)
    with torch.no_grad():
        _targets(ctx, names, fit + heldout)
    p = RefineParameters.zeros(ctx.schema, layers, stream)
    objective = _Objective(ctx, p, names)
    optimizer = torch.optim.Adam(p.tensors(), lr=cfg.lr)
    with torch.no_grad():
        unrefined = objective.errors(heldout)
    best, best_value, curve = [t.detach().clone() for t in p.tensors()], float(unrefined.mean()), []
    for step in range(cfg.steps):
        optimizer.zero_grad()
        loss = objective.errors([fit[step % len(fit)]]).mean()
        loss.backward()
        optimizer.step()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            with torch.no_grad():
                value = float(objective.errors(heldout).mean())
            curve.append({"step": step + 1, "train": float(loss.detach()), "heldout": value})
            if value < best_value:
                best_value, best = value, [t.detach().clone() for t in p.tensors()]
    with torch.no_grad():
        for t, b in zip(p.tensors(), best, strict=True):
            t.copy_(b)
        refined = objective.errors(heldout)
    verdict = paired_test(unrefined - refined, z=ctx.config.gate.z, sign_test=True)
    log = {
        "applied": verdict.passed,
        "reason": verdict.reason,
        "layers": layers,
        "stream": stream,
        "steps": cfg.steps,
        "examples": sum(int(c["mask"].shape[0]) for c in fit),
        "heldout_examples": int(refined.numel()),
        "error_estimated": float(unrefined.mean()),
        "error_refined": float(refined.mean()),
        "curve": curve,
        "seconds": time.perf_counter() - started,
    }
    logger.info("refinement: held-out error %.4f → %.4f (%s)", unrefined.mean(), refined.mean(), verdict.reason)
    return (as_transforms(p) if verdict.passed else []), log


__all__ = ["RefineParameters", "calibration_examples", "refine_alignment"]


@register_section
@dataclass
class RefineOptions(OptionSection):
    """Learned alignment (docs/design.md §5.6): ``steps`` Adam steps (0: off, learning rate ``lr``)
    on ``examples`` fit examples; the held-out gate set is scored every ``eval_every`` steps and the
    best step kept, applied only if it beats the estimated alignment."""

    section = "refine"

    steps: int = field(default=0, metadata=meta("Learned alignment: gradient steps (default 0: off).", "refine_steps"))
    lr: float = field(
        default=0.01, metadata=meta("Learned alignment: Adam's learning rate (default 0.01).", "refine_lr")
    )
    examples: int = field(
        default=64, metadata=meta("Learned alignment: fit examples it descends on (default 64).", "refine_examples")
    )
    eval_every: int = field(
        default=10, metadata=meta("Learned alignment: steps between held-out scores (default 10).", "refine_eval_every")
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_non_negative_int("refine_steps", self.steps)
        if not self.lr > 0:
            raise RaotError(f"refine_lr={self.lr} must be > 0 (Adam's learning rate)")
        for name, value in (("refine_examples", self.examples), ("refine_eval_every", self.eval_every)):
            if value < 1:
                raise RaotError(f"{name}={value} must be ≥ 1")
