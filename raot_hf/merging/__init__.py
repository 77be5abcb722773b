"""Merge rules on aligned state dicts, and a registry of them by name (docs/design.md §6).

>>> from raot_hf.merging import get_merge_rule
>>> merged, log = get_merge_rule("linear")(state_a, state_b, alpha=0.5, return_log=True)  # doctest: +SKIP

Every rule takes the merger's signature ``rule(state_a, state_b, *, alpha, ..., return_log=False)``;
its :class:`MergeRuleSpec` says what else it reads, and the merger, :class:`raot_hf.RaotConfig`'s
validation and the CLI's ``--merge-rule`` choices all read this one registry.
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
    dare_drop,
    elect_and_average,
    merge_dare_ties,
    merge_task_arithmetic,
    merge_ties,
    relative_task_norm,
    trim_to_top,
)
from raot_hf.merging.layered import count_layers
from raot_hf.merging.mergekit_rules import (
    TASK_RULES,
    MergekitOptions,
    breadcrumbs,
    breadcrumbs_ties,
    della,
    della_linear,
    group_form,
    model_stock,
    nuslerp,
    pair_form,
    slerp,
)
from raot_hf.merging.nary import (
    merge_dare_ties_n,
    merge_fisher_n,
    merge_heads_n,
    merge_linear_n,
    merge_regmean_n,
    merge_task_arithmetic_n,
    merge_ties_n,
)
from raot_hf.merging.rules import (
    HEAD_POLICIES,
    FisherOptions,
    RegMeanOptions,
    check_compatible_states,
    merge_fisher,
    merge_heads,
    merge_linear,
    merge_regmean,
    shrink_gram,
)


@dataclass(frozen=True)
class MergeRuleSpec:
    """A registered rule and what it needs besides ``state_a``, ``state_b`` and ``alpha``.

    * ``needs_base``: called with ``base=`` (the state dict of the model A and B were
      fine-tuned from); the merger then needs a base model.
    * ``needs_grams``: called with ``grams_a=``, ``grams_b=``, ``linear_weights=`` and
      ``transposed_weights=`` (the weights stored (in, out), GPT-2's ``Conv1D``) (RegMean).
    * ``needs_fisher``: called with ``fisher_a=`` and ``fisher_b=`` (diagonal Fishers).
    * ``per_tensor``: each output tensor depends only on the same-named inputs, so the merger
      may call the rule on a few tensors at a time (no merged copy of the whole model is held).
    * ``options``: rule keyword → :class:`raot_hf.RaotConfig` field the merger passes as that keyword
      (a dotted path into a section, e.g. ``base_rules.density``; :meth:`RaotConfig.lookup`).
    * ``nary``: the rule over N models (``nary(states, *, weights, ...)``, :mod:`raot_hf.merging.nary`),
      called with the same options; None: the rule merges two models only.
    * ``layered``: its options may vary by layer or module (:mod:`raot_hf.merging.layered`); called
      with ``layer_count=`` (the model's layers) so that a few tensors at a time evaluate them right.
    * ``absolute_weights``: it reads the models' weights as given, not normalised (mergekit's); the
      two-model form is called with ``pair_weights=`` (``group.weights``) when two are given.
    """

    name: str
    fn: Callable
    needs_base: bool = False
    needs_grams: bool = False
    needs_fisher: bool = False
    per_tensor: bool = False
    options: Mapping[str, str] = field(default_factory=dict)
    nary: Callable | None = None
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
    name: str,
    fn: Callable,
    *,
    needs_base: bool = False,
    needs_grams: bool = False,
    needs_fisher: bool = False,
    per_tensor: bool = False,
    options: Mapping[str, str] | None = None,
    config: type | None = None,
    nary: Callable | None = None,
    layered: bool = False,
    absolute_weights: bool = False,
) -> Callable:
    """Register ``fn`` as the merge rule ``name`` (see :class:`MergeRuleSpec` for the flags);
    refuses non-callables and duplicate names. ``config``: the rule's own options section (a
    dataclass :class:`~raot_hf.config.sections.OptionSection`), registered with it — then
    ``RaotConfig``, its JSON and the CLI's ``--<section>-<field>`` flags know it, and unless
    ``options`` maps the rule's keywords elsewhere, the rule is called with every field of it.
    ``nary``: the same rule over N models (see :class:`MergeRuleSpec`)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a merge rule name must be a non-empty string, got {name!r}")
    if not callable(fn) or (nary is not None and not callable(nary)):
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
    _RULES[name] = MergeRuleSpec(
        name,
        fn,
        needs_base,
        needs_grams,
        needs_fisher,
        per_tensor,
        dict(options or {}),
        nary,
        layered,
        absolute_weights,
    )
    return fn


def merge_rule_spec(name: str) -> MergeRuleSpec:
    """The registration of rule ``name``; the error lists the valid names."""
    if name not in _RULES:
        raise RaotError(f"unknown merge rule {name!r}; valid: {', '.join(available_merge_rules())}.")
    return _RULES[name]


def nary_merge_rules() -> list[str]:
    """The registered rules that merge more than two models, sorted."""
    return sorted(name for name, spec in _RULES.items() if spec.nary is not None)


def get_merge_rule(name: str) -> Callable:
    """The merge rule registered as ``name``; the error lists the valid names."""
    return merge_rule_spec(name).fn


def rule_options(spec: MergeRuleSpec, config, models: int = 2, names=None) -> dict[str, Any]:
    """The keywords ``spec`` reads from ``config`` (its ``options``), and with more than two
    models the per-model densities (``group.densities``) of a rule that takes a density; for a
    ``layered`` rule the layer count of the parameter ``names`` (all of the model's), and for an
    ``absolute_weights`` rule of two models the two ``group.weights`` when given."""
    options: dict[str, Any] = {name: config.lookup(path) for name, path in spec.options.items()}
    if (models > 2 or spec.absolute_weights) and "density" in options and config.group.densities:
        options["densities"] = list(config.group.densities)
    if spec.layered and names is not None:
        options["layer_count"] = count_layers(names)
    if spec.absolute_weights and models == 2 and len(config.group.weights) == 2:
        options["pair_weights"] = list(config.group.weights)
    return options


def apply_rule(spec: MergeRuleSpec, states: list, weighting: dict[str, Any], **inputs):
    """Call the rule on ``states``: its two-model form with ``weighting={"alpha": α}``, its N-ary
    form with ``weighting={"weights": [...]}``; returns ``(merged, log)``."""
    if "alpha" in weighting:
        return spec.fn(*states, **weighting, return_log=True, **inputs)
    return spec.nary(list(states), **weighting, return_log=True, **inputs)


def add_rule_log(total: dict[str, Any], part: dict[str, Any]) -> None:
    """Sum one chunk's rule log into ``total`` (counts and totals add, lists such as ``not_in_base`` extend)."""
    for key, value in part.get("settings", {}).items():
        if isinstance(value, list):
            total["settings"].setdefault(key, []).extend(value)
        else:
            total["settings"][key] = value
    for method, n in part.get("counts", {}).items():
        total["counts"][method] = total["counts"].get(method, 0) + n
    for name, n in part.get("totals", {}).items():  # entry counts of the base-relative rules
        total.setdefault("totals", {})[name] = total.get("totals", {}).get(name, 0) + n


register_merge_rule("linear", merge_linear, per_tensor=True, nary=merge_linear_n)
register_merge_rule("regmean", merge_regmean, needs_grams=True, config=RegMeanOptions, nary=merge_regmean_n)
register_merge_rule("fisher", merge_fisher, needs_fisher=True, config=FisherOptions, options={}, nary=merge_fisher_n)
register_merge_rule(
    "task_arithmetic",
    merge_task_arithmetic,
    needs_base=True,
    per_tensor=True,
    config=BaseRuleOptions,
    options={"scale": "base_rules.task_scale"},
    nary=merge_task_arithmetic_n,
)
register_merge_rule(
    "ties",
    merge_ties,
    needs_base=True,
    per_tensor=True,
    config=BaseRuleOptions,
    options={"density": "base_rules.density", "scale": "base_rules.task_scale"},
    nary=merge_ties_n,
)
register_merge_rule(
    "dare_ties",
    merge_dare_ties,
    needs_base=True,
    per_tensor=True,
    config=BaseRuleOptions,
    options={"density": "base_rules.density", "scale": "base_rules.task_scale", "seed": "seed"},
    nary=merge_dare_ties_n,
)
register_merge_rule(
    "slerp", pair_form(slerp), per_tensor=True, layered=True, config=MergekitOptions, options={"t": "mergekit.t"}
)
register_merge_rule(
    "nuslerp",
    pair_form(nuslerp),
    per_tensor=True,
    layered=True,
    absolute_weights=True,
    config=MergekitOptions,
    options={"row_wise": "mergekit.row_wise", "flatten": "mergekit.flatten"},
)
register_merge_rule(
    "model_stock",
    pair_form(model_stock),
    needs_base=True,
    per_tensor=True,
    layered=True,
    config=MergekitOptions,
    options={"filter_wise": "mergekit.filter_wise"},
    nary=group_form(model_stock),
)
for _name, _rule in zip(TASK_RULES, (della, della_linear, breadcrumbs, breadcrumbs_ties), strict=True):
    _extra = "epsilon" if TASK_RULES[_name][0] == "della" else "gamma"
    register_merge_rule(
        _name,
        pair_form(_rule),
        needs_base=True,
        per_tensor=True,
        layered=True,
        absolute_weights=True,
        config=MergekitOptions,
        options={
            "density": "mergekit.density",
            _extra: f"mergekit.{_extra}",
            "scale": "mergekit.scale",
            **({"seed": "seed"} if _extra == "epsilon" else {}),
        },
        nary=group_form(_rule),
    )

__all__ = [
    "HEAD_POLICIES",
    "add_rule_log",
    "apply_rule",
    "MAX_RELATIVE_TASK_NORM",
    "MergeRuleSpec",
    "available_merge_rules",
    "base_relative_rules",
    "check_base_states",
    "check_compatible_states",
    "dare_drop",
    "elect_and_average",
    "get_merge_rule",
    "merge_dare_ties",
    "merge_dare_ties_n",
    "merge_fisher_n",
    "merge_heads_n",
    "merge_linear_n",
    "merge_regmean_n",
    "merge_task_arithmetic_n",
    "merge_ties_n",
    "MergekitOptions",
    "nary_merge_rules",
    "merge_fisher",
    "merge_heads",
    "merge_linear",
    "merge_regmean",
    "merge_rule_spec",
    "merge_task_arithmetic",
    "merge_ties",
    "register_merge_rule",
    "relative_task_norm",
    "rule_options",
    "shrink_gram",
    "trim_to_top",
]
