"""Merge rules on aligned state dicts (docs/design.md §6): linear, RegMean, Fisher, heads.

Every rule has one signature for any number of models::

    rule(states, weights, base=None, *, return_log=False, **options)

``states``: N ≥ 2 state dicts with agreeing keys and shapes, the first the reference, the others
already in its basis; ``weights``: one non-negative number per model (α on B′ is ``(1 − α, α)``).
Arithmetic runs in float64 per tensor, cast back to the reference's dtype; non-float tensors are
copied from the reference; per-model inputs are lists in the models' order (``grams=[...]``).
``return_log=True`` also returns the rule's :class:`~raot_hf.merging.log.RuleLog` (its settings, counts
and per-tensor notes) for the provenance report. Weights here are normalised to sum 1; a model with all the
weight comes back bit for bit, and sums run left to right from the first model's term
(``(1 − α)·x_A + α·x_B′`` exactly as written). Base-relative rules: :mod:`raot_hf.merging.base_rules`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from huggingface_hub.utils import tqdm

from raot_hf.config.core import HEAD_POLICIES
from raot_hf.config.options import check_field_types, check_non_negative_int, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError
from raot_hf.merging.log import RuleLog

logger = logging.getLogger("raot_hf.merging")

StateDict = Mapping[str, torch.Tensor]
_F64 = torch.float64

#: Cholesky pivots below this fraction of the largest diagonal entry mark a RegMean system singular.
SINGULAR_PIVOT_RATIO = 1e-12
#: The ridge added to a singular RegMean system, relative to the mean of its diagonal.
RIDGE_RELATIVE = 1e-8
#: The head policies of :func:`merge_heads`.


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


def model_names(n: int) -> list[str]:
    """How messages name the models: A and B′ for two, else model 1 … model N."""
    return ["A", "B′"] if n == 2 else [f"model {i}" for i in range(1, n + 1)]


def _check_states(states: Sequence[StateDict]) -> None:
    if len(states) < 2:
        raise RaotError(f"a merge needs at least two models, got {len(states)}.")
    names = model_names(len(states))
    for name, state in zip(names[1:], states[1:]):
        check_compatible_states(states[0], state, names=(names[0], name))


def check_weights(weights: Sequence[float], n: int, *, normalise: bool) -> list[float]:
    """One finite, non-negative weight per model, positive sum; divided by the sum when ``normalise``."""
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise RaotError(f"{len(weights)} weights for {n} models; give one weight per model (--weights w1,w2,...).")
    if not all(math.isfinite(w) and w >= 0.0 for w in weights) or not sum(weights) > 0.0:
        raise RaotError(f"weights {weights} must be finite, non-negative and not all zero.")
    total = sum(weights)
    return [w / total for w in weights] if normalise else weights


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


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise RaotError(f"seed={seed!r} must be a non-negative integer.")
    return seed


# ----------------------------------------------------------------------------- helpers


def _f64(t: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(t).detach().to(_F64)


def _total(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """``terms[0] + terms[1] + …`` from the first term (a zero start would turn −0 into +0)."""
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def _finish(merged: dict[str, torch.Tensor], log: RuleLog, return_log: bool):
    # DEBUG: the merger calls per-tensor rules once per chunk and logs one summary itself
    logger.debug("%s merge: %s", log.rule, ", ".join(f"{n} {m}" for m, n in sorted(log.counts.items())))
    return (merged, log) if return_log else merged


def _copy_non_float(key: str, ref: torch.Tensor, other: torch.Tensor, log: RuleLog) -> torch.Tensor:
    same = torch.equal(ref.detach().cpu(), other.detach().cpu())
    if not same:
        logger.warning("non-float tensor %s differs between the models; A's is kept", key)
    log.note(key, "copied from A (not floating point)", identical=same)
    return ref.detach().clone()


def _sole_model(weights: Sequence[float]) -> int | None:
    """The index of the one model with non-zero weight, or None when several have some."""
    nonzero = [i for i, w in enumerate(weights) if w != 0.0]
    return nonzero[0] if len(nonzero) == 1 else None


def _linear_entry(key: str, tensors: Sequence[torch.Tensor], weights: Sequence[float], log: RuleLog) -> torch.Tensor:
    """``Σ wᵢ·xᵢ`` of one tensor, zero-weight models left out; a sole model's tensor bit for bit."""
    ref = tensors[0]
    if not ref.is_floating_point():
        return _copy_non_float(key, ref, tensors[1], log)
    log.note(key, "linear")
    sole = _sole_model(weights)
    if sole is not None:
        return tensors[sole].detach().to(dtype=ref.dtype, device=ref.device, copy=True)
    return _weighted_sum([(t, w) for t, w in zip(tensors, weights, strict=True) if w != 0.0], ref)


#: Elements of a tensor that :func:`_weighted_sum` takes in float64 at once (32 MiB per term).
SUM_BLOCK = 1 << 22


def _weighted_sum(terms: Sequence[tuple[torch.Tensor, float]], ref: torch.Tensor) -> torch.Tensor:
    """``Σ wᵢ·xᵢ`` in float64, summed from the first term, rounded once to ``ref``'s dtype and
    device: the same operations as ``_total([w * _f64(x) …])``, so the same bits, taken
    :data:`SUM_BLOCK` elements at a time so that no float64 copy of a whole tensor (an embedding
    table) is held."""
    out = torch.empty(ref.shape, dtype=ref.dtype, device=ref.device)
    flat_out = out.view(-1)
    flats = [(torch.as_tensor(t).detach().reshape(-1), w) for t, w in terms]
    for start in range(0, flat_out.numel(), SUM_BLOCK):
        total = None
        for flat, w in flats:
            term = flat[start : start + SUM_BLOCK].to(device=ref.device, dtype=_F64, copy=True).mul_(w)
            total = term if total is None else total.add_(term)
        flat_out[start : start + SUM_BLOCK] = total
    return out


def _endpoint_state(states: Sequence[StateDict], weights: Sequence[float], log: RuleLog) -> dict | None:
    """Every tensor of the model with all the weight (bit for bit), or None when several have some."""
    sole = _sole_model(weights)
    if sole is None:
        return None
    log.settings["endpoint"] = f"all the weight on {model_names(len(states))[sole]}: its tensors exactly"
    return {key: _linear_entry(key, [s[key] for s in states], weights, log) for key in states[0]}


# ----------------------------------------------------------------------------- linear


def merge_linear(
    states: Sequence[StateDict], weights: Sequence[float], base=None, *, normalize: bool = True,
    return_log: bool = False,
):  # fmt: skip
    """Linear interpolation ``W = Σ wᵢWᵢ / Σ wᵢ`` of every floating-point tensor (``normalize=False``,
    mergekit's switch: ``Σ wᵢWᵢ``)."""
    _check_states(states)
    if not isinstance(normalize, bool):
        raise RaotError(f"normalize={normalize!r} must be true or false")
    weights = check_weights(weights, len(states), normalise=normalize)
    log = RuleLog("linear", {"weights": tuple(weights)})  # a tuple: chunks' logs add up lists
    if not normalize:
        log.settings["normalize"] = False
    merged = {key: _linear_entry(key, [s[key] for s in states], weights, log) for key in states[0]}
    return _finish(merged, log, return_log)


# ----------------------------------------------------------------------------- RegMean


def shrink_gram(gram: torch.Tensor, shrink: float) -> torch.Tensor:
    """``G̃ = shrink·G + (1 − shrink)·diag(G)`` in float64, after symmetrising G (the paper's α)."""
    g = _f64(gram)
    g = 0.5 * (g + g.T)
    if shrink == 1.0:
        return g
    return shrink * g + (1.0 - shrink) * torch.diag(torch.diagonal(g))


def _regmean_readers(
    ref: StateDict, linear_weights: Mapping[str, str], grams: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, list[str]]:
    """Gram key → the RegMean weights reading that input (q, k and v read one), validating every model's Grams."""
    readers: dict[str, list[str]] = {}
    for name, gram_key in linear_weights.items():
        if name not in ref:
            raise RaotError(f"RegMean weight {name!r} is not a parameter of the models; check the linear_weights map.")
        weight = ref[name]
        if weight.dim() != 2 or not weight.is_floating_point():
            raise RaotError(
                f"RegMean weight {name!r} must be a 2-D floating-point Linear weight, got shape {tuple(weight.shape)}."
            )
        for side, model_grams in zip(model_names(len(grams)), grams, strict=True):
            if gram_key not in model_grams:
                raise RaotError(
                    f"no Gram matrix {gram_key!r} for {side} (needed by {name!r}); "
                    "collect input Grams for every RegMean layer in the calibration pass."
                )
            gram = model_grams[gram_key]
            fan_in = weight.shape[1]
            if tuple(gram.shape) != (fan_in, fan_in):
                raise RaotError(
                    f"Gram {gram_key!r} of {side} has shape {tuple(gram.shape)}, but {name!r} reads {fan_in} inputs "
                    f"and needs ({fan_in}, {fan_in}); the Gram belongs to another layer."
                )
            if not bool(torch.isfinite(_f64(gram)).all()):
                raise RaotError(f"Gram {gram_key!r} of {side} has non-finite entries; recollect the statistics.")
        readers.setdefault(gram_key, []).append(name)
    return readers


def _solve_symmetric(
    system: torch.Tensor, rhs: torch.Tensor, prior: torch.Tensor
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Solve a symmetric PSD ``system·X = rhs`` by Cholesky (never an inverse). A singular one (a
    pivot below ``SINGULAR_PIVOT_RATIO`` of the largest diagonal) gets a ridge ``λ·I`` towards
    ``prior`` (the linear merge), so directions without data keep the linear merge; lstsq last."""
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
    states, weights, base=None, *, grams: Sequence[Mapping], linear_weights: Mapping[str, str], shrink: float = 0.9,
    transposed_weights: Collection[str] = (), return_log: bool = False,
):  # fmt: skip
    """RegMean: per Linear layer, the weight that best reproduces every model's outputs.

    ``linear_weights`` maps weight name → gram key (q, k, v may share one); ``grams`` holds each
    model's input Grams ``Gᵢ = XᵢᵀXᵢ`` (in × in). With normalised weights wᵢ::

        W = (Σ wᵢG̃ᵢ)⁻¹ · Σ wᵢG̃ᵢWᵢᵀ, transposed back to (out, in),  G̃ = shrink·G + (1 − shrink)·diag(G)

    minimising ``Σ wᵢ‖X̃ᵢ·(W − Wᵢ)ᵀ‖²``. Every other tensor merges linearly. Weights in
    ``transposed_weights`` are stored (in, out) (GPT-2's ``Conv1D``) and solved transposed.
    """
    _check_states(states)
    weights = check_weights(weights, len(states), normalise=True)
    shrink = _check_unit("shrink", shrink)
    if len(grams) != len(states):
        raise RaotError(f"{len(grams)} Gram sets for {len(states)} models; RegMean needs one per model.")
    transposed = set(transposed_weights)
    ref = states[0]

    def as_linear(state: StateDict, name: str) -> torch.Tensor:  # (out, in)
        w = _f64(state[name])
        return w.T if name in transposed else w

    stored = {n: (w.T if n in transposed else w) for n, w in ref.items() if n in linear_weights}
    readers = _regmean_readers(stored, linear_weights, grams)
    log = RuleLog("regmean", {"weights": weights, "shrink": shrink, "ridge_relative": RIDGE_RELATIVE})
    endpoint = _endpoint_state(states, weights, log)
    if endpoint is not None:
        return _finish(endpoint, log, return_log)

    merged = {k: _linear_entry(k, [s[k] for s in states], weights, log) for k in ref if k not in linear_weights}
    for gram_key, names in tqdm(readers.items(), desc="RegMean solves", leave=False, disable=len(readers) < 4):
        device = ref[names[0]].device
        shrunk = [w * shrink_gram(g[gram_key], shrink).to(device) for g, w in zip(grams, weights, strict=True)]
        stacked = [torch.cat([as_linear(s, n).to(device) for n in names], dim=0) for s in states]
        rhs = _total([g @ x.T for g, x in zip(shrunk, stacked, strict=True)])
        prior = _total([w * x for w, x in zip(weights, stacked, strict=True)]).T
        solution, info = _solve_symmetric(_total(shrunk), rhs, prior)
        if info["solver"] != "cholesky":
            logger.warning("RegMean system %s is singular; solved with %s", gram_key, info["solver"])
        offset = 0
        for name in names:
            rows = ref[name].shape[1 if name in transposed else 0]
            weight = solution[:, offset : offset + rows].T
            linear = prior[:, offset : offset + rows].T
            offset += rows
            change = float(torch.linalg.norm(weight - linear) / torch.linalg.norm(linear).clamp_min(1e-300))
            others = [n for n in names if n != name]
            log.note(name, "regmean", gram=gram_key, shared_with=others, relative_change_vs_linear=change, **info)
            weight = weight.T if name in transposed else weight
            merged[name] = weight.to(ref[name].dtype).contiguous()
    return _finish({key: merged[key] for key in ref}, log, return_log)


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


def merge_fisher(states, weights, base=None, *, fishers: Sequence[Mapping], eps: float = 1e-8, return_log=False):
    """Fisher-weighted averaging with one diagonal Fisher per model (the parameters' keys and shapes)::

        F̂ᵢ = Fᵢ / mean(Fᵢ) + eps;   W = Σ wᵢF̂ᵢWᵢ / Σ wᵢF̂ᵢ

    Dividing by the mean keeps an overall larger Fisher from winning every entry; ``eps`` (in
    units of the mean Fisher, added to every one) sends entries without Fisher mass to the linear
    merge. Parameters absent from the Fishers merge linearly.
    """
    _check_states(states)
    weights = check_weights(weights, len(states), normalise=True)
    eps = _check_finite("eps", eps)
    if eps <= 0.0:
        raise RaotError(f"eps must be positive, got {eps}.")
    if len(fishers) != len(states):
        raise RaotError(f"{len(fishers)} Fishers for {len(states)} models; the Fisher rule needs one per model.")
    for fisher in fishers[1:]:
        if set(fisher) != set(fishers[0]):
            missing = sorted(set(fishers[0]) ^ set(fisher))[0]
            raise RaotError(
                f"the Fishers cover different parameters (first: {missing!r}); compute them all on the same set."
            )
    sides = model_names(len(states))
    means = [_fisher_mean(f, s, side) for f, s, side in zip(fishers, states, sides, strict=True)]
    settings = {"weights": weights, "eps": eps, "normalisation": "each Fisher divided by its mean", "means": means}
    log = RuleLog("fisher", dict(settings))
    endpoint = _endpoint_state(states, weights, log)
    if endpoint is not None:
        return _finish(endpoint, log, return_log)

    merged: dict[str, torch.Tensor] = {}
    for key, ref in states[0].items():
        tensors = [s[key] for s in states]
        if key not in fishers[0] or not ref.is_floating_point():
            merged[key] = _linear_entry(key, tensors, weights, log)
            continue
        parts = [
            w * (_f64(f[key]).to(ref.device) / mean + eps) for f, mean, w in zip(fishers, means, weights, strict=True)
        ]
        total = _total(parts)
        value = _total([p * _f64(t).to(ref.device) for p, t in zip(parts, tensors, strict=True)]) / total
        log.note(key, "fisher", mean_shares=[float((p / total).mean()) for p in parts])
        merged[key] = value.to(ref.dtype)
    return _finish(merged, log, return_log)


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


def _check_label_spaces(labels: Sequence[tuple[int | None, Mapping | None]] | None, n: int) -> None:
    """Refuse ``--head average`` unless every model has the reference's ``num_labels`` and ``id2label``."""
    if labels is None or len(labels) != n:
        raise RaotError(
            "--head average needs every model's label space: pass labels=[(num_labels, id2label), ...], one per model."
        )
    sides = ["A", "B"] if n == 2 else model_names(n)
    alternatives = "--head a or --head b" if n == 2 else "--head a"
    num_ref, map_ref = labels[0][0], _label_map(labels[0][1])
    for side, (num, id2label) in zip(sides[1:], labels[1:], strict=True):
        mapped = _label_map(id2label)
        if num_ref is None or num is None or num != num_ref or mapped != map_ref:
            raise RaotError(
                f"--head average needs the same label space; {sides[0]} has {_describe_labels(num_ref, map_ref)}, "
                f"{side} has {_describe_labels(num, mapped)}; use {alternatives}"
            )


def merge_heads(states, head_params: Sequence[str], weights, policy: str = "a", labels=None, *, return_log=False):
    """The head parameters ``head_params`` of N ≥ 2 models (``states``, the reference first), in the
    reference's dtype: the reference's (``"a"``); B′'s (``"b"``, two models only, after
    :func:`raot_hf.io.loading.adopt_head`); or (``"average"``) :func:`merge_linear`'s weighted average,
    which needs ``labels``, one ``(num_labels, id2label)`` per model, all the reference's."""
    if policy not in HEAD_POLICIES:
        raise RaotError(f"unknown head policy {policy!r}; use one of: {', '.join(HEAD_POLICIES)}.")
    n = len(states)
    if n < 2:
        raise RaotError(f"a head merge needs at least two models, got {n}.")
    if policy == "b" and n != 2:
        raise RaotError(f"--head b names one of two models; with {n} models use --head a (the reference's) or average")
    names = model_names(n)
    sources = {"a": [0], "b": [1], "average": list(range(n))}[policy]
    for name in head_params:
        for i in sources:
            if name not in states[i]:
                raise RaotError(f"head parameter {name!r} is not in {names[i]}; check the head parameter names.")
    merged: dict[str, torch.Tensor] = {}
    if policy == "average":
        weights = check_weights(weights, n, normalise=True)
        log = RuleLog("heads", {"policy": policy, "weights": weights})
        _check_label_spaces(labels, n)
        heads = [{name: state[name] for name in head_params} for state in states]
        for side, head in zip(names[1:], heads[1:]):
            check_compatible_states(heads[0], head, names=(names[0], side))
        for name in head_params:
            merged[name] = _linear_entry(name, [state[name] for state in states], weights, log)
    else:
        log = RuleLog("heads", {"policy": policy, "weights": None})
        source = sources[0]
        for name in head_params:
            dtype = states[0][name].dtype if name in states[0] else states[source][name].dtype
            merged[name] = states[source][name].detach().to(dtype=dtype, copy=True)
            log.note(name, f"head from {names[source]}")
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
