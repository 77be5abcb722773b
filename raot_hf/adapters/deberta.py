"""DeBERTa v1 (fused, per-head interleaved ``in_proj``) and DeBERTa-v2/v3: post-LN encoders
with disentangled relative attention (docs/design.md §2)."""

from __future__ import annotations

from dataclasses import replace

from raot_hf.adapters.base import Adapter, HeadTemplate
from raot_hf.adapters.bert import BERT_LAYER, EMBEDDINGS
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


# DeBERTa keeps BERT's attention-output, MLP and LayerNorm names; v2/v3 store Q/K/V apart and
# normalise the relative embeddings; v1 fuses Q/K/V into one per-head interleaved ``in_proj``.
DEBERTA_V2 = Adapter(
    name="deberta-v2",
    model_types=("deberta-v2",),
    norm="post",
    base_prefix="deberta",
    layers="encoder.layer",
    layer=replace(
        BERT_LAYER,
        q="attention.self.query_proj",
        k="attention.self.key_proj",
        v="attention.self.value_proj",
        pos_key=("attention.self.pos_key_proj",),
        pos_query=("attention.self.pos_query_proj",),
    ),
    embedding_writers=EMBEDDINGS,
    stream_norms=("embeddings.LayerNorm",),
    extra_stream=(("encoder.rel_embeddings.weight", 1),),
    extra_stream_norms=("encoder.LayerNorm",),
    heads=_HEADS,
    check_config=_check_v2,
)

DEBERTA_V1 = replace(
    DEBERTA_V2,
    name="deberta",
    model_types=("deberta",),
    layer=replace(
        BERT_LAYER,
        q="",
        k="",
        v="",
        fused_qkv="attention.self.in_proj",
        q_bias="attention.self.q_bias",
        v_bias="attention.self.v_bias",
        pos_key=("attention.self.pos_proj",),
        pos_query=("attention.self.pos_q_proj",),
    ),
    extra_stream_norms=(),
    check_config=_check_v1,
)

ADAPTERS = (DEBERTA_V1, DEBERTA_V2)
