"""Rule parameters that vary over the layers or by module, as mergekit's merge files write them
(docs/design.md §6.10).

A setting is one of

* a number (or a boolean): the same everywhere;
* a list of numbers, a *gradient*: the values are spread evenly over the layers — layer ``i`` of
  ``L`` sits at position ``p = i/(L − 1)`` (``p = 1`` when ``L = 1``) and takes the list linearly
  interpolated at ``p·(len − 1)``; tensors outside the layers (embeddings, final norm, head) sit
  at ``p = 0`` and take the first value;
* a mapping ``{substring: setting, ..., "default": setting}``: the first substring found in the
  tensor's name chooses (in order; ``"*"`` matches every name), else ``default``; mergekit's list
  of ``{filter, value}`` entries reads into it (the entry without a filter is the default).

>>> evaluate_setting([0.0, 1.0], "model.layers.1.mlp.up_proj.weight", layer_count=3)
0.5
>>> evaluate_setting({"mlp": 1.0, "default": 0.5}, "model.layers.0.self_attn.q_proj.weight", layer_count=2)
0.5
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from raot_hf.errors import RaotError

#: The key of a mapping setting that applies where no substring matches.
DEFAULT_KEY = "default"
#: ``<stack>.<index>.`` in a parameter name: the index of a layer of the model's stack.
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")

Setting = Any  # float | bool | list[float] | dict[str, float | bool | list[float]]


def layer_index(name: str) -> int | None:
    """The index of the layer ``name`` belongs to (``model.layers.3.mlp…`` → 3); None outside the layers."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def count_layers(names: Iterable[str]) -> int:
    """The number of layers the parameter ``names`` span (the largest index plus one; 0 if none)."""
    indices = [i for i in map(layer_index, names) if i is not None]
    return max(indices) + 1 if indices else 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_plain(name: str, value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if _is_number(value):
        return float(value)
    if isinstance(value, (list, tuple)) and value and all(_is_number(v) for v in value):
        return [float(v) for v in value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, bool) for v in value):
        return list(value)  # switches by layer: each layer takes the nearest entry below its position
    raise RaotError(
        f"{name}={value!r} must be a number, a per-layer list of numbers or filters "
        "(e.g. {self_attn: [0, 1], mlp: [1, 0], default: 0.5})"
    )


def check_setting(name: str, value: Any) -> Setting:
    """``value`` as a setting (numbers as floats, tuples as lists); None stays None. A mergekit
    list of ``{filter, value}`` entries becomes the mapping; entries after the one without a
    filter are never reached (mergekit takes the first match) and are dropped."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_setting(name, value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
        value = filters_to_mapping(name, value)
    if isinstance(value, dict):
        if not value:
            raise RaotError(f"{name}={{}} chooses nothing; give filters with values and a default")
        return {str(k): _check_plain(f"{name}[{k}]", v) for k, v in value.items()}
    return _check_plain(name, value)


def filters_to_mapping(name: str, entries: list[dict]) -> dict[str, Any]:
    """mergekit's ``[{filter: s, value: v}, ..., {value: d}]`` as ``{s: v, ..., "default": d}``."""
    out: dict[str, Any] = {}
    for i, entry in enumerate(entries, start=1):
        unknown = sorted(set(entry) - {"filter", "value"})
        if unknown or "value" not in entry:
            raise RaotError(
                f"{name} entry {i} must be {{filter: <substring>, value: ...}} (or only value: the default)"
            )
        key = entry.get("filter")
        if key is None:
            out[DEFAULT_KEY] = entry["value"]
            break
        out[str(key)] = entry["value"]
    return out


def parse_setting(name: str, text: str) -> Setting:
    """The command line's form: ``0.5``, ``0,0.5,1`` (a gradient) or
    ``self_attn=0,0.5,1;mlp=1,0.5,0;default=0.5`` (filters, in order)."""

    def numbers(part: str) -> Any:
        if part.strip().lower() in ("true", "false"):
            return part.strip().lower() == "true"
        try:
            values = [float(v) for v in part.split(",") if v.strip()]
        except ValueError:
            raise RaotError(
                f"{name}={text!r} must be a number, a comma list (0,0.5,1) or filters (self_attn=0,1;default=0.5)"
            ) from None
        return values[0] if len(values) == 1 and "," not in part else values

    if "=" in text:
        pairs = [p.split("=", 1) for p in text.split(";") if p.strip()]
        if any(len(p) != 2 for p in pairs):
            raise RaotError(f"{name}={text!r}: write filters as self_attn=0,1;mlp=1,0;default=0.5")
        return check_setting(name, {k.strip(): numbers(v) for k, v in pairs})
    return check_setting(name, numbers(text))


def _at(value: Any, position: float) -> Any:
    """A plain setting at ``position`` in [0, 1] (mergekit's gradient interpolation; a list of
    switches takes the entry at ``int(position·(len − 1))``)."""
    if not isinstance(value, list):
        return value
    if all(isinstance(v, bool) for v in value):
        return value[int(position * (len(value) - 1))]
    scaled = position * (len(value) - 1)
    low = int(scaled)
    high = min(len(value) - 1, low + 1)
    frac = scaled - low
    return (1.0 - frac) * value[low] + frac * value[high]


def layer_position(name: str, layer_count: int) -> float:
    """Where tensor ``name`` sits on a gradient of a model with ``layer_count`` layers: layer i at
    ``i/(L − 1)`` (1 when L = 1), anything outside the layers at 0."""
    index = layer_index(name)
    if index is None or layer_count <= 0:
        return 0.0  # outside the layers: mergekit plans embeddings, the final norm and the head at 0
    return index / (layer_count - 1) if layer_count > 1 else 1.0


def evaluate_setting(value: Setting, name: str, layer_count: int) -> Any:
    """The setting's value for the tensor ``name`` of a model with ``layer_count`` layers (None:
    a mapping with no matching filter and no default)."""
    return setting_at_position(value, name, layer_position(name, layer_count))


def setting_at_position(value: Setting, name: str, position: float) -> Any:
    """The setting's value for the tensor ``name`` at gradient ``position`` in [0, 1] (None: a
    mapping with no matching filter and no default)."""
    if isinstance(value, dict):
        for key, chosen in value.items():
            if key != DEFAULT_KEY and (key == "*" or key in name):
                return _at(chosen, position)
        return _at(value[DEFAULT_KEY], position) if DEFAULT_KEY in value else None
    return _at(value, position)


def first_setting(levels: Iterable[Mapping[str, Setting]], key: str, name: str, position: float) -> Any:
    """``key``'s value for tensor ``name`` from the first of ``levels`` (most specific first) that
    gives one: a level whose filters match nothing, and has no default, passes to the next, as in
    mergekit. None when no level gives one."""
    for level in levels:
        if key in level and level[key] is not None:
            value = setting_at_position(level[key], name, position)
            if value is not None:
                return value
    return None


def with_layer(name: str, index: int) -> str:
    """``name`` with its layer index replaced by ``index`` (``model.layers.3.mlp…`` → ``model.layers.<index>.mlp…``)."""
    match = _LAYER.search(name)
    if match is None:
        return name
    return f"{name[: match.start(1)]}{index}{name[match.end(1) :]}"
