"""BERT and RoBERTa (XLM-RoBERTa shares the layout): post-LN encoders."""

from __future__ import annotations

from raot_hf.adapters.base import Adapter, HeadTemplate, LayerTemplate

BERT_LAYER = LayerTemplate(
    q="attention.self.query",
    k="attention.self.key",
    v="attention.self.value",
    o="attention.output.dense",
    fc1="intermediate.dense",
    fc2="output.dense",
    norm_attn="attention.output.LayerNorm",
    norm_mlp="output.LayerNorm",
)

EMBEDDINGS = (
    ("embeddings.word_embeddings.weight", 1),
    ("embeddings.position_embeddings.weight", 1),
    ("embeddings.token_type_embeddings.weight", 1),
)


def _check_bert_config(config) -> None:
    from raot_hf.errors import RaotError

    if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
        raise RaotError(
            f"position_embedding_type={config.position_embedding_type!r} is not supported "
            "(relative_key distance embeddings live in head space); use an 'absolute' checkpoint."
        )
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise RaotError("decoder / cross-attention BERT checkpoints are not supported; use an encoder checkpoint.")


def bert_family_adapter(
    name: str, model_types: tuple[str, ...], prefix: str, *, sequence_reader: str, masked_lm: tuple[str, str, str]
) -> Adapter:
    """A post-LN encoder with BERT's layer and embedding layout under the base-model attribute
    ``prefix``; the families differ only in the stream reader of their sequence-classification
    head and in the (dense, norm, decoder) modules of their masked-LM head."""
    return Adapter(
        name=name,
        model_types=model_types,
        norm="post",
        base_prefix=prefix,
        layers="encoder.layer",
        layer=BERT_LAYER,
        embedding_writers=EMBEDDINGS,
        stream_norms=("embeddings.LayerNorm",),
        heads={
            "Model": HeadTemplate(stream_readers=("pooler.dense",)),
            "ForSequenceClassification": HeadTemplate(stream_readers=(sequence_reader,)),
            "ForTokenClassification": HeadTemplate(stream_readers=("classifier",)),
            "ForQuestionAnswering": HeadTemplate(stream_readers=("qa_outputs",)),
            "ForMaskedLM": HeadTemplate(tied=masked_lm),
        },
        check_config=_check_bert_config,
    )


# BERT classifies from its pooler; RoBERTa's classification head has its own dense layer.
BERT = bert_family_adapter(
    "bert",
    ("bert",),
    "bert",
    sequence_reader="bert.pooler.dense",
    masked_lm=("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm", "cls.predictions.decoder"),
)
ROBERTA = bert_family_adapter(
    "roberta",
    ("roberta", "xlm-roberta", "camembert"),
    "roberta",
    sequence_reader="classifier.dense",
    masked_lm=("lm_head.dense", "lm_head.layer_norm", "lm_head.decoder"),
)

ADAPTERS = (BERT, ROBERTA)
