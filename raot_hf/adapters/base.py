"""Architectures described as data: one :class:`Adapter` per family (docs/design.md §2), whose
weight-name templates :meth:`Adapter.build_schema` resolves into a model's
:class:`~raot_hf.adapters.schema.ModelSchema`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from raot_hf.adapters.schema import Fold, HeadReadout, LayerSchema, Member, ModelSchema, Space, head_index
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
    """A task head: which of its Linear modules read the residual stream; ``tied``: the
    ``(dense, norm, decoder)`` of a masked-LM transform tied to the stream through the word embeddings."""

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
    decoder: bool = False  # a causal decoder (right-padded calibration, generation)
    modality: str = "text"  # "text" | "image": what its calibration data is

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
        if self.check_config is not None:
            self.check_config(model.config)
        _, head = self.head_for(model)
        builder = _EncoderSchemaBuilder(self, model)
        builder.add_embeddings()
        for i in range(builder.num_layers):
            builder.add_layer(i)
        head_params, final_readers = builder.add_head(head)
        return builder.finish(head, head_params, final_readers)


class ParameterSet:
    """A model's parameters by name, for resolving templates: members are added only where the
    parameter exists (optional biases), and a missing weight is a one-line error."""

    def __init__(self, model: torch.nn.Module, layout: str):
        self.params = dict(model.named_parameters())
        self.owner, self.layout = type(model).__name__, layout

    def __contains__(self, name: str) -> bool:
        return name in self.params

    def linear(self, module: str) -> tuple[str, str | None]:
        """The weight and (optional) bias names of a Linear module that must exist."""
        if f"{module}.weight" not in self.params:
            raise RaotError(
                f"expected parameter {module}.weight in {self.owner}; the checkpoint does not match the "
                f"{self.layout} layout."
            )
        return f"{module}.weight", (f"{module}.bias" if f"{module}.bias" in self.params else None)

    def add(self, space: Space, name: str | None, axis: int, cov: bool, role: str, index=None) -> None:
        """Append ``name`` to ``space`` as a member when the model has that parameter."""
        if name is not None and name in self.params:
            space.members.append(Member(name, axis, cov, role, index))


class _EncoderSchemaBuilder(ParameterSet):
    """Resolves an encoder :class:`Adapter`'s templates on one model, member by member, in each
    space's order; optional parameters are skipped, a missing Linear weight is a one-line error."""

    def __init__(self, adapter: Adapter, model: torch.nn.Module):
        super().__init__(model, adapter.name)
        config = model.config
        self.adapter, self.config = adapter, config
        self.is_base = getattr(model, "base_model", model) is model
        self.base = "" if self.is_base else f"{adapter.base_prefix}."
        d, H = config.hidden_size, config.num_attention_heads
        if d % H:
            raise RaotError(f"hidden_size {d} is not divisible by num_attention_heads {H}; not a supported layout.")
        self.hidden_size, self.num_heads, self.head_size = d, H, d // H
        self.intermediate_size = config.intermediate_size
        self.num_layers = config.num_hidden_layers
        self.residual = Space("residual", "residual", d)
        self.spaces: dict[str, Space] = {}
        self.layers: list[LayerSchema] = []
        self.stream_modules: list[str] = []
        self.folds: list[Fold] = []

    def add_embeddings(self) -> None:
        """The stream's writers and norms before the first layer, and the modules carrying it."""
        adapter, base, residual = self.adapter, self.base, self.residual
        for mod, axis in adapter.embedding_writers:
            self.add(residual, base + mod, axis, True, "writer")
        for mod, axis in adapter.extra_stream:
            self.add(residual, base + mod, axis, True, "writer")
        for norm in adapter.stream_norms + adapter.extra_stream_norms:
            self.add(residual, f"{base}{norm}.weight", 0, True, "norm")
            self.add(residual, f"{base}{norm}.bias", 0, True, "norm_bias")
        if adapter.norm == "post":
            self.stream_modules += [base + n for n in adapter.stream_norms]
        else:
            self.stream_modules.append(base + adapter.embedding_module)

    def add_layer(self, i: int) -> None:
        """Layer ``i``: its qk / vo / mlp spaces, its stream members, folds and hooks."""
        t, p, residual = self.adapter.layer, f"{self.base}{self.adapter.layers}.{i}.", self.residual
        qk = Space(f"layers.{i}.qk", "qk", self.hidden_size, layer=i)
        vo = Space(f"layers.{i}.vo", "vo", self.hidden_size, layer=i)
        mlp = Space(f"layers.{i}.mlp", "mlp", self.intermediate_size, exact="permutation", layer=i)
        readers, readout = self._attention_inputs(p, qk, vo)
        self._position_projections(p, qk)
        w, b = self.linear(p + t.o)
        self.add(vo, w, 1, False, "o")
        self.add(residual, w, 0, True, "writer")
        self.add(residual, b, 0, True, "writer")
        w1, b1 = self.linear(p + t.fc1)
        w2, b2 = self.linear(p + t.fc2)
        self.add(mlp, w1, 0, True, "fc1")
        self.add(mlp, b1, 0, True, "fc1")
        self.add(mlp, w2, 1, False, "fc2")
        self.add(residual, w1, 1, False, "reader")
        self.add(residual, w2, 0, True, "writer")
        self.add(residual, b2, 0, True, "writer")
        for norm in (t.norm_attn, t.norm_mlp):
            self.add(residual, f"{p}{norm}.weight", 0, True, "norm")
            self.add(residual, f"{p}{norm}.bias", 0, True, "norm_bias")
        if self.adapter.norm == "post":
            self.stream_modules += [p + t.norm_attn, p + t.norm_mlp]
        else:
            self.stream_modules.append(p.rstrip("."))
            self.folds.append(Fold(f"{p}{t.norm_attn}.weight", f"{p}{t.norm_attn}.bias", tuple(readers)))
            self.folds.append(Fold(f"{p}{t.norm_mlp}.weight", f"{p}{t.norm_mlp}.bias", ((w1, b1),)))
        self.spaces.update({qk.name: qk, vo.name: vo, mlp.name: mlp})
        linears = tuple(p + m for m in self._layer_linears(p))
        self.layers.append(LayerSchema(i, readout, context=p + t.o, mlp_hidden=p + t.fc2, linears=linears))

    def _attention_inputs(self, p: str, qk: Space, vo: Space) -> tuple[list[tuple[str, str | None]], HeadReadout]:
        """The q / k / v projections of layer prefix ``p``: their members, the readers of the
        attention input (for the LayerNorm fold) and where the hooks read queries and keys."""
        t, residual = self.adapter.layer, self.residual
        readers: list[tuple[str, str | None]] = []
        if t.fused_qkv:
            H, h = self.num_heads, self.head_size
            w, _ = self.linear(p + t.fused_qkv)
            q_idx, k_idx, v_idx = (head_index(H, h, stride=3 * h, offset=j * h) for j in range(3))
            self.add(qk, w, 0, True, "q", q_idx)
            self.add(qk, w, 0, False, "k", k_idx)
            self.add(vo, w, 0, True, "v", v_idx)
            self.add(qk, p + t.q_bias, 0, True, "q")
            self.add(vo, p + t.v_bias, 0, True, "v")
            self.add(residual, w, 1, False, "reader")
            readers.append((w, None))
            fused = p + t.fused_qkv
            return readers, HeadReadout(fused, fused, fused, q_idx, k_idx, p + t.q_bias)
        for mod, cov, role, space in ((t.q, True, "q", qk), (t.k, False, "k", qk), (t.v, True, "v", vo)):
            w, b = self.linear(p + mod)
            self.add(space, w, 0, cov, role)
            self.add(space, b, 0, cov, role)
            self.add(residual, w, 1, False, "reader")
            readers.append((w, b))
        return readers, HeadReadout(p + t.q, p + t.q, p + t.k)

    def _position_projections(self, p: str, qk: Space) -> None:
        """DeBERTa's relative-position projections: paired with keys or queries, they read
        rel_embeddings (in the stream basis)."""
        t = self.adapter.layer
        for mods, cov in ((t.pos_key, False), (t.pos_query, True)):
            for mod in mods:
                if f"{p}{mod}.weight" in self:
                    w, b = self.linear(p + mod)
                    self.add(qk, w, 0, cov, "pos")
                    self.add(qk, b, 0, cov, "pos")
                    self.add(self.residual, w, 1, False, "reader")

    def _layer_linears(self, p: str) -> tuple[str, ...]:
        """The layer's Linear modules that exist (a fused projection stands for q, k and v)."""
        t = self.adapter.layer
        return tuple(
            m
            for m in [t.fused_qkv, t.q, t.k, t.v, t.o, t.fc1, t.fc2]
            if m and f"{p}{m}.weight" in self and not (t.fused_qkv and m in (t.q, t.k, t.v))
        )

    def add_head(self, head: HeadTemplate) -> tuple[list[str], list[tuple[str, str | None]]]:
        """Task-head members: readers of the final stream, and the MLM transform tied to it.
        Returns the head's own parameters and the final stream's readers."""
        residual, base = self.residual, self.base
        final_readers: list[tuple[str, str | None]] = []
        base_params = {n for n in self.params if n.startswith(base)} if base else set(self.params)
        for mod in head.stream_readers:
            if f"{mod}.weight" in self:
                w, b = self.linear(mod)
                self.add(residual, w, 1, False, "head_reader")
                final_readers.append((w, b))
        if head.tied is not None:
            dense, norm, decoder = head.tied
            w, b = self.linear(dense)
            self.add(residual, w, 1, False, "head_reader")
            self.add(residual, w, 0, True, "tied")
            self.add(residual, b, 0, True, "tied")
            self.add(residual, f"{norm}.weight", 0, True, "norm")
            self.add(residual, f"{norm}.bias", 0, True, "norm_bias")
            # An untied decoder reads the transform space; a tied one *is* the word embedding.
            self.add(residual, f"{decoder}.weight", 1, False, "tied")
        head_params = [] if self.is_base else sorted(n for n in self.params if n not in base_params)
        return head_params, final_readers

    def finish(
        self, head: HeadTemplate, head_params: list[str], final_readers: list[tuple[str, str | None]]
    ) -> ModelSchema:
        """Fold the final LayerNorm (pre-LN), decide the stream's exact group, build the schema."""
        exact = "permutation"
        if self.adapter.norm == "pre":
            fn = self.base + self.adapter.final_norm
            if final_readers and head.reads_final_norm:
                self.folds.append(Fold(f"{fn}.weight", f"{fn}.bias", tuple(final_readers)))
                biased = all(b is not None for fold in self.folds for _, b in fold.readers)
                exact = "mean_fixing" if biased else "permutation"
            self.add(self.residual, f"{fn}.weight", 0, True, "norm")
            self.add(self.residual, f"{fn}.bias", 0, True, "norm_bias")
        self.residual.exact = exact
        self.spaces["residual"] = self.residual
        notes = []
        if exact == "permutation" and self.adapter.norm == "pre":
            notes.append("the final LayerNorm cannot be folded (no reader after it, or a reader without bias)")
        return ModelSchema(
            model_type=self.config.model_type,
            architecture=self.owner,
            norm=self.adapter.norm,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            head_size=self.head_size,
            intermediate_size=self.intermediate_size,
            spaces=self.spaces,
            layers=self.layers,
            stream_modules=self.stream_modules,
            folds=self.folds,
            head_params=head_params,
            output_in_stream=self.is_base,  # last_hidden_state is an output: it lives in the stream basis
            notes=notes,
        )
