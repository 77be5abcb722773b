"""The parents' outputs that the one sweep after the solve reads, kept from the calibration pass
(docs/design.md §5.7): over the whole merge, each parent's layer runs once per calibration token.

While the fit phase runs A and B, every Linear of every layer reports its output rows (the real
tokens) on the correction's fit examples — the first ``correction.examples`` fit examples, which
the correction fits each merged layer to (§6.7) — and the last layer its output there; while the
held-out phase runs them, every layer reports its output on the gate's examples — the first
``gate.examples`` held-out examples, padded as their batch is — which the gate and the
correction's competition score against (§5.3). The values go to a temporary file
(:class:`KeptOutputs`), in the activations' own dtype, and the sweep reads them back a layer at a
time instead of running the parents' layers again. B's outputs are in B's basis; the sweep maps
them into B′'s (:func:`raot_hf.symmetry.map_output_rows`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from raot_hf.hooks import Hooks, first_tensor

logger = logging.getLogger("raot_hf.calibration.kept")

#: The share of the free space of the temporary directory the kept outputs may take: past it they
#: are dropped and the sweep runs the parents' layers again (the merge is the same).
DISK_SHARE = 0.5


@dataclass
class _Piece:
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


#: Pieces start at multiples of this (the alignment direct I/O needs of offsets, lengths and buffers).
ALIGN = 4096


def _aligned(nbytes: int) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` (a multiple of :data:`ALIGN`) whose address is a multiple of it."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    pad = (-raw.data_ptr()) % ALIGN
    return raw[pad : pad + nbytes]


def _open_direct(path: str) -> int | None:
    """The file opened again for direct I/O (past the page cache), where the system allows it."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        return os.open(path, os.O_RDWR | flag)
    except OSError:
        return None


class KeptOutputs:
    """Tensors appended under keys to one unlinked temporary file (each key's pieces are read back
    concatenated along their first axis), at most ``budget`` bytes: past it nothing more is kept
    and :attr:`usable` turns False. Thread-safe: a batch-by-batch calibration runs A's forward in a helper thread.

    Written once and read once, the file bypasses the page cache where the system allows
    (``O_DIRECT``, through one staging buffer aligned to :data:`ALIGN`): on the measuring host
    buffered writes of 2.4 GB ran at 0.2 GB/s once the kernel throttled its dirty pages, direct
    ones at 1.0 GB/s — and the cache would hold them beside the merge for nothing."""

    def __init__(self, directory: str | Path | None = None, budget: int | None = None):
        directory = Path(directory or tempfile.gettempdir())
        fd, path = tempfile.mkstemp(dir=directory, prefix="raot-kept-", suffix=".bin")
        self.direct = _open_direct(path)
        os.unlink(path)  # the descriptors keep the file; its space goes when they are closed
        self.fd: int | None = fd
        free = shutil.disk_usage(directory).free
        self.budget = int(DISK_SHARE * free) if budget is None else int(budget)
        self.end = 0
        self.index: dict[tuple, list[_Piece]] = {}
        self.usable = True
        self.why: str | None = None
        self._lock = threading.Lock()
        self._io = threading.Lock()  # the staging buffer's
        self._staged = _aligned(REQUEST) if self.direct is not None else None

    @property
    def nbytes(self) -> int:
        """Bytes written so far."""
        return self.end

    def drop(self, why: str) -> None:
        """Give up keeping (the sweep then runs the parents' layers again); the file is freed."""
        with self._lock:
            if self.usable:
                logger.info("the parents' outputs are not kept for the sweep: %s", why)
            self.usable, self.why, self.index = False, why, {}
            self._close()

    def _close(self) -> None:
        for fd in (self.fd, self.direct):
            if fd is not None:
                os.close(fd)
        self.fd = self.direct = None

    def put(self, key: tuple, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (any shape; its first axis is the one pieces are concatenated along)."""
        if not self.usable:
            return
        data = tensor.detach().to("cpu").contiguous()
        piece_bytes = data.numel() * data.element_size()
        span = -(-piece_bytes // ALIGN) * ALIGN
        with self._lock:
            over = self.usable and self.end + span > self.budget
            if not self.usable or over:
                fd = None
            else:
                offset, fd, direct = self.end, self.fd, self.direct
                self.end += span
                self.index.setdefault(key, []).append(_Piece(offset, tuple(data.shape), data.dtype))
        if over:
            self.drop(f"they would take more than {self.budget / 2**30:.1f} GiB of the temporary directory")
        if fd is None or not piece_bytes:
            return
        flat = data.reshape(-1).view(torch.uint8)
        if direct is None:
            _write_all(fd, memoryview(flat.numpy()), offset)
            return
        with self._io:  # through the one aligned buffer, a request at a time
            for at in range(0, span, REQUEST):
                n = min(REQUEST, span - at)
                real = max(0, min(n, piece_bytes - at))
                self._staged[:real].copy_(flat[at : at + real])
                self._staged[real:n].zero_()
                _write_all(direct, memoryview(self._staged[:n].numpy()), offset + at)

    def has(self, key: tuple) -> bool:
        return self.usable and key in self.index

    def rows(self, key: tuple, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (along the first axis) of the pieces kept under ``key``, concatenated."""
        pieces = self.index[key]
        total = sum(p.shape[0] for p in pieces)
        stop = total if stop is None else stop
        tail = pieces[0].shape[1:]
        out = torch.empty((stop - start, *tail), dtype=pieces[0].dtype)
        row_bytes = _numel(tail) * out.element_size()
        flat = out.reshape(-1).view(torch.uint8)
        done, first = 0, 0
        for p in pieces:
            lo, hi = max(start, first), min(stop, first + p.shape[0])
            if lo < hi:
                nbytes = (hi - lo) * row_bytes
                offset = p.offset + (lo - first) * row_bytes
                if self.direct is not None:  # the aligned span around the rows, a request at a time
                    begin = offset // ALIGN * ALIGN
                    span = -(-(offset + nbytes - begin) // ALIGN) * ALIGN
                    with self._io:
                        for at in range(0, span, REQUEST):
                            n = min(REQUEST, span - at)
                            _read_all(self.direct, memoryview(self._staged[:n].numpy()), begin + at)
                            lo_b, hi_b = max(begin + at, offset), min(begin + at + n, offset + nbytes)
                            if lo_b < hi_b:
                                dst = done + lo_b - offset
                                flat[dst : dst + hi_b - lo_b].copy_(self._staged[lo_b - begin - at : hi_b - begin - at])
                else:
                    _read_all(self.fd, memoryview(flat[done : done + nbytes].numpy()), offset)
                done += nbytes
            first += p.shape[0]
        return out

    def close(self) -> None:
        self._close()
        self.index = {}

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit os may be gone; the descriptors go with the process
            self.close()


#: Bytes per direct request (a multiple of :data:`ALIGN`), through one staging buffer of that size.
REQUEST = 1 << 25


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written : written + REQUEST], offset + written)


def _read_all(fd: int, view: memoryview, offset: int) -> None:
    read = 0
    while read < len(view):
        got = os.preadv(fd, [view[read : read + REQUEST]], offset + read)
        if got <= 0:
            raise OSError("the kept outputs' file ended early")
        read += got


@dataclass
class KeptPlan:
    """What to keep: the layer modules' names, each layer's Linears (names relative to the layer),
    and how many fit (correction) and held-out (gate) examples, counted from the start of each split."""

    layer_names: list[str]
    sites: list[list[str]]
    fit_examples: int
    gate_examples: int


@dataclass
class KeptBatch:
    """A batch as the capture sees it: how many of its first rows are kept, their real-token mask
    (None: every position), the batch's rows and positions, its phase and its number in its split."""

    rows: int
    mask: torch.Tensor | None
    shape: tuple[int, int] | None
    phase: str
    number: int
    calls: dict = field(default_factory=dict)


class OutputCapture:
    """Forward hooks on A's and B's layers and Linears that put their outputs on the kept examples
    into ``store`` while the calibration observes a batch (:meth:`observing`). Keys:
    ``("site", side, layer, name)`` → real-token rows of the fit examples (pieces in batch order);
    ``("final", side)`` → the last layer's output rows there; ``("gate", side, layer, number)`` →
    the layer's padded output on the kept rows of held-out batch ``number``."""

    def __init__(self, models: dict[str, torch.nn.Module], plan: KeptPlan, store: KeptOutputs):
        self.plan, self.store = plan, store
        self.current: KeptBatch | None = None
        self.taken = {"fit": 0, "heldout": 0}
        self.numbers = {"fit": 0, "heldout": 0}
        self.hooks = Hooks()
        last = len(plan.layer_names) - 1
        for side, model in models.items():
            for i, name in enumerate(plan.layer_names):
                layer = model.get_submodule(name)
                self.hooks.on_output(layer, lambda _a, out, s=side, i=i: self._layer(s, i, out, i == last))
                for site in plan.sites[i]:
                    module = layer.get_submodule(site)
                    self.hooks.on_output(module, lambda _a, out, s=side, i=i, n=site: self._site(s, i, n, out))

    def close(self) -> None:
        self.hooks.remove()
        self.current = None

    def enter(self, phase: str, rows: int, mask: torch.Tensor | None) -> KeptBatch | None:
        """The next batch of ``phase`` (split order; ``rows`` examples, real tokens ``mask``): what of
        it is kept, None for nothing. Call once per batch, before it is observed."""
        wanted = self.plan.fit_examples if phase == "fit" else self.plan.gate_examples
        keep = max(0, min(wanted - self.taken[phase], rows))
        self.taken[phase] += keep
        number = self.numbers[phase]
        self.numbers[phase] += 1
        if not keep:
            return None
        shape = None if mask is None else (int(mask.shape[0]), int(mask.shape[1]))
        kept_mask = None if mask is None else mask[:keep].to(torch.bool)
        return KeptBatch(keep, kept_mask, shape, phase, number)

    def observing(self, batch: KeptBatch | None) -> None:
        """The batch the forwards about to run compute (None: nothing to keep)."""
        self.current = batch
        if batch is not None:
            batch.calls = {}

    def _rows(self, y: torch.Tensor) -> torch.Tensor | None:
        """The kept real-token rows of a per-position output ``y`` (rows, positions, features), or None."""
        cur = self.current
        if y.dim() != 3 or (cur.shape is not None and tuple(y.shape[:2]) != cur.shape):
            return None
        if cur.mask is None:
            return y[: cur.rows].reshape(-1, y.shape[-1])
        return y[: cur.rows][cur.mask.to(y.device)]

    def _site(self, side: str, layer: int, name: str, out) -> None:
        cur = self.current
        if cur is None or cur.phase != "fit" or not self.store.usable:
            return
        rows = self._rows(first_tensor(out))
        if rows is None:  # not one row per position (DeBERTa's relative-position projections)
            return
        key = ("site", side, layer, name)
        seen = cur.calls.get(key, 0)
        cur.calls[key] = seen + 1
        if seen:  # called twice per forward on the positions: which call a fit means is not clear
            self.store.drop(f"{name} runs more than once per forward")
            return
        self.store.put(key, rows)

    def _layer(self, side: str, layer: int, out, last: bool) -> None:
        cur = self.current
        if cur is None or not self.store.usable:
            return
        y = first_tensor(out)
        if cur.phase == "heldout":
            self.store.put(("gate", side, layer, cur.number), y[: cur.rows])
        elif last:
            rows = self._rows(y)
            if rows is not None:
                self.store.put(("final", side), rows)


def site_bytes(model: torch.nn.Module, plan: KeptPlan) -> int:
    """Bytes of every kept Linear's output for one token of one parent."""
    total = 0
    for name, sites in zip(plan.layer_names, plan.sites, strict=True):
        layer = model.get_submodule(name)
        for site in sites:
            weight = layer.get_submodule(site).weight
            out = weight.shape[1] if type(layer.get_submodule(site)).__name__ == "Conv1D" else weight.shape[0]
            total += out * weight.element_size()
    return total


__all__ = ["KeptBatch", "KeptOutputs", "KeptPlan", "OutputCapture", "site_bytes"]
