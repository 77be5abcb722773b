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
from raot_hf.merging.base_rules import (
    MAX_RELATIVE_TASK_NORM,
    TaskVectorOptions,
    check_base_states,
    elect_signs,
    keep_top_magnitudes,
    merge_dare_linear,
    merge_dare_ties,
    merge_task_arithmetic,
    merge_ties,
    random_keep_rescaled,
    relative_task_norm,
)
from raot_hf.merging.layered import count_layers
from raot_hf.merging.log import RuleLog
from raot_hf.merging.mergekit_rules import (
    MergekitOptions,
    breadcrumbs,
    breadcrumbs_ties,
    della,
    della_linear,
    model_stock,
    nuslerp,
    passthrough,
    slerp,
)
from raot_hf.merging.nary import ModelsOptions
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
from raot_hf.registry import Registry, registry


@dataclass(frozen=True)
class MergeRuleSpec:
    """A registered rule and what it needs besides the models' state dicts and weights.

    * ``needs_base``: called with ``base=`` (the state dict the others were fine-tuned from).
    * ``needs_grams``: called with ``grams=`` (one mapping per model), ``linear_weights=`` and
      ``transposed_weights=`` (the weights stored (in, out), GPT-2's ``Conv1D``) (RegMean).
    * ``needs_fisher``: called with ``fishers=`` (one diagonal Fisher per model).
    * ``per_tensor``: each output tensor depends only on the same-named inputs (chunked merges).
    * ``options``: rule keyword → :class:`raot_hf.RaotConfig` path (e.g. ``task_vectors.density``).
    * ``max_models``: the most models the rule merges (SLERP's two); None: any number.
    * ``layered``: options may vary by layer or module; called with ``layer_count=``.
    * ``absolute_weights``: reads the weights as given (mergekit's); gets ``models.densities`` for two models too.
    * ``file_parameters``: the parameters a merge file gives the whole merge (mergekit's names) → the
      rule's keyword; ``model_parameters``: those it gives each model → (the keyword of the list
      with one value per model, mergekit's default; None: the weight's 1/N).
    * ``base_role``: what a merge file's ``base_model`` is to a rule that does not need a base:
      ``origin`` (of task vectors, when given: NuSLERP), ``first`` (the first model: SLERP's t = 0)
      or ``model`` (one more model merged, as mergekit does). A rule that needs one takes it as origin.
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
    file_parameters: Mapping[str, str] = field(default_factory=dict)
    model_parameters: Mapping[str, tuple[str, Any]] = field(default_factory=dict)
    base_role: str = "model"


_RULES: Registry[MergeRuleSpec] = registry("merge rule")


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
    if not callable(fn):
        raise TypeError(f"merge rule {name!r} must be callable, got {type(fn).__name__}")
    _RULES.check_free(name)
    if config is not None:
        register_section(config)
        if options is None:
            options = {f.name: f"{config.section}.{f.name}" for f in dataclasses.fields(config)}
    _RULES.register(name, MergeRuleSpec(name, fn, options=dict(options or {}), **flags))
    return fn


def merge_rule_spec(name: str) -> MergeRuleSpec:
    """The registration of rule ``name``; the error lists the valid names."""
    return _RULES.get(name)


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


#: mergekit's parameters of the generalized task-arithmetic rules, as merge files name them: the
#: whole merge's (name → the rule's keyword) and each model's (name → the keyword of the list
#: with one value per model, and mergekit's default).
_GTA_FILE = {"lambda": "scale", "normalize": "normalize", "rescale": "rescale", "int8_mask": "int8_mask"}
_GTA_MODEL = {"weight": ("weights", None), "density": ("densities", 1.0)}
_TASK = {"needs_base": True, "per_tensor": True, "config": TaskVectorOptions, "file_parameters": _GTA_FILE}
_MERGEKIT = {"per_tensor": True, "layered": True, "config": MergekitOptions}
_TIES = {"density": "task_vectors.density", "scale": "task_vectors.scale"}
_WEIGHT = {"weight": ("weights", None)}
register_merge_rule(
    "linear", merge_linear, per_tensor=True, file_parameters={"normalize": "normalize"}, model_parameters=_WEIGHT
)
register_merge_rule("regmean", merge_regmean, needs_grams=True, config=RegMeanOptions)
register_merge_rule("fisher", merge_fisher, needs_fisher=True, config=FisherOptions, options={})
register_merge_rule(
    "task_arithmetic", merge_task_arithmetic, **_TASK, model_parameters=_GTA_MODEL,
    options={"scale": "task_vectors.scale"},
)  # fmt: skip
register_merge_rule("ties", merge_ties, **_TASK, options=_TIES, model_parameters=_GTA_MODEL)
for _name, _rule in (("dare_ties", merge_dare_ties), ("dare_linear", merge_dare_linear)):
    register_merge_rule(_name, _rule, **_TASK, options={**_TIES, "seed": "seed"}, model_parameters=_GTA_MODEL)
register_merge_rule(
    "slerp", slerp, **_MERGEKIT, max_models=2, options={"t": "mergekit.t"}, file_parameters={"t": "t"},
    base_role="first",
)  # fmt: skip
_NUSLERP = {"row_wise": "mergekit.row_wise", "flatten": "mergekit.flatten"}
register_merge_rule(
    "nuslerp", nuslerp, **_MERGEKIT, max_models=2, absolute_weights=True, options=_NUSLERP,
    file_parameters={"nuslerp_row_wise": "row_wise", "nuslerp_flatten": "flatten"}, model_parameters=_WEIGHT,
    base_role="origin",
)  # fmt: skip
register_merge_rule(
    "model_stock", model_stock, **_MERGEKIT, needs_base=True, options={"filter_wise": "mergekit.filter_wise"},
    file_parameters={"filter_wise": "filter_wise"},
)  # fmt: skip
for _name, _rule in (("della", della), ("della_linear", della_linear)):
    _options = {"density": "task_vectors.density", "epsilon": "task_vectors.epsilon", "scale": "task_vectors.scale",
                "seed": "seed"}  # fmt: skip
    _model = {**_GTA_MODEL, "epsilon": ("epsilons", 0.15)}
    register_merge_rule(_name, _rule, **_MERGEKIT, needs_base=True, absolute_weights=True, options=_options,
                        file_parameters=_GTA_FILE, model_parameters=_model)  # fmt: skip
for _name, _rule in (("breadcrumbs", breadcrumbs), ("breadcrumbs_ties", breadcrumbs_ties)):
    _options = {"density": "task_vectors.density", "gamma": "task_vectors.gamma", "scale": "task_vectors.scale"}
    _model = {**_GTA_MODEL, "gamma": ("gammas", 0.01)}
    register_merge_rule(_name, _rule, **_MERGEKIT, needs_base=True, absolute_weights=True, options=_options,
                        file_parameters=_GTA_FILE, model_parameters=_model)  # fmt: skip
register_merge_rule(
    "passthrough", passthrough, per_tensor=True, max_models=1, model_parameters={"scale": ("scales", None)}
)

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
    "merge_dare_linear",
    "merge_dare_ties",
    "merge_fisher",
    "merge_heads",
    "merge_linear",
    "merge_regmean",
    "merge_rule_spec",
    "merge_task_arithmetic",
    "merge_ties",
    "MergekitOptions",
    "ModelsOptions",
    "nary_merge_rules",
    "random_keep_rescaled",
    "register_merge_rule",
    "relative_task_norm",
    "rule_options",
    "shrink_gram",
]
