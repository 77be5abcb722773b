"""A local safetensors checkpoint read from its headers and one tensor at a time, without
building a model (the streamed merge, §7.3, and the layer-wise one, §7.4, of docs/design.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from raot_hf.errors import RaotError

#: Bytes per element of the safetensors dtypes (for sizes read from the headers).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
#: The safetensors dtype names and the torch dtypes they hold (read here, written by the shard writer).
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a local checkpoint directory (sharded or not; none: [])."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / f for f in files]
    return [path / "model.safetensors"] if (path / "model.safetensors").is_file() else []


class Checkpoint:
    """The tensors of one local safetensors checkpoint, read one at a time; ``nbytes`` and
    ``numel``: each tensor's size in bytes and in elements, from the files' headers."""

    def __init__(self, path: Path):
        self.files: dict[str, Path] = {}
        self.nbytes: dict[str, int] = {}
        self.numel: dict[str, int] = {}
        self.dtypes: dict[str, str] = {}
        for file in weight_files(path):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                    piece = handle.get_slice(name)
                    self.files[name] = file
                    self.numel[name] = torch.Size(piece.get_shape()).numel()
                    self.dtypes[name] = piece.get_dtype()
                    self.nbytes[name] = self.numel[name] * _DTYPE_BYTES.get(piece.get_dtype(), 4)
        self._open: dict[Path, Any] = {}

    def keys(self) -> list[str]:
        return list(self.files)

    def sizes(self, dtype: torch.dtype | None = None) -> list[int]:
        """Every tensor's bytes as stored, or in ``dtype`` (None: as stored)."""
        if dtype is None:
            return list(self.nbytes.values())
        return [n * dtype.itemsize for n in self.numel.values()]

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of tensor ``name`` (from the header)."""
        return TORCH_DTYPES.get(self.dtypes[name], torch.float32)

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (a copy: the file's mapping is not kept in the returned tensor)."""
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt").__enter__()
        return self._open[file].get_tensor(name)

    def release(self) -> None:
        """Unmap the files read so far (their pages would otherwise count as the process's memory)."""
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()


def check_finite(label: str, name: str, tensor: torch.Tensor) -> None:
    """Refuse a floating-point tensor with NaN or Inf: the one input check every execution mode runs
    on every tensor it reads (docs/design.md §7.3)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise RaotError(f"model {label} has NaN/Inf in {name}; the checkpoint is corrupt — re-train or re-download it")


def prefix_variants(name: str, prefix: str) -> list[str]:
    """``name`` as a model with a head class and its bare model may call it: itself, under
    ``prefix`` (the head class's ``base_model_prefix``) and without it."""
    variants = [name, f"{prefix}.{name}"] if prefix else [name]
    if prefix and name.startswith(prefix + "."):
        variants.append(name[len(prefix) + 1 :])
    return variants
