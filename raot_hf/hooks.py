"""The one place forward hooks are registered and removed (docs/architecture.md): :class:`Hooks`
(registered together, removed together, also on error) and :func:`capture_calls`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.func import functional_call


def first_tensor(x) -> torch.Tensor:
    """A module's output (or input tuple) reduced to its first tensor."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    raise TypeError(f"cannot read an activation from {type(x).__name__}")


class Stop(Exception):
    """Raised by a hook to end a forward early (what comes after is not needed)."""


class Hooks:
    """Forward hooks registered on modules, removed together (use as a context manager)."""

    def __init__(self):
        self.handles: list = []

    def on_output(self, module: torch.nn.Module, fn: Callable[[tuple, torch.Tensor], None]) -> Hooks:
        """``fn(inputs, output)`` after every call of ``module``."""
        self.handles.append(module.register_forward_hook(lambda _m, args, out: fn(args, out)))
        return self

    def on_input(self, module: torch.nn.Module, fn: Callable[[tuple], None]) -> Hooks:
        """``fn(inputs)`` before every call of ``module``."""
        self.handles.append(module.register_forward_pre_hook(lambda _m, args: fn(args)))
        return self

    def on_call(self, module: torch.nn.Module, fn: Callable[[tuple, dict], None]) -> Hooks:
        """``fn(args, kwargs)`` before every call of ``module`` (keyword arguments included)."""
        self.handles.append(module.register_forward_pre_hook(lambda _m, a, kw: fn(a, kw), with_kwargs=True))
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


@dataclass
class Call:
    """One module call: its positional args, keyword args and output."""

    args: tuple
    kwargs: dict
    output: torch.Tensor | None

    @property
    def hidden(self) -> torch.Tensor:
        """The hidden states a layer was called with (first positional, or the keyword)."""
        return self.args[0] if self.args else self.kwargs["hidden_states"]


def without_cache(model: torch.nn.Module, inputs: dict) -> dict:
    """A decoder's KV cache would grow each time a captured layer call is replayed."""
    if "use_cache" in inspect.signature(model.forward).parameters:
        return {**inputs, "use_cache": False}
    return inputs


def capture_calls(
    model: torch.nn.Module, names: list[str], inputs: dict, *, params: dict | None = None, outputs: bool = True
) -> list[Call]:
    """Run ``model`` (with ``params`` swapped in, if given) on ``inputs`` until the last of the
    modules ``names`` has run (``outputs=False``: until it is called), keeping each one's call.
    Gradients flow if the caller allows them."""
    modules = [model.get_submodule(n) for n in names]
    calls: list[Call | None] = [None] * len(names)
    last = len(names) - 1

    def before(i):
        def record(args, kwargs):
            calls[i] = Call(args, dict(kwargs), None)
            if i == last and not outputs:
                raise Stop

        return record

    def after(i):
        def record(_args, out):
            calls[i].output = first_tensor(out)
            if i == last:
                raise Stop

        return record

    with Hooks() as hooks:
        for i, module in enumerate(modules):
            hooks.on_call(module, before(i))
            if outputs:
                hooks.on_output(module, after(i))
        try:
            inputs = without_cache(model, inputs)
            model(**inputs) if params is None else functional_call(model, params, (), inputs)
        except Stop:
            pass
    return calls
