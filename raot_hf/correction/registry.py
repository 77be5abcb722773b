"""The correction registry: ``correction.method=<name>`` is looked up here and nowhere else
(docs/design.md §6.7, docs/architecture.md).

>>> from raot_hf.correction import available_corrections
>>> available_corrections()
['auto', 'none', 'lsq', 'repair']

A correction is a function ``fn(request: CorrectionRequest) -> (merged, outputs, fits)`` called
once per layer, in depth order, by the sequential pass (``raot_hf/stages/correct.py``): it reads
the rule's merge of the layer and the layer's pass over the carried states of the parents and of
the merged model M, and returns the layer's corrected parameters (full names, as ``request.rule``),
M's layer outputs on the fit chunks with them (the states entering the next layer) and a
per-site log for the report. The pass writes each layer, lets it compete with the rule's merge
on held-out examples when the gate is on, and carries the states on.

``auto`` and ``none`` are not registrations: ``none`` runs no pass, and ``auto`` chooses ``lsq``
or ``none`` per merge (``raot_hf.stages.combine.correction_method``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.errors import RaotError

#: The methods that are not registrations: "auto" chooses one per merge, "none" runs no pass.
CHOOSING_METHODS = ("auto", "none")


@dataclass
class CorrectionRequest:
    """Everything a correction of one merged layer may read.

    * ``layer``: the layer's :class:`~raot_hf.correction.LayerPass` over the carried fit chunks:
      the correction runs ``layer.parents(...)`` (every parent's layer, whose outputs are the
      states entering the next layer) and ``layer.merged(params, ...)`` (M's, as often as it needs);
    * ``rule``: the rule's merge of the layer's parameters (full names, e.g. ``encoder.layer.0.…``);
    * ``index``, ``name``: the layer's position and module name;
    * ``mix``: each parent's weight in the target (side → weight, ``"a"`` the reference);
    * ``model``, ``schema``: the reference (A, whose module M's layer runs) and its schema;
    * ``options``: the config's ``correction`` section;
    * ``memo``: a dict kept over the layers of one merge (e.g. what layers of one class share);
    * ``skipped``: the correction appends why a part of a layer was left as the rule merged it.
    """

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
    """A registered correction.

    * ``fn``: the per-layer correction (see :class:`CorrectionRequest`);
    * ``readers``: the refit of the trunk Linears that read the final norm (an untied LM head),
      ``readers(chunks, norms, rest, sites, *, mix, options) -> (refit, fits)``, or None: left as
      the rule merged them;
    * ``report``: extra fields of the report's correction record, ``report(memo, options) -> dict``;
    * ``description``: how the model card names it (e.g. "merged-input least squares").
    """

    name: str
    fn: Callable[[CorrectionRequest], tuple[dict, list, list]]
    readers: Callable | None = None
    report: Callable[[dict, Any], dict] | None = None
    description: str = ""


_CORRECTIONS: dict[str, CorrectionSpec] = {}


def available_corrections() -> list[str]:
    """Every valid ``correction.method``: ``auto``, ``none``, then the registered corrections in
    registration order."""
    return [*CHOOSING_METHODS, *_CORRECTIONS]


def register_correction(
    name: str, fn: Callable, *, readers: Callable | None = None, report: Callable | None = None, description: str = ""
) -> Callable:
    """Register ``fn`` as ``correction.method=name`` (see :class:`CorrectionSpec`); refuses bad
    names, non-callables and duplicates. The config's validation and the CLI's ``--correction``
    choices read the registry, so the name is selectable at once."""
    if not isinstance(name, str) or not name or name in CHOOSING_METHODS:
        raise TypeError(f"a correction name must be a non-empty string other than 'auto' and 'none', got {name!r}")
    if not callable(fn):
        raise TypeError(f"correction {name!r} must be callable, got {type(fn).__name__}")
    for what, value in (("readers", readers), ("report", report)):
        if value is not None and not callable(value):
            raise TypeError(f"correction {name!r}: {what} must be callable, got {type(value).__name__}")
    if name in _CORRECTIONS:
        valid = ", ".join(available_corrections())
        raise RaotError(f"correction {name!r} is already registered; pick another name (valid: {valid})")
    _CORRECTIONS[name] = CorrectionSpec(name, fn, readers, report, description)
    return fn


def unregister_correction(name: str) -> CorrectionSpec:
    """Remove the registered correction ``name`` (a plugin's teardown, a test's cleanup); returns
    its registration."""
    if name not in _CORRECTIONS:
        raise RaotError(f"correction {name!r} is not registered; registered: {', '.join(_CORRECTIONS)}")
    return _CORRECTIONS.pop(name)


def get_correction(name: str) -> CorrectionSpec:
    """The registration of correction ``name``; the error lists the valid names (``auto`` and
    ``none`` choose or skip a correction and have none)."""
    if name not in _CORRECTIONS:
        raise RaotError(
            f"unknown correction {name!r}; registered: {', '.join(_CORRECTIONS)} "
            f"(valid methods: {', '.join(available_corrections())})"
        )
    return _CORRECTIONS[name]


def correction_description(name: str) -> str:
    """How the model card names correction ``name``: its registered description, else its name
    (a report read back after the correction was unregistered)."""
    spec = _CORRECTIONS.get(name)
    return spec.description if spec is not None and spec.description else name
