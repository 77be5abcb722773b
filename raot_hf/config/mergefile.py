"""Merge files in the shape mergekit users write (YAML or JSON), read into the models, the base and
a :class:`raot_hf.RaotConfig` (docs/design.md §6.9)::

    models:
      - model: ./seed-a
        parameters: {weight: 0.5}
      - model: ./seed-b
        parameters: {weight: 0.5}
    merge_method: linear
    raot:                       # this project's own options (any RaotConfig field or section)
      calibration: {source: calibration.csv, num_samples: 256}

``merge_method`` is a registered merge rule; ``base_model`` the models' origin (a ``models:`` entry
naming it is the base, as in mergekit; for ``slerp`` the model at ``t = 0``). Per-model
``parameters``: ``weight``, ``density``; top-level: ``lambda``, default ``weight`` / ``density``,
mergekit's ``normalize`` / ``rescale`` / ``int8_mask`` where they keep the method's definition,
and the mergekit rules' own (``t``, ``epsilon``, ``gamma``, ``filter_wise``, ``nuslerp_row_wise``,
``nuslerp_flatten``), which may vary by layer (:mod:`raot_hf.merging.layered`). One ``slices:``
entry covering the whole layer range reads like ``models:`` (:func:`check_layer_range`); other
slices, passthrough and another model's tokenizer are refused in one line before any weights load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raot_hf.errors import RaotError

#: Top-level keys of a merge file this project reads.
KEYS = ("models", "slices", "merge_method", "base_model", "parameters", "dtype", "raot")
#: mergekit keys with no meaning here, and why.
REFUSED_KEYS = {
    "tokenizer_source": "tokenizer_source: is not supported: the merged model takes the reference model's tokenizer",
    "tokenizer": "tokenizer: is not supported: the merged model takes the reference model's tokenizer",
    "chat_template": "chat_template: is not supported: the merged model keeps the reference model's tokenizer files",
}
#: mergekit methods this project does not implement, and why (the rest of the message lists the valid ones).
REFUSED_METHODS = {
    "passthrough": "passthrough (frankenmerges: layers copied from several models) is not a merge of aligned "
    "weights; raot-hf does not stack layers"
}
#: mergekit's defaults of the methods' normalize and rescale switches (the definitions implemented here).
_DEFAULTS = {
    "linear": {"normalize": True}, "task_arithmetic": {"normalize": False, "rescale": False},
    "ties": {"normalize": True, "rescale": False}, "dare_ties": {"normalize": False, "rescale": True},
    "della": {"normalize": True, "rescale": True}, "della_linear": {"normalize": False, "rescale": True},
    "breadcrumbs": {"normalize": False, "rescale": False}, "breadcrumbs_ties": {"normalize": False, "rescale": False},
}  # fmt: skip
#: The mergekit rules' parameters → their mergekit-section option (settings may vary by layer or module).
_MERGEKIT_PARAMETERS = {
    "t": "t", "density": "density", "lambda": "scale", "epsilon": "epsilon", "gamma": "gamma",
    "filter_wise": "filter_wise", "nuslerp_row_wise": "row_wise", "nuslerp_flatten": "flatten",
}  # fmt: skip
#: Rules whose base_model is one of the two models merged, not the origin of task vectors.
_BASE_IS_A_MODEL = ("slerp",)
_SLICE_FIX = "list whole models under models: (or one slice whose sources all cover every layer)"
_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64"}  # fmt: skip


@dataclass
class MergeFile:
    """What a merge file asks for: the models in order, the base (or None) and the options."""

    models: list[str]
    base: str | None
    config: Any  # raot_hf.RaotConfig
    #: ``slices:``'s layer range ``[0, L]`` (checked against the models by :func:`check_layer_range`), or None.
    layer_range: tuple[int, int] | None = None


def looks_like_merge_file(data: Any) -> bool:
    """Whether parsed ``--config`` content is a merge file (it lists models or names a method), not
    a RaotConfig JSON (whose ``models`` is the several-model options section, a mapping)."""
    if not isinstance(data, dict):
        return False
    return bool({"merge_method", "slices"} & set(data)) or isinstance(data.get("models"), list)


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


def _slice_entries(data: dict) -> tuple[list[dict], tuple[int, int]]:
    """The sources of a whole-model ``slices:`` as ``models:`` entries, and their layer range."""
    if "models" in data:
        raise RaotError("the merge file has both models: and slices:; keep one (models: for a whole-model merge)")
    slices = data["slices"]
    if not isinstance(slices, list) or len(slices) != 1:
        count = len(slices) if isinstance(slices, list) else 0
        raise RaotError(f"slices: has {count} slices; raot-hf merges whole models layer for layer: {_SLICE_FIX}")
    piece = slices[0] if isinstance(slices[0], dict) else {}
    extra = sorted(set(piece) - {"sources", "parameters"})
    if extra or not isinstance(piece.get("sources"), list) or not piece["sources"]:
        raise RaotError(
            f"slices: entry must hold sources: (and parameters:) only, got {extra or 'no sources'}; {_SLICE_FIX}"
        )
    ranges, entries = set(), []
    for i, source in enumerate(piece["sources"], start=1):
        if not isinstance(source, dict) or not source.get("model") or "layer_range" not in source:
            raise RaotError(f"slices: source {i} needs model: and layer_range: [0, <layers>]")
        bounds = source["layer_range"]
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(isinstance(b, int) for b in bounds)):
            raise RaotError(f"slices: source {i} layer_range {bounds!r} must be [start, end], two integers")
        ranges.add(tuple(bounds))
        entries.append({k: v for k, v in source.items() if k != "layer_range"})
    if len(ranges) != 1:
        raise RaotError(
            f"slices: sources cover different layer ranges {sorted(ranges)}: stitching layers from several models "
            f"is a frankenmerge; {_SLICE_FIX}"
        )
    ((start, end),) = ranges
    if start != 0 or end <= 0:
        raise RaotError(
            f"slices: layer_range [{start}, {end}] does not cover every layer; use [0, <layers>]: {_SLICE_FIX}"
        )
    return entries, (start, end)


def _model_entries(entries: Any, base: str | None) -> tuple[list[str], list[dict]]:
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


def _global_parameters(method: str, params: Any, layered: bool) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise RaotError("parameters: must be a mapping (lambda, weight, density, normalize, rescale, int8_mask)")
    out = {}
    for key, value in params.items():
        if layered and key in _MERGEKIT_PARAMETERS:
            from raot_hf.merging.layered import check_setting

            out[key] = check_setting(f"parameters: {key}", value)
            continue
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
            valid = ["lambda", "weight", "density", "normalize", "rescale", *(_MERGEKIT_PARAMETERS if layered else ())]
            raise RaotError(
                f"parameters: {key} is not supported for {method}; valid: {', '.join(dict.fromkeys(valid))}"
            )
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
    from raot_hf.config.core import current_section_names

    raot = data.get("raot") or {}
    if not isinstance(raot, dict):
        raise RaotError("raot: must be a mapping of RaotConfig options (e.g. alignment, calibration, correction)")
    for key, where in (("merge_rule", "merge_method:"), ("dtype", "dtype:"), ("alpha", "parameters: weight")):
        if key in raot:
            raise RaotError(f"raot: {key} is set by the merge file's {where}; remove it from raot:")
    raot = current_section_names(raot)  # ``group:`` of earlier versions reads as ``models:``
    section = raot.get("models") or {}
    if isinstance(section, dict) and ({"weights", "densities"} & set(section)):
        raise RaotError("raot: models weights and densities come from the models' parameters:; remove them from raot:")
    return raot


def _models_and_base(data: dict, method: str) -> tuple[list[str], list[dict], str | None, tuple | None]:
    """The models to merge, their parameters, the base (None when it is a model merged) and the slice's range."""
    entries, layer_range = _slice_entries(data) if "slices" in data else (data.get("models"), None)
    base = str(data["base_model"]) if data.get("base_model") else None
    if method in _BASE_IS_A_MODEL:
        if base is None:
            raise RaotError(f"merge_method: {method} needs base_model: (the model at t = 0, merged with the other)")
        models, params = _model_entries(entries, None)
        if base not in models:
            raise RaotError(f"base_model: {base} is not among the models; {method} merges it with one other model")
        order = sorted(range(len(models)), key=lambda i: models[i] != base)  # the base first: the reference
        return [models[i] for i in order], [params[i] for i in order], None, layer_range
    if method == "nuslerp" and base is not None:
        raise RaotError(
            "merge_method: nuslerp with a base_model (task-vector SLERP) is not supported; remove base_model:"
        )
    models, params = _model_entries(entries, base)
    return models, params, base, layer_range


def read_merge_file(data: dict) -> MergeFile:
    """The models, base and RaotConfig a parsed merge file describes (see the module docstring)."""
    from raot_hf.config import RaotConfig
    from raot_hf.merging import merge_rule_spec

    for key in data:
        if key in REFUSED_KEYS:
            raise RaotError(REFUSED_KEYS[key])
        if key not in KEYS:
            raise RaotError(f"unknown merge-file key {key!r}; valid: {', '.join(KEYS)}")
    method = _check_method(data.get("merge_method"))
    layered = merge_rule_spec(method).layered
    models, params, base, layer_range = _models_and_base(data, method)
    given = data.get("parameters")
    if "slices" in data and isinstance(data["slices"][0].get("parameters"), dict):  # the one slice's, over the top's
        given = {**(given or {}), **data["slices"][0]["parameters"]}
    top = _global_parameters(method, given, layered)
    options = _raot_section(data)
    if not isinstance(top.get("weight", 0.0), float):
        raise RaotError("parameters: weight must be one number (per-layer weights are not supported); give one")
    weights = [p.get("weight", top.get("weight", 1.0 / len(models))) for p in params]
    densities = [p["density"] for p in params if "density" in p]
    section = dict(options.get("models") or {})
    section["weights"] = weights
    if densities:
        if not isinstance(top.get("density", 1.0), float):
            raise RaotError("parameters: density varies by layer but a model sets its own density; give one kind")
        section["densities"] = [p.get("density", top.get("density", 1.0)) for p in params]
    config = {**options, "merge_rule": method, "models": section}
    if layered:
        mergekit = dict(options.get("mergekit") or {})
        mergekit.update({_MERGEKIT_PARAMETERS[k]: v for k, v in top.items() if k in _MERGEKIT_PARAMETERS})
        config["mergekit"] = mergekit
    else:
        rules = dict(options.get("base_rules") or {})
        if "lambda" in top:
            rules["task_scale"] = top["lambda"]
        if "density" in top:
            rules["density"] = top["density"]
        if rules:
            config["base_rules"] = rules
    if data.get("dtype") is not None:
        if str(data["dtype"]) not in _DTYPES:
            raise RaotError(f"dtype: {data['dtype']!r} is not supported; choose one of: {', '.join(sorted(_DTYPES))}")
        config["dtype"] = _DTYPES[str(data["dtype"])]
    return MergeFile(models, base, RaotConfig.from_dict(config), layer_range)


def model_layers(model: str) -> int | None:
    """The number of layers a checkpoint's config.json declares (None when unknown or unreadable)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except Exception:  # noqa: BLE001 - the merge itself reports an unreadable model
        return None
    config = getattr(config, "text_config", None) or config
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


def check_layer_range(merge_file: MergeFile) -> None:
    """Refuse a ``slices:`` layer range that does not cover every layer of every model."""
    if merge_file.layer_range is None:
        return
    start, end = merge_file.layer_range
    for model in [*merge_file.models, *([merge_file.base] if merge_file.base else [])]:
        layers = model_layers(model)
        if layers is not None and layers != end:
            raise RaotError(
                f"slices: layer_range [{start}, {end}] but {model} has {layers} layers: a partial range is a "
                f"frankenmerge; use layer_range: [0, {layers}] for every source"
            )


def load_merge_file(path: str | Path) -> MergeFile:
    """Read and check the merge file at ``path`` (YAML or JSON)."""
    path = Path(path)
    if not path.is_file():
        raise RaotError(f"--config {path} does not exist; pass a merge file (YAML) or a RaotConfig JSON")
    data = parse_text(path.read_text(encoding="utf-8"), str(path))
    if not looks_like_merge_file(data):
        raise RaotError(f"--config {path} names no models: or merge_method:; it is not a merge file")
    merge_file = read_merge_file(data)
    check_layer_range(merge_file)
    return merge_file


__all__ = ["MergeFile", "check_layer_range", "load_merge_file", "looks_like_merge_file", "read_merge_file"]
