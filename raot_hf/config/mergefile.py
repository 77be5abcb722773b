"""Merge files in the shape mergekit users write (YAML or JSON), read into the models, the base and
a :class:`raot_hf.RaotConfig` (docs/design.md §6.9)::

    models:
      - model: ./seed-a
        parameters: {weight: 0.5}
      - model: ./seed-b
        parameters: {weight: 0.25}
      - model: ./seed-c
        parameters: {weight: 0.25}
    merge_method: linear
    dtype: float32
    raot:                       # this project's own options (any RaotConfig field or section)
      calibration: {source: calibration.csv, num_samples: 256}

``merge_method`` is a registered merge rule; ``base_model`` the checkpoint the models were
fine-tuned from (a ``models:`` entry naming it is the base, not a model to merge, as in mergekit);
per-model ``parameters`` are ``weight`` and ``density``; the top-level ``parameters`` take
``lambda`` (the task-vector scale), a default ``weight`` and ``density``, and mergekit's
``normalize`` / ``rescale`` / ``int8_mask`` where they keep the method's definition. What this
project cannot do — ``slices:`` and passthrough frankenmerges, per-layer parameter gradients,
another model's tokenizer — is refused in one line before any weights are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raot_hf.errors import RaotError

#: Top-level keys of a merge file this project reads.
KEYS = ("models", "merge_method", "base_model", "parameters", "dtype", "raot")
#: mergekit keys with no meaning here, and why.
REFUSED_KEYS = {
    "slices": "slices: (layer ranges stitched from several models) are not supported: raot-hf merges models of "
    "one architecture layer for layer; list whole models under models:",
    "tokenizer_source": "tokenizer_source: is not supported: the merged model takes the reference model's tokenizer",
    "tokenizer": "tokenizer: is not supported: the merged model takes the reference model's tokenizer",
    "chat_template": "chat_template: is not supported: the merged model keeps the reference model's tokenizer files",
}
#: mergekit methods this project does not implement, and why (the rest of the message lists the valid ones).
REFUSED_METHODS = {
    "passthrough": "passthrough (frankenmerges: layers copied from several models) is not a merge of aligned "
    "weights; raot-hf does not stack layers",
}
#: mergekit's defaults of the methods' normalize and rescale switches (the definitions implemented here).
_DEFAULTS = {
    "linear": {"normalize": True},
    "task_arithmetic": {"normalize": False, "rescale": False},
    "ties": {"normalize": True, "rescale": False},
    "dare_ties": {"normalize": False, "rescale": True},
}
_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64"}  # fmt: skip


@dataclass
class MergeFile:
    """What a merge file asks for: the models in order, the base (or None) and the options."""

    models: list[str]
    base: str | None
    config: Any  # raot_hf.RaotConfig


def looks_like_merge_file(data: Any) -> bool:
    """Whether parsed ``--config`` content is a merge file (it names models or a method), not a
    RaotConfig JSON."""
    return isinstance(data, dict) and bool({"models", "merge_method", "slices"} & set(data))


def parse_text(text: str, name: str) -> Any:
    """YAML (JSON is YAML too) into Python data; a syntax error is one line."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise RaotError(f"--config {name} is not valid YAML or JSON{where}; fix the file") from None


def _number(value: Any, what: str) -> float:
    if isinstance(value, list):
        raise RaotError(f"{what} is a list (a per-layer gradient); raot-hf takes one number per model")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RaotError(f"{what}={value!r} must be a number")
    return float(value)


def _model_entries(data: dict, base: str | None) -> tuple[list[str], list[dict]]:
    entries = data.get("models")
    if not isinstance(entries, list) or not entries:
        raise RaotError("the merge file has no models: list; add one '- model: <path or Hub id>' entry per model")
    models, params = [], []
    for i, entry in enumerate(entries, start=1):
        if not isinstance(entry, dict) or not entry.get("model"):
            raise RaotError(f"models: entry {i} has no 'model:'; write '- model: <path or Hub id>'")
        unknown = sorted(set(entry) - {"model", "parameters"})
        if unknown:
            raise RaotError(f"models: entry {i} has unknown key(s) {', '.join(unknown)}; valid: model, parameters")
        if base is not None and str(entry["model"]) == base:
            continue  # mergekit lists the base among the models; it is the origin of the task vectors
        p = entry.get("parameters") or {}
        bad = sorted(set(p) - {"weight", "density"}) if isinstance(p, dict) else ["(not a mapping)"]
        if bad:
            raise RaotError(f"models: entry {i} parameters {', '.join(bad)} not supported; per model: weight, density")
        models.append(str(entry["model"]))
        params.append({k: _number(v, f"models: entry {i} {k}") for k, v in p.items()})
    if len(models) < 2:
        raise RaotError(f"the merge file lists {len(models)} model(s) to merge besides the base; list at least two")
    return models, params


def _global_parameters(method: str, params: Any) -> dict[str, float]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise RaotError("parameters: must be a mapping (lambda, weight, density, normalize, rescale, int8_mask)")
    out = {}
    for key, value in params.items():
        if key in ("normalize", "rescale"):
            default = _DEFAULTS.get(method, {}).get(key)
            if value != default:
                raise RaotError(
                    f"parameters: {key}: {value} is not supported for {method}; raot-hf implements mergekit's "
                    f"definition ({key}: {default})"
                )
        elif key == "int8_mask":
            continue  # a memory saving of mergekit's: the result does not change
        elif key in ("lambda", "weight", "density"):
            out[key] = _number(value, f"parameters: {key}")
        else:
            raise RaotError(f"parameters: {key} is not supported; valid: lambda, weight, density, normalize, rescale")
    return out


def _check_method(method: Any) -> str:
    from raot_hf.merging import available_merge_rules, nary_merge_rules

    if not isinstance(method, str) or not method:
        raise RaotError(f"the merge file has no merge_method:; choose one of: {', '.join(nary_merge_rules())}")
    if method in REFUSED_METHODS:
        raise RaotError(f"merge_method: {REFUSED_METHODS[method]}; choose one of: {', '.join(nary_merge_rules())}")
    if method not in available_merge_rules():
        raise RaotError(
            f"merge_method: {method!r} is not supported; choose one of: {', '.join(available_merge_rules())}"
        )
    return method


def _raot_section(data: dict) -> dict:
    raot = data.get("raot") or {}
    if not isinstance(raot, dict):
        raise RaotError("raot: must be a mapping of RaotConfig options (e.g. alignment, calibration, correction)")
    for key, where in (("merge_rule", "merge_method:"), ("dtype", "dtype:"), ("alpha", "parameters: weight")):
        if key in raot:
            raise RaotError(f"raot: {key} is set by the merge file's {where}; remove it from raot:")
    group = raot.get("group") or {}
    if isinstance(group, dict) and ({"weights", "densities"} & set(group)):
        raise RaotError("raot: group weights and densities come from the models' parameters:; remove them from raot:")
    return raot


def read_merge_file(data: dict) -> MergeFile:
    """The models, base and RaotConfig a parsed merge file describes (see the module docstring)."""
    from raot_hf.config import RaotConfig

    for key in data:
        if key in REFUSED_KEYS:
            raise RaotError(REFUSED_KEYS[key])
        if key not in KEYS:
            raise RaotError(f"unknown merge-file key {key!r}; valid: {', '.join(KEYS)}")
    method = _check_method(data.get("merge_method"))
    base = str(data["base_model"]) if data.get("base_model") else None
    models, params = _model_entries(data, base)
    top = _global_parameters(method, data.get("parameters"))
    options = _raot_section(data)
    weights = [p.get("weight", top.get("weight", 1.0 / len(models))) for p in params]
    densities = [p["density"] for p in params if "density" in p]
    section = dict(options.get("group") or {})
    section["weights"] = weights
    if densities:
        section["densities"] = [p.get("density", top.get("density", 1.0)) for p in params]
    rules = dict(options.get("base_rules") or {})
    if "lambda" in top:
        rules["task_scale"] = top["lambda"]
    if "density" in top:
        rules["density"] = top["density"]
    config = {**options, "merge_rule": method, "group": section}
    if rules:
        config["base_rules"] = rules
    if data.get("dtype") is not None:
        if str(data["dtype"]) not in _DTYPES:
            raise RaotError(f"dtype: {data['dtype']!r} is not supported; choose one of: {', '.join(sorted(_DTYPES))}")
        config["dtype"] = _DTYPES[str(data["dtype"])]
    return MergeFile(models, base, RaotConfig.from_dict(config))


def load_merge_file(path: str | Path) -> MergeFile:
    """Read and check the merge file at ``path`` (YAML or JSON)."""
    path = Path(path)
    if not path.is_file():
        raise RaotError(f"--config {path} does not exist; pass a merge file (YAML) or a RaotConfig JSON")
    data = parse_text(path.read_text(encoding="utf-8"), str(path))
    if not looks_like_merge_file(data):
        raise RaotError(f"--config {path} names no models: or merge_method:; it is not a merge file")
    return read_merge_file(data)


__all__ = ["MergeFile", "load_merge_file", "looks_like_merge_file", "read_merge_file"]
