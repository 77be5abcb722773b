"""Loading the two parents: safetensors only unless pickle is allowed, no remote code unless
asked, and every incompatibility caught from the configs before weights are read."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from raot_hf.adapters import get_adapter, supported_model_types
from raot_hf.errors import RaotError

logger = logging.getLogger("raot_hf.loading")

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSource:
    """Where a parent comes from."""

    name_or_path: str
    revision: str | None = None
    token: str | bool | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False

    @property
    def is_local(self) -> bool:
        return Path(self.name_or_path).is_dir()

    def describe(self) -> dict[str, Any]:
        return {"id": str(self.name_or_path), "revision": self.revision, "local": self.is_local}


def load_config(source: ModelSource, label: str):
    """The parent's config, with a one-line error if it cannot be read."""
    path = Path(source.name_or_path)
    if path.exists() and not path.is_dir():
        raise RaotError(f"model {label} ({source.name_or_path}) is a file; pass the directory that holds config.json")
    if source.is_local and not (path / "config.json").is_file():
        raise RaotError(f"model {label} ({source.name_or_path}) has no config.json; pass a save_pretrained directory")
    if source.is_local:
        _check_local_config(path, label)
    try:
        config = transformers.AutoConfig.from_pretrained(
            source.name_or_path,
            revision=source.revision,
            token=source.token,
            trust_remote_code=source.trust_remote_code,
        )
    except (OSError, ValueError, KeyError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "custom code" in msg or "trust_remote_code" in msg:
            raise RaotError(
                f"model {label} ({source.name_or_path}) needs custom code, which is not run by default; "
                f"raot_hf supports only {', '.join(supported_model_types())} — pass --trust-remote-code "
                "(trust_remote_code=True) only if you trust that code"
            ) from None
        raise RaotError(f"cannot read the config of model {label} ({source.name_or_path}): {msg}") from None
    get_adapter(config.model_type)  # an unsupported architecture fails here, before any weights or tokenizers
    if source.is_local:  # pickle-only, missing or corrupt weight files: refused before either parent loads
        _check_local_weights(source, label)
    return config


def _check_local_config(path: Path, label: str) -> None:
    """Read a local config.json as plain JSON (no code runs) and refuse what cannot be merged:
    invalid JSON, no ``model_type``, or a model type without an adapter (e.g. custom code)."""
    import json

    try:
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise RaotError(
            f"model {label} ({path}): config.json is not valid JSON ({reason}); re-save or re-download the model"
        ) from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    supported = ", ".join(supported_model_types())
    if not isinstance(model_type, str) or not model_type:
        raise RaotError(
            f"model {label} ({path}): config.json names no model_type; re-save it with transformers "
            f"(supported: {supported})"
        )
    if model_type not in supported_model_types():
        custom = " and ships custom code (auto_map), which was not run" if data.get("auto_map") else ""
        raise RaotError(
            f"model {label} ({path}) has model type {model_type!r}{custom}; raot_hf has no adapter for it — "
            f"merge checkpoints of a supported type: {supported}"
        )


def _check_local_weights(source: ModelSource, label: str) -> None:
    path = Path(source.name_or_path)
    names = os.listdir(path)
    has_st = any(n.endswith(".safetensors") for n in names)
    has_pickle = any(n.endswith((".bin", ".pt", ".pth", ".ckpt")) for n in names)
    if not has_st and has_pickle and not source.allow_pickle:
        raise RaotError(
            f"model {label} ({path}) has only pickle weights, which can run code when loaded; "
            "convert it to safetensors or pass --allow-pickle if you trust it."
        )
    if not has_st and not has_pickle:
        raise RaotError(f"model {label} ({path}) has no weight files (*.safetensors); pass a complete checkpoint")
    from safetensors import safe_open

    for name in sorted(n for n in names if n.endswith(".safetensors")):
        try:
            with safe_open(str(path / name), framework="pt") as fh:
                fh.keys()
        except Exception as exc:  # safetensors raises its own error type for a bad header
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RaotError(
                f"model {label}: {name} is corrupt or truncated ({reason}); re-download or re-save the checkpoint"
            ) from None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise RaotError(
                f"model {label}: {index.name} is not a valid index (no weight_map); re-save the model"
            ) from None
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise RaotError(f"model {label}: shard {missing[0]} listed in {index.name} is missing; re-download it")


def model_class(config) -> type:
    """The transformers class named by ``config.architectures`` (else the base AutoModel)."""
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModel._model_mapping[type(config)]


def load_model(source: ModelSource, label: str, *, dtype: str = "auto", config=None) -> torch.nn.Module:
    """Load one parent in eval mode (safetensors only unless ``allow_pickle``)."""
    config = config if config is not None else load_config(source, label)
    get_adapter(config.model_type)
    if source.is_local:
        _check_local_weights(source, label)
    cls = model_class(config)
    kwargs: dict[str, Any] = {}
    if dtype != "auto":
        kwargs["dtype"] = _DTYPES[dtype]
    else:
        kwargs["dtype"] = "auto"
    try:
        model = cls.from_pretrained(
            source.name_or_path,
            config=config,
            revision=source.revision,
            token=source.token,
            trust_remote_code=source.trust_remote_code,
            use_safetensors=None if source.allow_pickle else True,
            **kwargs,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RaotError(f"cannot load the weights of model {label} ({source.name_or_path}): {msg}") from None
    model.eval()
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise RaotError(
                f"model {label} has NaN/Inf in {name}; the checkpoint is corrupt — re-train or re-download it"
            )
    return model


def check_compatible(config_a, config_b, *, head_policy: str = "a") -> None:
    """Refuse pairs that cannot be merged, naming the first difference and the fix."""
    if config_a.model_type != config_b.model_type:
        raise RaotError(
            f"A is a {config_a.model_type} model and B a {config_b.model_type} model; "
            "merge two checkpoints of one architecture."
        )
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "type_vocab_size",
        "image_size",
        "patch_size",
        "num_channels",
        "relative_attention",
        "pos_att_type",
        "share_att_key",
        "position_buckets",
        "norm_rel_ebd",
        "position_biased_input",
        "hidden_act",
        "qkv_bias",
    ):
        va, vb = getattr(config_a, key, None), getattr(config_b, key, None)
        if va != vb:
            raise RaotError(f"A and B differ in {key} ({va} vs {vb}); merge two checkpoints of the same shape.")
    arch_a = (getattr(config_a, "architectures", None) or ["?"])[0]
    arch_b = (getattr(config_b, "architectures", None) or ["?"])[0]
    if arch_a != arch_b:
        raise RaotError(f"A is {arch_a} and B is {arch_b}; load both with the same head class.")
    if head_policy == "average":
        la, lb = getattr(config_a, "id2label", None), getattr(config_b, "id2label", None)
        if config_a.num_labels != config_b.num_labels or la != lb:
            raise RaotError(
                f"--head average needs the same label space; A has {config_a.num_labels} labels {la}, "
                f"B has {config_b.num_labels} {lb}; use --head a or --head b."
            )


def load_preprocessor(source: ModelSource):
    """A's tokenizer or image processor (None if the checkpoint ships neither)."""
    for loader in (transformers.AutoTokenizer, transformers.AutoImageProcessor):
        try:
            return loader.from_pretrained(
                source.name_or_path,
                revision=source.revision,
                token=source.token,
                trust_remote_code=source.trust_remote_code,
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return None


def check_tokenizers(pre_a, pre_b) -> None:
    """Text parents must tokenize identically (same vocabulary), or merged embeddings mean nothing."""
    if pre_a is None or pre_b is None:
        return
    vocab_a = getattr(pre_a, "get_vocab", None)
    vocab_b = getattr(pre_b, "get_vocab", None)
    if vocab_a is None or vocab_b is None:
        return
    if vocab_a() != vocab_b():
        raise RaotError("A and B use different tokenizers (vocabularies differ); merge models that share a tokenizer.")
