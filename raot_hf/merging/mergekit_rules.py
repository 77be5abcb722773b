"""mergekit's SLERP, NuSLERP, Model Stock, DELLA and Breadcrumbs rules (docs/design.md §6.10).

The registry's signature ``rule(states, weights, base=None, *, return_log=False, **options)``
(:mod:`raot_hf.merging.rules`): the first state is the reference (mergekit's ``base_model`` for
SLERP), ``weights`` mergekit's per-model ``weight`` (SLERP and Model Stock ignore them), ``base``
the fine-tunes' origin. Options may vary by layer or module (:mod:`raot_hf.merging.layered`),
evaluated per tensor with ``layer_count`` (counted from the names when absent). Float64
arithmetic, cast to the reference's dtype; non-float tensors are copied from the reference.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.config.options import meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError
from raot_hf.merging.base_rules import _tensor_seed, elect_signs, l1_rescaled, per_tensor_merge
from raot_hf.merging.layered import check_setting
from raot_hf.merging.rules import StateDict, _check_seed, _check_unit, check_weights

logger = logging.getLogger("raot_hf.merging")

_F64 = torch.float64
#: SLERP falls back to linear interpolation above this |cosine| (mergekit's DOT_THRESHOLD).
SLERP_COLINEAR = 0.9995
#: Norms at or below this are not divided by (mergekit's eps of SLERP).
SLERP_EPS = 1e-8
#: NuSLERP: vectors shorter than this are not normalised further; |sin θ| below NUSLERP_EPS is colinear.
NUSLERP_NORM_EPS = 1e-7
NUSLERP_EPS = 1e-8
#: Model Stock: the product of the task-vector norms is clamped to at least this.
MODEL_STOCK_EPS = 1e-6
#: mergekit's defaults of the options given as None.
DEFAULTS = {"density": 1.0, "epsilon": 0.15, "gamma": 0.01, "scale": 1.0}


# ----------------------------------------------------------------------------- checks


def _required(rule: str, name: str, value: Any, key: str) -> float:
    if value is None:
        raise RaotError(
            f"merge_rule={rule!r} has no {name} for {key!r}; set parameters: {name}: (a number, a per-layer list, or "
            "filters with a default value)"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RaotError(f"{name}={value!r} for {key!r} must be a finite number")
    return float(value)


def _two(rule: str, states: Sequence[StateDict]) -> None:
    if len(states) != 2:
        raise RaotError(f"merge_rule={rule!r} merges exactly two models, got {len(states)}; use model_stock or ties")


# ----------------------------------------------------------------------------- SLERP


def slerp_vectors(t: float, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """``sin((1−t)θ)/sin θ · v0 + sin(tθ)/sin θ · v1`` (θ their angle); linear when |cos θ| > :data:`SLERP_COLINEAR`."""
    n0, n1 = torch.linalg.norm(v0), torch.linalg.norm(v1)
    u0 = v0 / n0 if n0 > SLERP_EPS else v0
    u1 = v1 / n1 if n1 > SLERP_EPS else v1
    cosine = float((u0 * u1).sum())
    if abs(cosine) > SLERP_COLINEAR:
        return (1.0 - t) * v0 + t * v1
    theta = math.acos(cosine)
    return (math.sin(theta - theta * t) * v0 + math.sin(theta * t) * v1) / math.sin(theta)


def slerp(states, weights=(), base=None, *, t: Any = None, layer_count: int | None = None, return_log=False):
    """mergekit's ``slerp`` of two models per tensor, from the first (``t = 0``) by ``t`` (required)."""
    _two("slerp", states)
    t = check_setting("t", t)

    def merge_one(key, tensors, origin, values):
        return slerp_vectors(_required("slerp", "t", values["t"], key), tensors[0], tensors[1]), {}

    weights = list(weights) or [0.5, 0.5]
    return per_tensor_merge(
        "slerp", states, weights, None, {"t": t}, merge_one,
        needs_base=False, layer_count=layer_count, return_log=return_log,
    )  # fmt: skip


# ----------------------------------------------------------------------------- NuSLERP


def nuslerp_rows(t: float, v0: torch.Tensor, v1: torch.Tensor, *, row_wise: bool, flatten: bool) -> torch.Tensor:
    """SLERP of every vector along the last axis (``row_wise``: along the first; ``flatten``: of
    the whole tensor as one vector), linear where |sin θ| < :data:`NUSLERP_EPS`."""
    shape = v0.shape
    if flatten or v0.dim() < 2:
        a, b = v0.reshape(1, -1), v1.reshape(1, -1)
    else:
        a, b = (v0.transpose(0, -1), v1.transpose(0, -1)) if row_wise else (v0, v1)
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    ua = a / torch.linalg.norm(a, dim=-1, keepdim=True).clamp(min=NUSLERP_NORM_EPS)
    ub = b / torch.linalg.norm(b, dim=-1, keepdim=True).clamp(min=NUSLERP_NORM_EPS)
    theta = torch.acos((ua * ub).sum(-1, keepdim=True).clamp(-1.0, 1.0))
    sin = torch.sin(theta)
    colinear = sin.abs() < NUSLERP_EPS
    out = (torch.sin((1.0 - t) * theta) * a + torch.sin(t * theta) * b) / torch.where(colinear, 1.0, sin)
    out = torch.where(colinear, (1.0 - t) * a + t * b, out)
    if not flatten and v0.dim() >= 2 and row_wise:
        return out.reshape(v0.transpose(0, -1).shape).transpose(0, -1).reshape(shape)
    return out.reshape(shape)


def nuslerp(states, weights, base=None, *, row_wise=False, flatten=True, layer_count=None, return_log=False):
    """mergekit's ``nuslerp`` of two models with ``t = w₂/(w₁ + w₂)`` (½ when the sum is ~0); with
    ``base``, ``base + nuslerp`` of the two task vectors."""
    _two("nuslerp", states)
    w = [float(x) for x in weights]
    t = 0.5 if abs(sum(w)) < 1e-6 else w[1] / sum(w)

    def merge_one(key, tensors, origin, values):
        if origin is None:
            return nuslerp_rows(t, tensors[0], tensors[1], row_wise=row_wise, flatten=flatten), {}
        tasks = [x - origin for x in tensors]
        return origin + nuslerp_rows(t, tasks[0], tasks[1], row_wise=row_wise, flatten=flatten), {}

    settings = {"t": t, "row_wise": bool(row_wise), "flatten": bool(flatten)}
    return per_tensor_merge(
        "nuslerp", states, w, base, settings, merge_one,
        needs_base=False, layer_count=layer_count, return_log=return_log,
    )  # fmt: skip


# ----------------------------------------------------------------------------- Model Stock


def model_stock_tensor(origin: torch.Tensor, tensors: list[torch.Tensor], *, filter_wise: bool) -> torch.Tensor:
    """``W = t·mean(Wᵢ) + (1 − t)·W_base``, ``t = N·cos θ / (1 + (N − 1)·cos θ)`` with ``cos θ`` the
    mean pairwise cosine of the task vectors (per row when ``filter_wise``)."""
    shape = origin.shape
    if filter_wise:
        w0 = origin.reshape(1, -1) if origin.dim() < 2 else origin.reshape(-1, origin.shape[-1])
        ws = [w.reshape(w0.shape) for w in tensors]
    else:
        w0, ws = origin.reshape(-1), [w.reshape(-1) for w in tensors]
    tasks = [w - w0 for w in ws]
    cosines = []
    for i in range(len(tasks)):
        for j in range(i + 1, len(tasks)):
            norms = torch.linalg.norm(tasks[i], dim=-1) * torch.linalg.norm(tasks[j], dim=-1)
            norms = norms.clamp(min=MODEL_STOCK_EPS)
            cosines.append(((tasks[i] * tasks[j]).sum(-1) / norms).clamp(-1.0, 1.0))
    cosine = torch.stack(cosines).mean(0).unsqueeze(-1)
    n = len(ws)
    t = n * cosine / (1 + (n - 1) * cosine)
    return (t * (sum(ws) / n) + (1 - t) * w0).reshape(shape)


def model_stock(states, weights=(), base=None, *, filter_wise=False, layer_count=None, return_log=False):
    """mergekit's ``model_stock`` (Jang et al. 2024): :func:`model_stock_tensor` per tensor."""
    weights = list(weights) or [1.0] * len(states)

    def merge_one(key, tensors, origin, values):
        return model_stock_tensor(origin, tensors, filter_wise=bool(filter_wise)), {}

    settings = {"filter_wise": bool(filter_wise)}
    return per_tensor_merge(
        "model_stock", states, weights, base, settings, merge_one,
        needs_base=True, layer_count=layer_count, return_log=return_log,
    )  # fmt: skip


# ----------------------------------------------------------------------------- DELLA and Breadcrumbs


def della_keep(task: torch.Tensor, density: float, epsilon: float, *, seed: int, name: str, model: int) -> torch.Tensor:
    """DELLA's MagPrune (mergekit): per row, keep probabilities rise with magnitude rank from
    ``density − ε`` to ``density + ε``; a seeded draw, rescaled to the task's L1 norm."""
    if density >= 1.0:
        return task.clone()
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
    kept = torch.where(draw < probability, rows, torch.zeros_like(rows)).reshape(task.shape)
    return l1_rescaled(task, kept)


def breadcrumbs_keep(task: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs: drop the ``int(γ·n)`` largest and the smallest magnitudes, keeping ``int(density·n)``."""
    if density >= 1.0:
        return task.clone()
    n = task.numel()
    keep, top = int(density * n), int(gamma * n)
    bottom = n - keep - top
    if bottom < 0:
        top, bottom = top + bottom, 0
    order = torch.argsort(task.abs().flatten(), stable=True)
    mask = torch.zeros(n, dtype=torch.bool, device=task.device)
    mask[order[bottom : n - top]] = True
    return torch.where(mask.view_as(task), task, torch.zeros_like(task))


#: The task-vector rules: (sparsification, sign election, normalise by the kept weight) as mergekit registers them.
TASK_RULES = {
    "della": ("della", True, True),
    "della_linear": ("della", False, False),
    "breadcrumbs": ("breadcrumbs", False, False),
    "breadcrumbs_ties": ("breadcrumbs", True, False),
}


def _densities(density: Any, densities: Sequence[float] | None, n: int) -> list[Any]:
    if densities:
        if len(densities) != n:
            raise RaotError(f"{len(densities)} densities for {n} models; give one density per model")
        return [float(d) for d in densities]
    return [check_setting("density", DEFAULTS["density"] if density is None else density)] * n


def task_vector_rule(
    rule: str, states, weights, base, *, density=None, densities: Sequence[float] | None = None, epsilon=None,
    gamma=None, scale=None, seed: int = 0, layer_count: int | None = None, return_log: bool = False,
):  # fmt: skip
    """Generalized task arithmetic with DELLA's or Breadcrumbs' sparsification (:data:`TASK_RULES`):
    ``W = base + λ·mixed`` of the sparse weighted τᵢ (sign-elected, normalised as registered)."""
    sparsify, elect, normalise = TASK_RULES[rule]
    weights = check_weights(weights, len(states), normalise=False)
    seed = _check_seed(seed)
    kept = _densities(density, densities, len(states))
    settings = {f"density{i}": d for i, d in enumerate(kept, start=1)}
    settings["scale"] = check_setting("scale", DEFAULTS["scale"] if scale is None else scale)
    extra, value = ("epsilon", epsilon) if sparsify == "della" else ("gamma", gamma)
    settings[extra] = check_setting(extra, DEFAULTS[extra] if value is None else value)

    def merge_one(key, tensors, origin, values):
        tasks = []
        for i, x in enumerate(tensors):
            d = _check_unit("density", _required(rule, "density", values[f"density{i + 1}"], key))
            if sparsify == "della":
                eps = _required(rule, "epsilon", values["epsilon"], key)
                tasks.append(della_keep(x - origin, d, eps, seed=seed, name=key, model=i))
            else:
                tasks.append(breadcrumbs_keep(x - origin, d, _required(rule, "gamma", values["gamma"], key)))
        w = torch.tensor(weights, dtype=_F64, device=origin.device).view(-1, *[1] * origin.dim())
        if elect:
            weighted, agree = elect_signs(tasks, weights)
            mixed, divisor = (weighted * agree).sum(0), (w * agree).sum(0)
            divisor = torch.where(divisor == 0, 1.0, divisor)
        else:
            mixed = sum(wi * ti for wi, ti in zip(weights, tasks, strict=True))
            divisor = sum(weights) if abs(sum(weights)) >= 1e-8 else 1.0
        if normalise:
            mixed = mixed / divisor
        return origin + _required(rule, "scale", values["scale"], key) * mixed, {}

    logged = {"mask": "sha256(seed, parameter, model) → torch.Generator", "seed": seed} if sparsify == "della" else {}
    return per_tensor_merge(
        rule, states, weights, base, settings, merge_one,
        needs_base=True, layer_count=layer_count, logged=logged, return_log=return_log,
    )  # fmt: skip


def della(states, weights, base=None, *, return_log=False, **options):
    """mergekit's ``della``: MagPrune (:func:`della_keep`), sign election, normalised mean."""
    return task_vector_rule("della", states, weights, base, return_log=return_log, **options)


def della_linear(states, weights, base=None, *, return_log=False, **options):
    """mergekit's ``della_linear``: MagPrune (:func:`della_keep`), weighted sum, no sign election."""
    return task_vector_rule("della_linear", states, weights, base, return_log=return_log, **options)


def breadcrumbs(states, weights, base=None, *, return_log=False, **options):
    """mergekit's ``breadcrumbs``: :func:`breadcrumbs_keep`, weighted sum, no sign election."""
    return task_vector_rule("breadcrumbs", states, weights, base, return_log=return_log, **options)


def breadcrumbs_ties(states, weights, base=None, *, return_log=False, **options):
    """mergekit's ``breadcrumbs_ties``: :func:`breadcrumbs_keep`, sign election, weighted sum."""
    return task_vector_rule("breadcrumbs_ties", states, weights, base, return_log=return_log, **options)


# ----------------------------------------------------------------------------- options


def _setting_field(help: str, flag: str | None = None) -> Any:
    return field(default=None, metadata=meta(help, **({"flag": flag} if flag else {})))


@register_section
@dataclass
class MergekitOptions(OptionSection):
    """Options of the mergekit rules, with mergekit's names and defaults (None). ``t``, ``density``,
    ``epsilon``, ``gamma`` and ``scale`` may vary by layer (:mod:`raot_hf.merging.layered`), e.g.
    ``0,0.5,1`` or ``self_attn=0,1;mlp=1,0;default=0.5``."""

    section = "mergekit"

    t: Any = _setting_field("slerp: interpolation from the reference (0) to the other model (1); required.", "--t")
    density: Any = _setting_field("della / breadcrumbs: fraction of each task vector kept (default 1).")
    epsilon: Any = _setting_field("della: keep probabilities span density ± epsilon (default 0.15).")
    gamma: Any = _setting_field("breadcrumbs: fraction of largest task-vector entries dropped (default 0.01).")
    scale: Any = _setting_field("della / breadcrumbs: mergekit's lambda, the task-vector scale (default 1).")
    filter_wise: bool = field(default=False, metadata=meta("model_stock: one ratio per row (default off)."))
    row_wise: bool = field(default=False, metadata=meta("nuslerp: interpolate columns (default off: rows)."))
    flatten: bool = field(default=True, metadata=meta("nuslerp: interpolate whole tensors (default on)."))

    def __post_init__(self) -> None:
        for name in ("t", "density", "epsilon", "gamma", "scale"):
            setattr(self, name, check_setting(name, getattr(self, name)))
        for name in ("filter_wise", "row_wise", "flatten"):
            if not isinstance(getattr(self, name), bool):
                raise RaotError(f"mergekit.{name}={getattr(self, name)!r} must be true or false")
