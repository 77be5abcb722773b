"""What ``raot-hf demo`` trains: small ViTs on digit images that ship offline, built reproducibly
and cached under ``$RAOT_HF_CACHE`` (default ``~/.cache/raot_hf/zoo``), keyed by all settings."""

from raot_hf.demo.images import (
    IMAGE_DATASETS,
    build_vit,
    build_vit_pair,
    load_image_dataset,
    make_image_processor,
    train_vit,
)
from raot_hf.demo.training import (
    ZOO_CODE_VERSION,
    cached_build,
    default_cache_dir,
    evaluate_accuracy,
    read_zoo_info,
    train_and_save,
)

__all__ = [
    "IMAGE_DATASETS",
    "ZOO_CODE_VERSION",
    "build_vit",
    "build_vit_pair",
    "cached_build",
    "default_cache_dir",
    "evaluate_accuracy",
    "load_image_dataset",
    "make_image_processor",
    "read_zoo_info",
    "train_and_save",
    "train_vit",
]
