"""Base-relative merge rules for fine-tuned siblings of one base model (docs/design.md §6, §6.9).

Each rule combines the task vectors ``τᵢ = Wᵢ − W_base`` per tensor and adds the result back to
the base, following mergekit's generalized task arithmetic (``scale`` is mergekit's ``lambda``;
weights wᵢ as given, not normalised): ``task_arithmetic`` ``W = base + λ·Σ wᵢτᵢ``; ``ties`` trims
each τᵢ to its top magnitudes, elects signs by ``Σ wᵢτᵢ`` and takes the weighted mean of the
agreeing entries; ``dare_ties`` drops entries at random (seeded), rescales to the former L1 norm,
elects signs the same way and adds the agreeing entries. Float64 arithmetic, cast to the
reference's dtype. A parameter the base lacks merges linearly (normalised weights, a warning); one
with another shape is refused. No weight returns a model bit for bit.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.config.options import meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError
from raot_hf.merging.layered import check_setting, count_layers, evaluate_setting
from raot_hf.merging.log import RuleLog
from raot_hf.merging.rules import (
    StateDict,
    _check_seed,
    _check_states,
    _check_unit,
    _copy_non_float,
    _f64,
    _finish,
    _linear_entry,
    _total,
    check_weights,
)

logger = logging.getLogger("raot_hf.merging")

_F64 = torch.float64

#: Above this relative distance ‖W − W_base‖ / ‖W_base‖ (median over the 2-D weights), a model is
#: not a fine-tune of the base: two independent initialisations sit at ≈ √2, fine-tunes far below 1.
MAX_RELATIVE_TASK_NORM = 1.0
#: Below this L1 norm (before or after the drop) DARE's rescale is skipped, as in mergekit.
RESCALE_EPS = 1e-7

#: One tensor merged: (name, the models' tensors in float64, the base's or None, the settings
#: evaluated for it) → (merged tensor, details for the log).
TensorMerge = Callable[[str, list[torch.Tensor], "torch.Tensor | None", dict[str, Any]], tuple[torch.Tensor, dict]]


# ----------------------------------------------------------------------------- validation


def check_base_states(base: Mapping[str, torch.Tensor], state_a: StateDict) -> list[str]:
    """Refuse a base whose shared parameters differ in shape; return A's parameters it lacks."""
    shared = [key for key in state_a if key in base]
    if state_a and not shared:
        raise RaotError(
            "the base shares no parameter names with A; pass the checkpoint A and B were fine-tuned from, "
            "loaded with A's class."
        )
    for key in shared:
        a, origin = state_a[key], base[key]
        if tuple(a.shape) != tuple(origin.shape) or a.is_floating_point() != origin.is_floating_point():
            raise RaotError(
                f"parameter {key!r} has shape {tuple(origin.shape)} in the base but {tuple(a.shape)} in A: the base "
                "has another architecture; pass the checkpoint A and B were fine-tuned from."
            )
    return [key for key in state_a if key not in base]


def relative_task_norm(base: StateDict, state: StateDict) -> float:
    """Median over the shared 2-D float weights of ``‖W − W_base‖ / ‖W_base‖``: a few percent for a
    fine-tune, near √2 for another initialisation (the median ignores LayerNorm gains)."""
    ratios = [task_norm_ratio(w, base[key]) for key, w in state.items() if key in base]
    return median_ratio([r for r in ratios if r is not None])


def task_norm_ratio(w: torch.Tensor, origin: torch.Tensor) -> float | None:
    """``‖W − W_base‖ / ‖W_base‖`` of one 2-D floating-point weight (None for any other tensor)."""
    if w.dim() != 2 or not w.is_floating_point() or tuple(origin.shape) != tuple(w.shape):
        return None
    scale = float(torch.linalg.norm(_f64(origin)))
    return float(torch.linalg.norm(_f64(w) - _f64(origin).to(w.device))) / scale if scale > 0.0 else None


def median_ratio(ratios: list[float]) -> float:
    """The median of :func:`task_norm_ratio` values (the lower of the two middle ones; 0 if none)."""
    return float(torch.tensor(ratios, dtype=_F64).median()) if ratios else 0.0


# ----------------------------------------------------------------------------- the shared loop


def per_tensor_merge(
    rule: str, states, weights, base, settings: dict[str, Any], merge_one: TensorMerge, *, needs_base: bool,
    layer_count: int | None = None, logged: dict[str, Any] | None = None, return_log: bool = False,
):  # fmt: skip
    """Run ``merge_one`` on every float tensor with ``settings`` evaluated for it (per layer or
    module, :mod:`raot_hf.merging.layered`); ``logged``: settings recorded as they are."""
    _check_states(states)
    ref = states[0]
    if needs_base and base is None:
        raise RaotError(f"merge_rule={rule!r} measures task vectors; pass the base model (base_model: or --base)")
    missing = check_base_states(base, ref) if base is not None else []
    layers = count_layers(ref) if layer_count is None else int(layer_count)
    # lists as tuples: a chunked merge's logs add up lists (RuleLog.add), settings stay as given;
    # per-model settings (``density1`` …) are logged as ``logged`` gathers them
    given = {"weights": weights, **{k: v for k, v in settings.items() if k[-1] not in "0123456789"}}
    given.update(logged or {})
    log = RuleLog(rule, {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
    if missing and needs_base:
        floating = [k for k in missing if ref[k].is_floating_point()]
        if floating:
            logger.warning(
                "%d parameter(s) are not in the base (first: %s): they merge linearly", len(floating), floating[0]
            )
        log.settings["not_in_base"] = missing
    total = sum(weights)
    normalised = [w / total for w in weights] if total > 0 else [1.0 / len(weights)] * len(weights)
    merged: dict[str, torch.Tensor] = {}
    for key, r in ref.items():
        tensors = [s[key] for s in states]
        if not r.is_floating_point():
            merged[key] = _copy_non_float(key, r, tensors[1], log)
        elif needs_base and key not in base:
            merged[key] = _linear_entry(key, tensors, normalised, RuleLog("linear"))
            log.note(key, "linear (not in the base)")
        else:
            values = {name: evaluate_setting(v, key, layers) for name, v in settings.items()}
            origin = _f64(base[key]).to(r.device) if base is not None and key in base else None
            value, details = merge_one(key, [_f64(t).to(r.device) for t in tensors], origin, values)
            log.note(key, rule, **{k: v for k, v in values.items() if isinstance(v, (int, float))}, **details)
            log.add_totals(r.numel(), details)  # entry counts, which add up across chunks
            merged[key] = value.to(r.dtype)
    return _finish(merged, log, return_log)


def sparsity_details(tasks: Sequence[torch.Tensor]) -> dict[str, float]:
    """Fractions of entries each sparse task vector keeps (``kept_i``) and that disagree in sign."""
    n = max(tasks[0].numel(), 1)
    details = {f"kept_{i}": float((t != 0).sum()) / n for i, t in enumerate(tasks, start=1)}
    stacked = torch.stack(list(tasks))
    details["sign_conflicts"] = float(((stacked > 0).any(0) & (stacked < 0).any(0)).sum()) / n
    return details


# ----------------------------------------------------------------------------- sparsification


def _tensor_seed(seed: int, name: str, side: str) -> int:
    """A 63-bit seed for one tensor of one model, stable across runs, processes and chunkings."""
    digest = hashlib.sha256(f"{int(seed)}\0{name}\0{side}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def keep_top_magnitudes(task: torch.Tensor, density: float) -> torch.Tensor:
    """mergekit's magnitude sparsification: keep the ``int(density·n)`` largest-magnitude entries."""
    if density >= 1.0:
        return task.clone()
    k = int(density * task.numel())
    if k <= 0:
        raise RaotError(f"density {density} keeps no entry of a tensor of {task.numel()}; raise the density.")
    mask = torch.zeros(task.numel(), dtype=torch.bool, device=task.device)
    mask[torch.topk(task.abs().flatten(), k, sorted=False).indices] = True
    return torch.where(mask.view_as(task), task, torch.zeros_like(task))


def random_keep(task: torch.Tensor, density: float, *, seed: int, name: str, model: int) -> torch.Tensor:
    """DARE's drop (mergekit's ``random``): keep each entry with probability ``density``, from a CPU
    generator seeded by ``(seed, name, model)`` (device- and chunk-independent)."""
    generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name, f"model{model}"))
    keep = torch.rand(task.shape, generator=generator, dtype=_F64).to(task.device) < density
    return torch.where(keep, task, torch.zeros_like(task))


def random_keep_rescaled(task: torch.Tensor, density: float, *, seed: int, name: str, model: int) -> torch.Tensor:
    """DARE (mergekit's ``dare_ties``): :func:`random_keep`, rescaled to the task's L1 norm."""
    if density >= 1.0:
        return task.clone()
    return l1_rescaled(task, random_keep(task, density, seed=seed, name=name, model=model))


def l1_rescaled(task: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``kept`` rescaled to ``task``'s L1 norm (as is when either norm is below :data:`RESCALE_EPS`)."""
    before, after = float(task.abs().sum()), float(kept.abs().sum())
    if before < RESCALE_EPS or after < RESCALE_EPS:
        return kept
    return kept * (before / after)


def della_keep(task: torch.Tensor, density: float, epsilon: float, *, seed: int, name: str, model: int) -> torch.Tensor:
    """DELLA's MagPrune (mergekit): per row, keep probabilities rise with magnitude rank from
    ``density − ε`` to ``density + ε``; a seeded draw (not rescaled)."""
    if density - epsilon <= 0.0 or density + epsilon >= 1.0:
        raise RaotError(
            f"della: density {density} ± epsilon {epsilon} must stay inside (0, 1); lower epsilon or move the density"
        )
    rows = task.reshape(1, -1) if task.dim() < 2 else task.reshape(task.shape[0], -1)
    order = torch.argsort(rows.abs(), dim=1, stable=True)
    ranks = torch.argsort(order, dim=1, stable=True).to(_F64)
    span = rows.shape[1] - 1
    scaled = (ranks / span).clamp(0.0, 1.0) if span > 0 else torch.zeros_like(ranks)
    probability = (density - epsilon) + scaled * 2.0 * epsilon
    generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name, f"model{model}"))
    draw = torch.rand(rows.shape, generator=generator, dtype=_F64).to(task.device)
    return torch.where(draw < probability, rows, torch.zeros_like(rows)).reshape(task.shape)


def breadcrumbs_keep(task: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs: drop the ``int(γ·n)`` largest and the smallest magnitudes, keeping ``int(density·n)``."""
    n = task.numel()
    keep, top = int(density * n), int(gamma * n)
    bottom = n - keep - top
    if bottom < 0:
        top, bottom = top + bottom, 0
    order = torch.argsort(task.abs().flatten(), stable=True)
    mask = torch.zeros(n, dtype=torch.bool, device=task.device)
    mask[order[bottom : n - top]] = True
    return torch.where(mask.view_as(task), task, torch.zeros_like(task))


def elect_signs(tasks: Sequence[torch.Tensor], weights: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """mergekit's ``sum`` consensus (sign of ``Σ wᵢτᵢ``, +1 at 0): weighted tasks (N, …), agree mask."""
    weighted = torch.stack([w * t for t, w in zip(tasks, weights, strict=True)])
    elected = torch.where(weighted.sum(0) >= 0, 1.0, -1.0).to(weighted.dtype)
    return weighted, torch.sign(weighted) == elected


# ----------------------------------------------------------------------------- the rules


@dataclass(frozen=True)
class TaskVectorRule:
    """One of mergekit's generalized task-arithmetic methods: how each task vector is sparsified
    (``magnitude``: TIES' top magnitudes, ``random``: DARE's drop, ``della``: MagPrune,
    ``outliers``: Breadcrumbs; None: kept whole), whether signs are elected, and the defaults of
    mergekit's ``normalize`` (divide by the kept weight) and ``rescale`` (each sparse vector back
    to its L1 norm) switches and of the density."""

    sparsify: str | None
    elect: bool
    normalize: bool
    rescale: bool
    density: float = 1.0


#: mergekit's registrations (``ties`` and ``dare_ties`` keep this project's default density 0.2).
TASK_VECTOR_RULES = {
    "task_arithmetic": TaskVectorRule(None, False, False, False),
    "ties": TaskVectorRule("magnitude", True, True, False, 0.2),
    "dare_ties": TaskVectorRule("random", True, False, True, 0.2),
    "dare_linear": TaskVectorRule("random", False, False, True),
    "della": TaskVectorRule("della", True, True, True),
    "della_linear": TaskVectorRule("della", False, False, True),
    "breadcrumbs": TaskVectorRule("outliers", False, False, False),
    "breadcrumbs_ties": TaskVectorRule("outliers", True, False, False),
}
#: mergekit's defaults of DELLA's ``epsilon`` and Breadcrumbs' ``gamma``.
SPARSIFY_DEFAULTS = {"epsilon": 0.15, "gamma": 0.01}


def required_number(rule: str, name: str, value: Any, key: str) -> float:
    """A setting's value for tensor ``key`` as a finite number; a missing one names the fix."""
    if value is None:
        raise RaotError(
            f"merge_rule={rule!r} has no {name} for {key!r}; set parameters: {name}: (a number, a per-layer list, or "
            "filters with a default value)"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RaotError(f"{name}={value!r} for {key!r} must be a finite number")
    return float(value)


def check_switch(name: str, value: Any) -> bool:
    """A true/false option (mergekit's ``normalize``, ``rescale``, ``int8_mask``)."""
    if not isinstance(value, bool):
        raise RaotError(f"{name}={value!r} must be true or false")
    return value


def per_model_settings(name: str, one: Any, each: Sequence[Any] | None, n: int, default: Any) -> list[Any]:
    """One setting per model: ``each`` (one per model) when given, else ``one`` (else ``default``) for all."""
    if each:
        if len(each) != n:
            raise RaotError(f"{len(each)} {name} values for {n} models; give one {name} per model.")
        return [check_setting(name, v) for v in each]
    return [check_setting(name, default if one is None else one)] * n


def sparsified(
    rule: str, spec: TaskVectorRule, task: torch.Tensor, values: dict[str, Any], *, rescale: bool, seed: int,
    key: str, model: int,
) -> torch.Tensor:  # fmt: skip
    """Model ``model``'s task vector of tensor ``key`` sparsified as ``spec`` says, with its evaluated
    settings ``values`` (``density<i>``, ``epsilon<i>``, ``gamma<i>``, i from 1); rescaled to its
    L1 norm when ``rescale``. Nothing is dropped at density 1."""
    i = model + 1
    density = required_number(rule, "density", values[f"density{i}"], key)
    density = _check_unit("density", density, open_low=spec.sparsify in ("magnitude", "random"))
    if density >= 1.0:
        return task.clone()
    if spec.sparsify == "magnitude":
        kept = keep_top_magnitudes(task, density)
    elif spec.sparsify == "random":
        kept = random_keep(task, density, seed=seed, name=key, model=model)
    elif spec.sparsify == "della":
        epsilon = required_number(rule, "epsilon", values[f"epsilon{i}"], key)
        kept = della_keep(task, density, epsilon, seed=seed, name=key, model=model)
    else:
        kept = breadcrumbs_keep(task, density, required_number(rule, "gamma", values[f"gamma{i}"], key))
    return l1_rescaled(task, kept) if rescale else kept


def task_vector_rule(
    rule: str, states, weights, base=None, *, density=None, densities=None, epsilon=None, epsilons=None,
    gamma=None, gammas=None, scale=None, normalize: bool | None = None, rescale: bool | None = None,
    int8_mask: bool | None = None, seed: int = 0, layer_count: int | None = None, return_log: bool = False,
):  # fmt: skip
    """mergekit's generalized task arithmetic (:data:`TASK_VECTOR_RULES`): each τᵢ = Wᵢ − base
    sparsified (rescaled to its L1 norm with ``rescale``), signs elected by ``Σ wᵢτᵢ`` where the
    rule does, ``mixed = Σ wᵢτᵢ`` over the kept (agreeing) entries, divided by the weight kept
    (``normalize``; 1 where none) and ``W = base + λ·mixed`` (``scale``, mergekit's ``lambda``).
    ``density``/``epsilon``/``gamma`` apply to every model, ``densities``/``epsilons``/``gammas``
    give one per model; every one may vary by layer or module. ``int8_mask`` (mergekit's memory
    saving) does not change the result."""
    spec = TASK_VECTOR_RULES[rule]
    weights = check_weights(weights, len(states), normalise=False)
    seed = _check_seed(seed)
    normalize = spec.normalize if normalize is None else check_switch("normalize", normalize)
    rescale = spec.rescale if rescale is None else check_switch("rescale", rescale)
    if int8_mask is not None:
        check_switch("int8_mask", int8_mask)
    n = len(states)
    settings: dict[str, Any] = {}
    logged: dict[str, Any] = {}
    if spec.sparsify is not None:
        kept = per_model_settings("density", density, densities, n, spec.density)
        settings.update({f"density{i}": d for i, d in enumerate(kept, start=1)})
        extra = {"della": ("epsilon", epsilon, epsilons), "outliers": ("gamma", gamma, gammas)}.get(spec.sparsify)
        if extra is not None:
            name, one, each = extra
            values = per_model_settings(name, one, each, n, SPARSIFY_DEFAULTS[name])
            settings.update({f"{name}{i}": v for i, v in enumerate(values, start=1)})
        logged["densities"] = kept
        if extra is not None:
            logged[f"{extra[0]}s"] = values
        if spec.sparsify in ("random", "della"):
            logged.update(seed=seed, mask="sha256(seed, parameter, model) → torch.Generator")
    settings["scale"] = check_setting("scale", 1.0 if scale is None else scale)
    for name, value, default in (("normalize", normalize, spec.normalize), ("rescale", rescale, spec.rescale)):
        if value != default:
            logged[name] = value

    def merge_one(key, tensors, origin, values):
        tasks = [x - origin for x in tensors]
        if spec.sparsify is not None:
            tasks = [
                sparsified(rule, spec, t, values, rescale=rescale, seed=seed, key=key, model=i)
                for i, t in enumerate(tasks)
            ]
        if spec.elect:
            weighted, agree = elect_signs(tasks, weights)
            mixed = (weighted * agree).sum(0)
            w = torch.tensor(weights, dtype=_F64, device=origin.device).view(-1, *[1] * origin.dim())
            divisor = (w * agree).sum(0)
            divisor = torch.where(divisor == 0, 1.0, divisor)
        else:
            mixed = _total([w * t for w, t in zip(weights, tasks, strict=True)])
            divisor = sum(weights) if abs(sum(weights)) >= 1e-8 else 1.0
        if normalize:
            mixed = mixed / divisor
        details = sparsity_details(tasks) if spec.sparsify is not None else {}
        return origin + required_number(rule, "scale", values["scale"], key) * mixed, details

    return per_tensor_merge(
        rule, states, weights, base, settings, merge_one,
        needs_base=True, layer_count=layer_count, logged=logged, return_log=return_log,
    )  # fmt: skip


def merge_task_arithmetic(states, weights, base=None, *, return_log: bool = False, **options):
    """Task arithmetic (mergekit): ``W = base + λ·Σ wᵢτᵢ`` with ``τᵢ = Wᵢ − base``."""
    return task_vector_rule("task_arithmetic", states, weights, base, return_log=return_log, **options)


def merge_ties(states, weights, base=None, *, return_log=False, **options):
    """TIES: top ``int(densityᵢ·n)`` magnitudes, weighted mean of the agreeing entries (:func:`task_vector_rule`)."""
    return task_vector_rule("ties", states, weights, base, return_log=return_log, **options)


def merge_dare_ties(states, weights, base=None, *, return_log=False, **options):
    """DARE-TIES: seeded random drop and rescale, agreeing entries summed (:func:`task_vector_rule`)."""
    return task_vector_rule("dare_ties", states, weights, base, return_log=return_log, **options)


def merge_dare_linear(states, weights, base=None, *, return_log=False, **options):
    """DARE without sign election: seeded random drop and rescale, weighted sum (:func:`task_vector_rule`)."""
    return task_vector_rule("dare_linear", states, weights, base, return_log=return_log, **options)


def _layered_field(help: str, legacy: str | None = None, **extra: Any) -> Any:
    return field(default=None, metadata=meta(help, legacy, **extra))


@register_section
@dataclass
class TaskVectorOptions(OptionSection):
    """Options of the task-vector rules (:data:`TASK_VECTOR_RULES`: task arithmetic, TIES, DARE,
    DELLA, Breadcrumbs), with mergekit's names; None: the rule's default. Each may vary by layer or
    module (:mod:`raot_hf.merging.layered`), e.g. ``0,0.5,1`` or ``self_attn=0,1;mlp=1,0;default=0.5``."""

    section = "task_vectors"
    #: Where these settings lived in earlier versions (still read): ``section.field`` → field.
    moved_from = {
        "base_rules.density": "density", "base_rules.task_scale": "scale", "mergekit.density": "density",
        "mergekit.epsilon": "epsilon", "mergekit.gamma": "gamma", "mergekit.scale": "scale",
    }  # fmt: skip

    density: Any = _layered_field(
        "Fraction of each task vector kept (default: ties / dare_ties 0.2, the others 1).", "density",
        flag="--density", aliases=("--mergekit-density",),
    )  # fmt: skip
    scale: Any = _layered_field(
        "λ in base + λ·Σ wᵢτᵢ, mergekit's lambda (default 1).", "task_scale", flag="--task-scale",
        aliases=("--mergekit-scale",),
    )  # fmt: skip
    epsilon: Any = _layered_field(
        "della: keep probabilities span density ± epsilon (default 0.15).", flag="--epsilon",
        aliases=("--mergekit-epsilon",),
    )  # fmt: skip
    gamma: Any = _layered_field(
        "breadcrumbs: fraction of largest task-vector entries dropped (default 0.01).", flag="--gamma",
        aliases=("--mergekit-gamma",),
    )  # fmt: skip

    def __post_init__(self) -> None:
        for name in ("density", "scale", "epsilon", "gamma"):
            setattr(self, name, check_setting(name, getattr(self, name)))
        if isinstance(self.density, float) and not 0.0 < self.density <= 1.0:
            raise RaotError(f"density={self.density} must lie in (0, 1] (the fraction of each task vector kept)")
