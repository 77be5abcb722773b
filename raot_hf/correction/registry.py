"""The correction registry: ``correction.method=<name>`` is looked up here and nowhere else
(docs/design.md §6.7, docs/architecture.md).

>>> from raot_hf.correction import available_corrections
>>> available_corrections()
['auto', 'none', 'lsq', 'repair']

A correction ``fn(request: CorrectionRequest) -> (merged, outputs, fits)`` runs once per layer in
depth order (``raot_hf/stages/correct.py``) and returns the layer's corrected parameters (full
names), M's layer outputs on the fit chunks with them (the next layer's input) and a per-site
log. ``none`` runs no pass; ``auto`` picks ``lsq`` or ``none`` (``raot_hf.stages.combine``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.registry import Registry, registry

#: The methods that are not registrations: "auto" chooses one per merge, "none" runs no pass.
CHOOSING_METHODS = ("auto", "none")


@dataclass
class CorrectionRequest:
    """Everything a correction of one merged layer may read: ``layer`` (its
    :class:`~raot_hf.correction.LayerPass`: ``layer.parents(...)``, ``layer.merged(params, ...)``),
    ``rule`` (the rule's merge of its parameters, full names), ``index`` / ``name``, ``mix`` (side →
    parent weight, ``"a"`` the reference), ``model`` / ``schema`` (A's), ``options`` (the
    ``correction`` section), ``memo`` (kept over one merge's layers) and ``skipped`` (appended:
    why a part was left as the rule merged it)."""

    layer: Any
    rule: dict[str, torch.Tensor]
    index: int
    name: str
    mix: dict[str, float]
    model: torch.nn.Module
    schema: Any
    options: Any
    memo: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CorrectionSpec:
    """A registered correction: ``fn`` per layer; ``readers(chunks, norms, rest, sites, *, mix,
    options) -> (refit, fits)`` refits the final norm's trunk readers (None: left as merged);
    ``report(memo, options) -> dict`` adds report fields; ``description`` names it in the card."""

    name: str
    fn: Callable[[CorrectionRequest], tuple[dict, list, list]]
    readers: Callable | None = None
    report: Callable[[dict, Any], dict] | None = None
    description: str = ""


_CORRECTIONS: Registry[CorrectionSpec] = registry("correction", fixed=CHOOSING_METHODS)


def available_corrections() -> list[str]:
    """Every valid ``correction.method``: ``auto``, ``none``, then the registered ones in order."""
    return list(_CORRECTIONS.names())


def register_correction(
    name: str, fn: Callable, *, readers: Callable | None = None, report: Callable | None = None, description: str = ""
) -> Callable:
    """Register ``fn`` as ``correction.method=name`` (see :class:`CorrectionSpec`), selectable at
    once; refuses bad names, non-callables and duplicates."""
    if not callable(fn):
        raise TypeError(f"correction {name!r} must be callable, got {type(fn).__name__}")
    for what, value in (("readers", readers), ("report", report)):
        if value is not None and not callable(value):
            raise TypeError(f"correction {name!r}: {what} must be callable, got {type(value).__name__}")
    _CORRECTIONS.register(name, CorrectionSpec(name, fn, readers, report, description))
    return fn


def unregister_correction(name: str) -> CorrectionSpec:
    """Remove the registered correction ``name``; returns its registration."""
    return _CORRECTIONS.unregister(name)


def get_correction(name: str) -> CorrectionSpec:
    """The registration of correction ``name``; the error lists the valid names."""
    return _CORRECTIONS.get(name)


def correction_description(name: str) -> str:
    """How the model card names correction ``name``: its description, else its name."""

    spec = _CORRECTIONS.get(name) if name in _CORRECTIONS else None
    return spec.description if spec is not None and spec.description else name
