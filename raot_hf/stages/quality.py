"""Stage: how closely the merged model follows its parents, without labels (docs/design.md §6.8).

On the held-out rows the B′ ≡ B check replays, A runs before the merge, B′ and the merged model after.
For logits: the merged predictions' agreement with each parent's, the parents' with each other, and
the mean KL(parent ‖ merged) per position; for hidden states, the relative squared error to each parent.
"""

from __future__ import annotations

from typing import Any

import torch

from raot_hf.stages.context import PairContext, on_device_of
from raot_hf.symmetry.equivalence import primary_outputs

_LOGITS = ("logits", "start_logits", "end_logits", "cls_logits")


def quality_inputs(ctx: PairContext, run) -> list[dict[str, torch.Tensor]]:
    """The held-out rows the check replays, else the first held-out rows."""
    if run is None:
        return []
    if run.check_inputs:
        return list(run.check_inputs)

    rows = max(1, run.config.batch_size // run.config.heldout_every)
    for batch in run.batches(ctx.preprocessor, split="heldout"):
        return [{k: v[:rows] for k, v in batch.inputs.items()}]
    return []


def reference_outputs(ctx: PairContext, inputs: list[dict]) -> list[dict]:
    """A's primary outputs on ``inputs`` (call before the merge writes into A's module)."""
    return [primary_outputs(ctx.model_a, on_device_of(ctx.model_a, x)) for x in inputs]


def _positions(x: dict, out: torch.Tensor) -> torch.Tensor:
    """The rows of a logits tensor that are predictions: every example, or every real token."""
    flat = out.reshape(-1, out.shape[-1]).to("cpu", torch.float64)
    mask = x.get("attention_mask")
    if out.ndim == 3 and mask is not None and mask.numel() * out.shape[-1] == out.numel():
        return flat[mask.reshape(-1).bool().cpu()]
    return flat


def _logit_figures(logits: dict[str, list[torch.Tensor]], comparable: dict[str, bool]) -> dict[str, Any]:
    m = torch.cat(logits["m"]).log_softmax(-1)
    out: dict[str, Any] = {"positions": int(m.shape[0])}
    parents = {}
    for side in "ab":
        if not comparable[side]:
            continue
        p = torch.cat(logits[side]).log_softmax(-1)
        parents[side] = p
        out[f"agreement_{side}"] = float((m.argmax(-1) == p.argmax(-1)).double().mean())
        out[f"kl_{side}"] = float((p.exp() * (p - m)).sum(-1).mean())
    if len(parents) == 2:
        out["parents_agreement"] = float((parents["a"].argmax(-1) == parents["b"].argmax(-1)).double().mean())
    return out


def merge_quality(ctx: PairContext, inputs: list[dict], outputs_a: list[dict]) -> dict[str, Any] | None:
    """The label-free figures of the merged model (A's module after the merge) against A (its
    outputs ``outputs_a`` from before the merge) and B′ (run now: the merge leaves it as aligned);
    a parent whose label space is not the merged model's is left out."""
    if not inputs:
        return None
    logits: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "m": []}
    hidden: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "m": []}
    # B′ is compared only when its classes are the merged model's (A's module; the head policy chose them)
    labels = [getattr(model.config, "id2label", None) for model in (ctx.model_a, ctx.model_b)]
    comparable = {"a": True, "b": labels[0] == labels[1]}
    examples = 0
    for x, out_a in zip(inputs, outputs_a, strict=True):
        out_b = primary_outputs(ctx.model_b, on_device_of(ctx.model_b, x))
        out_m = primary_outputs(ctx.model_a, on_device_of(ctx.model_a, x))
        examples += int(next(iter(x.values())).shape[0])
        key = next((k for k in _LOGITS if k in out_m), None)
        if key is not None:
            logits["m"].append(_positions(x, out_m[key]))
            for side, out in (("a", out_a), ("b", out_b)):
                comparable[side] &= key in out and out[key].shape == out_m[key].shape
                if comparable[side]:
                    logits[side].append(_positions(x, out[key]))
        elif "last_hidden_state" in out_m:
            mask = x.get("attention_mask")
            for side, out in (("a", out_a), ("b", out_b), ("m", out_m)):
                h = out["last_hidden_state"].to("cpu", torch.float64)
                hidden[side].append(h[mask.bool().cpu()] if mask is not None else h.reshape(-1, h.shape[-1]))
    report: dict[str, Any] = {"examples": examples}
    if logits["m"]:
        report.update(_logit_figures(logits, comparable))
    elif hidden["m"]:
        a, b, m = (torch.cat(hidden[s]) for s in "abm")
        report.update(
            positions=int(m.shape[0]),
            error_a=float((m - a).pow(2).sum() / a.pow(2).sum().clamp_min(1e-300)),
            error_b=float((m - b).pow(2).sum() / b.pow(2).sum().clamp_min(1e-300)),
        )
    return report
