"""Layer-wise execution: parameters kept in disk-backed working files (docs/design.md §7.4).

A model is *offloaded* by writing its parameters, in the merge's dtype, into one working file and
making every parameter a view of that file mapped shared into memory: the OS reads a layer's pages
when a stage touches them and may drop them (writing modified pages back) at any time. Pages are
released after each layer's forward, after each parameter a stage writes and at every stage
boundary, so about one layer of each model is resident; the computation is the in-memory path's,
operation for operation. The file is unlinked as soon as it is mapped: nothing is left on disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import shutil
import sys
import tempfile
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from raot_hf.errors import RaotError

logger = logging.getLogger("raot_hf.io.offload")

#: Offsets in the working file are multiples of this (any dtype's alignment; a cache line).
_ALIGN = 64
_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
#: Free disk space kept beyond the working files.
DISK_MARGIN = 256 << 20


def _libc_function(name: str):
    """glibc's function ``name``, or None (not Linux, musl or another libc): its callers then do nothing."""
    if not sys.platform.startswith("linux"):
        return None
    with contextlib.suppress(OSError, AttributeError):
        return getattr(ctypes.CDLL("libc.so.6", use_errno=True), name)
    return None


_MADVISE = _libc_function("madvise")
if _MADVISE is not None:
    _MADVISE.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_TRIM = _libc_function("malloc_trim")


def mapped_file_ranges() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files (from ``/proc/self/maps``; empty
    where there is none to read)."""
    ranges = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                lo, hi = fields[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def drop_file_pages(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
    """Drop the resident pages of a tensor that lies in a mapping of a file (``ranges``, from
    :func:`mapped_file_ranges`) and that no parameter uses any longer — a loaded checkpoint's, whose
    parameter took a new tensor (:func:`raot_hf.symmetry.load_state`). Only whole pages inside the
    tensor are dropped; a read afterwards reads the file again. Nothing for memory that is not a
    file's (zeroing it would lose data) or where ``madvise`` is not available."""
    start = tensor.untyped_storage().data_ptr()
    stop = start + tensor.untyped_storage().nbytes()
    if _MADVISE is None or not any(lo <= start and stop <= hi for lo, hi in ranges):
        return
    lo, hi = -(-start // _PAGE) * _PAGE, stop // _PAGE * _PAGE  # inward: neighbours keep their pages
    if hi > lo:
        _MADVISE(lo, hi - lo, _MADV_DONTNEED)


def release_mapped(tensors: Iterable[torch.Tensor]) -> None:
    """Drop the resident pages of those ``tensors`` that lie in a mapping of a file (a loaded
    checkpoint's parameters, read again only from the file): :func:`drop_file_pages` for each."""
    ranges = mapped_file_ranges()
    for tensor in tensors:
        drop_file_pages(tensor, ranges)


def trim_heap() -> None:
    """Return the C heap's free pages to the OS (glibc's ``malloc_trim``; a no-op elsewhere)."""
    if _TRIM is not None:
        _TRIM(0)


@dataclass(eq=False)
class OffloadedWeights:
    """One model's parameters in its mapped working file: the mapping and each parameter's byte
    range in it (``spans``: a module prefix → the ranges of its parameters, merged)."""

    label: str
    mapping: torch.Tensor  # uint8, the whole file
    ranges: dict[str, tuple[int, int]]
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    hooks: object = None  # the per-layer release hooks (raot_hf.hooks.Hooks)

    @property
    def nbytes(self) -> int:
        """The working file's size."""
        return int(self.mapping.numel())

    def _drop(self, start: int, stop: int) -> None:
        base = self.mapping.data_ptr()
        lo = (base + start) // _PAGE * _PAGE  # outward to whole pages: the file keeps the data
        hi = -(-(base + stop) // _PAGE) * _PAGE
        if _MADVISE is not None and hi > lo:
            _MADVISE(lo, hi - lo, _MADV_DONTNEED)

    def release(self, prefix: str | None = None) -> None:
        """Drop the resident pages of the parameters under module ``prefix`` (None: all of them);
        the data stays in the file and is read back when next touched."""
        if prefix is None:
            self._drop(0, self.nbytes)
            return
        if prefix not in self.spans:
            dotted = prefix + "."
            self.spans[prefix] = _merged([r for n, r in self.ranges.items() if n.startswith(dotted)])
        for start, stop in self.spans[prefix]:
            self._drop(start, stop)

    def view(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Parameter ``name``'s bytes in the mapping, as a tensor of ``like``'s dtype and shape."""
        start, stop = self.ranges[name]
        return self.mapping[start:stop].view(like.dtype).view(like.shape)

    def owns(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """``tensor``'s byte range in the working file, or None if it lies elsewhere."""
        start = tensor.data_ptr() - self.mapping.data_ptr()
        stop = start + tensor.numel() * tensor.element_size()
        return (start, stop) if start >= 0 and stop <= self.nbytes else None


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1] + _ALIGN:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _layout(params: list[tuple[str, torch.Tensor]]) -> tuple[dict[str, tuple[int, int]], int]:
    ranges, offset = {}, 0
    for name, p in params:
        nbytes = p.numel() * p.element_size()
        ranges[name] = (offset, offset + nbytes)
        offset = -(-(offset + nbytes) // _ALIGN) * _ALIGN
    return ranges, max(offset, _ALIGN)


def check_room(directory: Path, nbytes: int, what: str) -> None:
    """Refuse (one line, naming the fix) an offload directory without ``nbytes`` (and a margin) free for ``what``."""
    free = shutil.disk_usage(directory).free
    if free < nbytes + DISK_MARGIN:
        raise RaotError(
            f"the offload directory {directory} has {free / 2**30:.1f} GiB free, {what} needs "
            f"{(nbytes + DISK_MARGIN) / 2**30:.1f} GiB; pass --offload-dir on a larger disk"
        )


def _mapped_file(params: list[tuple[str, torch.Tensor]], directory: Path, label: str) -> OffloadedWeights:
    """A zeroed working file laid out for ``params`` in ``directory``, mapped shared and unlinked."""
    if not directory.is_dir():
        raise RaotError(f"the offload directory {directory} does not exist; create it or pass another --offload-dir")
    ranges, total = _layout(params)
    check_room(directory, total, f"model {label}'s working file")
    fd, path = tempfile.mkstemp(dir=directory, prefix=f"raot-offload-{label}-", suffix=".bin")
    try:
        os.ftruncate(fd, total)
        mapping = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(path)  # the mapping keeps the file alive; its space goes when the mapping does
    return OffloadedWeights(label, mapping, ranges)


@torch.no_grad()
def offload_model(
    model: torch.nn.Module, directory: str | Path | None, label: str, files: WorkingFiles
) -> OffloadedWeights:
    """Move ``model``'s parameters (tied ones once) into a working file in ``directory`` (None: the
    system's temporary directory) and make each a view of the file mapped into memory. Values,
    dtypes, shapes and ties are unchanged; the in-memory copies are freed. The working file is
    recorded in ``files`` and returned."""
    directory = Path(directory or tempfile.gettempdir())
    params = [(n, p) for n, p in model.named_parameters() if p.device.type == "cpu"]
    weights = _mapped_file(params, directory, label)
    for name, p in params:
        p.data = weights.view(name, p).copy_(p.detach())
        weights._drop(*weights.ranges[name])
    files.add(model, weights, directory)
    logger.info("model %s offloaded: %.1f MiB of parameters in a working file", label, weights.nbytes / 2**20)
    return weights


class WorkingFiles:
    """The working files behind one merge's offloaded models (docs/design.md §7.4): each model →
    its :class:`OffloadedWeights` (weak keys: nothing is kept on the model, which may be the user's).
    Carried by ``PairContext.working_files`` and the :class:`~raot_hf.results.MergeResult`; an
    in-memory merge carries an empty one, whose releases do nothing."""

    def __init__(self):
        self._by_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.directory: Path | None = None  # where the offloaded models' working files lie

    def park(self, tensors: dict[str, torch.Tensor], label: str) -> dict[str, torch.Tensor]:
        """``tensors`` copied into a working file of their own beside the models' and returned as
        views of it, their pages dropped: what a layer-by-layer pass holds from its first layer to
        its last (the merged embeddings and final readers) is read
        back from the file when next touched instead of being held in memory throughout (§7.4).
        Names that share one tensor share its view; a tensor already in a model's working file (a
        parent's own parameter) stays as it is. An in-memory merge gets ``tensors`` back."""
        items = [(k, v) for k, v in tensors.items() if v.device.type == "cpu" and self._holder(v) is None]
        if not len(self) or self.directory is None or not items:
            return tensors
        first: dict[int, str] = {}  # a tensor → the first name it was laid out under
        unique = [(k, v) for k, v in items if first.setdefault(id(v), k) == k]
        weights = _mapped_file(unique, self.directory, label)
        views = {k: weights.view(k, v).copy_(v) for k, v in unique}
        weights.release()  # the file holds them now; the views read them back when touched
        return {k: views[first[id(v)]] if id(v) in first else v for k, v in tensors.items()}

    def add(self, model: torch.nn.Module, weights: OffloadedWeights, directory: Path) -> OffloadedWeights:
        """Record ``weights`` as the working file behind ``model``'s parameters, in ``directory``;
        returns it."""
        self._by_model[model] = weights
        self.directory = directory
        return weights

    def of(self, model: torch.nn.Module) -> OffloadedWeights | None:
        """The working file behind ``model``'s parameters (None: they are in memory)."""
        return self._by_model.get(model)

    def __len__(self) -> int:
        return len(self._by_model)

    def release_after_forward(self, model: torch.nn.Module, module_names: list[str]) -> None:
        """Release each module's parameter pages as soon as its forward returns (layer by layer);
        nothing for a model in memory."""
        weights = self.of(model)
        if weights is None:
            return
        from raot_hf.hooks import Hooks

        modules = dict(model.named_modules())
        weights.hooks = Hooks()  # kept for the model's life, with its working file
        for name in module_names:
            weights.hooks.on_output(modules[name], lambda *_args, n=name: weights.release(n))

    def release_tensor(self, tensor: torch.Tensor, *, trim: bool = True) -> None:
        """Drop the resident pages of ``tensor`` if it is a view of a working file, and (``trim``) hand
        the heap's free pages back: a parameter-by-parameter transform's temporaries (under glibc's
        32 MB mmap threshold) otherwise pile up as fragmented heap — 11 GB for a 3.4 B model."""
        held = self._holder(tensor)
        if held is not None:
            held[0]._drop(*held[1])
            if trim:
                trim_heap()

    def _holder(self, tensor: torch.Tensor) -> tuple[OffloadedWeights, tuple[int, int]] | None:
        """The working file ``tensor`` is a view of, with its byte range there (None: elsewhere)."""
        for weights in list(self._by_model.values()):
            span = weights.owns(tensor)
            if span is not None:
                return weights, span
        return None

    def release_all(self, *, trim: bool = True) -> None:
        """Drop the resident pages of every offloaded model (between stages and layers) and
        (``trim``) hand the heap's free pages back: a layer's activations, in memory or offloaded."""
        for weights in list(self._by_model.values()):
            weights.release()
        if trim:
            trim_heap()


def _model_dtype(dtype: str, config, ckpt) -> torch.dtype:
    """The dtype ``from_pretrained`` builds the model in: the requested one, else the config's, else
    the checkpoint's first floating tensor's."""
    if dtype != "auto":
        return getattr(torch, dtype)
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = getattr(torch, configured, None)
    if isinstance(configured, torch.dtype):
        return configured
    stored = (ckpt.dtype(k) for k in ckpt.dtypes)
    return next((d for d in stored if d.is_floating_point), torch.float32)


def _saved_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's name as ``save_pretrained`` writes it (transformers' renamings, e.g. ViT's
    legacy names on disk, reverted), matched by tensor identity; renamings that are not one-to-one
    leave a parameter under its own name."""
    params = dict(model.named_parameters())
    try:
        from transformers.core_model_loading import revert_weight_conversion

        reverted = revert_weight_conversion(model, dict(params))
    except Exception:  # noqa: BLE001 - another transformers: no renamings to revert
        return {}
    owner = {id(p): n for n, p in params.items()}
    return {owner[id(t)]: key for key, t in reverted.items() if id(t) in owner}


def checkpoint_keys(model: torch.nn.Module, names: list[str], keys: set[str]) -> dict[str, str] | None:
    """Each parameter's key in the checkpoint: its saved name or its own, with or without the head
    class's prefix (None if one has none)."""
    from raot_hf.io.checkpoint import prefix_variants

    prefix = getattr(model, "base_model_prefix", "") or ""
    saved = _saved_names(model)
    found = {}
    for name in names:
        stored = [name] if saved.get(name, name) == name else [saved[name], name]
        key = next((k for s in stored for k in prefix_variants(s, prefix) if k in keys), None)
        if key is None:
            return None
        found[name] = key
    return found


@torch.no_grad()
def load_offloaded(
    cls: type, path: Path, config, dtype: str, directory: str | Path | None, label: str, files: WorkingFiles
):
    """``cls`` built empty and filled tensor by tensor from the safetensors checkpoint at ``path``
    straight into a working file recorded in ``files`` (no whole copy ever in memory). None when a
    parameter is not in the checkpoint under its own or its saved name (the caller loads and offloads)."""
    from accelerate import init_empty_weights

    from raot_hf.io.checkpoint import Checkpoint, check_finite

    ckpt = Checkpoint(path)
    with init_empty_weights(include_buffers=False):  # built in the load dtype, as from_pretrained does:
        model = cls._from_config(config, dtype=_model_dtype(dtype, config, ckpt))  # a few stay float32
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        owners.setdefault(id(param), []).append((model.get_submodule(module_name), leaf))
    params = list(model.named_parameters())
    keys = checkpoint_keys(model, [n for n, _ in params], set(ckpt.keys()))
    if keys is None:
        return None
    directory = Path(directory or tempfile.gettempdir())
    weights = _mapped_file(params, directory, label)
    for name, param in params:
        view = weights.view(name, param)
        value = ckpt.get(keys[name])
        if value.shape != view.shape:
            raise RaotError(
                f"{keys[name]} has shape {tuple(value.shape)} in {path}, the model expects {tuple(view.shape)}"
            )
        check_finite(label, name, value)
        view.copy_(value)
        weights._drop(*weights.ranges[name])
        del value
        ckpt.release()  # the checkpoint's mapped pages would otherwise count as this process's memory
        new = torch.nn.Parameter(view)
        for module, leaf in owners[id(param)]:
            module._parameters[leaf] = new
    ckpt.release()
    model.config._name_or_path = str(path)
    model.eval()
    files.add(model, weights, directory)
    logger.info("model %s read into a working file: %.1f MiB of parameters", label, weights.nbytes / 2**20)
    return model
