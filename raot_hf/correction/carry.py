"""The sequential pass behind the post-merge corrections (docs/design.md §6.7): A, B′ and the
merged model M run side by side over a few calibration examples, **one layer at a time**, each on
its own hidden states carried from the layer before.

Only the merged layer being corrected is ever built: M's layers are A's modules computing with
merged parameters (``torch.func.functional_call``), so A's own parameters serve A's forward until
its layer has been passed and the corrected merged layer is written into it — no third copy of
the model. The layer calls (attention masks, rotary position embeddings, DeBERTa's relative
embeddings) are captured once, at layer 0's input, from each model's own forward; the hidden
states are replaced as the pass moves on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.func import functional_call

from raot_hf.errors import RaotError
from raot_hf.hooks import Hooks, capture_calls, first_tensor


@dataclass
class LayerCall:
    """A layer's call without its hidden states: the other positional args and the kwargs."""

    args: tuple
    kwargs: dict
    hidden_in_kwargs: bool

    def __call__(self, module: torch.nn.Module, hidden: torch.Tensor, params: dict | None = None) -> torch.Tensor:
        """Run ``module`` (with ``params`` swapped in, if given) on ``hidden``; returns the layer's output states."""
        if self.hidden_in_kwargs:
            args, kwargs = self.args, {**self.kwargs, "hidden_states": hidden}
        else:
            args, kwargs = (hidden, *self.args), self.kwargs
        out = module(*args, **kwargs) if params is None else functional_call(module, params, args, kwargs)
        return first_tensor(out)


@dataclass
class Carried:
    """One chunk of correction examples: the real-token mask, and per model (the parents' sides
    "a", "b", … and M's "m") the layer call and the hidden states entering the current layer."""

    mask: torch.Tensor  # (rows, seq) bool
    calls: dict[str, LayerCall]
    hidden: dict[str, torch.Tensor]


@torch.no_grad()
def layer0_call(model: torch.nn.Module, layer0: str, inputs: dict, params: dict | None = None):
    """Run ``model`` (with ``params`` swapped in) up to layer 0 and return its call and its input states."""
    call = capture_calls(model, [layer0], inputs, params=params, outputs=False)[0]
    if call is None:
        raise RaotError("layer 0 did not run during the correction pass; report this")
    if call.args:
        return LayerCall(tuple(call.args[1:]), call.kwargs, False), call.args[0]
    rest = {k: v for k, v in call.kwargs.items() if k != "hidden_states"}
    return LayerCall((), rest, True), call.kwargs["hidden_states"]


@contextmanager
def recording(module: torch.nn.Module, names: list[str], on_call: Callable[[str, torch.Tensor, torch.Tensor], None]):
    """Within the block, every call of the submodules ``names`` of ``module`` (relative names)
    reports ``(name, input, output)`` to ``on_call``."""
    with Hooks() as hooks:
        for name in names:
            hooks.on_output(module.get_submodule(name), lambda args, out, n=name: on_call(n, args[0], out))
        yield


def rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The real-token rows of an activation (…, seq, k) as (n, k), in x's precision."""
    return x.reshape(*mask.shape, x.shape[-1])[mask.to(x.device)]


def capture(parents: dict, layer0: str, batches: Iterator, merged_rest: dict, examples: int) -> list[Carried]:
    """Layer 0's calls and input states of every parent (side → model; ``"a"`` the reference) and
    of M (A's module with the merged non-layer parameters ``merged_rest``) over the first
    ``examples`` rows of ``batches``."""
    chunks, taken = [], 0
    for batch in batches:
        keep = min(examples - taken, len(batch))
        if keep <= 0:
            break
        inputs = {k: v[:keep] for k, v in batch.inputs.items()}
        mask = batch.token_mask[:keep] if batch.token_mask is not None else None
        calls, hidden = {}, {}
        runs = [(side, model, None) for side, model in parents.items()] + [("m", parents["a"], merged_rest)]
        for key, model, params in runs:
            device = next(model.parameters()).device
            call, h = layer0_call(model, layer0, {k: v.to(device) for k, v in inputs.items()}, params)
            calls[key], hidden[key] = call, h
        if mask is None:  # images: every position the model produces is real
            mask = torch.ones(hidden["a"].shape[:2], dtype=torch.bool)
        chunks.append(Carried(mask.to(torch.bool), calls, hidden))
        taken += keep
    return chunks
