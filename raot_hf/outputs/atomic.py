"""The atomic output directory: written into a hidden sibling ``<parent>/.<name>.tmp-<random>`` and
renamed onto the destination only once complete, so a crash leaves an existing output untouched."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from raot_hf.errors import RaotError
from raot_hf.outputs.report import REPORT_NAME

_OUTPUT_MARKERS = ("config.json", REPORT_NAME)

__all__ = ["atomic_directory", "check_destination"]


def check_destination(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """Validate the destination before any heavy work; returns it as an absolute path. A non-empty
    directory needs ``overwrite`` and must hold ``config.json`` or ``raot_report.json``."""
    out = Path(out_dir).expanduser().absolute()
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise RaotError(f"output path {str(out)!r} exists and is not a directory; choose another --out")
        if any(out.iterdir()):
            if not overwrite:
                raise RaotError(
                    f"output directory {str(out)!r} exists; pass --overwrite (overwrite=True) or choose another --out"
                )
            if not any((out / marker).exists() for marker in _OUTPUT_MARKERS):
                raise RaotError(
                    f"refusing to replace {str(out)!r}: it holds no config.json or {REPORT_NAME}, so it is not a "
                    "model directory; remove it yourself or choose another --out"
                )
    # nothing is created here: missing parents are made when the output is written, so a merge
    # that fails leaves no empty directories behind
    existing = out.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise RaotError(
            f"{str(existing)!r} is not a directory, so {str(out)!r} cannot be created; choose another --out"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RaotError(
            f"parent directory {str(existing)!r} is not writable; choose another --out or fix its permissions"
        )
    return out


def _make_temp_dir(out: Path) -> Path:
    """Create the hidden sibling ``.<name>.tmp-<random>`` (and missing parents of ``out``)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RaotError(
            f"cannot create parent directory {str(out.parent)!r} ({exc.strerror}); choose another --out"
        ) from exc
    for _ in range(100):
        candidate = out.parent / f".{out.name}.tmp-{secrets.token_hex(6)}"
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise RaotError(f"cannot write into {str(out.parent)!r} ({exc.strerror}); choose another --out") from exc
        return candidate
    raise RaotError(f"could not create a temporary directory next to {str(out)!r}; clean up .{out.name}.tmp-* there")


def _move_into_place(temporary: Path, out: Path) -> None:
    """Rename ``temporary`` onto ``out``; an existing ``out`` is moved aside, deleted once replaced."""
    if not (out.exists() or out.is_symlink()):
        os.rename(temporary, out)
        return
    backup = out.parent / f".{out.name}.old-{secrets.token_hex(6)}"
    os.rename(out, backup)
    try:
        os.rename(temporary, out)
    except BaseException:
        os.rename(backup, out)
        raise
    if backup.is_symlink():
        backup.unlink()
    else:
        shutil.rmtree(backup, ignore_errors=True)


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield a fresh temporary sibling of ``out`` that replaces ``out`` when the block ends without error."""
    temporary = _make_temp_dir(out)
    try:
        yield temporary
        _move_into_place(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
