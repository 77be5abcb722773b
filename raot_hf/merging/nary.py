"""Merge rules over N aligned models, with one weight per model (docs/design.md §6.9).

Every rule takes ``rule(states, *, weights, ..., return_log=False)``: ``states`` are N state dicts
whose keys and shapes agree (the first is the reference, the others already moved into its
basis), ``weights`` one non-negative number per model. Arithmetic runs in float64 and results are
cast to the reference's dtype; tensors that are not floating point are copied from the reference.

The weight-space rules normalise the weights (``linear``, ``regmean``, ``fisher``: a weighted
mean). The base-relative rules follow mergekit's definitions of its generalized task
arithmetic, with ``scale`` as mergekit's ``lambda``:

* ``task_arithmetic``: ``W = base + λ·Σ wᵢτᵢ`` (weights not normalised);
* ``ties``: each τᵢ trimmed to its ``int(densityᵢ·n)`` largest magnitudes; the elected sign of an
  entry is that of ``Σ wᵢτᵢ`` (+ where it is 0); ``W = base + λ·Σ wᵢmᵢτᵢ / Σ wᵢmᵢ`` over the
  entries mᵢ that carry the elected sign (divisor 1 where none does);
* ``dare_ties``: each τᵢ keeps every entry with probability densityᵢ (a seeded mask per tensor and
  model) and is rescaled to its former L1 norm; signs elected as in TIES; ``W = base + λ·Σ wᵢmᵢτᵢ``
  (not normalised).

With two models and weights ``(1 − α, α)``, ``linear``, ``regmean``, ``fisher`` and
``task_arithmetic`` coincide with the two-model rules of :mod:`raot_hf.merging.rules`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.config.options import meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError
from raot_hf.merging.base_rules import _tensor_seed, check_base_states
from raot_hf.merging.rules import (
    StateDict,
    _check_finite,
    _check_unit,
    _copy_non_float,
    _f64,
    _finish,
    _new_log,
    _note,
    _regmean_groups,
    _solve_symmetric,
    check_compatible_states,
    shrink_gram,
)

logger = logging.getLogger("raot_hf.merging")

_F64 = torch.float64
#: Below this L1 norm (before or after the drop) DARE's rescale is skipped, as in mergekit.
RESCALE_EPS = 1e-7


# ----------------------------------------------------------------------------- validation


def check_weights(weights: Sequence[float], n: int, *, normalise: bool) -> list[float]:
    """One finite, non-negative weight per model with a positive sum; divided by the sum when
    ``normalise``."""
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise RaotError(f"{len(weights)} weights for {n} models; give one weight per model (--weights w1,w2,...).")
    if not all(math.isfinite(w) and w >= 0.0 for w in weights) or not sum(weights) > 0.0:
        raise RaotError(f"weights {weights} must be finite, non-negative and not all zero.")
    total = sum(weights)
    return [w / total for w in weights] if normalise else weights


def check_densities(density: float, densities: Sequence[float] | None, n: int) -> list[float]:
    """Each model's density: ``densities`` when given (one per model), else ``density`` for all."""
    values = [float(density)] * n if not densities else [float(d) for d in densities]
    if len(values) != n:
        raise RaotError(f"{len(values)} densities for {n} models; give one density per model.")
    return [_check_unit("density", d, open_low=True) for d in values]


def _check_states(states: Sequence[StateDict]) -> None:
    if len(states) < 2:
        raise RaotError(f"an N-model merge needs at least two models, got {len(states)}.")
    for i, state in enumerate(states[1:], start=2):
        check_compatible_states(states[0], state, names=("model 1", f"model {i}"))


def _weighted_sum(tensors: Sequence[torch.Tensor], weights: Sequence[float], device) -> torch.Tensor:
    total = torch.zeros(tensors[0].shape, dtype=_F64, device=device)
    for t, w in zip(tensors, weights, strict=True):
        if w != 0.0:
            total += w * _f64(t).to(device)
    return total


def _linear_entry_n(key: str, tensors: Sequence[torch.Tensor], weights: Sequence[float], log: dict) -> torch.Tensor:
    """The weighted mean of one tensor (weights sum to 1); a model with all the weight is returned
    bit for bit, and non-floating-point tensors come from the reference."""
    ref = tensors[0]
    if not ref.is_floating_point():
        return _copy_non_float(key, ref, tensors[1], log)
    _note(log, key, "linear")
    nonzero = [i for i, w in enumerate(weights) if w != 0.0]
    if len(nonzero) == 1:
        return tensors[nonzero[0]].detach().to(dtype=ref.dtype, device=ref.device, copy=True)
    return _weighted_sum(tensors, weights, ref.device).to(ref.dtype)


# ----------------------------------------------------------------------------- weight-space rules


def merge_linear_n(states: Sequence[StateDict], *, weights: Sequence[float], return_log: bool = False):
    """``W = Σ wᵢWᵢ / Σ wᵢ`` for every floating-point tensor."""
    _check_states(states)
    weights = check_weights(weights, len(states), normalise=True)
    log = _new_log("linear", {"weights": weights})
    merged = {key: _linear_entry_n(key, [s[key] for s in states], weights, log) for key in states[0]}
    return _finish(merged, log, return_log)


def merge_regmean_n(
    states: Sequence[StateDict],
    *,
    weights: Sequence[float],
    grams: Sequence[Mapping[str, torch.Tensor]],
    linear_weights: Mapping[str, str],
    shrink: float = 0.9,
    transposed_weights: Collection[str] = (),
    return_log: bool = False,
):
    """RegMean over N models: per Linear, ``W = (Σ wᵢG̃ᵢ)⁻¹·Σ wᵢG̃ᵢWᵢᵀ`` (transposed back), the
    weight that best reproduces every model's outputs on its own inputs; other tensors linear."""
    _check_states(states)
    weights = check_weights(weights, len(states), normalise=True)
    shrink = _check_unit("shrink", shrink)
    if len(grams) != len(states):
        raise RaotError(f"{len(grams)} Gram sets for {len(states)} models; RegMean needs one per model.")
    transposed = set(transposed_weights)
    ref = states[0]
    first = {n: (w.T if n in transposed else w) for n, w in ref.items() if n in linear_weights}
    groups = _regmean_groups(first, linear_weights, grams[0], grams[1])
    for g in grams[2:]:
        _regmean_groups(first, linear_weights, grams[0], g)
    log = _new_log("regmean", {"weights": weights, "shrink": shrink})
    merged = {k: _linear_entry_n(k, [s[k] for s in states], weights, log) for k in ref if k not in linear_weights}
    for gram_key, names in groups.items():
        device = ref[names[0]].device
        system, rhs, prior = 0.0, 0.0, 0.0
        for state, gram, w in zip(states, grams, weights, strict=True):
            g = w * shrink_gram(gram[gram_key], shrink).to(device)
            stacked = torch.cat([(_f64(state[n]).T if n in transposed else _f64(state[n])).to(device) for n in names])
            system, rhs, prior = system + g, rhs + g @ stacked.T, prior + w * stacked.T
        solution, info = _solve_symmetric(system, rhs, prior)
        offset = 0
        for name in names:
            rows = ref[name].shape[1 if name in transposed else 0]
            weight = solution[:, offset : offset + rows]
            offset += rows
            _note(log, name, "regmean", gram=gram_key, **info)
            merged[name] = (weight if name in transposed else weight.T).to(ref[name].dtype).contiguous()
    return _finish({k: merged[k] for k in ref}, log, return_log)


def merge_fisher_n(
    states: Sequence[StateDict],
    *,
    weights: Sequence[float],
    fishers: Sequence[Mapping[str, torch.Tensor]],
    eps: float = 1e-8,
    return_log: bool = False,
):
    """Fisher-weighted averaging over N models: each Fisher divided by its mean (over the entries
    it covers), ``F̂ᵢ = Fᵢ/mean(Fᵢ) + eps`` and ``W = Σ wᵢF̂ᵢWᵢ / Σ wᵢF̂ᵢ``; parameters without a
    Fisher merge linearly."""
    from raot_hf.merging.rules import _check_same_fisher_keys, _fisher_mean

    _check_states(states)
    weights = check_weights(weights, len(states), normalise=True)
    if len(fishers) != len(states):
        raise RaotError(f"{len(fishers)} Fishers for {len(states)} models; the Fisher rule needs one per model.")
    for f in fishers[1:]:
        _check_same_fisher_keys(fishers[0], f)
    means = [_fisher_mean(f, s, f"model {i + 1}") for i, (f, s) in enumerate(zip(fishers, states, strict=True))]
    log = _new_log("fisher", {"weights": weights, "eps": eps, "normalisation": "each Fisher divided by its mean"})
    merged = {}
    for key, ref in states[0].items():
        if key not in fishers[0] or not ref.is_floating_point():
            merged[key] = _linear_entry_n(key, [s[key] for s in states], weights, log)
            continue
        num = torch.zeros(ref.shape, dtype=_F64, device=ref.device)
        den = torch.zeros_like(num)
        for state, fisher, mean, w in zip(states, fishers, means, weights, strict=True):
            f = w * (_f64(fisher[key]).to(ref.device) / mean + eps)
            num += f * _f64(state[key]).to(ref.device)
            den += f
        _note(log, key, "fisher")
        merged[key] = (num / den).to(ref.dtype)
    return _finish(merged, log, return_log)


# ----------------------------------------------------------------------------- base-relative rules

TaskCombine = Callable[[str, list[torch.Tensor]], torch.Tensor]


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


def random_keep_rescaled(task: torch.Tensor, density: float, *, seed: int, name: str, model: int) -> torch.Tensor:
    """DARE as mergekit runs it in ``dare_ties``: keep each entry with probability ``density``
    (a CPU generator seeded from ``(seed, name, model)``) and rescale to the former L1 norm."""
    if density >= 1.0:
        return task.clone()
    generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name, f"model{model}"))
    keep = torch.rand(task.shape, generator=generator, dtype=_F64).to(task.device) < density
    return l1_rescaled(task, torch.where(keep, task, torch.zeros_like(task)))


def l1_rescaled(task: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``kept`` (a sparsified ``task``) rescaled to ``task``'s L1 norm, as mergekit rescales; left
    as is when either norm is below :data:`RESCALE_EPS`."""
    before, after = float(task.abs().sum()), float(kept.abs().sum())
    if before < RESCALE_EPS or after < RESCALE_EPS:
        return kept
    return kept * (before / after)


def elect_signs(tasks: Sequence[torch.Tensor], weights: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """mergekit's ``sum`` consensus: the elected sign is that of ``Σ wᵢτᵢ`` (+1 where it is 0);
    returns the weighted tasks (N, …) and the mask of entries that carry the elected sign."""
    weighted = torch.stack([w * t for t, w in zip(tasks, weights, strict=True)])
    elected = torch.where(weighted.sum(0) >= 0, 1.0, -1.0).to(weighted.dtype)
    return weighted, torch.sign(weighted) == elected


def _base_relative_n(
    rule: str, states, base: StateDict, weights, scale: float, settings: dict, combine: TaskCombine, return_log: bool
):
    """``W = base + λ·combine(τ₁, …, τ_N)`` per floating-point tensor; a tensor the base lacks
    merges linearly (normalised weights), with a warning."""
    _check_states(states)
    ref = states[0]
    missing = check_base_states(base, ref)
    log = _new_log(rule, {"weights": list(weights), "scale": scale, **settings})
    if missing:
        floating = [k for k in missing if ref[k].is_floating_point()]
        if floating:
            logger.warning(
                "%d parameter(s) are not in the base (first: %s): they merge linearly", len(floating), floating[0]
            )
        log["settings"]["not_in_base"] = missing
    normalised = [w / sum(weights) for w in weights]
    merged = {}
    for key, r in ref.items():
        tensors = [s[key] for s in states]
        if not r.is_floating_point() or key not in base:
            merged[key] = _linear_entry_n(key, tensors, normalised, log)
            continue
        origin = _f64(base[key]).to(r.device)
        tasks = [_f64(t).to(r.device) - origin for t in tensors]
        _note(log, key, rule)
        merged[key] = (origin + scale * combine(key, tasks)).to(r.dtype)
    return _finish(merged, log, return_log)


def merge_task_arithmetic_n(
    states, *, base: StateDict, weights: Sequence[float], scale: float = 1.0, return_log: bool = False
):
    """Task arithmetic over N task vectors (mergekit): ``W = base + λ·Σ wᵢτᵢ``."""
    weights = check_weights(weights, len(states), normalise=False)
    scale = _check_finite("scale", scale)

    def combine(key: str, tasks: list[torch.Tensor]) -> torch.Tensor:
        return sum(w * t for t, w in zip(tasks, weights, strict=True))

    return _base_relative_n("task_arithmetic", states, base, weights, scale, {}, combine, return_log)


def _sparse_settings(states, weights, density, densities, scale) -> tuple[list[float], list[float], float]:
    """The checked weights (not normalised), per-model densities and scale of TIES / DARE-TIES."""
    n = len(states)
    return (
        check_weights(weights, n, normalise=False),
        check_densities(density, densities, n),
        _check_finite("scale", scale),
    )


def merge_ties_n(
    states,
    *,
    base: StateDict,
    weights: Sequence[float],
    density: float = 0.2,
    densities: Sequence[float] | None = None,
    scale: float = 1.0,
    return_log: bool = False,
):
    """TIES over N task vectors (mergekit): trim each to its top ``int(densityᵢ·n)`` magnitudes,
    elect signs by the weighted sum, take the weighted mean of the agreeing entries."""
    weights, kept, scale = _sparse_settings(states, weights, density, densities, scale)

    def combine(key: str, tasks: list[torch.Tensor]) -> torch.Tensor:
        trimmed = [keep_top_magnitudes(t, d) for t, d in zip(tasks, kept, strict=True)]
        weighted, agree = elect_signs(trimmed, weights)
        w = torch.tensor(weights, dtype=_F64, device=weighted.device).view(-1, *[1] * (weighted.dim() - 1))
        divisor = (w * agree).sum(0)
        divisor = torch.where(divisor == 0, 1.0, divisor)
        return (weighted * agree).sum(0) / divisor

    return _base_relative_n("ties", states, base, weights, scale, {"densities": kept}, combine, return_log)


def merge_dare_ties_n(
    states,
    *,
    base: StateDict,
    weights: Sequence[float],
    density: float = 0.2,
    densities: Sequence[float] | None = None,
    scale: float = 1.0,
    seed: int = 0,
    return_log: bool = False,
):
    """DARE-TIES over N task vectors (mergekit): drop at random with L1 rescale, elect signs by
    the weighted sum, add the agreeing weighted entries (not normalised)."""
    weights, kept, scale = _sparse_settings(states, weights, density, densities, scale)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise RaotError(f"seed={seed!r} must be a non-negative integer.")

    def combine(key: str, tasks: list[torch.Tensor]) -> torch.Tensor:
        dropped = [
            random_keep_rescaled(t, d, seed=seed, name=key, model=i)
            for i, (t, d) in enumerate(zip(tasks, kept, strict=True))
        ]
        weighted, agree = elect_signs(dropped, weights)
        return (weighted * agree).sum(0)

    settings = {"densities": kept, "seed": seed, "mask": "sha256(seed, parameter, model) → torch.Generator"}
    return _base_relative_n("dare_ties", states, base, weights, scale, settings, combine, return_log)


def merge_heads_n(states: Sequence[StateDict], head_params: Sequence[str], weights: Sequence[float]) -> dict:
    """The classification head averaged over N models with the same label space (normalised weights)."""
    weights = check_weights(weights, len(states), normalise=True)
    log = _new_log("heads", {"policy": "average", "weights": weights})
    return {name: _linear_entry_n(name, [s[name] for s in states], weights, log) for name in head_params}


#: How the reference model (the basis every other model is moved into) is chosen.
REFERENCE_CHOICES = ("first", "central")


def _numbers(name: str, value: Any) -> tuple[float, ...]:
    """A comma-separated string or a sequence of numbers as a tuple of floats."""
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    try:
        numbers = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise RaotError(f"{name}={value!r} must be numbers, one per model (e.g. 0.5,0.25,0.25)") from None
    if not all(math.isfinite(v) for v in numbers):
        raise RaotError(f"{name}={value!r} must be finite numbers")
    return numbers


@register_section
@dataclass
class GroupOptions(OptionSection):
    """Options of a merge of several models (docs/design.md §6.9).

    ``weights``: one weight per model, in the order given (empty: equal weights; with two models
    they set α = w₂/(w₁ + w₂)); ``densities``: per-model densities of ``ties`` / ``dare_ties``
    (empty: ``base_rules.density`` for every model); ``reference``: the model every other one is
    aligned to — ``first``, or ``central``, the model whose representations agree most with all
    the others (mean linear CKA over layers, a quantity no rotation, permutation or scale changes).
    """

    section = "group"

    weights: tuple = field(
        default=(),
        metadata=meta("Per-model weights, comma list in model order (default equal).", "weights", flag="--weights"),
    )
    densities: tuple = field(
        default=(),
        metadata=meta(
            "Per-model densities of ties / dare_ties, comma list (default --density).", "densities", flag="--densities"
        ),
    )
    reference: str = field(
        default="first",
        metadata=meta(
            "Model the others are aligned to: first, or central (most similar to the rest).",
            "reference",
            flag="--reference",
            choices=REFERENCE_CHOICES,
        ),
    )

    def __post_init__(self) -> None:
        self.weights = _numbers("weights", self.weights)
        self.densities = _numbers("densities", self.densities)
        if any(w < 0 for w in self.weights) or (self.weights and not sum(self.weights) > 0):
            raise RaotError(f"weights={list(self.weights)} must be non-negative and not all zero")
        if any(not 0.0 < d <= 1.0 for d in self.densities):
            raise RaotError(f"densities={list(self.densities)} must each lie in (0, 1]")
        if self.reference not in REFERENCE_CHOICES:
            raise RaotError(f"reference={self.reference!r} is not valid; choose one of: {', '.join(REFERENCE_CHOICES)}")

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-safe dict (lists of numbers)."""
        return {"weights": list(self.weights), "densities": list(self.densities), "reference": self.reference}
