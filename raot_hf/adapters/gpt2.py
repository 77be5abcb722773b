"""GPT-2: a pre-LN decoder with learned positions, a fused ``c_attn`` (q, k, v as three contiguous
blocks) and ``Conv1D`` weights stored (in, out) (docs/design.md §8). The final ``ln_f`` feeds a
bias-free reader that cannot absorb its shift β, so the stream is aligned by permutations only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raot_hf.adapters.base import Adapter, HeadTemplate, LayerTemplate, ParameterSet
from raot_hf.adapters.llama import decoder_layers, decoder_schema
from raot_hf.adapters.schema import Fold, HeadReadout, LayerSchema, ModelSchema, Space, head_index
from raot_hf.errors import RaotError

GPT2_LAYER = LayerTemplate(
    q="attn.c_attn",
    k="attn.c_attn",
    v="attn.c_attn",
    o="attn.c_proj",
    fc1="mlp.c_fc",
    fc2="mlp.c_proj",
    norm_attn="ln_1",
    norm_mlp="ln_2",
    fused_qkv="attn.c_attn",
)

FINAL_NOTE = (
    "ln_f's shift cannot be folded into the bias-free lm_head/score (nor its scale into a tied lm_head), "
    "so the residual stream is aligned by permutations only"
)


def check_gpt2_config(config) -> None:
    """Refuse GPT-2 variants the schema does not describe, before any weights load."""
    if getattr(config, "add_cross_attention", False):
        raise RaotError("GPT-2 with add_cross_attention=True is not supported; use a decoder-only checkpoint.")
    if config.hidden_size % config.num_attention_heads:
        raise RaotError(
            f"n_embd {config.hidden_size} is not divisible by n_head {config.num_attention_heads}; not a GPT-2 layout."
        )


@dataclass(frozen=True)
class GPT2Adapter(Adapter):
    """GPT-2's weight names; :meth:`build_schema` resolves them (docs/design.md §8)."""

    def build_schema(self, model: torch.nn.Module) -> ModelSchema:
        config = model.config
        check_gpt2_config(config)
        suffix, head = self.head_for(model)
        ps = ParameterSet(model, "GPT-2")
        is_base = getattr(model, "base_model", model) is model
        if suffix == "Model" and not is_base:
            raise RaotError(
                f"{type(model).__name__} is not supported; use one of GPT2{', GPT2'.join(sorted(self.heads))}."
            )
        base = "" if is_base else f"{self.base_prefix}."
        d, L = config.hidden_size, config.num_hidden_layers
        residual = Space("residual", "residual", d)
        for mod, _ in self.embedding_writers:
            ps.add(residual, base + mod, 1, True, "writer")
        trunk = decoder_layers(self._layer, ps, f"{base}{self.layers}", L, config, residual)
        spaces = trunk[0]  # the residual space joins below
        for mod in head.stream_readers:
            ps.add(residual, f"{mod}.weight", 1, False, "head_reader")
        ps.add(residual, f"{base}{self.final_norm}.weight", 0, True, "norm")
        ps.add(residual, f"{base}{self.final_norm}.bias", 0, True, "norm_bias")
        residual.exact = "permutation"  # ln_f cannot be folded (FINAL_NOTE)
        spaces["residual"] = residual
        trunk_only = is_base or suffix == "LMHeadModel"  # a causal LM's head shares the (checked) vocabulary
        return decoder_schema(
            model,
            ps,
            base,
            trunk,
            stream_start=base + self.embedding_module,
            trunk_only=trunk_only,
            intermediate_size=config.n_inner or 4 * d,
            notes=[FINAL_NOTE],
        )

    def _layer(self, ps: ParameterSet, p: str, i: int, config, residual: Space):
        """One block's head and MLP spaces, its two LayerNorm folds and its hook names. Conv1D
        weights are (in, out): outputs are axis 1 and inputs axis 0; q, k, v are three
        contiguous blocks of ``c_attn``'s output."""
        t, d, H = self.layer, config.hidden_size, config.num_attention_heads
        q_idx, k_idx, v_idx = (head_index(H, d // H, offset=j * d) for j in range(3))
        qk = Space(f"layers.{i}.qk", "qk", d, layer=i)
        vo = Space(f"layers.{i}.vo", "vo", d, layer=i)
        mlp = Space(f"layers.{i}.mlp", "mlp", config.n_inner or 4 * d, exact="permutation", layer=i)
        (attn_w, attn_b), (o_w, o_b) = ps.linear(p + t.fused_qkv), ps.linear(p + t.o)
        (fc1_w, fc1_b), (fc2_w, fc2_b) = ps.linear(p + t.fc1), ps.linear(p + t.fc2)
        for space, cov, role, idx in ((qk, True, "q", q_idx), (qk, False, "k", k_idx), (vo, True, "v", v_idx)):
            ps.add(space, attn_w, 1, cov, role, idx)
            ps.add(space, attn_b, 0, cov, role, idx)
        ps.add(vo, o_w, 0, False, "o")
        ps.add(mlp, fc1_w, 1, True, "fc1")
        ps.add(mlp, fc1_b, 0, True, "fc1")
        ps.add(mlp, fc2_w, 0, False, "fc2")
        for w in (attn_w, fc1_w):
            ps.add(residual, w, 0, False, "reader")
        for w, b in ((o_w, o_b), (fc2_w, fc2_b)):
            ps.add(residual, w, 1, True, "writer")
            ps.add(residual, b, 0, True, "writer")
        folds = []
        for norm, (w, b) in ((t.norm_attn, (attn_w, attn_b)), (t.norm_mlp, (fc1_w, fc1_b))):
            ps.add(residual, f"{p}{norm}.weight", 0, True, "norm")
            ps.add(residual, f"{p}{norm}.bias", 0, True, "norm_bias")
            folds.append(Fold(f"{p}{norm}.weight", f"{p}{norm}.bias", ((w, b),), transposed=(w,)))
        fused = p + t.fused_qkv
        # Conv1D weights are (in, out): RegMean solves them transposed (raot_hf/merging/grams.py)
        linears = tuple(p + m for m in (t.fused_qkv, t.o, t.fc1, t.fc2))
        readout = HeadReadout(fused, fused, fused, q_idx, k_idx)
        layer = LayerSchema(i, readout, p + t.o, p + t.fc2, linears, p.rstrip("."))
        return (qk, vo, mlp), folds, layer


GPT2 = GPT2Adapter(
    name="gpt2",
    model_types=("gpt2",),
    norm="pre",
    base_prefix="transformer",
    layers="h",
    layer=GPT2_LAYER,
    embedding_writers=(("wte.weight", 1), ("wpe.weight", 1)),
    embedding_module="drop",
    final_norm="ln_f",
    heads={
        "Model": HeadTemplate(reads_final_norm=False),
        "LMHeadModel": HeadTemplate(stream_readers=("lm_head",)),
        "ForSequenceClassification": HeadTemplate(stream_readers=("score",)),
    },
    decoder=True,
    check_config=check_gpt2_config,
)
ADAPTERS = (GPT2,)
