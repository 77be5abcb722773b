"""The sequential pass behind the post-merge corrections (docs/design.md §6.7): A, B′ and the
merged model M run side by side over a few calibration examples, **one layer at a time**, each on
its own hidden states carried from the layer before.

M's layers are A's modules computing with merged parameters (``torch.func.functional_call``), so no
third copy of the model is built. Every layer's call (attention masks, which differ for
sliding-window layers, rotary embeddings, DeBERTa's relative embeddings) is captured once from each
model's own forward in which no layer computes; the hidden states are replaced as the pass moves on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.func import functional_call

from raot_hf.errors import RaotError
from raot_hf.hooks import Hooks, Stop, capture_calls, first_tensor, without_cache


@dataclass
class LayerCall:
    """A layer's call without its hidden states: the other positional args and the kwargs."""

    args: tuple
    kwargs: dict
    hidden_in_kwargs: bool

    def bind(self, hidden: torch.Tensor) -> tuple[tuple, dict]:
        """The call's args and kwargs with ``hidden`` as its hidden states."""
        if self.hidden_in_kwargs:
            return self.args, {**self.kwargs, "hidden_states": hidden}
        return (hidden, *self.args), self.kwargs

    def __call__(self, module: torch.nn.Module, hidden: torch.Tensor, params: dict | None = None) -> torch.Tensor:
        """Run ``module`` (with ``params`` swapped in, if given) on ``hidden``; returns the layer's output states."""
        args, kwargs = self.bind(hidden)
        out = module(*args, **kwargs) if params is None else functional_call(module, params, args, kwargs)
        return first_tensor(out)


@dataclass
class Carried:
    """One chunk of correction examples: the real-token mask, and per model (the parents' sides
    "a", "b", … and M's "m") the current layer's call and the hidden states entering it
    (``layers``: every layer's calls; ``layer``: the current one)."""

    mask: torch.Tensor  # (rows, seq) bool
    calls: dict[str, LayerCall]
    hidden: dict[str, torch.Tensor]
    layers: dict[str, list[LayerCall]] | None = None
    layer: int = 0

    def next_layer(self, hidden: dict[str, torch.Tensor]) -> None:
        """Move on to the next layer with these entering states."""
        self.hidden, self.layer = hidden, self.layer + 1
        if self.layers is not None and self.layer < len(next(iter(self.layers.values()))):
            self.calls = {side: calls[self.layer] for side, calls in self.layers.items()}


def _as_call(args: tuple, kwargs: dict) -> tuple[LayerCall, torch.Tensor]:
    if args:
        return LayerCall(tuple(args[1:]), dict(kwargs), False), args[0]
    rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
    return LayerCall((), rest, True), kwargs["hidden_states"]


def _output_tail(out) -> int | None:
    """``out``'s structure if every call can be given it without computing: None (a tensor) or the
    number of trailing ``None`` entries; -1 when it carries tensors beside the states."""
    if isinstance(out, torch.Tensor):
        return None
    return len(out) - 1 if all(x is None for x in out[1:]) else -1


def with_forwards(model: torch.nn.Module, forwards: dict[str, Callable]) -> torch.nn.Module:
    """A stand-in for ``model`` in which each submodule named in ``forwards`` runs the given
    function instead of its forward. The stand-ins are shallow copies of those submodules and of
    the modules above them; every other module, and every parameter, buffer and hook, is the
    model's own: nothing is set on ``model`` (it may be the user's object)."""
    copies: dict[str, torch.nn.Module] = {}

    def copy_of(name: str) -> torch.nn.Module:
        if name not in copies:
            module = model.get_submodule(name)
            twin = object.__new__(type(module))
            twin.__dict__.update(module.__dict__, _modules=dict(module._modules))
            copies[name] = twin
            if name:
                parent, _, leaf = name.rpartition(".")
                copy_of(parent)._modules[leaf] = twin
        return copies[name]

    for name, forward in forwards.items():
        copy_of(name).__dict__["forward"] = forward
    return copy_of("")


@torch.no_grad()
def layer_calls(
    model: torch.nn.Module,
    layer_names: list[str],
    inputs: dict,
    params: dict | None = None,
    tails: dict | None = None,
) -> tuple[list[LayerCall], torch.Tensor]:
    """Every layer's call on ``inputs`` (with ``params`` swapped in, if given) and layer 0's input
    states, from one forward in which every layer returns its input (in layer 0's output structure),
    so that no layer's weights are read; the forward stops after the last layer. ``tails``: the
    pass's record of layer 0's output structure, so that a pass computes layer 0 once. The layers'
    forwards are swapped on a stand-in (:func:`with_forwards`), not on ``model``."""
    modules = [model.get_submodule(n) for n in layer_names]
    seen: list[tuple | None] = [None] * len(modules)
    first: dict[str, object] = {}
    tails = {} if tails is None else tails

    def standin(i: int, module: torch.nn.Module):
        compute = module.forward

        def forward(*args, **kwargs):
            seen[i] = (args, kwargs)
            hidden = args[0] if args else kwargs["hidden_states"]
            if i == 0:
                tail = tails.get(module, -1)
                if tail == -1:  # not met yet, or an output that carries tensors: computed
                    first["out"] = real = compute(*args, **kwargs)
                    tail = _output_tail(real)
                    if tail != -1:
                        tails[module] = tail
                first["tail"] = tail
            tail = first["tail"]
            out = hidden if tail is None else (hidden, *(first["out"][1:] if tail == -1 else [None] * tail))
            if i == len(modules) - 1:
                raise Stop
            return out

        return forward

    runner = with_forwards(model, {n: standin(i, m) for i, (n, m) in enumerate(zip(layer_names, modules, strict=True))})
    try:
        inputs = without_cache(model, inputs)
        runner(**inputs) if params is None else functional_call(runner, params, (), inputs)
    except Stop:
        pass
    calls = [_as_call(*call) for call in seen]
    return [call for call, _ in calls], calls[0][1]


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
            # a router returns (logits, scores, chosen experts): its output rows are the logits (§10)
            hooks.on_output(
                module.get_submodule(name), lambda args, out, n=name: on_call(n, args[0], first_tensor(out))
            )
        yield


def rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The real-token rows of an activation (…, seq, k) as (n, k), in x's precision: a view when
    every position is real (no padding, images), else a copy of the real rows. Read only."""
    if bool(mask.all()):
        return x.reshape(-1, x.shape[-1])
    return x.reshape(*mask.shape, x.shape[-1])[mask.to(x.device)]


def capture(
    parents: dict,
    layer_names: list[str],
    batches: Iterator,
    merged_rest: dict,
    examples: int,
    parent_params: dict[str, dict] | None = None,
    parents_run: bool = True,
) -> list[Carried]:
    """Every layer's calls and layer 0's input states of every parent (side → model; ``"a"`` the
    reference) and of M (A's module with the merged non-layer parameters ``merged_rest``) over the
    first ``examples`` rows of ``batches``; ``parent_params``: side → parameters a parent computes
    with instead of its own (the one sweep's B′ before its module holds them, docs/design.md §5.7);
    ``parents_run`` False: M's only (the parents' outputs are read from the calibration pass)."""
    parent_params = parent_params or {}
    chunks, taken = [], 0
    tails: dict = {}  # layer 0's output structure, learnt once for the pass (layer_calls)
    for batch in batches:
        keep = min(examples - taken, len(batch))
        if keep <= 0:
            break
        inputs = {k: v[:keep] for k, v in batch.inputs.items()}
        mask = batch.token_mask[:keep] if batch.token_mask is not None else None
        layers, hidden = {}, {}
        runs = [(side, model, parent_params.get(side)) for side, model in parents.items()] if parents_run else []
        runs.append(("m", parents["a"], merged_rest))
        for key, model, params in runs:
            device = next(model.parameters()).device
            layers[key], hidden[key] = layer_calls(
                model, layer_names, {k: v.to(device) for k, v in inputs.items()}, params, tails
            )
        if mask is None:  # images: every position the model produces is real
            mask = torch.ones(hidden["m"].shape[:2], dtype=torch.bool)
        calls = {side: every[0] for side, every in layers.items()}
        chunks.append(Carried(mask.to(torch.bool), calls, hidden, layers))
        taken += keep
    return chunks
