"""Llama, Mistral and Qwen2: pre-RMSNorm decoders with RoPE, grouped-query attention and a
SwiGLU MLP (docs/design.md §8).

Unlike the encoders': Q/K maps are restricted to rotary pairs (``qk_structure="rope"``), KV heads
get their own spaces (``layers.i.k`` / ``layers.i.v``), the stream admits all of O(d) once every
RMSNorm is folded (``exact="orthogonal"``), and a tied ``lm_head`` keeps the final norm unfolded
(residual permutations only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raot_hf.adapters.base import Adapter, HeadTemplate, LayerTemplate, ParameterSet
from raot_hf.adapters.schema import Fold, HeadReadout, LayerSchema, ModelSchema, Space
from raot_hf.errors import RaotError

LLAMA_LAYER = LayerTemplate(
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o="self_attn.o_proj",
    fc1="mlp.up_proj",
    fc2="mlp.down_proj",
    norm_attn="input_layernorm",
    norm_mlp="post_attention_layernorm",
)

TIED_NOTE = (
    "tied lm_head: the final RMSNorm weight cannot be folded into it without untying the embeddings, "
    "so the residual stream is aligned by permutations only (rotations are refused)"
)


def check_rope_config(config) -> None:
    """Refuse layouts the RoPE schema does not describe, before any weights load."""
    d, H = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or H
    h = getattr(config, "head_dim", None) or d // H
    if H % kv:
        raise RaotError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {kv}; not a GQA layout.")
    if H * h != d:
        raise RaotError(
            f"{config.model_type} with num_attention_heads·head_dim = {H * h} != hidden_size {d} is not supported; "
            "use a checkpoint whose heads tile the hidden size."
        )
    if h % 2:
        raise RaotError(f"head_dim {h} is odd; RoPE pairs dims i and i + head_dim/2, so it must be even.")
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) if rope else 1.0
    if factor not in (None, 1, 1.0):
        raise RaotError(f"partial_rotary_factor={factor} is not supported; use a checkpoint with full rotary heads.")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        raise RaotError("pretraining_tp > 1 (sliced projections) is not supported; set config.pretraining_tp = 1.")


def decoder_layers(build_layer, ps: ParameterSet, prefix: str, num_layers: int, config, residual: Space):
    """Every layer's spaces (by name), schemas and folds, from ``build_layer(ps, prefix, i, config, residual)``."""
    spaces: dict[str, Space] = {}
    layers: list[LayerSchema] = []
    folds: list[Fold] = []
    for i in range(num_layers):
        layer_spaces, layer_folds, layer = build_layer(ps, f"{prefix}.{i}.", i, config, residual)
        spaces.update({s.name: s for s in layer_spaces})
        folds += layer_folds
        layers.append(layer)
    return spaces, layers, folds


def decoder_schema(
    model: torch.nn.Module,
    ps: ParameterSet,
    base: str,
    trunk: tuple[dict[str, Space], list[LayerSchema], list[Fold]],
    *,
    stream_start: str,
    trunk_only: bool,
    **fields,
) -> ModelSchema:
    """The :class:`ModelSchema` of a pre-norm causal decoder from its ``trunk`` (spaces, layers and
    folds, as :func:`decoder_layers` returns them, completed), whose parameters start with ``base``
    (empty for a bare base model): the stream runs from ``stream_start`` through every layer's
    output; unless ``trunk_only``, the parameters outside the trunk are the head's. ``fields``: the
    architecture's further schema fields (``intermediate_size``, ``notes``, ...)."""
    spaces, layers, folds = trunk
    config = model.config
    d, H = config.hidden_size, config.num_attention_heads
    is_base = base == ""
    return ModelSchema(
        model_type=config.model_type,
        architecture=type(model).__name__,
        norm="pre",
        num_layers=config.num_hidden_layers,
        hidden_size=d,
        num_heads=H,
        head_size=d // H,
        spaces=spaces,
        layers=layers,
        stream_modules=[stream_start] + [lay.module for lay in layers],
        folds=folds,
        head_params=[] if trunk_only else sorted(n for n in ps.params if not n.startswith(base)),
        output_in_stream=is_base,
        causal=True,
        **fields,
    )


@dataclass(frozen=True)
class RopeDecoderAdapter(Adapter):
    """Weight names of a Llama-style decoder; :meth:`build_schema` resolves them (docs/design.md §8)."""

    gate: str = "mlp.gate_proj"
    embedding: str = "embed_tokens"

    def build_schema(self, model: torch.nn.Module) -> ModelSchema:
        config = model.config
        check_rope_config(config)
        suffix, head = self.head_for(model)
        ps = ParameterSet(model, self.name)
        is_base = getattr(model, "base_model", model) is model
        if suffix == "Model" and not is_base:
            raise RaotError(f"{type(model).__name__} is not supported; use one of {', '.join(sorted(self.heads))}.")
        base = "" if is_base else f"{self.base_prefix}."
        d, H, L = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
        kv = getattr(config, "num_key_value_heads", None) or H
        residual = Space("residual", "residual", d)
        ps.add(residual, f"{base}{self.embedding}.weight", 1, True, "writer")
        trunk = decoder_layers(self._layer, ps, f"{base}{self.layers}", L, config, residual)
        spaces, _, folds = trunk  # the residual space and the final fold join below
        final_readers = []
        for mod in head.stream_readers:
            if f"{mod}.weight" in ps:
                w, b = ps.linear(mod)
                ps.add(residual, w, 1, False, "head_reader")
                final_readers.append((w, b))
        final = f"{base}{self.final_norm}.weight"
        ps.add(residual, final, 0, True, "norm")
        tied = suffix == "ForCausalLM" and "lm_head.weight" not in ps
        if final_readers and not tied:
            folds.append(Fold(final, None, tuple(final_readers)))
        residual.exact = "orthogonal" if final_readers and not tied else "permutation"
        spaces["residual"] = residual
        # the LM head shares the vocabulary (checked): it is merged with the trunk, not by head policy
        trunk_only = is_base or suffix == "ForCausalLM"
        return decoder_schema(
            model,
            ps,
            base,
            trunk,
            stream_start=f"{base}{self.embedding}",
            trunk_only=trunk_only,
            intermediate_size=config.intermediate_size,
            notes=[TIED_NOTE] if tied else [],
            num_kv_heads=kv,
            qk_structure="rope",
            stream_centered=False,
            norm_dtype="float32",
        )

    def _layer(self, ps: ParameterSet, p: str, i: int, config, residual: Space):
        """One decoder layer's spaces (queries, keys, outputs, values, MLP units), its two
        RMSNorm folds and its hook names; stream members are added to ``residual``."""
        t, H, f = self.layer, config.num_attention_heads, config.intermediate_size
        kv = getattr(config, "num_key_value_heads", None) or H
        h = config.hidden_size // H
        qk = Space(f"layers.{i}.qk", "qk", H * h, layer=i)  # query rows (covariant)
        k = Space(f"layers.{i}.k", "qk", kv * h, layer=i)  # key rows (contravariant)
        vo = Space(f"layers.{i}.vo", "vo", H * h, layer=i)  # o_proj columns, per query head
        v = Space(f"layers.{i}.v", "vo", kv * h, layer=i)  # value rows, per KV head
        mlp = Space(f"layers.{i}.mlp", "mlp", f, exact="permutation", layer=i)
        attn_readers, mlp_readers = [], []
        for mod, space, cov, role in ((t.q, qk, True, "q"), (t.k, k, False, "k"), (t.v, v, True, "v")):
            w, b = ps.linear(p + mod)
            ps.add(space, w, 0, cov, role)
            ps.add(space, b, 0, cov, role)
            ps.add(residual, w, 1, False, "reader")
            attn_readers.append((w, b))
        for mod in (self.gate, t.fc1):  # SwiGLU: gate and up rows move together
            w, b = ps.linear(p + mod)
            ps.add(mlp, w, 0, True, "fc1")
            ps.add(mlp, b, 0, True, "fc1")
            ps.add(residual, w, 1, False, "reader")
            mlp_readers.append((w, b))
        for mod, space in ((t.o, vo), (t.fc2, mlp)):
            w, b = ps.linear(p + mod)
            ps.add(space, w, 1, False, "o" if space is vo else "fc2")
            ps.add(residual, w, 0, True, "writer")
            ps.add(residual, b, 0, True, "writer")
        folds = []
        for norm, readers in ((t.norm_attn, attn_readers), (t.norm_mlp, mlp_readers)):
            ps.add(residual, f"{p}{norm}.weight", 0, True, "norm")
            folds.append(Fold(f"{p}{norm}.weight", None, tuple(readers)))
        # keys are observed per query head (each query head's KV head repeated), §8
        k_index = tuple((j // (H // kv)) * h + c for j in range(H) for c in range(h)) if kv != H else None
        readout = HeadReadout(p + t.q, p + t.q, p + t.k, k_index=k_index)
        linears = tuple(p + m for m in (t.q, t.k, t.v, t.o, self.gate, t.fc1, t.fc2))
        layer = LayerSchema(i, readout, p + t.o, p + t.fc2, linears, module=p.rstrip("."))
        return (qk, k, vo, v, mlp), folds, layer


_HEADS = {
    "Model": HeadTemplate(reads_final_norm=False),
    "ForCausalLM": HeadTemplate(stream_readers=("lm_head",)),
    "ForSequenceClassification": HeadTemplate(stream_readers=("score",)),
}


def _adapter(name: str) -> RopeDecoderAdapter:
    return RopeDecoderAdapter(
        name=name,
        model_types=(name,),
        norm="pre",
        base_prefix="model",
        layers="layers",
        layer=LLAMA_LAYER,
        embedding_writers=(),
        final_norm="norm",
        heads=_HEADS,
        check_config=check_rope_config,
        decoder=True,
    )


LLAMA, MISTRAL, QWEN2 = _adapter("llama"), _adapter("mistral"), _adapter("qwen2")
ADAPTERS = (LLAMA, MISTRAL, QWEN2)
