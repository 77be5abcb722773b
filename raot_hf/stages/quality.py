"""Stage: how closely the merged model follows its parents, without labels (docs/design.md §6.8).

On the held-out rows the B′ ≡ B check replays, A runs before the merge, B′ and the merged model after.
For logits: the merged predictions' agreement with each parent's, the parents' with each other, and
the mean KL(parent ‖ merged) per position; for hidden states, the relative squared error to each parent.
For a mixture of experts, per layer, the fraction of real tokens whose top-k experts differ between
each parent and the merge (docs/design.md §10.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raot_hf.adapters.schema import ModelSchema
from raot_hf.hooks import Hooks, first_tensor
from raot_hf.stages.context import PairContext, on_device_of
from raot_hf.symmetry.equivalence import primary_outputs


@dataclass(frozen=True)
class ParentOutputs:
    """A parent's primary outputs on the quality inputs, and its routing there: per input, each
    mixture-of-experts layer's chosen experts (empty for a dense model)."""

    outputs: list[dict[str, torch.Tensor]]
    routing: list[dict[int, torch.Tensor]]


@torch.no_grad()
def outputs_and_routing(model: torch.nn.Module, schema: ModelSchema, x: dict) -> tuple[dict, dict[int, torch.Tensor]]:
    """``model``'s primary outputs on ``x`` and, per mixture-of-experts layer, the experts its router
    chooses for every real token (real tokens × k, each row sorted), from one forward."""
    chosen: dict[int, torch.Tensor] = {}
    blocks = schema.expert_layers
    mask = x.get("attention_mask")
    with Hooks() as hooks:
        for block in blocks:

            def record(_args, out, block=block):
                logits = first_tensor(out)
                top = torch.topk(logits.reshape(-1, logits.shape[-1]).float(), block.top_k, dim=-1).indices
                real = (
                    mask.reshape(-1).bool().to(top.device)
                    if mask is not None and mask.numel() == top.shape[0]
                    else None
                )
                chosen[block.layer] = (top if real is None else top[real]).sort(-1).values.cpu()

            hooks.on_output(model.get_submodule(block.router), record)
        outputs = primary_outputs(model, x)
    return outputs, chosen


def routing_change(chosen: dict[str, list[dict[int, torch.Tensor]]]) -> list[dict[str, Any]]:
    """Per mixture-of-experts layer, the fraction of tokens whose top-k experts differ between the
    merge (``"m"``) and each parent (``"a"``, ``"b"``), and between the parents."""
    out = []
    for layer in sorted(chosen["m"][0]) if chosen["m"] else []:
        sets = {side: torch.cat([c[layer] for c in chosen[side]]) for side in chosen}
        record: dict[str, Any] = {"layer": layer, "tokens": int(sets["m"].shape[0])}
        for side in ("a", "b"):
            record[f"changed_{side}"] = float((sets[side] != sets["m"]).any(-1).double().mean())
        record["parents_differ"] = float((sets["a"] != sets["b"]).any(-1).double().mean())
        out.append(record)
    return out


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


def reference_outputs(ctx: PairContext, inputs: list[dict]) -> ParentOutputs:
    """A's primary outputs and routing on ``inputs`` (call before the merge writes into A's module)."""
    pairs = [outputs_and_routing(ctx.model_a, ctx.schema, on_device_of(ctx.model_a, x)) for x in inputs]
    return ParentOutputs([o for o, _ in pairs], [r for _, r in pairs])


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


def merge_quality(ctx: PairContext, inputs: list[dict], parent_a: ParentOutputs) -> dict[str, Any] | None:
    """The label-free figures of the merged model (A's module after the merge) against A (its
    outputs ``parent_a`` from before the merge) and B′ (run now: the merge leaves it as aligned);
    a parent whose label space is not the merged model's is left out."""
    if not inputs:
        return None
    outputs_a = parent_a.outputs
    chosen: dict[str, list[dict[int, torch.Tensor]]] = {"a": parent_a.routing, "b": [], "m": []}
    logits: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "m": []}
    hidden: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "m": []}
    # B′ is compared only when its classes are the merged model's (A's module; the head policy chose them)
    labels = [getattr(model.config, "id2label", None) for model in (ctx.model_a, ctx.model_b)]
    comparable = {"a": True, "b": labels[0] == labels[1]}
    examples = 0
    for x, out_a in zip(inputs, outputs_a, strict=True):
        out_b, routing_b = outputs_and_routing(ctx.model_b, ctx.schema, on_device_of(ctx.model_b, x))
        out_m, routing_m = outputs_and_routing(ctx.model_a, ctx.schema, on_device_of(ctx.model_a, x))
        chosen["b"].append(routing_b)
        chosen["m"].append(routing_m)
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
    if ctx.schema.expert_layers:
        report["routing"] = routing_change(chosen)
    return report
