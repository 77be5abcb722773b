"""SHA-256 of files and of a checkpoint directory's weight and config files, for the report."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from raot_hf.errors import RaotError

_HASHED_PATTERNS = ("*.safetensors", "*.bin", "config.json")

__all__ = ["file_sha256", "hash_checkpoint_files"]


def file_sha256(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """The hex SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk_size), b""):
            digest.update(block)
    return digest.hexdigest()


def hash_checkpoint_files(path_or_repo_dir: str | os.PathLike) -> dict[str, str]:
    """SHA-256 of each ``*.safetensors``, ``*.bin`` and ``config.json`` at the top of a local
    model directory (e.g. a Hub cache snapshot), keyed by file name in sorted order."""
    directory = Path(path_or_repo_dir).expanduser()
    if not directory.is_dir():
        raise RaotError(
            f"cannot hash checkpoint files: {str(directory)!r} is not a local directory; pass a model folder"
        )
    names = sorted({p.name for pattern in _HASHED_PATTERNS for p in directory.glob(pattern) if p.is_file()})
    return {name: file_sha256(directory / name) for name in names}
