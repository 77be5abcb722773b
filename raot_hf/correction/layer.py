"""One layer of the sequential correction pass (docs/design.md §6.7): every parent's layer runs
once on its carried states, M's layer runs with the merged parameters as often as the correction
needs, and every model's states move on. A *site* is a module of the layer whose input rows
(n × in) and output rows (n × out) over the chunk's real tokens a callback reads, so nothing larger
than one chunk's activations is held, except the parents' outputs at the sites a fit needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from raot_hf.correction.carry import Carried, recording, rows
from raot_hf.hooks import Hooks, first_tensor

SiteCallback = Callable[[int, str, torch.Tensor, torch.Tensor], None]


def _relative(params: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    n = len(prefix) + 1
    return {k[n:]: v for k, v in params.items() if k.startswith(prefix + ".")}


def _per_token(x: torch.Tensor, chunk: Carried) -> bool:
    """Whether a module's input has one row per position of the chunk (DeBERTa's relative-position
    projections read the relative embeddings instead, and are not corrected)."""
    return x.shape[:-1].numel() == chunk.mask.numel()


@dataclass(frozen=True)
class KeptParents:
    """The parents' outputs of one layer on the carried chunks, kept from the calibration pass
    (docs/design.md §5.7), so that their layer does not run again: ``rows(side, chunk, site)``, a
    site's real-token output rows on a chunk, in the merge's basis (B′'s for B), or None where
    nothing was kept; ``states(side, chunk)``, the layer's output there where something reads it
    (the last layer's: the final readers' refit), else None."""

    rows: Callable[[str, int, str], torch.Tensor | None]
    states: Callable[[str, int], torch.Tensor | None]


@dataclass
class LayerPass:
    """Layer ``prefix`` over the carried ``chunks``: its module in every parent (``parents``: side
    → module; ``"a"`` is the reference, whose module M's layer computes with); ``kept``: the
    parents' outputs of the layer, read instead of running their layer."""

    chunks: list[Carried]
    prefix: str
    parent_modules: dict[str, torch.nn.Module]
    outs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    kept: KeptParents | None = None

    @property
    def module_a(self) -> torch.nn.Module:
        """The reference's module (M's layer runs it with the merged parameters)."""
        return self.parent_modules["a"]

    def parents(self, sites: list[str], on_site: Callable[[str, int, str, torch.Tensor], None]) -> None:
        """Run every parent's layer on every chunk (``on_site(side, chunk, site, y)`` with the site's
        output rows, in the model's precision); their outputs are the states entering the next layer.
        With ``kept`` outputs the sites' rows are read instead, and only the states something reads
        are carried."""
        if self.kept is not None:
            self.outs = {}
            for side in self.parent_modules:
                for i in range(len(self.chunks)):
                    for name in sites:
                        y = self.kept.rows(side, i, name)
                        if y is not None:
                            on_site(side, i, name, y)
                states = [self.kept.states(side, i) for i in range(len(self.chunks))]
                if all(x is not None for x in states):
                    self.outs[side] = states
            return
        for side, module in self.parent_modules.items():
            out = self.outs.setdefault(side, [])
            out.clear()
            for i, c in enumerate(self.chunks):

                def report(name, x, y, side=side, i=i, c=c):
                    if _per_token(x, c):
                        on_site(side, i, name, rows(y, c.mask))

                with torch.no_grad(), recording(module, sites, report):
                    out.append(c.calls[side](module, c.hidden[side]))

    def merged(
        self,
        params: dict[str, torch.Tensor],
        sites: list[str],
        on_site: SiteCallback,
        *,
        stop: bool = False,
        stop_after: Callable[[str], bool] | None = None,
    ) -> list[torch.Tensor | None]:
        """Run M's layer (A's module with the merged ``params``, full names) on every chunk; returns
        its outputs (``on_site(chunk, site, x, y)``: rows in the model's precision). ``stop``: skip
        the rest of the layer once every site has reported; ``stop_after(site)``: skip it once that
        site has reported and this says so (the chunk's output is then None)."""
        rel, outs = _relative(params, self.prefix), []
        for i, c in enumerate(self.chunks):
            pending = set(sites)

            def report(name, x, y, i=i, c=c, pending=pending):
                if _per_token(x, c):
                    on_site(i, name, rows(x, c.mask), rows(y, c.mask))
                    pending.discard(name)
                    if (stop and not pending) or (stop_after is not None and stop_after(name)):
                        raise _SitesDone

            try:
                with torch.no_grad(), recording(self.module_a, sites, report):
                    outs.append(c.calls["m"](self.module_a, c.hidden["m"], rel))
            except _SitesDone:
                outs.append(None)
        return outs

    def merged_fitting(
        self,
        params: dict[str, torch.Tensor],
        readers_by_input: list[list[str]],
        fit: Callable[[list[str], torch.Tensor], tuple[dict, list[str]]],
        check: Callable[[str, torch.Tensor, torch.Tensor], dict],
    ) -> list[torch.Tensor]:
        """One forward of M's layer over the single chunk, refitting as it goes: when the forward
        reaches the first Linear reading an input (its one-row-per-position call), ``fit(readers,
        x)`` gets that input's rows (model precision) and returns its readers' new parameters (full
        names), which the running layer then computes with, and the readers whose decision waits
        for their own outputs: after such a Linear has run, ``check(name, x, y)`` gets its input and
        output rows and returns its new parameters (none: kept), with which it runs again.
        ``readers_by_input``: the Linears reading each input (:class:`SharedInputs`). Returns M's
        layer output, every Linear corrected. Only for one chunk: a fit needs every example's
        inputs before its readers run."""
        (c,) = self.chunks
        rel = {k: v.clone() for k, v in _relative(params, self.prefix).items()}  # written in place
        first = {readers[0]: readers for readers in readers_by_input}
        done: set[str] = set()
        waiting: set[str] = set()
        n = len(self.prefix) + 1

        def write(new: dict) -> None:
            for key, value in new.items():
                rel[key[n:]].copy_(value)

        def before(name, args):
            x = args[0]
            if name in done or not _per_token(x, c):
                return
            done.add(name)
            new, wait = fit(first[name], rows(x, c.mask))
            write(new)
            waiting.update(wait)

        def after(name, module, args, out):
            x = args[0]
            if name not in waiting or not _per_token(x, c):
                return None
            waiting.discard(name)
            new = check(name, rows(x, c.mask), rows(first_tensor(out), c.mask))
            if not new:
                return None
            write(new)  # the swapped-in parameters are rel's tensors: the module now computes with the new ones
            return module(*args)

        with torch.no_grad(), Hooks() as hooks:
            for readers in readers_by_input:
                module = self.module_a.get_submodule(readers[0])
                hooks.on_input(module, lambda args, name=readers[0]: before(name, args))
                for name in readers:
                    module = self.module_a.get_submodule(name)
                    hooks.on_output(module, lambda args, out, name=name, m=module: after(name, m, args, out))
            out = c.calls["m"](self.module_a, c.hidden["m"], rel)
        return [out]

    def advance(self, merged_out: list[torch.Tensor]) -> None:
        """Every model's states move on to the next layer (call after :meth:`parents`)."""
        for i, (c, m) in enumerate(zip(self.chunks, merged_out, strict=True)):
            c.next_layer({**{side: out[i] for side, out in self.outs.items()}, "m": m})


class _SitesDone(Exception):
    """Raised inside M's layer once every site of a fit has reported (:meth:`LayerPass.merged`)."""


@dataclass(frozen=True)
class SharedInputs:
    """A layer's sites in call order, gathered by the input tensor they read: ``readers``, the sites
    reading each input, inputs in call order; ``once``: every site is called once per chunk (a
    forward for one input's readers may then stop after the last of them)."""

    readers: list[list[str]]
    once: bool


@torch.no_grad()
def shared_input_sites(layer: LayerPass, params: dict, sites: list[str]) -> SharedInputs:
    """``sites`` in the order the layer first calls them, those reading one input together (q, k,
    v; gate, up), the readers of each input fitted on the inputs that the Linears corrected before
    them produce. Sites whose input is not per token (DeBERTa's relative-position projections) are left out."""

    c = layer.chunks[0]
    order: list[tuple[str, torch.Tensor]] = []  # the inputs are held, so no address is reused
    calls: dict[str, int] = {}

    def note(name, x, _y):
        if _per_token(x, c):
            calls[name] = calls.get(name, 0) + 1
            if calls[name] == 1:
                order.append((name, x))

    rel = _relative(params, layer.prefix)
    with recording(layer.module_a, sites, note):
        c.calls["m"](layer.module_a, c.hidden["m"], rel)
    readers: list[list[str]] = []
    last = None
    for name, x in order:
        if readers and x.data_ptr() == last.data_ptr() and x.shape == last.shape:
            readers[-1].append(name)
        else:
            readers.append([name])
        last = x
    return SharedInputs(readers, all(n == 1 for n in calls.values()))
