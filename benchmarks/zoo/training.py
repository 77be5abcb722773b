"""Fine-tuning a zoo model: the one training sequence behind the benchmarks' sibling builders.

A *sibling* is a zoo parent (the *base*, a ViT or a BERT directory) fine-tuned briefly on one
data set; two siblings of one base differ only in their data. Fine-tuning runs through the
demo's deterministic machinery (:func:`raot_hf.demo.training.train_and_save`): the base is
loaded inside the seeded block, and when the data set's labels differ from the base's the
classifier is re-initialized there too (seeded), so the result is a function of the settings.
"""

from __future__ import annotations

from pathlib import Path

import torch

from raot_hf.demo import IMAGE_DATASETS, load_image_dataset, train_and_save
from raot_hf.demo.training import label_maps

#: Weight decay of fine-tuning per modality (the from-scratch trainers' values).
WEIGHT_DECAY = {"image": 0.05, "text": 0.01}


def finetune(base: Path, params: dict, out_dir: Path) -> dict:
    """Fine-tune the zoo model in ``base`` as ``params`` describe; save it into ``out_dir``.

    ``params`` holds ``dataset`` (an image data set of :data:`raot_hf.demo.IMAGE_DATASETS` or a
    text task of :data:`benchmarks.zoo.text.TEXT_DATASETS`), ``seed``, ``epochs``,
    ``batch_size``, ``learning_rate``, ``base`` (the base's folder name, for the progress label)
    and, for text, ``max_length``. The base's processor or tokenizer is reused. Returns the
    metrics (test accuracy on the data set's test split, training time).
    """
    from transformers import (
        AutoImageProcessor,
        AutoModelForImageClassification,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    modality = "image" if params["dataset"] in IMAGE_DATASETS else "text"
    if modality == "image":
        splits = load_image_dataset(params["dataset"])
        processor, model_class = AutoImageProcessor.from_pretrained(base), AutoModelForImageClassification
    else:
        from benchmarks.zoo.text import load_text_dataset

        splits = load_text_dataset(params["dataset"])
        processor, model_class = AutoTokenizer.from_pretrained(base), AutoModelForSequenceClassification
    names = splits["train"].features["label"].names

    def load_base() -> torch.nn.Module:
        return relabel(model_class.from_pretrained(base), names)

    return train_and_save(
        out_dir,
        params,
        load_base,
        processor,
        splits["train"],
        splits["test"],
        weight_decay=WEIGHT_DECAY[modality],
        description=f"fine-tune {params['dataset']} from {params['base']}",
    )


def relabel(model: torch.nn.Module, label_names: list[str]) -> torch.nn.Module:
    """Give ``model`` a fresh classifier for ``label_names`` unless it already has those labels.

    The new ``classifier`` Linear is drawn from the current torch random state (normal with the
    config's ``initializer_range``, zero bias); call inside a seeded block for reproducibility.
    """
    config = model.config
    if [config.id2label[i] for i in range(config.num_labels)] == list(label_names):
        return model
    maps = label_maps(label_names)
    config.id2label, config.label2id = maps["id2label"], maps["label2id"]
    model.classifier = torch.nn.Linear(config.hidden_size, len(label_names))
    torch.nn.init.normal_(model.classifier.weight, std=config.initializer_range)
    torch.nn.init.zeros_(model.classifier.bias)
    config.num_labels = len(label_names)
    return model
