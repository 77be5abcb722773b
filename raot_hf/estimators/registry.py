"""The estimator registry: ``alignment=<name>`` is looked up here and nowhere else (docs/architecture.md).

>>> from raot_hf.estimators import estimator_spec
>>> estimator_spec("activation").needs_statistics
True

An estimator is ``fn(request: EstimationRequest) -> (transforms, logs)``: candidate symmetries of B
(B's coordinates → A's) and a log dict; its registration says what it reads, whether the gate judges
it and which :class:`raot_hf.RaotConfig` section holds its options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.registry import Registry, registry


@dataclass
class EstimationRequest:
    """Everything an estimator may read (``stats`` is None without calibration)."""

    stats: Any
    schema: Any
    state_a: dict[str, torch.Tensor]
    state_b: dict[str, torch.Tensor]
    config: Any
    progress: bool = True
    options: Any = None  # the config section the registration names (e.g. ``config.weight``), if any
    # layer → (candidates, logs) the layer-by-layer fit phase already solved (docs/design.md §7.4)
    solved_layers: dict[int, tuple] = field(default_factory=dict)

    def scope(self, *allowed: str) -> tuple[str, ...]:
        """The configured scope restricted to what this estimator can estimate."""
        return tuple(s for s in self.config.scope if s in allowed)


@dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator: ``needs_statistics`` (reads the fit moments), ``gated`` (exact
    symmetries the gate may judge; False: applied ungated, reported approximate), ``options`` (its
    :class:`raot_hf.RaotConfig` section, or None)."""

    name: str
    fn: Callable[[EstimationRequest], tuple[list, dict[str, Any]]]
    needs_statistics: bool
    gated: bool = True
    options: str | None = None
    description: str = ""


_ESTIMATORS: Registry[EstimatorSpec] = registry("alignment", fixed=("none",))


def available_estimators() -> list[str]:
    """The registered estimator names, in registration order."""
    return list(_ESTIMATORS)


def register_estimator(
    name: str,
    fn: Callable,
    *,
    needs_statistics: bool,
    gated: bool = True,
    options: str | None = None,
    description: str = "",
    config: type | None = None,
) -> Callable:
    """Register ``fn`` as ``alignment=name`` (bad names, non-callables and duplicates refused);
    ``config``: its options section, registered with it and handed over as ``request.options``."""
    if not callable(fn):
        raise TypeError(f"estimator {name!r} must be callable, got {type(fn).__name__}")
    _ESTIMATORS.check_free(name)
    if config is not None:
        from raot_hf.config.sections import register_section

        register_section(config)
        options = config.section
    _ESTIMATORS.register(name, EstimatorSpec(name, fn, needs_statistics, gated, options, description))
    return fn


def estimator_spec(name: str) -> EstimatorSpec:
    """The registration of estimator ``name``; the error lists the valid names."""
    return _ESTIMATORS.get(name)


def finite(*moments) -> bool:
    """True when every sum in these statistics is finite (NaN/Inf activations poison them)."""
    return all(bool(torch.isfinite(t).all()) for m in moments for t in m.tensors())
