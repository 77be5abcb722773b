"""The one registry type: merge rules, estimators, corrections, families and options sections are
each a :class:`Registry` of entries by name (docs/architecture.md, "Extending raot_hf").

A registry is found by its kind (:func:`registry`), so a module reads one without importing the
package that fills it: :class:`raot_hf.RaotConfig` validates ``merge_rule`` against
``registry("merge rule")`` and imports no merge rule.

>>> from raot_hf.registry import registry
>>> registry("merge rule").get("linear").name  # doctest: +SKIP
'linear'
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from raot_hf.errors import RaotError

Entry = TypeVar("Entry")


class Registry(Generic[Entry]):
    """Entries by name, in registration order. ``kind`` names an entry in messages ("merge rule");
    ``fixed``: names valid besides the entries (a correction's ``auto`` and ``none``), listed first
    and never registrable."""

    def __init__(self, kind: str, fixed: tuple[str, ...] = ()):
        self.kind, self.fixed = kind, tuple(fixed)
        self._entries: dict[str, Entry] = {}

    def check_free(self, name: str) -> None:
        """Refuse a name that is not a non-empty string, is fixed, or is taken (the message lists
        the valid names): what :meth:`register` checks, for a caller with more to do first."""
        if not isinstance(name, str) or not name or name in self.fixed:
            reserved = f" other than {' and '.join(map(repr, self.fixed))}" if self.fixed else ""
            raise TypeError(f"a {self.kind} name must be a non-empty string{reserved}, got {name!r}")
        if name in self._entries:
            raise RaotError(f"{self.kind} {name!r} is already registered; pick another name (valid: {self.valid()})")

    def register(self, name: str, entry: Entry, *, same: Callable[[Entry, Entry], bool] | None = None) -> Entry:
        """Add ``entry`` as ``name`` (:meth:`check_free`), or keep the entry there when
        ``same(old, entry)`` says this registration repeats it."""
        if name in self._entries and same is not None and same(self._entries[name], entry):
            return self._entries[name]
        self.check_free(name)
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> Entry:
        """Remove ``name``; returns its entry."""
        if name not in self._entries:
            raise RaotError(f"{self.kind} {name!r} is not registered; registered: {', '.join(self._entries)}")
        return self._entries.pop(name)

    def get(self, name: str) -> Entry:
        """The entry ``name``; the error lists the valid names."""
        if name not in self._entries:
            raise RaotError(f"unknown {self.kind} {name!r}; valid: {self.valid()}")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        """Every valid name: the fixed ones, then the entries in registration order."""
        return (*self.fixed, *self._entries)

    def valid(self) -> str:
        return ", ".join(self.names())

    def items(self) -> list[tuple[str, Entry]]:
        return list(self._entries.items())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


_REGISTRIES: dict[str, Registry] = {}


def registry(kind: str, fixed: tuple[str, ...] = ()) -> Registry:
    """The registry of ``kind``, made on first use (by its filler or its first reader, whichever
    comes first)."""
    if kind not in _REGISTRIES:
        _REGISTRIES[kind] = Registry(kind, fixed)
    return _REGISTRIES[kind]


@contextmanager
def registries_restored():
    """Within the block entries may be registered freely: on exit every registry holds what it held
    before (in place, so every reference to a registry stays valid)."""
    saved = {kind: dict(reg._entries) for kind, reg in _REGISTRIES.items()}
    try:
        yield
    finally:
        for kind, reg in _REGISTRIES.items():
            reg._entries.clear()
            reg._entries.update(saved.get(kind, {}))
