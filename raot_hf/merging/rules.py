"""Merge rules on aligned state dicts (docs/design.md §6).

Every rule takes state dicts (parameter name → tensor) whose keys and shapes agree — model B
has already been aligned to A (B′) — and returns the merged state dict. The arithmetic runs in
float64, one tensor at a time, and each result is cast back to A's dtype. Tensors that are not
floating point (integer buffers such as ``position_ids``) are copied from A.

With ``return_log=True`` a rule returns ``(merged, log)`` (the POT convention). The log is
JSON-serialisable and feeds the provenance report::

    {"rule": "regmean", "settings": {...}, "counts": {"regmean": 72, "linear": 127},
     "params": {"encoder.layer.0.attention.self.query.weight": {"method": "regmean", ...}, ...}}

Endpoints are exact: wherever a rule has an ``alpha``, ``alpha=0`` returns A's tensors bit for
bit and ``alpha=1`` returns B′'s (cast to A's dtype), without any arithmetic that could round
or flip the sign of a zero. The base-relative rules (task arithmetic, TIES, DARE-TIES) are in
:mod:`raot_hf.merging.base_rules`, where α weights the task vectors instead.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from huggingface_hub.utils import tqdm

from raot_hf.config.options import check_field_types, check_non_negative_int, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError

logger = logging.getLogger("raot_hf.merging")

StateDict = Mapping[str, torch.Tensor]
_F64 = torch.float64

#: Cholesky pivots below this fraction of the largest diagonal entry mark a RegMean system singular.
SINGULAR_PIVOT_RATIO = 1e-12
#: The ridge added to a singular RegMean system, relative to the mean of its diagonal.
RIDGE_RELATIVE = 1e-8
#: The head policies of :func:`merge_heads`.
HEAD_POLICIES = ("a", "b", "average")


# ----------------------------------------------------------------------------- validation


def check_compatible_states(state_a: StateDict, state_b: StateDict, *, names: tuple[str, str] = ("A", "B′")) -> None:
    """Raise :class:`RaotError` naming the first key or shape on which the two state dicts differ."""
    name_a, name_b = names
    fix = "the two models differ in architecture; merge checkpoints of the same model type and config"
    for key in state_a:
        if key not in state_b:
            raise RaotError(f"parameter {key!r} is in {name_a} but not in {name_b}: {fix}.")
    for key in state_b:
        if key not in state_a:
            raise RaotError(f"parameter {key!r} is in {name_b} but not in {name_a}: {fix}.")
    for key, a in state_a.items():
        b = state_b[key]
        if tuple(a.shape) != tuple(b.shape):
            raise RaotError(
                f"parameter {key!r} has shape {tuple(a.shape)} in {name_a} but {tuple(b.shape)} in {name_b}: {fix} "
                "(for classification heads of different label spaces, merge without the head and use --head a or b)."
            )
        if a.is_floating_point() != b.is_floating_point():
            raise RaotError(f"parameter {key!r} is floating point in one model and not in the other: {fix}.")


def _check_unit(name: str, value: float, *, open_low: bool = False) -> float:
    value = float(value)
    low_ok = value > 0.0 if open_low else value >= 0.0
    if not (math.isfinite(value) and low_ok and value <= 1.0):
        interval = "(0, 1]" if open_low else "[0, 1]"
        raise RaotError(f"{name} must lie in {interval}, got {value}; pass a value in {interval}.")
    return value


def _check_finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise RaotError(f"{name} must be a finite number, got {value}.")
    return value


# ----------------------------------------------------------------------------- helpers


def _f64(t: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(t).detach().to(_F64)


def _new_log(rule: str, settings: dict[str, Any]) -> dict[str, Any]:
    return {"rule": rule, "settings": dict(settings), "counts": {}, "params": {}}


def _note(log: dict[str, Any], key: str, method: str, **details: Any) -> None:
    log["params"][key] = {"method": method, **details}
    log["counts"][method] = log["counts"].get(method, 0) + 1


def _finish(merged: dict[str, torch.Tensor], log: dict[str, Any], return_log: bool):
    # DEBUG: the merger calls per-tensor rules once per chunk and logs one summary itself
    logger.debug("%s merge: %s", log["rule"], ", ".join(f"{n} {m}" for m, n in sorted(log["counts"].items())))
    return (merged, log) if return_log else merged


def _copy_non_float(key: str, a: torch.Tensor, b: torch.Tensor, log: dict[str, Any]) -> torch.Tensor:
    same = torch.equal(a.detach().cpu(), b.detach().cpu())
    if not same:
        logger.warning("non-float tensor %s differs between the models; A's is kept", key)
    _note(log, key, "copied from A (not floating point)", identical=same)
    return a.detach().clone()


def _linear_entry(key: str, a: torch.Tensor, b: torch.Tensor, alpha: float, log: dict[str, Any]) -> torch.Tensor:
    if not a.is_floating_point():
        return _copy_non_float(key, a, b, log)
    if alpha == 0.0:
        _note(log, key, "linear")
        return a.detach().clone()
    if alpha == 1.0:
        _note(log, key, "linear")
        return b.detach().to(dtype=a.dtype, device=a.device, copy=True)
    merged = (1.0 - alpha) * _f64(a) + alpha * _f64(b).to(a.device)
    _note(log, key, "linear")
    return merged.to(a.dtype)


def _endpoint_state(state_a: StateDict, state_b: StateDict, alpha: float, log: dict[str, Any]) -> dict:
    log["settings"]["endpoint"] = "alpha=0 returns A exactly" if alpha == 0.0 else "alpha=1 returns B′ exactly"
    return {key: _linear_entry(key, a, state_b[key], alpha, log) for key, a in state_a.items()}


# ----------------------------------------------------------------------------- linear


def merge_linear(state_a: StateDict, state_b: StateDict, *, alpha: float = 0.5, return_log: bool = False):
    """Linear interpolation ``W = (1 − α)·W_A + α·W_B′`` of every floating-point tensor.

    ``alpha`` is the weight of B′ in [0, 1]; ``alpha=0`` gives A bit for bit, ``alpha=1`` B′.
    Returns the merged state dict, or ``(merged, log)`` with ``return_log=True``.
    """
    check_compatible_states(state_a, state_b)
    alpha = _check_unit("alpha", alpha)
    log = _new_log("linear", {"alpha": alpha})
    merged = {key: _linear_entry(key, a, state_b[key], alpha, log) for key, a in state_a.items()}
    return _finish(merged, log, return_log)


# ----------------------------------------------------------------------------- RegMean


def shrink_gram(gram: torch.Tensor, shrink: float) -> torch.Tensor:
    """``G̃ = shrink·G + (1 − shrink)·diag(G)`` in float64, after symmetrising G.

    ``shrink=1`` leaves G as is; smaller values pull the off-diagonal entries towards zero
    (the RegMean paper's α), which keeps the merged system well conditioned.
    """
    g = _f64(gram)
    g = 0.5 * (g + g.T)
    if shrink == 1.0:
        return g
    return shrink * g + (1.0 - shrink) * torch.diag(torch.diagonal(g))


def _regmean_groups(
    state_a: StateDict, linear_weights: Mapping[str, str], grams_a: Mapping, grams_b: Mapping
) -> dict[str, list[str]]:
    """Group the RegMean weights by gram key (q, k and v read one input), validating shapes."""
    groups: dict[str, list[str]] = {}
    for name, gram_key in linear_weights.items():
        if name not in state_a:
            raise RaotError(f"RegMean weight {name!r} is not a parameter of the models; check the linear_weights map.")
        weight = state_a[name]
        if weight.dim() != 2 or not weight.is_floating_point():
            raise RaotError(
                f"RegMean weight {name!r} must be a 2-D floating-point Linear weight, got shape {tuple(weight.shape)}."
            )
        for side, grams in (("A", grams_a), ("B′", grams_b)):
            if gram_key not in grams:
                raise RaotError(
                    f"no Gram matrix {gram_key!r} for {side} (needed by {name!r}); "
                    "collect input Grams for every RegMean layer in the calibration pass."
                )
            gram = grams[gram_key]
            fan_in = weight.shape[1]
            if tuple(gram.shape) != (fan_in, fan_in):
                raise RaotError(
                    f"Gram {gram_key!r} of {side} has shape {tuple(gram.shape)}, but {name!r} reads {fan_in} inputs "
                    f"and needs ({fan_in}, {fan_in}); the Gram belongs to another layer."
                )
            if not bool(torch.isfinite(_f64(gram)).all()):
                raise RaotError(f"Gram {gram_key!r} of {side} has non-finite entries; recollect the statistics.")
        groups.setdefault(gram_key, []).append(name)
    return groups


def _solve_symmetric(
    system: torch.Tensor, rhs: torch.Tensor, prior: torch.Tensor
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Solve ``system·X = rhs`` for a symmetric positive semi-definite system.

    A Cholesky factorisation solves it (a solve, never an explicit inverse). When the system is
    singular — a pivot below ``SINGULAR_PIVOT_RATIO`` of the largest diagonal entry, e.g. an
    input feature no calibration token activates, or fewer tokens than inputs with ``shrink=1``
    — a ridge ``λ·I`` pulls the solution towards ``prior`` (the linear merge), so directions
    with no data get the linear merge rather than arbitrary values. A least-squares solve is
    the last resort. The returned dict records what was done.
    """
    diag = torch.diagonal(system)
    scale = float(diag.mean()) if diag.numel() else 0.0
    if not scale > 0.0:
        return prior.clone(), {"solver": "linear (zero Gram)"}
    chol, status = torch.linalg.cholesky_ex(system)
    pivot_ratio = 0.0
    if int(status) == 0:
        pivot_ratio = float((torch.diagonal(chol) ** 2).min() / diag.max())
        if pivot_ratio > SINGULAR_PIVOT_RATIO:
            return torch.cholesky_solve(rhs, chol), {"solver": "cholesky", "min_pivot_ratio": pivot_ratio}
    ridge = RIDGE_RELATIVE * scale
    eye = torch.eye(system.shape[0], dtype=system.dtype, device=system.device)
    chol, status = torch.linalg.cholesky_ex(system + ridge * eye)
    if int(status) == 0:
        solution = torch.cholesky_solve(rhs + ridge * prior, chol)
        return solution, {"solver": "ridge", "ridge": ridge, "min_pivot_ratio": pivot_ratio}
    solution = torch.linalg.lstsq(system.cpu(), rhs.cpu(), driver="gelsd").solution.to(system.device)
    return solution, {"solver": "lstsq", "min_pivot_ratio": pivot_ratio}


def merge_regmean(
    state_a: StateDict,
    state_b: StateDict,
    *,
    grams_a: Mapping[str, torch.Tensor],
    grams_b: Mapping[str, torch.Tensor],
    linear_weights: Mapping[str, str],
    alpha: float = 0.5,
    shrink: float = 0.9,
    transposed_weights: Collection[str] = (),
    return_log: bool = False,
):
    """RegMean: per Linear layer, the weight that best reproduces both models' outputs on their inputs.

    For each weight name in ``linear_weights`` (weight name → gram key; weights reading the same
    input, such as q, k and v, or DeBERTa v1's fused ``in_proj``, may share a key), with input
    Grams ``G = XᵀX`` (in × in) of A and B′::

        W = ((1−α)·G̃_A + α·G̃_B)⁻¹ · ((1−α)·G̃_A·W_Aᵀ + α·G̃_B·W_B′ᵀ), transposed back to (out, in)

    where ``G̃ = shrink·G + (1 − shrink)·diag(G)``. This minimises
    ``(1−α)·‖X̃_A·(W − W_A)ᵀ‖² + α·‖X̃_B·(W − W_B′)ᵀ‖²``; α=0.5 is plain RegMean, α=0 gives A.
    Systems are solved (Cholesky), never inverted; a singular one gets a tiny ridge towards the
    linear merge (see :func:`_solve_symmetric`), recorded in the log. Every other tensor
    (biases, LayerNorms, embeddings) merges linearly with the same α. Weights named in
    ``transposed_weights`` are stored (in, out) — GPT-2's ``Conv1D`` — and solved as their
    transpose.
    """
    check_compatible_states(state_a, state_b)
    alpha = _check_unit("alpha", alpha)
    shrink = _check_unit("shrink", shrink)
    transposed = set(transposed_weights)

    def as_linear(state: StateDict, name: str) -> torch.Tensor:  # (out, in)
        w = _f64(state[name])
        return w.T if name in transposed else w

    groups = _regmean_groups(
        {n: (w.T if n in transposed else w) for n, w in state_a.items() if n in linear_weights},
        linear_weights,
        grams_a,
        grams_b,
    )
    log = _new_log("regmean", {"alpha": alpha, "shrink": shrink, "ridge_relative": RIDGE_RELATIVE})
    if alpha in (0.0, 1.0):
        return _finish(_endpoint_state(state_a, state_b, alpha, log), log, return_log)

    merged: dict[str, torch.Tensor] = {}
    for key, a in state_a.items():
        if key not in linear_weights:
            merged[key] = _linear_entry(key, a, state_b[key], alpha, log)
    for gram_key, names in tqdm(groups.items(), desc="RegMean solves", leave=False, disable=len(groups) < 4):
        device = state_a[names[0]].device
        gram_a = (1.0 - alpha) * shrink_gram(grams_a[gram_key], shrink).to(device)
        gram_b = alpha * shrink_gram(grams_b[gram_key], shrink).to(device)
        w_a = torch.cat([as_linear(state_a, n) for n in names], dim=0)
        w_b = torch.cat([as_linear(state_b, n).to(device) for n in names], dim=0)
        rhs = gram_a @ w_a.T + gram_b @ w_b.T
        prior = ((1.0 - alpha) * w_a + alpha * w_b).T
        solution, info = _solve_symmetric(gram_a + gram_b, rhs, prior)
        if info["solver"] != "cholesky":
            logger.warning("RegMean system %s is singular; solved with %s", gram_key, info["solver"])
        offset = 0
        for name in names:
            rows = state_a[name].shape[1 if name in transposed else 0]
            weight = solution[:, offset : offset + rows].T
            linear = prior[:, offset : offset + rows].T
            offset += rows
            change = float(torch.linalg.norm(weight - linear) / torch.linalg.norm(linear).clamp_min(1e-300))
            others = [n for n in names if n != name]
            _note(log, name, "regmean", gram=gram_key, shared_with=others, relative_change_vs_linear=change, **info)
            weight = weight.T if name in transposed else weight
            merged[name] = weight.to(state_a[name].dtype).contiguous()
    merged = {key: merged[key] for key in state_a}
    return _finish(merged, log, return_log)


# ----------------------------------------------------------------------------- Fisher


def _fisher_mean(fisher: Mapping[str, torch.Tensor], state: StateDict, side: str) -> float:
    total, count = 0.0, 0
    for key, value in fisher.items():
        if key not in state:
            raise RaotError(f"Fisher of {side} has {key!r}, which is not a parameter of the models.")
        if tuple(value.shape) != tuple(state[key].shape):
            raise RaotError(
                f"Fisher of {side} for {key!r} has shape {tuple(value.shape)}, the parameter {tuple(state[key].shape)}."
            )
        f = _f64(value)
        if not bool(torch.isfinite(f).all()) or bool((f < 0).any()):
            raise RaotError(
                f"Fisher of {side} for {key!r} has negative or non-finite entries; a diagonal Fisher is ≥ 0."
            )
        total += float(f.sum())
        count += f.numel()
    mean = total / max(count, 1)
    if not mean > 0.0:
        raise RaotError(f"the Fisher of {side} is zero everywhere; recompute it on data with non-zero gradients.")
    return mean


def merge_fisher(
    state_a: StateDict,
    state_b: StateDict,
    *,
    fisher_a: Mapping[str, torch.Tensor],
    fisher_b: Mapping[str, torch.Tensor],
    alpha: float = 0.5,
    eps: float = 1e-8,
    return_log: bool = False,
):
    """Fisher-weighted averaging with diagonal Fishers (same keys and shapes as the parameters).

    Normalisation: each model's Fisher is divided by its mean over all the entries it covers,
    so both have mean 1. Only the ratio F_A/F_B matters per entry, and this keeps a model whose
    Fisher is larger overall (a sharper loss, more samples, a summed estimator) from winning
    every entry, while keeping relative importance within that model. ``eps`` is then in units
    of the mean Fisher and is added to both::

        F̂ = F / mean(F) + eps;   W = ((1−α)·F̂_A·W_A + α·F̂_B·W_B′) / ((1−α)·F̂_A + α·F̂_B)

    Adding eps to both Fishers (rather than only to the denominator) makes entries where neither
    model has Fisher mass fall back to the linear merge instead of to zero, and equal Fishers
    give exactly the linear merge. Parameters absent from the Fishers merge linearly.
    """
    check_compatible_states(state_a, state_b)
    alpha = _check_unit("alpha", alpha)
    eps = _check_finite("eps", eps)
    if eps <= 0.0:
        raise RaotError(f"eps must be positive, got {eps}.")
    _check_same_fisher_keys(fisher_a, fisher_b)
    mean_a = _fisher_mean(fisher_a, state_a, "A")
    mean_b = _fisher_mean(fisher_b, state_b, "B′")
    log = _new_log(
        "fisher",
        {
            "alpha": alpha,
            "eps": eps,
            "normalisation": "each Fisher divided by its mean",
            "mean_a": mean_a,
            "mean_b": mean_b,
        },
    )
    if alpha in (0.0, 1.0):
        return _finish(_endpoint_state(state_a, state_b, alpha, log), log, return_log)

    merged: dict[str, torch.Tensor] = {}
    for key, a in state_a.items():
        if key not in fisher_a or not a.is_floating_point():
            merged[key] = _linear_entry(key, a, state_b[key], alpha, log)
            continue
        fishers = (fisher_a[key], fisher_b[key])
        merged[key] = _fisher_entry(key, a, state_b[key], fishers, (mean_a, mean_b), alpha, eps, log)
    return _finish(merged, log, return_log)


def _check_same_fisher_keys(fisher_a: Mapping[str, torch.Tensor], fisher_b: Mapping[str, torch.Tensor]) -> None:
    """Both Fishers must cover the same parameters."""
    if set(fisher_a) != set(fisher_b):
        missing = sorted(set(fisher_a) ^ set(fisher_b))[0]
        raise RaotError(
            f"the two Fishers cover different parameters (first: {missing!r}); compute both on the same set."
        )


def _fisher_entry(
    key: str,
    a: torch.Tensor,
    b: torch.Tensor,
    fishers: tuple[torch.Tensor, torch.Tensor],
    means: tuple[float, float],
    alpha: float,
    eps: float,
    log: dict[str, Any],
) -> torch.Tensor:
    """One parameter's Fisher-weighted mean of ``a`` and ``b`` (see :func:`merge_fisher`),
    with the mean share of B noted in ``log``."""
    (fisher_a, fisher_b), (mean_a, mean_b) = fishers, means
    weight_a = (1.0 - alpha) * (_f64(fisher_a).to(a.device) / mean_a + eps)
    weight_b = alpha * (_f64(fisher_b).to(a.device) / mean_b + eps)
    total = weight_a + weight_b
    value = (weight_a * _f64(a) + weight_b * _f64(b).to(a.device)) / total
    _note(log, key, "fisher", mean_share_of_b=float((weight_b / total).mean()))
    return value.to(a.dtype)


# ----------------------------------------------------------------------------- heads


def _label_map(id2label: Mapping | None) -> dict[int, str] | None:
    if id2label is None:
        return None
    return {int(k): str(v) for k, v in id2label.items()}


def _describe_labels(num_labels: int | None, id2label: dict[int, str] | None) -> str:
    if id2label is None:
        return f"{num_labels} labels"
    shown = ", ".join(f"{k}: {v}" for k, v in sorted(id2label.items())[:5])
    more = ", …" if len(id2label) > 5 else ""
    return f"{num_labels} labels {{{shown}{more}}}"


def merge_heads(
    state_a: StateDict,
    state_b: StateDict,
    head_params: list[str] | tuple[str, ...],
    policy: str = "a",
    num_labels_a: int | None = None,
    num_labels_b: int | None = None,
    id2label_a: Mapping | None = None,
    id2label_b: Mapping | None = None,
    *,
    alpha: float = 0.5,
    return_log: bool = False,
) -> dict:
    """The classification-head parameters ``head_params``, taken from A, from B′, or averaged.

    Returns a dict holding only the head parameters (cast to A's dtype), to overlay on the body
    merge — merge the body with the head parameters left out when the label spaces differ.
    ``policy="average"`` interpolates with weight ``alpha`` on B′ and needs the same label
    space (equal ``num_labels`` and ``id2label``); with ``policy="b"`` the model receiving the
    merge must first take B's head shapes and label config (:func:`raot_hf.io.loading.adopt_head`).
    """
    if policy not in HEAD_POLICIES:
        raise RaotError(f"unknown head policy {policy!r}; use one of: {', '.join(HEAD_POLICIES)}.")
    sources = {"a": (state_a,), "b": (state_b,), "average": (state_a, state_b)}[policy]
    for name in head_params:
        for state, side in zip((state_a, state_b), ("A", "B′")):
            if any(state is s for s in sources) and name not in state:
                raise RaotError(f"head parameter {name!r} is not in {side}; check the head parameter names.")
    log = _new_log("heads", {"policy": policy, "alpha": alpha if policy == "average" else None})
    merged: dict[str, torch.Tensor] = {}
    if policy == "average":
        alpha = _check_unit("alpha", alpha)
        labels_a, labels_b = _label_map(id2label_a), _label_map(id2label_b)
        if num_labels_a is None or num_labels_b is None or num_labels_a != num_labels_b or labels_a != labels_b:
            raise RaotError(
                f"--head average needs the same label space; A has {_describe_labels(num_labels_a, labels_a)}, "
                f"B has {_describe_labels(num_labels_b, labels_b)}; use --head a or --head b"
            )
        head_a = {name: state_a[name] for name in head_params}
        head_b = {name: state_b[name] for name in head_params}
        check_compatible_states(head_a, head_b)
        for name in head_params:
            merged[name] = _linear_entry(name, state_a[name], state_b[name], alpha, log)
    else:
        source = state_a if policy == "a" else state_b
        for name in head_params:
            dtype = state_a[name].dtype if name in state_a else source[name].dtype
            merged[name] = source[name].detach().to(dtype=dtype, copy=True)
            _note(log, name, f"head from {'A' if policy == 'a' else 'B′'}")
    return _finish(merged, log, return_log)


@register_section
@dataclass
class RegMeanOptions(OptionSection):
    """Options of ``merge_rule="regmean"``: ``shrink`` scales the Grams' off-diagonal."""

    section = "regmean"

    shrink: float = field(default=0.9, metadata=meta("RegMean off-diagonal scale (default 0.9).", "regmean_shrink"))

    def __post_init__(self) -> None:
        check_field_types(self)
        if not 0.0 <= self.shrink <= 1.0:
            raise RaotError(f"regmean_shrink={self.shrink} must lie in [0, 1]")


@register_section
@dataclass
class FisherOptions(OptionSection):
    """Options of ``merge_rule="fisher"``: examples for the label-free diagonal Fisher."""

    section = "fisher"

    samples: int = field(
        default=64, metadata=meta("Examples for the Fisher of --merge-rule fisher (default 64).", "fisher_samples")
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_non_negative_int("fisher_samples", self.samples)
