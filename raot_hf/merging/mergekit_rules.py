"""mergekit's SLERP, NuSLERP, Model Stock, DELLA, Breadcrumbs and passthrough rules (docs/design.md §6.10).

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
from raot_hf.merging.base_rules import per_tensor_merge, required_number, task_vector_rule
from raot_hf.merging.layered import check_setting, count_layers, evaluate_setting
from raot_hf.merging.log import RuleLog
from raot_hf.merging.rules import StateDict

logger = logging.getLogger("raot_hf.merging")

#: SLERP falls back to linear interpolation above this |cosine| (mergekit's DOT_THRESHOLD).
SLERP_COLINEAR = 0.9995
#: Norms at or below this are not divided by (mergekit's eps of SLERP).
SLERP_EPS = 1e-8
#: NuSLERP: vectors shorter than this are not normalised further; |sin θ| below NUSLERP_EPS is colinear.
NUSLERP_NORM_EPS = 1e-7
NUSLERP_EPS = 1e-8
#: Model Stock: the product of the task-vector norms is clamped to at least this.
MODEL_STOCK_EPS = 1e-6


# ----------------------------------------------------------------------------- checks


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
        return slerp_vectors(required_number("slerp", "t", values["t"], key), tensors[0], tensors[1]), {}

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


# ----------------------------------------------------------------------------- passthrough


def passthrough(states, weights=(), base=None, *, scales=None, layer_count=None, return_log=False):
    """mergekit's ``passthrough``: one model's tensors as they are, each times the model's
    ``scale`` where one is given (a setting: it may vary by layer or module)."""
    if len(states) != 1:
        raise RaotError(
            f"merge_rule='passthrough' copies the tensors of one model, got {len(states)}; give each slice one source"
        )
    (state,) = states
    scale = check_setting("scale", (list(scales or ()) or [None])[0])
    layers = count_layers(state) if layer_count is None else int(layer_count)
    log = RuleLog("passthrough", {"scale": scale} if scale is not None else {})
    merged = {}
    for key, tensor in state.items():
        value = evaluate_setting(scale, key, layers) if scale is not None else None
        if value is None or not tensor.is_floating_point():
            merged[key] = tensor.detach().clone()
        else:
            merged[key] = (tensor.detach().to(torch.float64) * float(value)).to(tensor.dtype)
        log.note(key, "passthrough")
    return (merged, log) if return_log else merged


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
    filter_wise: bool = field(default=False, metadata=meta("model_stock: one ratio per row (default off)."))
    row_wise: bool = field(default=False, metadata=meta("nuslerp: interpolate columns (default off: rows)."))
    flatten: bool = field(default=True, metadata=meta("nuslerp: interpolate whole tensors (default on)."))

    def __post_init__(self) -> None:
        self.t = check_setting("t", self.t)
        for name in ("filter_wise", "row_wise", "flatten"):
            if not isinstance(getattr(self, name), bool):
                raise RaotError(f"mergekit.{name}={getattr(self, name)!r} must be true or false")
