"""Errors raised for user mistakes: one line naming the problem and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

Value = TypeVar("Value")


class RaotError(ValueError):
    """A user-facing error: the message names the problem and how to fix it."""


class EquivalenceError(RuntimeError):
    """An exact symmetry transform changed the model's function: a bug, never a warning."""


def lookup(table: Mapping[str, Value], name: str, missing: str) -> Value:
    """``table[name]``; a :class:`RaotError` saying ``missing`` (which should list the valid names)
    when ``name`` is not in ``table``."""
    if name not in table:
        raise RaotError(missing)
    return table[name]
