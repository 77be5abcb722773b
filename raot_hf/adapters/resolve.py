"""One resolver from a :class:`~raot_hf.adapters.spec.FamilySpec` and a loaded model to its
:class:`~raot_hf.adapters.schema.ModelSchema` (docs/design.md §2, §8, §9).

The resolver walks the model as the spec describes it — the stream's writers before the first
layer, every layer's attention, MLP and norms, the task head, the final norm — and lists every
parameter axis in the space it indexes. What acts exactly on each space follows from the spec:

* the residual stream rotates (all of O(d) under RMSNorm, the mean-fixing maps under LayerNorm,
  docs/design.md §3.3, §8.2) only when every norm reading it folds into its readers — pre-norm,
  the final norm read by Linears that absorb its shift, not tied to the embeddings — and no norm
  weight sits in the stream; a norm on a branch's output (Gemma's sandwich, OLMo 2) limits it to
  the signed permutations under RMSNorm (§9.2), any other weight in the stream to permutations;
* query/key maps commute with the rotary positions (a complex scalar per rotary pair, a free map
  on the dims that do not rotate, §8.2, §9.4) and, under per-head query/key norms, with the norm
  weights too (half turns per pair; quarter turns where each head has its own weights, §9.1);
* a per-head score bias shared by every layer keeps the heads in place (§9.7).
"""

from __future__ import annotations

import torch

from raot_hf.adapters.schema import (
    ExpertLayer,
    Fold,
    HeadReadout,
    LayerSchema,
    Member,
    ModelSchema,
    Space,
    head_index,
)
from raot_hf.adapters.spec import FamilySpec, HeadSpec, config_value, model_dims, rotary_factor
from raot_hf.errors import RaotError


# --------------------------------------------------------------------------------- the resolver
class _Resolver:
    """Resolves one spec on one model, member by member in each space's order; optional parameters
    (biases, a first layer's missing norm) are skipped, a missing Linear weight is a one-line error."""

    def __init__(self, spec: FamilySpec, model: torch.nn.Module, suffix: str, head: HeadSpec):
        self.spec, self.model, self.head, self.config = spec, model, head, model.config
        self.params = dict(model.named_parameters())
        self.owner = type(model).__name__
        self.is_base = getattr(model, "base_model", model) is model
        if suffix == "Model" and not self.is_base:
            raise RaotError(f"{self.owner} is not supported; use one of {', '.join(sorted(spec.heads))}.")
        self.base = "" if self.is_base else f"{spec.base_prefix}."
        self.d, self.H, self.h, self.kv = model_dims(spec, self.config)
        self.f = config_value(self.config, spec.config.intermediate_size)
        self.L = config_value(self.config, spec.config.num_layers)
        self.kv_spaces = bool(spec.config.kv_heads)  # KV heads get spaces of their own (§8.1)
        self.residual = Space("residual", "residual", self.d)
        self.spaces: dict[str, Space] = {}
        self.layers: list[LayerSchema] = []
        self.stream_modules: list[str] = []
        self.folds: list[Fold] = []
        self.stream_weighted = False  # a norm or scale weight sits in the stream (no rotation)

    # -- helpers ---------------------------------------------------------------------------------
    def linear(self, module: str) -> tuple[str, str | None]:
        if f"{module}.weight" not in self.params:
            raise RaotError(
                f"expected parameter {module}.weight in {self.owner}; the checkpoint does not match the "
                f"{self.spec.name} layout."
            )
        return f"{module}.weight", (f"{module}.bias" if f"{module}.bias" in self.params else None)

    def add(self, space: Space, name: str | None, axis: int, cov: bool, role: str, index=None, **kw) -> None:
        if name is not None and name in self.params:
            space.members.append(Member(name, axis, cov, role, index, **kw))

    def add_norm(self, space: Space, module: str) -> None:
        self.add(space, f"{module}.weight", 0, True, "norm")
        self.add(space, f"{module}.bias", 0, True, "norm_bias")

    @property
    def out_axis(self) -> int:  # the axis of a weight's outputs (rows; columns when stored (in, out))
        return 1 if self.spec.transposed else 0

    @property
    def in_axis(self) -> int:
        return 0 if self.spec.transposed else 1

    # -- the stream before the first layer -------------------------------------------------------
    def embeddings(self) -> None:
        emb, base, residual = self.spec.embeddings, self.base, self.residual
        projection = emb.projection and f"{base}{emb.projection}.weight" in self.params
        if projection:  # the stream starts at the projection; the tables live in a space of their own
            w, b = self.linear(base + emb.projection)
            self.add(residual, w, 0, True, "writer")
            self.add(residual, b, 0, True, "writer")
        else:
            for name, axis in emb.writers + emb.relative_writers:
                self.add(residual, base + name, axis, True, "writer")
            for norm in emb.norms + emb.relative_norms:
                self.add_norm(residual, base + norm)
        if emb.norms and not projection:
            self.stream_weighted = True
        if self.spec.norms.placement == "post":
            self.stream_modules += [base + emb.projection] if projection else [base + n for n in emb.norms]
        else:
            self.stream_modules.append(base + emb.module)

    # -- one layer ---------------------------------------------------------------------------------
    def layer(self, i: int) -> None:
        spec, residual = self.spec, self.residual
        p = f"{self.base}{spec.layers}.{i}."
        H, h, kv = self.H, self.h, self.kv
        qk = Space(f"layers.{i}.qk", "qk", H * h, layer=i)
        vo = Space(f"layers.{i}.vo", "vo", H * h, layer=i)
        moe = self._is_moe_layer(p)
        mlp_spec = spec.experts.shared if moe else spec.mlp  # a mixture-of-experts layer's dense MLP: its shared expert
        units = self._mlp_units(p, mlp_spec) if moe and mlp_spec is not None else self.f
        mlp = Space(f"layers.{i}.mlp", "mlp", units, exact="permutation", layer=i) if mlp_spec else None
        k_space, v_space = qk, vo
        order = [qk]
        if self.kv_spaces:
            k_space = Space(f"layers.{i}.k", "qk", kv * h, layer=i)  # key rows (contravariant)
            v_space = Space(f"layers.{i}.v", "vo", kv * h, layer=i)  # value rows, per KV head
            order += [k_space, vo, v_space]
        else:
            order.append(vo)
        if mlp is not None:
            order.append(mlp)
        attn_readers, readout = self._attention_inputs(p, qk, k_space, v_space)
        self._position_projections(p, qk)
        o_w, o_b = self.linear(p + spec.attention.o)
        mlp_readers = []
        experts = None

        def mlp_inputs():
            nonlocal experts
            if moe:  # the router and the experts read the stream (§10)
                experts, expert_spaces = self._experts_inputs(i, p, mlp_readers)
                order.extend(expert_spaces)
            if mlp_spec is None:
                return
            parts = mlp_spec.fused_parts
            for module in mlp_spec.inputs:
                w, b = self.linear(p + module)
                for j in range(parts):
                    index = None if parts == 1 else tuple(range(j * mlp.size, (j + 1) * mlp.size))
                    self.add(mlp, w, self.out_axis, True, "fc1", index)
                    self.add(mlp, b, 0, True, "fc1", index)
                self.add(residual, w, self.in_axis, False, "reader")
                mlp_readers.append((w, b))

        def attention_output():
            self.add(vo, o_w, self.in_axis, False, "o")
            self.add(residual, o_w, self.out_axis, True, "writer")
            self.add(residual, o_b, 0, True, "writer")

        # decoders list a block's readers, then its writers; encoders the attention, then the MLP
        if spec.decoder:
            mlp_inputs()
            attention_output()
        else:
            attention_output()
            mlp_inputs()
        fc2_w = fc2_b = None
        if mlp_spec is not None:
            fc2_w, fc2_b = self.linear(p + mlp_spec.output)
            self.add(mlp, fc2_w, self.in_axis, False, "fc2")
            self.add(residual, fc2_w, self.out_axis, True, "writer")
            self.add(residual, fc2_b, 0, True, "writer")
        if experts is not None:  # every expert's output rows write the stream
            self.add(residual, experts.down, 1, True, "writer")
        self._layer_norms(p, attn_readers, mlp_readers, (o_w, o_b), (fc2_w, fc2_b))
        self.spaces.update({s.name: s for s in order})
        modules = [*spec.attention.input_modules(), spec.attention.o]
        if moe:  # the router is read like a Linear (RegMean, the corrections); the experts are not Linears
            modules += [spec.experts.router, *((spec.experts.shared_gate,) if spec.experts.shared_gate else ())]
        if mlp_spec is not None:
            modules += [*mlp_spec.inputs, mlp_spec.output]
        linears = tuple(p + m for m in modules if f"{p}{m}.weight" in self.params)
        module = p.rstrip(".") if spec.decoder else None
        hidden = p + mlp_spec.output if mlp_spec is not None else None
        self.layers.append(LayerSchema(i, readout, p + spec.attention.o, hidden, linears, module, experts))

    # -- mixture of experts (docs/design.md §10) ----------------------------------------------------
    def _is_moe_layer(self, p: str) -> bool:
        """Whether the layer at ``p`` holds the family's experts (a dense layer of an MoE family does not)."""
        experts = self.spec.experts
        return experts is not None and f"{p}{experts.experts}.{experts.mlp.inputs[0]}" in self.params

    def _mlp_units(self, p: str, mlp_spec) -> int:
        """The units of a dense MLP read from its output Linear (a shared expert's width is its own)."""
        w = self.params[self.linear(p + mlp_spec.output)[0]]
        return int(w.shape[0 if self.spec.transposed else 1])

    def _experts_inputs(self, i: int, p: str, readers: list) -> tuple[ExpertLayer, list[Space]]:
        """The router's rows and every expert's units: the spaces ``layers.i.router`` (E) and
        ``layers.i.experts`` (E·f, expert-major), the stream members of the router and the experts'
        input parameter (readers; the output parameter is added as a writer by the caller) and the
        shared expert's gate. Returns the block's :class:`ExpertLayer` and its two spaces."""
        spec, residual = self.spec.experts, self.residual
        gate_up = f"{p}{spec.experts}.{spec.mlp.inputs[0]}"
        down = f"{p}{spec.experts}.{spec.mlp.output}"
        if down not in self.params:
            raise RaotError(
                f"expected parameter {down} in {self.owner}; the checkpoint does not match the {self.spec.name} layout."
            )
        e, parts = self.params[gate_up].shape[0], spec.mlp.fused_parts
        f = self.params[down].shape[2]
        if self.params[gate_up].shape[1] != parts * f:
            raise RaotError(
                f"{gate_up} has {self.params[gate_up].shape[1]} rows per expert, not {parts}·{f}; "
                f"not the {self.spec.name} layout."
            )
        router_w, router_b = self.linear(p + spec.router)
        router = Space(f"layers.{i}.router", "router", e, exact="permutation", layer=i)
        self.add(router, router_w, 0, True, "router")
        self.add(router, router_b, 0, True, "router")
        units = Space(f"layers.{i}.experts", "experts", e * f, exact="expert_permutation", layer=i)
        for j in range(parts):  # [gate | up]: each part's rows of every expert, expert-major
            index = tuple(x * parts * f + j * f + u for x in range(e) for u in range(f))
            self.add(units, gate_up, 1, True, "fc1", index if parts > 1 else None, expert_axis=0)
        self.add(units, down, 2, False, "fc2", expert_axis=0)
        self.add(residual, router_w, 1, False, "reader")
        self.add(residual, gate_up, 2, False, "reader")
        readers += [(router_w, router_b), (gate_up, None)]
        if spec.shared_gate:
            gate_w, gate_b = self.linear(p + spec.shared_gate)
            self.add(residual, gate_w, 1, False, "reader")
            readers.append((gate_w, gate_b))
        top_k = config_value(self.config, spec.top_k)
        block = ExpertLayer(
            i, p + spec.router, p + spec.experts, gate_up, down, e, f, top_k, spec.renormalised(self.config), parts
        )
        return block, [router, units]

    def _attention_inputs(self, p: str, qk: Space, k_space: Space, v_space: Space):
        """The q / k / v projections: their members, the readers of the attention input (for the
        norm fold) and where the hooks read queries and keys (keys per query head, §8.3)."""
        att, residual = self.spec.attention, self.residual
        H, h, kv = self.H, self.h, self.kv
        spaces = {"q": (qk, True), "k": (k_space, False), "v": (v_space, True)}
        expand = [(j // (H // kv)) for j in range(H)] if kv != H else None
        readers: list[tuple[str, str | None]] = []
        if att.fused:
            w, b = self.linear(p + att.fused)
            if att.fused_layout == "per_head":  # per head [q_i | k_i | v_i] (DeBERTa v1, GPT-NeoX)
                index = {r: head_index(H, h, stride=3 * h, offset=j * h) for j, r in enumerate("qkv")}
            else:  # [q (H·h) | k (K·h) | v (K·h)]
                index = {"q": head_index(H, h), "k": head_index(kv, h, offset=H * h)}
                index["v"] = head_index(kv, h, offset=(H + kv) * h)
            for role in "qkv":
                space, cov = spaces[role]
                self.add(space, w, self.out_axis, cov, role, index[role])
                self.add(space, b, 0, cov, role, index[role])
            self.add(residual, w, self.in_axis, False, "reader")
            readers.append((w, b))
            added = dict(att.added_biases)
            for role, name in att.added_biases:
                self.add(spaces[role][0], p + name, 0, spaces[role][1], role)
            k_index = index["k"]
            if expand is not None:  # the keys of each query head's KV head
                k_index = tuple(H * h + g * h + c for g in expand for c in range(h))
            fused = p + att.fused
            q_bias = p + added["q"] if "q" in added else None
            k_bias = p + added["k"] if "k" in added else None
            return readers, HeadReadout(fused, fused, fused, index["q"], k_index, q_bias, k_bias)
        for role, module in (("q", att.q), ("k", att.k), ("v", att.v)):
            space, cov = spaces[role]
            w, b = self.linear(p + module)
            self.add(space, w, self.out_axis, cov, role)
            self.add(space, b, 0, cov, role)
            self.add(residual, w, self.in_axis, False, "reader")
            readers.append((w, b))
        if att.qk_norm_span == "projection":  # one weight over the whole projection moves with its heads
            for module, (space, _) in ((att.q_norm, spaces["q"]), (att.k_norm, spaces["k"])):
                if module:
                    self.add(space, f"{p}{module}.weight", 0, True, "norm")
        k_index = tuple(g * h + c for g in expand for c in range(h)) if expand is not None else None
        return readers, HeadReadout(p + att.q, p + att.q, p + att.k, k_index=k_index)

    def _position_projections(self, p: str, qk: Space) -> None:
        """Relative-position projections: paired with keys or queries, they read the relative
        embeddings (in the stream basis)."""
        att = self.spec.attention
        for modules, cov in ((att.position_key, False), (att.position_query, True)):
            for module in modules:
                if f"{p}{module}.weight" in self.params:
                    w, b = self.linear(p + module)
                    self.add(qk, w, 0, cov, "pos")
                    self.add(qk, b, 0, cov, "pos")
                    self.add(self.residual, w, 1, False, "reader")

    def _layer_norms(self, p, attn_readers, mlp_readers, attn_writer, mlp_writer) -> None:
        """The layer's norms (and LayerScale): stream members, folds and where the stream is observed."""
        norms, residual = self.spec.norms, self.residual
        for module in (norms.attention, norms.attention_out, norms.mlp, norms.mlp_out):
            if module:
                self.add_norm(residual, p + module)
        if norms.attention_out or norms.mlp_out:
            self.stream_weighted = True
        if self.spec.layer_scale:  # x + λ ⊙ f(x): λ folds into the writer's rows and bias (§9.8)
            for name, writer in zip(self.spec.layer_scale, (attn_writer, mlp_writer), strict=True):
                if p + name in self.params:
                    self.add(residual, p + name, 0, True, "norm")
                    self.folds.append(Fold(p + name, None, (), writers=(writer,), transposed=self._transposed(writer)))
        if norms.placement == "post":
            self.stream_modules += [p + norms.attention, p + norms.mlp]
            return
        self.stream_modules.append(p.rstrip("."))
        for module, readers in ((norms.attention, attn_readers), (norms.mlp, mlp_readers)):
            if module and f"{p}{module}.weight" in self.params:
                bias = f"{p}{module}.bias" if f"{p}{module}.bias" in self.params else None
                offset = norms.offset
                transposed = tuple(w for w, _ in readers) if self.spec.transposed else ()
                if norms.kind == "rms":
                    bias = None
                self.folds.append(Fold(f"{p}{module}.weight", bias, tuple(readers), transposed, offset=offset))

    def _transposed(self, *pairs) -> tuple[str, ...]:
        return tuple(w for w, _ in pairs) if self.spec.transposed else ()

    # -- the head and the final norm -----------------------------------------------------------------
    def task_head(self) -> tuple[list[str], list[tuple[str, str | None]]]:
        """Head members: readers of the final stream and the masked-LM transform tied to it. Returns
        the head's own parameters and the final stream's readers."""
        residual, base, head = self.residual, self.base, self.head
        final_readers: list[tuple[str, str | None]] = []
        for module in head.readers:
            if f"{module}.weight" in self.params:
                w, b = self.linear(module)
                copies = self.params[w].shape[1] // self.d
                if copies > 1:  # reads several tokens' streams side by side (DINOv2: [class, mean patch])
                    for c in range(copies):
                        self.add(residual, w, 1, False, "head_reader", tuple(range(c * self.d, (c + 1) * self.d)))
                else:
                    self.add(residual, w, 1, False, "head_reader")
                final_readers.append((w, b))
        for name, axis, covariant in head.stream:  # a probe written in the stream's basis, fused readers' columns
            self.add(residual, name, axis, covariant, "writer" if covariant else "head_reader")
        if head.tied is not None:
            dense, norm, decoder = head.tied
            w, b = self.linear(dense)
            self.add(residual, w, 1, False, "head_reader")
            self.add(residual, w, 0, True, "tied")
            self.add(residual, b, 0, True, "tied")
            self.add_norm(residual, norm)
            # an untied decoder reads the transform space; a tied one *is* the word embedding
            self.add(residual, f"{decoder}.weight", 1, False, "tied")
        # a causal LM's head shares the (checked) vocabulary: it is merged with the trunk
        trunk_only = self.is_base or head.trunk
        head_params = [] if trunk_only else sorted(n for n in self.params if not n.startswith(base))
        return head_params, final_readers

    def finish(self, head_params: list[str], final_readers: list[tuple[str, str | None]]) -> ModelSchema:
        """The final norm, the stream's exact group, the schema."""
        spec, norms, residual = self.spec, self.spec.norms, self.residual
        notes: list[str] = []
        # a causal LM's head tied to the embeddings is not a parameter of its own
        tied = self.head.trunk and any(f"{m}.weight" not in self.params for m in self.head.readers)
        exact = "permutation"
        if norms.final:
            final = f"{self.base}{norms.final}"
            has_shift = norms.kind == "layer" and f"{final}.bias" in self.params
            folds = bool(final_readers) and self.head.reads_final_norm and not tied
            folds = folds and (not has_shift or all(b is not None for _, b in final_readers))
            folds = folds and not self.stream_weighted  # the stream does not rotate: nothing to fold for
            if folds:
                self.folds.append(Fold(f"{final}.weight", f"{final}.bias" if has_shift else None,
                                       tuple(final_readers), offset=norms.offset))  # fmt: skip
            self.add_norm(residual, final)
            if norms.placement == "pre" and not self.stream_weighted and folds:
                if norms.kind == "rms":
                    exact = "orthogonal"
                else:  # a shift folds only into readers with a bias
                    reads = [b for fold in self.folds for _, b in fold.readers]
                    exact = "mean_fixing" if all(b is not None for b in reads) else "permutation"
            if tied:
                notes.append(
                    "tied lm_head: the final norm's weight cannot be folded into it without untying the "
                    "embeddings, so the residual stream is aligned by permutations only (rotations are refused)"
                )
            elif norms.placement == "pre" and exact == "permutation" and not self.stream_weighted:
                notes.append(
                    "the final norm cannot be folded (no reader after it, a reader without bias, or the "
                    "norm's output is the model's), so the residual stream is aligned by permutations only"
                )
        if self.stream_weighted and norms.kind == "rms":
            exact = "signed_permutation"  # norm weights in an RMSNorm stream: signed permutations (§9.2)
        if self.stream_weighted:
            notes.append("norm weights sit in the residual stream: it is aligned by (signed) permutations only")
        residual.exact = exact
        self.spaces["residual"] = residual
        att, pos = spec.attention, spec.positions
        rope = pos.kind == "rope"
        rotary = int(self.h * rotary_factor(self.config)) if rope else None
        qk_turns = None
        if att.q_norm:  # per-head Q/K norms: half turns per rotary pair; quarter turns with per-head weights
            qk_turns = 4 if att.qk_norm_span == "projection" else 2
        return ModelSchema(
            model_type=self.config.model_type,
            architecture=self.owner,
            norm=norms.placement,
            num_layers=self.L,
            hidden_size=self.d,
            num_heads=self.H,
            head_size=self.h,
            intermediate_size=self.f,
            spaces=self.spaces,
            layers=self.layers,
            stream_modules=self.stream_modules,
            folds=self.folds,
            head_params=head_params,
            output_in_stream=self.is_base,  # last_hidden_state is an output: it lives in the stream basis
            notes=notes,
            num_kv_heads=self.kv if self.kv_spaces else None,
            qk_structure="rope" if rope else "free",
            stream_centered=norms.kind == "layer",
            causal=spec.decoder,
            norm_dtype=norms.dtype,
            rotary_dims=rotary if rope and rotary != self.h else None,
            qk_turns=qk_turns,
            qk_scales=not att.q_norm,
            head_permutation=att.relative_bias is None,
        )


def build_schema(spec: FamilySpec, model: torch.nn.Module) -> ModelSchema:
    """Resolve ``spec`` on ``model`` (a base model or one of the family's heads)."""
    spec.check_config(model.config)
    suffix, head = spec.head_for(model)
    resolver = _Resolver(spec, model, suffix, head)
    resolver.embeddings()
    for i in range(resolver.L):
        resolver.layer(i)
    head_params, final_readers = resolver.task_head()
    return resolver.finish(head_params, final_readers)
