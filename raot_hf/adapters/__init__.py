"""Architecture families as data: a registry from ``config.model_type`` to a
:class:`~raot_hf.adapters.spec.FamilySpec` (docs/design.md §2). The built-in families are the JSON
files of ``raot_hf/adapters/families/``, one per family; :func:`register_adapter` adds another.

>>> from raot_hf.adapters import get_adapter, schema_for
>>> schema = schema_for(model)  # doctest: +SKIP
"""

from __future__ import annotations

import json
from importlib import resources

import torch

from raot_hf.adapters import resolve
from raot_hf.adapters.schema import Fold, HeadReadout, LayerSchema, Member, ModelSchema, Space
from raot_hf.adapters.spec import (
    AttentionSpec,
    ConfigCheck,
    ConfigKeys,
    DualEncoderSpec,
    EmbeddingSpec,
    FamilySpec,
    HeadSpec,
    MLPSpec,
    NormSpec,
    PositionSpec,
    merged,
)
from raot_hf.errors import RaotError
from raot_hf.registry import Registry, registry

#: The name the rest of the package (and earlier versions) gives a family's description.
Adapter = FamilySpec

#: The families by the ``config.model_type`` they serve.
_REGISTRY: Registry[FamilySpec] = registry("model type")


def register_adapter(adapter: FamilySpec, *, overwrite: bool = False) -> FamilySpec:
    """Register ``adapter`` (a validated :class:`FamilySpec`) for each of its ``model_types``;
    refuses silent replacement (``overwrite``: replace the family of a type already served)."""
    if not isinstance(adapter, FamilySpec):
        raise TypeError(f"register_adapter expects a FamilySpec, got {type(adapter).__name__}")
    adapter.validate()
    return _register_types(_REGISTRY, adapter, overwrite)


def _register_types(where: Registry, entry, overwrite: bool):
    """Register ``entry`` in ``where`` for each of its ``model_types``: all checked before any is added."""
    for model_type in entry.model_types:
        if model_type in where and overwrite:
            where.unregister(model_type)
        where.check_free(model_type)
    for model_type in entry.model_types:
        where.register(model_type, entry)
    return entry


def load_family(data: dict, known: dict[str, dict] | None = None) -> FamilySpec:
    """A family from its JSON data; ``"extends": name`` starts from the family ``name`` of
    ``known`` (raw data by family name) or of the registry."""
    data = dict(data)
    parent = data.pop("extends", None)
    if parent is not None:
        if known is not None and parent in known:
            base = _raw_family(known[parent], known)
        else:
            registered = {spec.name: spec for _, spec in _REGISTRY.items()}
            if parent not in registered:
                raise ValueError(f"family {data.get('name')!r} extends unknown family {parent!r}")
            base = registered[parent].to_dict()
        data = merged(base, data)
    return FamilySpec.from_dict(data)


def _raw_family(data: dict, known: dict[str, dict]) -> dict:
    """``data`` with its ``extends`` chain resolved (plain JSON data)."""
    data = dict(data)
    parent = data.pop("extends", None)
    return data if parent is None else merged(_raw_family(known[parent], known), data)


def builtin_families() -> list[FamilySpec]:
    """The families shipped with the package (``raot_hf/adapters/families/*.json``), by file name."""
    folder = resources.files("raot_hf.adapters") / "families"
    raw = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            data = json.loads(entry.read_text(encoding="utf-8"))
            raw[data["name"]] = data
    return [load_family(data, raw) for data in raw.values()]


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values that have an adapter."""
    return sorted(_REGISTRY)


def get_adapter(model_type: str) -> FamilySpec:
    """The family of ``model_type``; the error lists the supported types."""
    if model_type not in _REGISTRY:
        raise RaotError(
            f"model type {model_type!r} has no raot_hf adapter; supported: {', '.join(supported_model_types())}."
        )
    return _REGISTRY.get(model_type)


def is_decoder(model_type: str) -> bool:
    """Whether ``model_type``'s family is a causal decoder (False for unsupported types)."""
    return model_type in _REGISTRY and _REGISTRY.get(model_type).decoder


def modality_of(model_type: str) -> str:
    """What ``model_type`` reads — ``"text"`` or ``"image"`` (text for unsupported types)."""
    return _REGISTRY.get(model_type).modality if model_type in _REGISTRY else "text"


def compatibility_keys(model_type: str) -> tuple[str, ...]:
    """Config fields two parents of ``model_type`` must share beyond the shape keys (its family's)."""
    return _REGISTRY.get(model_type).compatible_keys if model_type in _REGISTRY else ()


def schema_for(model: torch.nn.Module) -> ModelSchema:
    """Resolve ``model`` (a loaded transformers model) onto the common schema."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise RaotError(f"{type(model).__name__} is not a transformers model (no config.model_type).")
    return resolve.build_schema(get_adapter(config.model_type), model)


for _family in builtin_families():
    register_adapter(_family)


# -- two-tower models (docs/design.md §11) ------------------------------------------------------------
_DUAL: Registry[DualEncoderSpec] = registry("two-tower model type")


def register_dual_encoder(spec: DualEncoderSpec, *, overwrite: bool = False) -> DualEncoderSpec:
    """Register a two-tower model for each of its ``model_types`` (its towers' families must be
    registered); refuses silent replacement."""
    if not isinstance(spec, DualEncoderSpec):
        raise TypeError(f"register_dual_encoder expects a DualEncoderSpec, got {type(spec).__name__}")
    families = {f.name for _, f in _REGISTRY.items()}
    missing = [t.family for t in spec.validate().towers if t.family not in families]
    if missing:
        raise ValueError(f"dual encoder {spec.name!r}: tower families {missing} are not registered")
    return _register_types(_DUAL, spec, overwrite)


def is_dual_encoder(model_type: str) -> bool:
    """Whether ``model_type`` is a registered two-tower model (CLIP, SigLIP)."""
    return model_type in _DUAL


def get_dual_encoder(model_type: str) -> DualEncoderSpec:
    return _DUAL.get(model_type)


def tower_family(spec: DualEncoderSpec, tower) -> FamilySpec:
    """The family of one tower of ``spec``."""
    return next(f for _, f in _REGISTRY.items() if f.name == tower.family)


def builtin_dual_encoders() -> list[DualEncoderSpec]:
    """The two-tower models shipped with the package (``raot_hf/adapters/dual/*.json``), by file name."""
    folder = resources.files("raot_hf.adapters") / "dual"
    return [
        DualEncoderSpec.from_dict(json.loads(entry.read_text(encoding="utf-8")))
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".json")
    ]


for _dual in builtin_dual_encoders():
    register_dual_encoder(_dual)

__all__ = [
    "Adapter",
    "AttentionSpec",
    "ConfigCheck",
    "ConfigKeys",
    "DualEncoderSpec",
    "EmbeddingSpec",
    "FamilySpec",
    "Fold",
    "HeadReadout",
    "HeadSpec",
    "LayerSchema",
    "MLPSpec",
    "Member",
    "ModelSchema",
    "NormSpec",
    "PositionSpec",
    "Space",
    "builtin_dual_encoders",
    "builtin_families",
    "compatibility_keys",
    "get_adapter",
    "get_dual_encoder",
    "is_dual_encoder",
    "register_dual_encoder",
    "tower_family",
    "is_decoder",
    "load_family",
    "modality_of",
    "register_adapter",
    "schema_for",
    "supported_model_types",
]
