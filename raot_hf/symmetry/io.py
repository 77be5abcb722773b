"""Transforms on disk: one safetensors file per alignment (``raot_transform.safetensors``), every
tensor bit-exact, the metadata listing each transform's type and scalar fields."""

from __future__ import annotations

import dataclasses
import json
import os

import safetensors.torch
import torch

from raot_hf.errors import RaotError
from raot_hf.symmetry.transforms import Transform, TransformSequence

TRANSFORM_NAME = "raot_transform.safetensors"
_META_KEY = "raot_transforms"

__all__ = ["TRANSFORM_NAME", "load_transform", "save_transform"]


def save_transform(transform: Transform, path: str | os.PathLike) -> None:
    """Write ``transform`` (one or a sequence) to a safetensors file at ``path``."""
    parts = list(transform.transforms) if isinstance(transform, TransformSequence) else [transform]
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for i, part in enumerate(parts):
        fields = {}
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if isinstance(value, torch.Tensor):
                key = f"{i}.{f.name}"
                tensors[key] = value.detach().to("cpu").contiguous().clone()
                fields[f.name] = {"tensor": key}
            else:
                fields[f.name] = value
        entries.append({"type": part.kind, "fields": fields})
    safetensors.torch.save_file(tensors, os.fspath(path), metadata={_META_KEY: json.dumps(entries)})


def load_transform(path: str | os.PathLike) -> TransformSequence:
    """Read a file written by :func:`save_transform` back into a :class:`TransformSequence`."""
    try:
        with safetensors.safe_open(os.fspath(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (no __iter__)
    except (OSError, safetensors.SafetensorError) as exc:
        raise RaotError(f"cannot read a transform from {os.fspath(path)!r}: {exc}") from exc
    if _META_KEY not in metadata:
        raise RaotError(f"{os.fspath(path)!r} is not a raot_hf transform file (no {_META_KEY} metadata)")
    parts = []
    for entry in json.loads(metadata[_META_KEY]):
        cls = Transform._types.get(entry["type"])
        if cls is None:
            raise RaotError(f"unknown transform type {entry['type']!r} in {os.fspath(path)!r}")
        kwargs = {
            name: tensors[value["tensor"]] if isinstance(value, dict) and "tensor" in value else value
            for name, value in entry["fields"].items()
        }
        parts.append(cls(**kwargs))
    return TransformSequence(parts)
