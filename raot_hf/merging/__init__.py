"""Merge rules on aligned state dicts, and a registry of them by name (DESIGN.md §6).

>>> from raot_hf.merging import get_merge_rule
>>> merged, log = get_merge_rule("linear")(state_a, state_b, alpha=0.5, return_log=True)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

from raot_hf.errors import RaotError
from raot_hf.merging.rules import (
    HEAD_POLICIES,
    check_compatible_states,
    merge_fisher,
    merge_heads,
    merge_linear,
    merge_regmean,
    merge_task_arithmetic,
    merge_ties,
    shrink_gram,
    trim_to_top,
)

_RULES: dict[str, Callable] = {}


def available_merge_rules() -> list[str]:
    """The registered merge-rule names, sorted."""
    return sorted(_RULES)


def register_merge_rule(name: str, fn: Callable) -> Callable:
    """Register ``fn`` as the merge rule ``name``; refuses non-callables and duplicate names."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a merge rule name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise TypeError(f"merge rule {name!r} must be callable, got {type(fn).__name__}")
    if name in _RULES:
        raise RaotError(
            f"merge rule {name!r} is already registered; pick another name (registered: "
            f"{', '.join(available_merge_rules())})."
        )
    _RULES[name] = fn
    return fn


def get_merge_rule(name: str) -> Callable:
    """The merge rule registered as ``name``; the error lists the valid names."""
    if name not in _RULES:
        raise RaotError(f"unknown merge rule {name!r}; valid: {', '.join(available_merge_rules())}.")
    return _RULES[name]


register_merge_rule("linear", merge_linear)
register_merge_rule("regmean", merge_regmean)
register_merge_rule("fisher", merge_fisher)
register_merge_rule("task_arithmetic", merge_task_arithmetic)
register_merge_rule("ties", merge_ties)

__all__ = [
    "HEAD_POLICIES",
    "available_merge_rules",
    "check_compatible_states",
    "get_merge_rule",
    "merge_fisher",
    "merge_heads",
    "merge_linear",
    "merge_regmean",
    "merge_task_arithmetic",
    "merge_ties",
    "register_merge_rule",
    "shrink_gram",
    "trim_to_top",
]
