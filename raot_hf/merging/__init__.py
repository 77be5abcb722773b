"""Merge rules and their registry by name (docs/design.md §6); the merger, :class:`raot_hf.RaotConfig`'s
validation and the CLI's ``--merge-rule`` choices all read this one registry.

>>> from raot_hf.merging import get_merge_rule
>>> merged, log = get_merge_rule("linear")([state_a, state_b], [0.5, 0.5], return_log=True)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raot_hf.config.sections import register_section
from raot_hf.errors import RaotError
from raot_hf.merging.base_rules import (
    MAX_RELATIVE_TASK_NORM,
    BaseRuleOptions,
    check_base_states,
    elect_signs,
    keep_top_magnitudes,
    merge_dare_ties,
    merge_task_arithmetic,
    merge_ties,
    random_keep_rescaled,
    relative_task_norm,
)
from raot_hf.merging.layered import count_layers
from raot_hf.merging.log import RuleLog
from raot_hf.merging.mergekit_rules import (
    TASK_RULES,
    MergekitOptions,
    breadcrumbs,
    breadcrumbs_ties,
    della,
    della_linear,
    model_stock,
    nuslerp,
    slerp,
)
from raot_hf.merging.rules import (
    HEAD_POLICIES,
    FisherOptions,
    RegMeanOptions,
    check_compatible_states,
    check_weights,
    merge_fisher,
    merge_heads,
    merge_linear,
    merge_regmean,
    shrink_gram,
)


@dataclass(frozen=True)
class MergeRuleSpec:
    """A registered rule and what it needs besides the models' state dicts and weights.

    * ``needs_base``: called with ``base=`` (the state dict the others were fine-tuned from).
    * ``needs_grams``: called with ``grams=`` (one mapping per model), ``linear_weights=`` and
      ``transposed_weights=`` (the weights stored (in, out), GPT-2's ``Conv1D``) (RegMean).
    * ``needs_fisher``: called with ``fishers=`` (one diagonal Fisher per model).
    * ``per_tensor``: each output tensor depends only on the same-named inputs (chunked merges).
    * ``options``: rule keyword → :class:`raot_hf.RaotConfig` path (e.g. ``base_rules.density``).
    * ``max_models``: the most models the rule merges (SLERP's two); None: any number.
    * ``layered``: options may vary by layer or module; called with ``layer_count=``.
    * ``absolute_weights``: reads the weights as given (mergekit's); gets ``models.densities`` for two models too.
    """

    name: str
    fn: Callable
    needs_base: bool = False
    needs_grams: bool = False
    needs_fisher: bool = False
    per_tensor: bool = False
    options: Mapping[str, str] = field(default_factory=dict)
    max_models: int | None = None
    layered: bool = False
    absolute_weights: bool = False


_RULES: dict[str, MergeRuleSpec] = {}


def available_merge_rules() -> list[str]:
    """The registered merge-rule names, sorted."""
    return sorted(_RULES)


def base_relative_rules() -> list[str]:
    """The registered rules that measure task vectors against a base model, sorted."""
    return sorted(name for name, spec in _RULES.items() if spec.needs_base)


def register_merge_rule(
    name: str, fn: Callable, *, options: Mapping[str, str] | None = None, config: type | None = None, **flags: Any
) -> Callable:
    """Register ``fn`` as the merge rule ``name``; ``flags``: :class:`MergeRuleSpec`'s booleans and
    ``max_models``. ``config``: the rule's :class:`~raot_hf.config.sections.OptionSection`, registered
    with it (``RaotConfig``, its JSON and the CLI's flags know it); the rule gets every field of it
    unless ``options`` says otherwise. Refuses non-callables and duplicate names."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a merge rule name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise TypeError(f"merge rule {name!r} must be callable, got {type(fn).__name__}")
    if name in _RULES:
        raise RaotError(
            f"merge rule {name!r} is already registered; pick another name (registered: "
            f"{', '.join(available_merge_rules())})."
        )
    if config is not None:
        register_section(config)
        if options is None:
            options = {f.name: f"{config.section}.{f.name}" for f in dataclasses.fields(config)}
    _RULES[name] = MergeRuleSpec(name, fn, options=dict(options or {}), **flags)
    return fn


def merge_rule_spec(name: str) -> MergeRuleSpec:
    """The registration of rule ``name``; the error lists the valid names."""
    if name not in _RULES:
        raise RaotError(f"unknown merge rule {name!r}; valid: {', '.join(available_merge_rules())}.")
    return _RULES[name]


def nary_merge_rules() -> list[str]:
    """The registered rules that merge more than two models, sorted."""
    return sorted(name for name, spec in _RULES.items() if spec.max_models is None or spec.max_models > 2)


def get_merge_rule(name: str) -> Callable:
    """The merge rule registered as ``name``; the error lists the valid names."""
    return merge_rule_spec(name).fn


def rule_options(spec: MergeRuleSpec, config, models: int = 2, names=None) -> dict[str, Any]:
    """The keywords ``spec`` reads from ``config``, plus per-model ``densities`` (more than two models
    or ``absolute_weights``) and a ``layered`` rule's layer count of the parameter ``names``."""
    options: dict[str, Any] = {name: config.lookup(path) for name, path in spec.options.items()}
    if (models > 2 or spec.absolute_weights) and "density" in options and config.models.densities:
        options["densities"] = list(config.models.densities)
    if spec.layered and names is not None:
        options["layer_count"] = count_layers(names)
    return options


def apply_rule(spec: MergeRuleSpec, states: list, weights: list[float], **inputs) -> tuple[dict, RuleLog]:
    """Call the rule on ``states`` with one weight per model; returns ``(merged, log)`` (a plain-dict
    log, as a rule registered from outside may return, read by :meth:`RuleLog.from_dict`)."""
    merged, log = spec.fn(list(states), list(weights), return_log=True, **inputs)
    return merged, log if isinstance(log, RuleLog) else RuleLog.from_dict(log)


_TASK = {"needs_base": True, "per_tensor": True, "config": BaseRuleOptions}
_MERGEKIT = {"per_tensor": True, "layered": True, "config": MergekitOptions}
_TIES = {"density": "base_rules.density", "scale": "base_rules.task_scale"}
register_merge_rule("linear", merge_linear, per_tensor=True)
register_merge_rule("regmean", merge_regmean, needs_grams=True, config=RegMeanOptions)
register_merge_rule("fisher", merge_fisher, needs_fisher=True, config=FisherOptions, options={})
register_merge_rule("task_arithmetic", merge_task_arithmetic, **_TASK, options={"scale": "base_rules.task_scale"})
register_merge_rule("ties", merge_ties, **_TASK, options=_TIES)
register_merge_rule("dare_ties", merge_dare_ties, **_TASK, options={**_TIES, "seed": "seed"})
register_merge_rule("slerp", slerp, **_MERGEKIT, max_models=2, options={"t": "mergekit.t"})
_NUSLERP = {"row_wise": "mergekit.row_wise", "flatten": "mergekit.flatten"}
register_merge_rule("nuslerp", nuslerp, **_MERGEKIT, max_models=2, absolute_weights=True, options=_NUSLERP)
register_merge_rule(
    "model_stock", model_stock, **_MERGEKIT, needs_base=True, options={"filter_wise": "mergekit.filter_wise"}
)
for _name, _rule in zip(TASK_RULES, (della, della_linear, breadcrumbs, breadcrumbs_ties), strict=True):
    _extra = "epsilon" if TASK_RULES[_name][0] == "della" else "gamma"
    _options = {"density": "mergekit.density", _extra: f"mergekit.{_extra}", "scale": "mergekit.scale"}
    _options.update({"seed": "seed"} if _extra == "epsilon" else {})
    register_merge_rule(_name, _rule, **_MERGEKIT, needs_base=True, absolute_weights=True, options=_options)

__all__ = [
    "HEAD_POLICIES",
    "apply_rule",
    "MAX_RELATIVE_TASK_NORM",
    "MergeRuleSpec",
    "RuleLog",
    "available_merge_rules",
    "base_relative_rules",
    "check_base_states",
    "check_compatible_states",
    "check_weights",
    "elect_signs",
    "get_merge_rule",
    "keep_top_magnitudes",
    "merge_dare_ties",
    "merge_fisher",
    "merge_heads",
    "merge_linear",
    "merge_regmean",
    "merge_rule_spec",
    "merge_task_arithmetic",
    "merge_ties",
    "MergekitOptions",
    "nary_merge_rules",
    "random_keep_rescaled",
    "register_merge_rule",
    "relative_task_norm",
    "rule_options",
    "shrink_gram",
]
