"""Base-relative merge rules for fine-tuned siblings of one base model (docs/design.md §6).

Each rule measures the task vectors ``τ_A = W_A − W_base`` and ``τ_B = W_B − W_base`` per tensor,
combines them and adds the result back to the base. They take the merger's rule signature —
``rule(state_a, state_b, *, base, alpha, ...)`` — with ``alpha`` the weight of B as everywhere
else: the task vectors enter with weights ``w_A = 1 − α`` and ``w_B = α``. The arithmetic runs in
float64 and each result is cast to A's dtype; non-floating-point tensors are copied from A.

A parameter of A that the base lacks (a pooler the pretraining checkpoint never had) has no task
vector: it merges linearly with the same α, with a warning, and the log counts it. A parameter
the base has with another shape is refused.

Unlike the base-free rules, α = 0 does not return A bit for bit: it returns
``base + scale·(trimmed) τ_A``, which is A only for task arithmetic with ``scale = 1``.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.config.options import check_field_types, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError
from raot_hf.merging.rules import (
    StateDict,
    _check_finite,
    _check_unit,
    _copy_non_float,
    _f64,
    _finish,
    _linear_entry,
    _new_log,
    _note,
    check_compatible_states,
)

logger = logging.getLogger("raot_hf.merging")

_F64 = torch.float64

#: Above this relative distance ‖W − W_base‖ / ‖W_base‖ (median over the 2-D weights), a model is
#: not a fine-tune of the base: two independent initialisations sit at ≈ √2, fine-tunes far below 1.
MAX_RELATIVE_TASK_NORM = 1.0

Combine = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


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
    """Median over the shared 2-D floating-point weights of ``‖W − W_base‖ / ‖W_base‖``.

    Fine-tuning moves weights by a few percent; a model trained from another initialisation (or
    the base in another basis, e.g. with permuted MLP units) sits near √2. The median over
    matrices keeps LayerNorm gains (≈ 1 in every model) from hiding an unrelated base.
    """
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


def _base_relative(
    rule: str,
    state_a: StateDict,
    state_b: StateDict,
    base: StateDict,
    alpha: float,
    scale: float,
    settings: dict[str, Any],
    combine: Combine,
    return_log: bool,
):
    """``W = base + scale·combine(τ_A, τ_B)`` per floating-point tensor of A."""
    check_compatible_states(state_a, state_b)
    missing = check_base_states(base, state_a)
    log = _new_log(rule, {"alpha": alpha, "scale": scale, **settings})
    if missing:
        floating = [key for key in missing if state_a[key].is_floating_point()]
        if floating:
            logger.warning(
                "%d parameter(s) of A are not in the base (first: %s): they merge linearly with alpha=%g",
                len(floating),
                floating[0],
                alpha,
            )
        log["settings"]["not_in_base"] = missing
    merged: dict[str, torch.Tensor] = {}
    for key, a in state_a.items():
        b = state_b[key]
        if not a.is_floating_point():
            merged[key] = _copy_non_float(key, a, b, log)
        elif key not in base:
            merged[key] = _linear_entry(key, a, b, alpha, _new_log("linear", {}))
            _note(log, key, "linear (not in the base)")
        else:
            origin = _f64(base[key]).to(a.device)
            task, details = combine(key, _f64(a) - origin, _f64(b).to(a.device) - origin)
            _note(log, key, rule, **details)
            _add_totals(log, a.numel(), details)
            merged[key] = (origin + scale * task).to(a.dtype)
    return _finish(merged, log, return_log)


def _add_totals(log: dict[str, Any], entries: int, details: dict[str, Any]) -> None:
    """Entry counts over all tensors (kept, sign conflicts), which add up across the merger's chunks."""
    totals = log.setdefault("totals", {"entries": 0})
    totals["entries"] += entries
    for name in ("kept_a", "kept_b", "sign_conflicts"):
        if name in details:
            totals[name] = totals.get(name, 0) + round(details[name] * entries)


def _weights(alpha: float) -> tuple[float, float]:
    alpha = _check_unit("alpha", alpha)
    return 1.0 - alpha, alpha


# ----------------------------------------------------------------------------- task arithmetic


def merge_task_arithmetic(
    state_a: StateDict,
    state_b: StateDict,
    *,
    base: StateDict,
    alpha: float = 0.5,
    scale: float = 1.0,
    return_log: bool = False,
):
    """Task arithmetic: ``W = base + scale·((1 − α)·τ_A + α·τ_B)`` with ``τ = W − base``.

    With α = ½, ``scale = 1`` is the average of A and B and ``scale = 2`` the sum of the task
    vectors (the task-arithmetic paper's λ is ``scale/2`` there). The log records, per tensor,
    the cosine between the two task vectors.
    """
    w_a, w_b = _weights(alpha)
    scale = _check_finite("scale", scale)

    def combine(key: str, task_a: torch.Tensor, task_b: torch.Tensor):
        norms = float(torch.linalg.norm(task_a) * torch.linalg.norm(task_b))
        cosine = float((task_a * task_b).sum()) / norms if norms > 0 else 0.0
        return w_a * task_a + w_b * task_b, {"task_cosine": cosine}

    return _base_relative("task_arithmetic", state_a, state_b, base, alpha, scale, {}, combine, return_log)


# ----------------------------------------------------------------------------- TIES


def trim_to_top(task: torch.Tensor, density: float) -> torch.Tensor:
    """Zero all but the ⌈density·n⌉ largest-magnitude entries of ``task`` (ties at the cut are kept)."""
    n = task.numel()
    keep = min(n, max(1, math.ceil(density * n - 1e-9)))
    if n == 0 or keep == n:
        return task.clone()
    magnitude = task.abs()
    threshold = torch.kthvalue(magnitude.flatten(), n - keep + 1).values
    return torch.where(magnitude >= threshold, task, torch.zeros_like(task))


def elect_and_average(
    task_a: torch.Tensor, task_b: torch.Tensor, w_a: float, w_b: float
) -> tuple[torch.Tensor, dict[str, Any]]:
    """TIES steps 2–3 on two (trimmed or dropped) task vectors.

    The elected sign of each entry is the sign of the weighted mass ``w_A·τ_A + w_B·τ_B``; the
    result is the weighted mean of the non-zero entries that carry the elected sign (the
    disjoint mean), zero where none does. With equal weights this is the TIES paper's
    unweighted disjoint mean.
    """
    elected = torch.sign(w_a * task_a + w_b * task_b)
    agree_a = (task_a != 0) & (torch.sign(task_a) == elected)
    agree_b = (task_b != 0) & (torch.sign(task_b) == elected)
    mass = w_a * agree_a.to(_F64) + w_b * agree_b.to(_F64)
    summed = torch.where(agree_a, w_a * task_a, 0.0) + torch.where(agree_b, w_b * task_b, 0.0)
    merged = torch.where(mass > 0, summed / torch.where(mass > 0, mass, 1.0), 0.0)
    n = max(task_a.numel(), 1)
    details = {
        "kept_a": float((task_a != 0).sum()) / n,
        "kept_b": float((task_b != 0).sum()) / n,
        "sign_conflicts": float((task_a * task_b < 0).sum()) / n,
    }
    return merged, details


def merge_ties(
    state_a: StateDict,
    state_b: StateDict,
    *,
    base: StateDict,
    alpha: float = 0.5,
    density: float = 0.2,
    scale: float = 1.0,
    return_log: bool = False,
):
    """TIES-merging of two fine-tuned siblings of ``base``.

    Per tensor: (1) trim each task vector to its top-``density`` fraction by magnitude
    (:func:`trim_to_top`; 0.2 is the TIES paper's k = 20 %); (2) elect each entry's sign by the
    weighted summed mass; (3) take the weighted disjoint mean (:func:`elect_and_average`);
    (4) ``W = base + scale·merged``.
    """
    w_a, w_b = _weights(alpha)
    density = _check_unit("density", density, open_low=True)
    scale = _check_finite("scale", scale)

    def combine(key: str, task_a: torch.Tensor, task_b: torch.Tensor):
        return elect_and_average(trim_to_top(task_a, density), trim_to_top(task_b, density), w_a, w_b)

    settings = {"density": density}
    return _base_relative("ties", state_a, state_b, base, alpha, scale, settings, combine, return_log)


# ----------------------------------------------------------------------------- DARE-TIES


def _tensor_seed(seed: int, name: str, side: str) -> int:
    """A 63-bit seed for one tensor of one model, stable across runs, processes and chunkings."""
    digest = hashlib.sha256(f"{int(seed)}\0{name}\0{side}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def dare_drop(task: torch.Tensor, density: float, *, seed: int, name: str = "", side: str = "A") -> torch.Tensor:
    """DARE: keep each entry with probability ``density`` and rescale the kept ones by 1/density.

    The mask comes from a CPU ``torch.Generator`` seeded from ``(seed, name, side)``, so a
    tensor's mask does not depend on the device, on the other tensors or on their order, and
    the expectation over masks is ``task`` itself.
    """
    if density == 1.0:
        return task.clone()
    generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name, side))
    keep = torch.rand(task.shape, generator=generator, dtype=_F64).to(task.device) < density
    return torch.where(keep, task / density, torch.zeros_like(task))


def merge_dare_ties(
    state_a: StateDict,
    state_b: StateDict,
    *,
    base: StateDict,
    alpha: float = 0.5,
    density: float = 0.2,
    scale: float = 1.0,
    seed: int = 0,
    return_log: bool = False,
):
    """DARE-TIES: :func:`dare_drop` each task vector (keep fraction ``density``, seeded by
    ``seed``), then elect signs and take the weighted disjoint mean as in :func:`merge_ties`;
    ``W = base + scale·merged``. The same seed gives byte-identical weights."""
    w_a, w_b = _weights(alpha)
    density = _check_unit("density", density, open_low=True)
    scale = _check_finite("scale", scale)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise RaotError(f"seed={seed!r} must be a non-negative integer.")

    def combine(key: str, task_a: torch.Tensor, task_b: torch.Tensor):
        dropped_a = dare_drop(task_a, density, seed=seed, name=key, side="A")
        dropped_b = dare_drop(task_b, density, seed=seed, name=key, side="B")
        return elect_and_average(dropped_a, dropped_b, w_a, w_b)

    settings = {"density": density, "seed": seed, "mask": "sha256(seed, parameter, model) → torch.Generator"}
    return _base_relative("dare_ties", state_a, state_b, base, alpha, scale, settings, combine, return_log)


@register_section
@dataclass
class BaseRuleOptions(OptionSection):
    """Options of the base-relative rules ``task_arithmetic``, ``ties`` and ``dare_ties``.

    ``density``: fraction of each task vector that ``ties`` keeps (top magnitudes; 0.2 is the
    TIES paper's k) and ``dare_ties`` keeps at random (seeded by the config's ``seed``);
    ``task_scale``: λ in ``base + λ·((1−α)·τ_A + α·τ_B)`` (with α = ½, 1 averages the task
    vectors, 2 sums them).
    """

    section = "base_rules"

    density: float = field(
        default=0.2,
        metadata=meta(
            "ties / dare_ties: fraction of each task vector kept (default 0.2).", "density", flag="--density"
        ),
    )
    task_scale: float = field(
        default=1.0,
        metadata=meta(
            "Base-relative rules: λ in base + λ·((1−α)·τA + α·τB) (default 1).", "task_scale", flag="--task-scale"
        ),
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if not 0.0 < self.density <= 1.0:
            raise RaotError(f"density={self.density} must lie in (0, 1] (the fraction of each task vector kept)")
