"""Architectures described as data: one :class:`Adapter` per family (docs/design.md §2).

An adapter holds weight-name templates for the embeddings, one encoder layer and the task
heads; :meth:`Adapter.build_schema` resolves them against a loaded model's parameters and
returns the :class:`~raot_hf.adapters.schema.ModelSchema` every later stage works from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from raot_hf.adapters.schema import (
    Fold,
    HeadReadout,
    LayerSchema,
    Member,
    ModelSchema,
    Space,
    head_index,
)
from raot_hf.errors import RaotError


@dataclass(frozen=True)
class LayerTemplate:
    """Module names inside one encoder layer (relative to the layer's own prefix)."""

    q: str
    k: str
    v: str
    o: str
    fc1: str
    fc2: str
    norm_attn: str  # post-LN: after the attention residual; pre-LN: before attention
    norm_mlp: str
    fused_qkv: str | None = None  # DeBERTa v1: q, k, v interleaved per head in one Linear
    q_bias: str | None = None  # DeBERTa v1: per-head bias added after the fused projection
    v_bias: str | None = None
    pos_key: tuple[str, ...] = ()  # extra projections paired with queries (k side)
    pos_query: tuple[str, ...] = ()  # extra projections paired with keys (q side)


@dataclass(frozen=True)
class HeadTemplate:
    """A task head: which of its Linear modules read the residual stream.

    ``tied`` describes a masked-LM transform whose output space is tied to the stream basis
    through the (tied) word embeddings: ``(dense, norm, decoder)`` module names.
    """

    stream_readers: tuple[str, ...] = ()
    tied: tuple[str, str, str] | None = None
    reads_final_norm: bool = True  # pre-LN: the final LayerNorm folds into these readers


@dataclass(frozen=True)
class Adapter:
    """Weight-name templates of one architecture family and how its blocks are wired."""

    name: str
    model_types: tuple[str, ...]
    norm: str  # "pre" | "post"
    base_prefix: str  # attribute of the task model holding the base model ("bert", "vit", ...)
    layers: str  # "encoder.layer" (relative to the base model)
    layer: LayerTemplate
    embedding_writers: tuple[tuple[str, int], ...]  # (parameter, axis of the stream)
    stream_norms: tuple[str, ...] = ()  # post-LN model-level norms in the stream (embedding LN)
    extra_stream: tuple[tuple[str, int], ...] = ()  # e.g. DeBERTa rel_embeddings (parameter, axis)
    extra_stream_norms: tuple[str, ...] = ()  # e.g. DeBERTa-v2 rel_embeddings LayerNorm
    final_norm: str | None = None  # pre-LN final LayerNorm
    embedding_module: str = "embeddings"
    heads: dict[str, HeadTemplate] = field(default_factory=dict)
    check_config: Callable[[object], None] | None = None

    # -- resolution ---------------------------------------------------------------------------
    def head_for(self, model: torch.nn.Module) -> tuple[str, HeadTemplate]:
        cls = type(model).__name__
        for suffix in sorted(self.heads, key=len, reverse=True):
            if cls.endswith(suffix):
                return suffix, self.heads[suffix]
        raise RaotError(
            f"{cls} is not supported by the {self.name} adapter; supported heads: "
            f"{', '.join(sorted(self.heads))}. Load the checkpoint with one of those classes."
        )

    def build_schema(self, model: torch.nn.Module) -> ModelSchema:
        """Resolve the templates on ``model`` (a base model or one of the supported heads)."""
        config = model.config
        if self.check_config is not None:
            self.check_config(config)
        suffix, head = self.head_for(model)
        params = dict(model.named_parameters())
        is_base = getattr(model, "base_model", model) is model
        base = "" if is_base else f"{self.base_prefix}."

        d = config.hidden_size
        H = config.num_attention_heads
        if d % H:
            raise RaotError(f"hidden_size {d} is not divisible by num_attention_heads {H}; not a supported layout.")
        h = d // H
        f = config.intermediate_size
        L = config.num_hidden_layers

        def has(name: str) -> bool:
            return name in params

        def linear(module: str) -> tuple[str, str | None]:
            w, b = f"{module}.weight", f"{module}.bias"
            if not has(w):
                raise RaotError(
                    f"expected parameter {w} in {type(model).__name__}; "
                    f"the checkpoint does not match the {self.name} layout."
                )
            return w, (b if has(b) else None)

        residual = Space("residual", "residual", d)
        spaces: dict[str, Space] = {}
        layers: list[LayerSchema] = []
        stream_modules: list[str] = []
        folds: list[Fold] = []

        def add(space: Space, name: str | None, axis: int, cov: bool, role: str, index=None) -> None:
            if name is not None and has(name):
                space.members.append(Member(name, axis, cov, role, index))

        for mod, axis in self.embedding_writers:
            add(residual, base + mod, axis, True, "writer")
        for mod, axis in self.extra_stream:
            add(residual, base + mod, axis, True, "writer")
        for norm in self.stream_norms + self.extra_stream_norms:
            add(residual, f"{base}{norm}.weight", 0, True, "norm")
            add(residual, f"{base}{norm}.bias", 0, True, "norm_bias")
        if self.norm == "post":
            stream_modules += [base + n for n in self.stream_norms]
        else:
            stream_modules.append(base + self.embedding_module)

        t = self.layer
        for i in range(L):
            p = f"{base}{self.layers}.{i}."
            qk = Space(f"layers.{i}.qk", "qk", d, layer=i)
            vo = Space(f"layers.{i}.vo", "vo", d, layer=i)
            mlp = Space(f"layers.{i}.mlp", "mlp", f, exact="permutation", layer=i)
            readers: list[tuple[str, str | None]] = []  # readers of the attention input (folds)
            if t.fused_qkv:
                w, _ = linear(p + t.fused_qkv)
                q_idx, k_idx, v_idx = (head_index(H, h, stride=3 * h, offset=j * h) for j in range(3))
                add(qk, w, 0, True, "q", q_idx)
                add(qk, w, 0, False, "k", k_idx)
                add(vo, w, 0, True, "v", v_idx)
                add(qk, p + t.q_bias, 0, True, "q")
                add(vo, p + t.v_bias, 0, True, "v")
                add(residual, w, 1, False, "reader")
                readers.append((w, None))
                readout = HeadReadout(p + t.fused_qkv, p + t.fused_qkv, p + t.fused_qkv, q_idx, k_idx, p + t.q_bias)
            else:
                for mod, cov, role, space in (
                    (t.q, True, "q", qk),
                    (t.k, False, "k", qk),
                    (t.v, True, "v", vo),
                ):
                    w, b = linear(p + mod)
                    add(space, w, 0, cov, role)
                    add(space, b, 0, cov, role)
                    add(residual, w, 1, False, "reader")
                    readers.append((w, b))
                readout = HeadReadout(p + t.q, p + t.q, p + t.k)
            for mods, cov in ((t.pos_key, False), (t.pos_query, True)):
                for mod in mods:
                    if has(f"{p}{mod}.weight"):
                        w, b = linear(p + mod)
                        add(qk, w, 0, cov, "pos")
                        add(qk, b, 0, cov, "pos")
                        add(residual, w, 1, False, "reader")  # they read rel_embeddings (stream basis)
            w, b = linear(p + t.o)
            add(vo, w, 1, False, "o")
            add(residual, w, 0, True, "writer")
            add(residual, b, 0, True, "writer")
            w1, b1 = linear(p + t.fc1)
            w2, b2 = linear(p + t.fc2)
            add(mlp, w1, 0, True, "fc1")
            add(mlp, b1, 0, True, "fc1")
            add(mlp, w2, 1, False, "fc2")
            add(residual, w1, 1, False, "reader")
            add(residual, w2, 0, True, "writer")
            add(residual, b2, 0, True, "writer")
            for norm in (t.norm_attn, t.norm_mlp):
                add(residual, f"{p}{norm}.weight", 0, True, "norm")
                add(residual, f"{p}{norm}.bias", 0, True, "norm_bias")
            if self.norm == "post":
                stream_modules += [p + t.norm_attn, p + t.norm_mlp]
            else:
                stream_modules.append(p.rstrip("."))
                folds.append(Fold(f"{p}{t.norm_attn}.weight", f"{p}{t.norm_attn}.bias", tuple(readers)))
                folds.append(Fold(f"{p}{t.norm_mlp}.weight", f"{p}{t.norm_mlp}.bias", ((w1, b1),)))
            spaces.update({qk.name: qk, vo.name: vo, mlp.name: mlp})
            linears = tuple(
                m
                for m in [t.fused_qkv, t.q, t.k, t.v, t.o, t.fc1, t.fc2]
                if m and has(f"{p}{m}.weight") and not (t.fused_qkv and m in (t.q, t.k, t.v))
            )
            layers.append(
                LayerSchema(i, readout, context=p + t.o, mlp_hidden=p + t.fc2, linears=tuple(p + m for m in linears))
            )

        # Task heads: readers of the final stream, and the MLM transform tied to it.
        head_params: list[str] = []
        final_readers: list[tuple[str, str | None]] = []
        base_params = {n for n in params if n.startswith(base)} if base else set(params)
        for mod in head.stream_readers:
            if has(f"{mod}.weight"):
                w, b = linear(mod)
                add(residual, w, 1, False, "head_reader")
                final_readers.append((w, b))
        if head.tied is not None:
            dense, norm, decoder = head.tied
            w, b = linear(dense)
            add(residual, w, 1, False, "head_reader")
            add(residual, w, 0, True, "tied")
            add(residual, b, 0, True, "tied")
            add(residual, f"{norm}.weight", 0, True, "norm")
            add(residual, f"{norm}.bias", 0, True, "norm_bias")
            # An untied decoder reads the transform space; a tied one *is* the word embedding.
            add(residual, f"{decoder}.weight", 1, False, "tied")
        if not is_base:
            head_params = sorted(n for n in params if n not in base_params)

        exact = "permutation"
        output_in_stream = is_base  # last_hidden_state is an output: it lives in the stream basis
        if self.norm == "pre":
            fn = base + self.final_norm
            if final_readers and head.reads_final_norm:
                folds.append(Fold(f"{fn}.weight", f"{fn}.bias", tuple(final_readers)))
                exact = "mean_fixing" if all(b is not None for f_ in folds for _, b in f_.readers) else "permutation"
            add(residual, f"{fn}.weight", 0, True, "norm")
            add(residual, f"{fn}.bias", 0, True, "norm_bias")
        residual.exact = exact
        spaces["residual"] = residual
        notes = []
        if exact == "permutation" and self.norm == "pre":
            notes.append("the final LayerNorm cannot be folded (no reader after it, or a reader without bias)")
        return ModelSchema(
            model_type=config.model_type,
            architecture=type(model).__name__,
            norm=self.norm,
            num_layers=L,
            hidden_size=d,
            num_heads=H,
            head_size=h,
            intermediate_size=f,
            spaces=spaces,
            layers=layers,
            stream_modules=stream_modules,
            folds=folds,
            head_params=head_params,
            output_in_stream=output_in_stream,
            notes=notes,
        )
