"""ViT and DeiT (the same layout plus a distillation token): pre-LN encoders. transformers ≥ 5 names the
modules ``layers.N.attention.q_proj`` / ``mlp.fc1`` in memory (legacy keys on disk)."""

from __future__ import annotations

from dataclasses import replace

from raot_hf.adapters.base import Adapter, HeadTemplate, LayerTemplate

VIT_LAYER = LayerTemplate(
    q="attention.q_proj",
    k="attention.k_proj",
    v="attention.v_proj",
    o="attention.o_proj",
    fc1="mlp.fc1",
    fc2="mlp.fc2",
    norm_attn="layernorm_before",
    norm_mlp="layernorm_after",
)

VIT = Adapter(
    name="vit",
    model_types=("vit",),
    norm="pre",
    base_prefix="vit",
    layers="layers",
    layer=VIT_LAYER,
    embedding_writers=(
        ("embeddings.cls_token", 2),
        ("embeddings.position_embeddings", 2),
        ("embeddings.patch_embeddings.projection.weight", 0),
        ("embeddings.patch_embeddings.projection.bias", 0),
    ),
    final_norm="layernorm",
    heads={
        # last_hidden_state is the base model's output: the final LayerNorm stays unfolded.
        "Model": HeadTemplate(stream_readers=("pooler.dense",), reads_final_norm=False),
        "ForImageClassification": HeadTemplate(stream_readers=("classifier",)),
    },
    modality="image",
)

# DeiT: ViT's layout under another prefix, plus a distillation token and a teacher head.
DEIT = replace(
    VIT,
    name="deit",
    model_types=("deit",),
    base_prefix="deit",
    embedding_writers=(("embeddings.distillation_token", 2), *VIT.embedding_writers),
    heads={
        **VIT.heads,
        "ForImageClassificationWithTeacher": HeadTemplate(stream_readers=("cls_classifier", "distillation_classifier")),
    },
)

ADAPTERS = (VIT, DEIT)
