"""DeBERTa v1 (fused, per-head interleaved ``in_proj``) and DeBERTa-v2/v3: post-LN encoders
with disentangled relative attention (docs/design.md §2)."""

from __future__ import annotations

from raot_hf.adapters.base import Adapter, HeadTemplate, LayerTemplate
from raot_hf.errors import RaotError

_HEADS = {
    "Model": HeadTemplate(),
    "ForSequenceClassification": HeadTemplate(stream_readers=("pooler.dense",)),
    "ForTokenClassification": HeadTemplate(stream_readers=("classifier",)),
    "ForQuestionAnswering": HeadTemplate(stream_readers=("qa_outputs",)),
    "ForMaskedLM": HeadTemplate(
        tied=("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm", "cls.predictions.decoder")
    ),
}

_EMBEDDINGS = (
    ("embeddings.word_embeddings.weight", 1),
    ("embeddings.position_embeddings.weight", 1),
    ("embeddings.token_type_embeddings.weight", 1),
)


def _check_common(config) -> None:
    emb = getattr(config, "embedding_size", None)
    if emb is not None and emb != config.hidden_size:
        raise RaotError(
            f"{config.model_type} with embedding_size={emb} != hidden_size={config.hidden_size} (embed_proj) "
            "is not supported; use a checkpoint whose embedding size equals its hidden size."
        )


def _check_v1(config) -> None:
    _check_common(config)
    if getattr(config, "talking_head", False):
        raise RaotError("DeBERTa v1 with talking_head=True mixes heads and has no head symmetry; not supported.")


def _check_v2(config) -> None:
    _check_common(config)
    if getattr(config, "conv_kernel_size", 0):
        raise RaotError(
            "DeBERTa-v2 with conv_kernel_size > 0 (the convolution branch) is not supported; "
            "use a checkpoint without it (e.g. deberta-v3-*)."
        )


# The layer outputs, norms and stream members both versions share; they differ in how Q/K/V
# are stored (v1: one fused, per-head interleaved ``in_proj``), the relative-position projections'
# names and v2's LayerNorm on the relative embeddings.
_LAYER_OUTPUTS = dict(
    o="attention.output.dense",
    fc1="intermediate.dense",
    fc2="output.dense",
    norm_attn="attention.output.LayerNorm",
    norm_mlp="output.LayerNorm",
)
_COMMON = dict(
    norm="post",
    base_prefix="deberta",
    layers="encoder.layer",
    embedding_writers=_EMBEDDINGS,
    stream_norms=("embeddings.LayerNorm",),
    extra_stream=(("encoder.rel_embeddings.weight", 1),),
    heads=_HEADS,
)

DEBERTA_V1 = Adapter(
    name="deberta",
    model_types=("deberta",),
    layer=LayerTemplate(
        q="",
        k="",
        v="",
        **_LAYER_OUTPUTS,
        fused_qkv="attention.self.in_proj",
        q_bias="attention.self.q_bias",
        v_bias="attention.self.v_bias",
        pos_key=("attention.self.pos_proj",),
        pos_query=("attention.self.pos_q_proj",),
    ),
    check_config=_check_v1,
    **_COMMON,
)

DEBERTA_V2 = Adapter(
    name="deberta-v2",
    model_types=("deberta-v2",),
    layer=LayerTemplate(
        q="attention.self.query_proj",
        k="attention.self.key_proj",
        v="attention.self.value_proj",
        **_LAYER_OUTPUTS,
        pos_key=("attention.self.pos_key_proj",),
        pos_query=("attention.self.pos_query_proj",),
    ),
    extra_stream_norms=("encoder.LayerNorm",),
    check_config=_check_v2,
    **_COMMON,
)

ADAPTERS = (DEBERTA_V1, DEBERTA_V2)
