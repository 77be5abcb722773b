"""Loading the two parents: safetensors only unless pickle is allowed, no remote code unless
asked, and every incompatibility caught from the configs before weights are read."""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from raot_hf.adapters import compatibility_keys, get_adapter, is_decoder, supported_model_types
from raot_hf.errors import RaotError

logger = logging.getLogger("raot_hf.io.loading")

#: The dtypes a merge may load in, by the names the options use.
LOAD_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    adapter = get_adapter(config.model_type)  # an unsupported architecture fails here, before any weights
    if is_decoder(config.model_type) and adapter.check_config is not None:
        adapter.check_config(config)  # decoder layouts the schema cannot describe (§8), also before weights
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


def meta_model(config) -> torch.nn.Module:
    """The model ``config`` describes on the meta device: its parameter names and shapes, no memory."""
    with torch.device("meta"):
        return model_class(config)._from_config(config)


def load_model_checks(source: ModelSource, label: str, config) -> None:
    """What :func:`load_model` checks before reading weights: a supported architecture and, for a
    local directory, weights it may read."""
    get_adapter(config.model_type)
    if source.is_local:
        _check_local_weights(source, label)


def load_model(source: ModelSource, label: str, *, dtype: str = "auto", config=None) -> torch.nn.Module:
    """Load one parent in eval mode (safetensors only unless ``allow_pickle``)."""
    config = config if config is not None else load_config(source, label)
    load_model_checks(source, label, config)
    return _load_weights(model_class(config), source, label, dtype=dtype, config=config)[0]


def _load_weights(cls: type, source: ModelSource, label: str, *, dtype: str, config) -> tuple[torch.nn.Module, dict]:
    """``cls.from_pretrained`` in eval mode with a one-line error; returns the model and its loading info."""
    kwargs: dict[str, Any] = {}
    if dtype != "auto":
        kwargs["dtype"] = LOAD_DTYPES[dtype]
    else:
        kwargs["dtype"] = "auto"
    try:
        model, info = cls.from_pretrained(
            source.name_or_path,
            config=config,
            revision=source.revision,
            token=source.token,
            trust_remote_code=source.trust_remote_code,
            use_safetensors=None if source.allow_pickle else True,
            output_loading_info=True,
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
    return model, info


#: Config fields that fix the trunk's parameter shapes and function; A, B and a base must agree on them.
_SHAPE_KEYS = (
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
)


# Decoders (docs/design.md §8): what fixes the KV sharing of the heads, RoPE and the attention pattern.
_DECODER_KEYS = (
    "num_key_value_heads",
    "head_dim",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "n_inner",
    "activation_function",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn",
)


def _kind(model_type: str) -> str:
    return "a decoder" if is_decoder(model_type) else "an encoder"


def check_compatible(config_a, config_b, *, head_policy: str = "a") -> None:
    """Refuse pairs that cannot be merged, naming the first difference and the fix."""
    if config_a.model_type != config_b.model_type:
        kind_a, kind_b = _kind(config_a.model_type), _kind(config_b.model_type)
        detail = f" ({kind_a} and {kind_b})" if kind_a != kind_b else ""
        raise RaotError(
            f"A is a {config_a.model_type} model and B a {config_b.model_type} model{detail}; "
            "merge two checkpoints of one architecture."
        )
    decoder = is_decoder(config_a.model_type)
    # beyond the shape keys, the fields a family's function depends on (its spec's ``compatible_keys``)
    for key in _SHAPE_KEYS + (_DECODER_KEYS if decoder else ()) + compatibility_keys(config_a.model_type):
        va, vb = getattr(config_a, key, None), getattr(config_b, key, None)
        if va != vb:
            raise RaotError(f"A and B differ in {key} ({va} vs {vb}); merge two checkpoints of the same shape.")
    arch_a = (getattr(config_a, "architectures", None) or ["?"])[0]
    arch_b = (getattr(config_b, "architectures", None) or ["?"])[0]
    if arch_a != arch_b:
        raise RaotError(f"A is {arch_a} and B is {arch_b}; load both with the same head class.")
    _check_heads(config_a, config_b, arch_a, head_policy)


# Config fields that describe a task head rather than the trunk: the label space, and what
# shapes or drives the modules outside the base model (DeBERTa's pooler sits there). With
# head="b" the output takes B's values of these with B's head tensors (docs/design.md §6).
LABEL_KEYS = ("id2label", "label2id", "problem_type")
HEAD_MODULE_KEYS = ("pooler_hidden_size", "pooler_hidden_act", "pooler_dropout", "cls_dropout", "classifier_dropout")


def _check_heads(config_a, config_b, arch: str, head_policy: str) -> None:
    """Refuse head combinations that cannot be written, from the configs alone."""
    if head_policy == "average":
        la, lb = getattr(config_a, "id2label", None), getattr(config_b, "id2label", None)
        if config_a.num_labels != config_b.num_labels or la != lb:
            raise RaotError(
                f"--head average needs the same label space; A has {config_a.num_labels} labels {la}, "
                f"B has {config_b.num_labels} {lb}; use --head a or --head b."
            )
    # ViT/DeiT build no classifier at all for num_labels=0: the heads then hold different parameters
    if arch.endswith("ForImageClassification") and (config_a.num_labels == 0) != (config_b.num_labels == 0):
        raise RaotError(
            f"{arch} A has {config_a.num_labels} labels and B {config_b.num_labels}: one of them has no classifier "
            "(num_labels=0), so their heads hold different parameters; merge two classifiers, or two models "
            "without one."
        )


def adopt_head(model: torch.nn.Module, donor: torch.nn.Module, head_params: list[str] | tuple[str, ...]) -> None:
    """Give ``model`` (A, receiving the merge) ``donor``'s (B′) label space, head module fields and
    head parameter shapes for ``head="b"``; the values are loaded afterwards."""
    target, source = model.config, donor.config
    for key in (*LABEL_KEYS, *HEAD_MODULE_KEYS):
        if hasattr(source, key):
            value = getattr(source, key)
            setattr(target, key, copy.deepcopy(value))
    if hasattr(model, "num_labels"):  # the task classes keep their own copy for the loss
        model.num_labels = source.num_labels
    donor_params = dict(donor.named_parameters())
    for name, param in list(model.named_parameters()):
        if name not in head_params or donor_params[name].shape == param.shape:
            continue
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        module.register_parameter(leaf, torch.nn.Parameter(donor_params[name].detach().to(param.dtype, copy=True)))
        if isinstance(module, torch.nn.Linear):
            module.out_features, module.in_features = module.weight.shape
    logger.info(
        "head from B′: %d labels %s, problem_type %s",
        source.num_labels,
        getattr(source, "id2label", None),
        getattr(source, "problem_type", None),
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


# ------------------------------------------------------------------------------- the base model


def check_base_compatible(config_a, config_base) -> None:
    """Refuse a base of another architecture or shape than A (read from the configs, before any
    weights load). Its head class and label space may differ: the base's head is never read."""
    if config_a.model_type != config_base.model_type:
        raise RaotError(
            f"A is a {config_a.model_type} model but the base a {config_base.model_type} model; "
            "pass the checkpoint A and B were fine-tuned from as --base."
        )
    for key in _SHAPE_KEYS:
        va, vb = getattr(config_a, key, None), getattr(config_base, key, None)
        if va != vb:
            raise RaotError(
                f"A and the base differ in {key} ({va} vs {vb}); pass the checkpoint A and B were fine-tuned from."
            )


def check_base_tokenizer(pre_a, pre_base) -> None:
    """A base with a tokenizer of A's size must share A's vocabulary. (A checkpoint without
    tokenizer files yields a vocabulary of special tokens only: that one is not compared.)"""
    vocab_a, vocab_base = getattr(pre_a, "get_vocab", None), getattr(pre_base, "get_vocab", None)
    if vocab_a is None or vocab_base is None:
        return
    words_a, words_base = vocab_a(), vocab_base()
    if len(words_a) == len(words_base) and words_a != words_base:
        raise RaotError("A and the base use different tokenizers (vocabularies differ); pass the base A was tuned from")


def load_base_model(source: ModelSource, config_a, *, dtype: str = "auto", config=None):
    """The base, loaded with A's class so that its parameters carry A's names, and the names of A's
    parameters the checkpoint does not hold (initialised at random: they have no base value)."""
    config = config if config is not None else load_config(source, "base")
    check_base_compatible(config_a, config)
    if source.is_local:
        _check_local_weights(source, "base")
    model, info = _load_weights(model_class(config_a), source, "base", dtype=dtype, config=config)
    missing = sorted(set(info.get("missing_keys") or ()) & {name for name, _ in model.named_parameters()})
    return model, missing
