"""Architecture adapters: a registry from ``config.model_type`` to an :class:`Adapter`.

>>> from raot_hf.adapters import get_adapter, schema_for
>>> schema = schema_for(model)  # doctest: +SKIP
"""

from __future__ import annotations

import torch

from raot_hf.adapters import bert, deberta, gpt2, llama, vit
from raot_hf.adapters.base import Adapter, HeadTemplate, LayerTemplate
from raot_hf.adapters.schema import Fold, HeadReadout, LayerSchema, Member, ModelSchema, Space
from raot_hf.errors import RaotError

_REGISTRY: dict[str, Adapter] = {}


def register_adapter(adapter: Adapter, *, overwrite: bool = False) -> Adapter:
    """Register ``adapter`` for each of its ``model_types``; refuses silent replacement."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"register_adapter expects an Adapter, got {type(adapter).__name__}")
    if adapter.norm not in ("pre", "post"):
        raise ValueError(f"adapter {adapter.name}: norm must be 'pre' or 'post', got {adapter.norm!r}")
    if adapter.norm == "pre" and not adapter.final_norm:
        raise ValueError(f"adapter {adapter.name}: a pre-LN adapter needs final_norm")
    for model_type in adapter.model_types:
        if model_type in _REGISTRY and not overwrite:
            raise ValueError(f"model type {model_type!r} already has adapter {_REGISTRY[model_type].name!r}")
        _REGISTRY[model_type] = adapter
    return adapter


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values that have an adapter."""
    return sorted(_REGISTRY)


def get_adapter(model_type: str) -> Adapter:
    """The adapter for ``model_type``; the error lists the supported types."""
    if model_type not in _REGISTRY:
        raise RaotError(
            f"model type {model_type!r} has no raot_hf adapter; supported: {', '.join(supported_model_types())}."
        )
    return _REGISTRY[model_type]


def is_decoder(model_type: str) -> bool:
    """Whether ``model_type``'s adapter is a causal decoder (False for unsupported types)."""
    return model_type in _REGISTRY and _REGISTRY[model_type].decoder


def modality_of(model_type: str) -> str:
    """What ``model_type`` reads — ``"text"`` or ``"image"`` (text for unsupported types)."""
    return _REGISTRY[model_type].modality if model_type in _REGISTRY else "text"


def schema_for(model: torch.nn.Module) -> ModelSchema:
    """Resolve ``model`` (a loaded transformers model) onto the common schema."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise RaotError(f"{type(model).__name__} is not a transformers model (no config.model_type).")
    return get_adapter(config.model_type).build_schema(model)


for _adapter in (*bert.ADAPTERS, *deberta.ADAPTERS, *vit.ADAPTERS, *gpt2.ADAPTERS, *llama.ADAPTERS):
    register_adapter(_adapter)

__all__ = [
    "Adapter",
    "Fold",
    "HeadReadout",
    "HeadTemplate",
    "LayerSchema",
    "LayerTemplate",
    "Member",
    "ModelSchema",
    "Space",
    "get_adapter",
    "is_decoder",
    "modality_of",
    "register_adapter",
    "schema_for",
    "supported_model_types",
]
