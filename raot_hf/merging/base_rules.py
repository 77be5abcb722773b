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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.config.options import check_field_types, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError
from raot_hf.merging.layered import count_layers, evaluate_setting
from raot_hf.merging.log import RuleLog
from raot_hf.merging.rules import (
    StateDict,
    _check_finite,
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


def check_densities(density: float, densities: Sequence[float] | None, n: int) -> list[float]:
    """Each model's density: ``densities`` when given (one per model), else ``density`` for all."""
    values = [float(density)] * n if not densities else [float(d) for d in densities]
    if len(values) != n:
        raise RaotError(f"{len(values)} densities for {n} models; give one density per model.")
    return [_check_unit("density", d, open_low=True) for d in values]


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
    # lists as tuples: a chunked merge's logs add up lists (RuleLog.add), settings stay as given
    given = {"weights": weights, **settings, **(logged or {})}
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


def random_keep_rescaled(task: torch.Tensor, density: float, *, seed: int, name: str, model: int) -> torch.Tensor:
    """DARE (mergekit's ``dare_ties``): keep each entry with probability ``density`` (a CPU
    generator seeded from ``(seed, name, model)``: device- and chunk-independent), rescale to L1."""
    if density >= 1.0:
        return task.clone()
    generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name, f"model{model}"))
    keep = torch.rand(task.shape, generator=generator, dtype=_F64).to(task.device) < density
    return l1_rescaled(task, torch.where(keep, task, torch.zeros_like(task)))


def l1_rescaled(task: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``kept`` rescaled to ``task``'s L1 norm (as is when either norm is below :data:`RESCALE_EPS`)."""
    before, after = float(task.abs().sum()), float(kept.abs().sum())
    if before < RESCALE_EPS or after < RESCALE_EPS:
        return kept
    return kept * (before / after)


def elect_signs(tasks: Sequence[torch.Tensor], weights: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """mergekit's ``sum`` consensus (sign of ``Σ wᵢτᵢ``, +1 at 0): weighted tasks (N, …), agree mask."""
    weighted = torch.stack([w * t for t, w in zip(tasks, weights, strict=True)])
    elected = torch.where(weighted.sum(0) >= 0, 1.0, -1.0).to(weighted.dtype)
    return weighted, torch.sign(weighted) == elected


# ----------------------------------------------------------------------------- the rules


def merge_task_arithmetic(states, weights, base=None, *, scale: float = 1.0, return_log: bool = False):
    """Task arithmetic (mergekit): ``W = base + λ·Σ wᵢτᵢ`` with ``τᵢ = Wᵢ − base``."""
    weights = check_weights(weights, len(states), normalise=False)
    scale = _check_finite("scale", scale)

    def merge_one(key, tensors, origin, values):
        tasks = [w * (x - origin) for x, w in zip(tensors, weights, strict=True)]
        return origin + scale * _total(tasks), {}

    return per_tensor_merge(
        "task_arithmetic", states, weights, base, {}, merge_one,
        needs_base=True, logged={"scale": scale}, return_log=return_log,
    )  # fmt: skip


def ties_rule(
    rule: str, states, weights, base=None, *, density=0.2, densities=None, scale=1.0, seed=0, return_log=False
):
    """mergekit's ``ties`` or ``dare_ties``: sparsify each task vector to ``densityᵢ``, elect signs,
    combine the agreeing weighted entries; ``W = base + λ·combined``."""
    weights = check_weights(weights, len(states), normalise=False)
    kept, scale = check_densities(density, densities, len(states)), _check_finite("scale", scale)
    seed = _check_seed(seed)
    logged: dict[str, Any] = {"scale": scale, "densities": kept}
    if rule == "dare_ties":
        logged.update(seed=seed, mask="sha256(seed, parameter, model) → torch.Generator")

    def merge_one(key, tensors, origin, values):
        tasks = [x - origin for x in tensors]
        if rule == "ties":
            sparse = [keep_top_magnitudes(t, d) for t, d in zip(tasks, kept, strict=True)]
        else:
            sparse = [
                random_keep_rescaled(t, d, seed=seed, name=key, model=i)
                for i, (t, d) in enumerate(zip(tasks, kept, strict=True))
            ]
        weighted, agree = elect_signs(sparse, weights)
        combined = (weighted * agree).sum(0)
        if rule == "ties":  # the weighted mean of the agreeing entries (divisor 1 where none agrees)
            w = torch.tensor(weights, dtype=_F64, device=weighted.device).view(-1, *[1] * (weighted.dim() - 1))
            divisor = (w * agree).sum(0)
            combined = combined / torch.where(divisor == 0, 1.0, divisor)
        return origin + scale * combined, sparsity_details(sparse)

    return per_tensor_merge(
        rule, states, weights, base, {}, merge_one, needs_base=True, logged=logged, return_log=return_log
    )


def merge_ties(states, weights, base=None, *, return_log=False, **options):
    """TIES: top ``int(densityᵢ·n)`` magnitudes, weighted mean of the agreeing entries (:func:`ties_rule`)."""
    return ties_rule("ties", states, weights, base, return_log=return_log, **options)


def merge_dare_ties(states, weights, base=None, *, return_log=False, **options):
    """DARE-TIES: seeded random drop and rescale, agreeing entries summed (:func:`ties_rule`)."""
    return ties_rule("dare_ties", states, weights, base, return_log=return_log, **options)


@register_section
@dataclass
class BaseRuleOptions(OptionSection):
    """Options of ``task_arithmetic``, ``ties`` and ``dare_ties`` (``task_scale`` is λ)."""

    section = "base_rules"

    density: float = field(
        default=0.2,
        metadata=meta(
            "ties / dare_ties: fraction of each task vector kept (default 0.2).", "density", flag="--density"
        ),
    )
    task_scale: float = field(
        default=1.0,
        metadata=meta("Base-relative rules: λ in base + λ·Σ wᵢτᵢ (default 1).", "task_scale", flag="--task-scale"),
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if not 0.0 < self.density <= 1.0:
            raise RaotError(f"density={self.density} must lie in (0, 1] (the fraction of each task vector kept)")
