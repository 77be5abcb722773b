"""The options of a merge (docs/architecture.md): :class:`RaotConfig`
(:mod:`raot_hf.config.core`), the options sections and their registry
(:mod:`raot_hf.config.sections`), and the field metadata that generates the CLI
(:mod:`raot_hf.config.options`).

``RaotConfig`` is imported on first use: the method modules that define their sections import
:mod:`raot_hf.config.options` and :mod:`raot_hf.config.sections`, and :mod:`raot_hf.config.core`
imports those method modules.
"""

from __future__ import annotations

from typing import Any

_CORE = (
    "RaotConfig",
    "ALIGNMENTS",
    "DTYPES",
    "GATE_OBJECTIVES",
    "HEAD_POLICIES",
    "MERGER_RULES",
    "RESIDUAL_MODES",
    "SCOPES",
    "alignments",
)


def __getattr__(name: str) -> Any:
    if name in _CORE:
        from raot_hf.config import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_CORE)
