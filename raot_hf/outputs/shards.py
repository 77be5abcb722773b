"""The weights of a merged model as safetensors shards with ``model.safetensors.index.json``.

A streaming writer: the tensors are gathered into shards of at most ``max_shard_size`` bytes and
each shard's file is written tensor by tensor (the safetensors layout: an 8-byte header length,
the JSON header, the raw little-endian bytes), so at most one tensor is copied at a time and an
offloaded model's pages are dropped as soon as they are written (docs/design.md §7.4). The key set is the one
``PreTrainedModel.save_pretrained`` writes (tied aliases dropped, weight renamings reverted to the
checkpoint format), so the output reloads with no missing or unexpected keys. The index is
written even for a single shard; identical tensors give byte-identical files.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import sys
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from huggingface_hub.utils import tqdm
from safetensors import safe_open

from raot_hf.errors import RaotError
from raot_hf.io.checkpoint import TORCH_DTYPES
from raot_hf.io.offload import WorkingFiles, trim_heap

logger = logging.getLogger("raot_hf.outputs.shards")

SINGLE_WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_PATTERN = "model-{index:05d}-of-{count:05d}.safetensors"
#: Size suffixes: decimal (KB = 10³) and binary (KiB = 2¹⁰), any case.
_SIZE_UNITS = {"": 1, "B": 1, **{f"{p}B": 1000**i for i, p in enumerate("KMGT", 1)}}
_SIZE_UNITS.update({f"{p}IB": 1024**i for i, p in enumerate("KMGT", 1)})


def parse_size(size: int | str) -> int:
    """Parse a byte count such as ``2GB`` (10⁹), ``500MiB`` (2²⁰ each) or ``4096`` into an int."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise RaotError(f"cannot read size {size!r}; write it like '2GB', '500MB' or '1GiB'")
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise RaotError(f"max shard size must be positive, got {size!r}; use e.g. '2GB'")
    return value


def _drop_tied_targets(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Fallback for transformers without ``remove_tied_weights_from_state_dict``: drop each tied
    target whose storage is its source's."""
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target in state and source in state and state[target].data_ptr() == state[source].data_ptr():
            del state[target]
    return state


def _without_tied(
    state: dict[str, torch.Tensor], model: torch.nn.Module, remove, working_files: WorkingFiles | None
) -> dict[str, torch.Tensor]:
    """``state`` less its tied aliases (``remove``: transformers' rule of which name is kept).

    An offloaded model's weights all share one storage, the working file, which ``remove`` would
    take for disjoint aliases and clone — a copy of the whole model in memory. It is then given
    meta stand-ins instead, whose ties are found by parameter identity, and keeps the real tensors."""
    if working_files is None or working_files.of(model) is None:
        return remove(state, model)
    kept = remove({name: torch.empty_like(t, device="meta") for name, t in state.items()}, model)
    return {name: state[name] for name in kept}


def weights_to_save(model: torch.nn.Module, working_files: WorkingFiles | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` would write, by checkpoint name, without copying them
    (``working_files``: the model's when it is offloaded, docs/design.md §7.4).

    Tied aliases are dropped (the kept name is the one ``from_pretrained`` expects) and the
    model's weight renamings (e.g. ViT's ``layers.N.attention.q_proj`` ↔
    ``encoder.layer.N.attention.attention.query``) are reverted to the checkpoint format.
    """
    state = dict(model.state_dict())
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    for key in ignored:
        state.pop(key, None)
    meta = [name for name, tensor in state.items() if tensor.device.type == "meta"]
    if meta:
        raise RaotError(f"{len(meta)} weights (e.g. {meta[0]!r}) are on the meta device; load the model fully first")
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # older or newer transformers
        remove_tied_weights_from_state_dict = _drop_tied_targets
    all_names = set(state)
    state = _without_tied(state, model, remove_tied_weights_from_state_dict, working_files)
    tied_targets = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
    unexplained = all_names - set(state) - tied_targets
    if unexplained:
        raise RuntimeError(f"weights {sorted(unexplained)} would be dropped without being tied: bug in the writer")
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    return revert_weight_conversion(model, state)


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _cpu_copy_for_saving(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning exactly its bytes (safetensors refuses partial aliases)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.untyped_storage().nbytes() != _tensor_nbytes(tensor):
        tensor = tensor.clone()
    return tensor


#: safetensors' names of the dtypes the streaming writer writes (any other goes through safetensors).
_SAFETENSORS_DTYPES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


#: safetensors' layout order: widest dtype first (then by name), so every tensor stays aligned.
_LAYOUT_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL")


def _layout(tensors: dict[str, torch.Tensor], names: list[str]) -> list[str]:
    """``names`` in the order safetensors lays them out (its files and ours are byte-identical)."""
    rank = {dtype: i for i, dtype in enumerate(_LAYOUT_ORDER)}
    return sorted(names, key=lambda n: (rank[_SAFETENSORS_DTYPES[tensors[n].dtype]], n.encode("utf-8")))


def _shard_header(tensors: dict[str, torch.Tensor], names: list[str], metadata: dict[str, str]) -> bytes:
    """The safetensors header of ``names`` laid out in that order, padded with spaces to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        tensor = tensors[name]
        size = _tensor_nbytes(tensor)
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return text + b" " * (-len(text) % 8)


def _write_shard(path: Path, tensors: dict, names: list[str], metadata: dict, working_files=None) -> None:
    """Write one shard's safetensors file, one tensor at a time; each written tensor's offloaded
    pages are dropped (:meth:`raot_hf.io.offload.WorkingFiles.release_tensor`)."""
    names = _layout(tensors, names)
    header = _shard_header(tensors, names, metadata)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)))
        handle.write(header)
        for name in names:
            tensor = tensors[name].detach().to("cpu")
            data = tensor.contiguous()
            if data.numel():
                handle.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
            del data
            if working_files is not None:
                working_files.release_tensor(tensor, trim=False)
    trim_heap()


def _streamable(tensors: dict[str, torch.Tensor], names: list[str]) -> bool:
    return sys.byteorder == "little" and all(tensors[n].dtype in _SAFETENSORS_DTYPES for n in names)


class ShardWriter:
    """Tensors, in the order given, into safetensors shards of at most ``max_bytes`` (a larger
    tensor gets a shard of its own). A shard is written as soon as the next tensor would not fit,
    under a temporary name; :meth:`finish` renames the shards as ``save_pretrained`` names them and
    writes the index. A pending shard holds references to its tensors, no copies: the writer of an
    in-memory model and the streamed merge (docs/design.md §7.3) are this one writer.
    ``working_files``: those behind the tensors when they are an offloaded model's (each tensor's
    pages are dropped once written)."""

    def __init__(self, directory: Path, max_bytes: int, working_files: WorkingFiles | None = None):
        self.directory, self.max_bytes, self.working_files = Path(directory), max_bytes, working_files
        self.pending: dict[str, torch.Tensor] = {}
        self.size, self.total = 0, 0
        self.written: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = _tensor_nbytes(tensor)
        if self.pending and self.size + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.size += size

    def _flush(self) -> None:
        if not self.pending:
            return
        path = self.directory / f".part-{len(self.written):05d}.safetensors"
        names = list(self.pending)
        if _streamable(self.pending, names):
            _write_shard(path, self.pending, names, {"format": "pt"}, self.working_files)
        else:  # a dtype the streaming writer does not name: the whole shard through safetensors
            shard = {name: _cpu_copy_for_saving(self.pending[name]) for name in names}
            safetensors.torch.save_file(shard, str(path), metadata={"format": "pt"})
            del shard
        self.written.append((path, names))
        self.total += self.size
        self.pending, self.size = {}, 0

    def finish(self, total_parameters: int | None = None) -> dict[str, Any]:
        """Write the last shard, name every shard and write the index (always, even for one shard);
        returns the index."""
        self._flush()
        weight_map: dict[str, str] = {}
        for number, (path, names) in enumerate(self.written, start=1):
            filename = shard_name(number, len(self.written))
            path.rename(self.directory / filename)
            weight_map.update(dict.fromkeys(names, filename))
        index = write_index(self.directory, weight_map, self.total, total_parameters)
        logger.info("wrote %d weights (%d bytes) in %d shard(s)", len(weight_map), self.total, len(self.written))
        return index


def write_safetensors_shards(
    directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int, *, total_parameters: int | None = None,
    working_files: WorkingFiles | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Write ``tensors`` (name → tensor, in order) with one :class:`ShardWriter`; returns the index."""
    writer = ShardWriter(directory, max_shard_bytes, working_files)
    for name, tensor in tqdm(tensors.items(), desc="Writing weights", unit="tensor", leave=False):
        writer.add(name, tensor)
    return writer.finish(total_parameters)


def write_index(
    directory: Path, weight_map: dict[str, str], total_size: int, total_parameters: int | None = None
) -> dict[str, Any]:
    """Write ``model.safetensors.index.json`` (tensor name → shard file) and return it."""
    metadata: dict[str, int] = {"total_size": total_size}
    if total_parameters is not None:
        metadata["total_parameters"] = total_parameters
    index = {"metadata": metadata, "weight_map": weight_map}
    with open(directory / INDEX_NAME, "w", encoding="utf-8", newline="\n") as handle:
        handle.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index


def shard_name(index: int, count: int) -> str:
    """The file name of shard ``index`` (1-based) of ``count``, as ``save_pretrained`` names it."""
    return SINGLE_WEIGHTS_NAME if count == 1 else _SHARD_PATTERN.format(index=index, count=count)


def verify_written_weights(directory: Path, expected_keys: set[str]) -> None:
    """Check, from the files on disk, that the index maps exactly ``expected_keys`` and that
    each shard's header holds exactly the keys the index assigns to it (no tensor data read)."""
    with open(directory / INDEX_NAME, encoding="utf-8") as handle:
        weight_map: dict[str, str] = json.load(handle)["weight_map"]
    if set(weight_map) != expected_keys:
        missing = sorted(expected_keys - set(weight_map))[:5]
        extra = sorted(set(weight_map) - expected_keys)[:5]
        raise RuntimeError(f"written index does not match the weights: missing {missing}, unexpected {extra}")
    by_file: dict[str, set[str]] = {}
    for key, filename in weight_map.items():
        by_file.setdefault(filename, set()).add(key)
    for filename, keys in sorted(by_file.items()):
        with safe_open(str(directory / filename), framework="pt") as shard:
            stored = set(shard.keys())
        if stored != keys:
            raise RuntimeError(f"shard {filename} holds {len(stored)} tensors but the index assigns it {len(keys)}")
