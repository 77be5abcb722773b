"""Builders of the benchmarked parents: each turns a :class:`benchmarks.pairs.ModelSpec` into a
directory that ``from_pretrained`` loads, trained reproducibly and cached through
:func:`raot_hf.zoo.training.cached_build` (or, for the tiny smoke-test models, written once).

Builders the zoo does not offer are here, made of the zoo's public pieces: ViTs on resized
MNIST, BERTs on the party task with the sentiment tokenizer, and fine-tuned siblings: two
fine-tunes of one zoo parent (the *base*) on two different data sets or tasks.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.pairs import ModelSpec


def build_model(spec: ModelSpec) -> Path:
    """Build (or reuse from the zoo cache) one parent; return its directory."""
    if spec.builder not in BUILDERS:
        raise ValueError(f"unknown builder {spec.builder!r}; choose from {', '.join(BUILDERS)}")
    return Path(BUILDERS[spec.builder](**dict(spec.options)))


def _zoo_vit(seed, dataset="digits", hidden_size=64, cache_dir=None):
    from raot_hf.zoo import build_vit

    return build_vit(dataset, seed=seed, hidden_size=hidden_size, cache_dir=cache_dir)


def _zoo_bert(seed, cache_dir=None):
    from raot_hf.zoo import build_bert

    return build_bert(seed=seed, cache_dir=cache_dir)


def _zoo_minilm(seed, task, cache_dir=None):
    from raot_hf.zoo import build_minilm_sibling

    return build_minilm_sibling(task, seed=seed, cache_dir=cache_dir)


def _resized_vit(seed, dataset, image_size, hidden_size, epochs, cache_dir=None):
    """A ViT shaped like the zoo's digits ViT (8×8 input, 2×2 patches) trained on another data
    set whose images the processor resizes (MNIST 28×28 → 8×8)."""
    from raot_hf.zoo.training import cached_build

    params = {
        "kind": "bench-resized-vit",
        "dataset": dataset,
        "seed": seed,
        "image_size": image_size,
        "patch_size": 2,
        "hidden_size": hidden_size,
        "num_layers": 4,
        "num_heads": 4,
        "intermediate_size": 4 * hidden_size,
        "epochs": epochs,
        "batch_size": 64,
        "learning_rate": 2e-3,
    }
    return cached_build(
        f"bench-vit-{dataset}{image_size}-seed{seed}", params, lambda out: _train_resized_vit(params, out), cache_dir
    )


def _train_resized_vit(params: dict, out_dir: Path) -> dict:
    from transformers import ViTConfig, ViTForImageClassification

    from raot_hf.zoo import load_image_dataset, make_image_processor
    from raot_hf.zoo.training import (
        deterministic_torch,
        fit_and_score,
        steps_for_epochs,
    )

    splits = load_image_dataset(params["dataset"])
    processor = make_image_processor(params["image_size"])
    names = splits["train"].features["label"].names
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
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
    )
    steps = steps_for_epochs(len(splits["train"]), params["batch_size"], params["epochs"])
    with deterministic_torch(params["seed"]):
        model = ViTForImageClassification(config)
        metrics = fit_and_score(
            model,
            processor,
            splits["train"],
            splits["test"],
            seed=params["seed"],
            steps=steps,
            batch_size=params["batch_size"],
            learning_rate=params["learning_rate"],
            weight_decay=0.05,
            description=f"ViT {params['dataset']}@{params['image_size']} seed {params['seed']}",
        )
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return metrics


@functools.lru_cache(maxsize=1)
def _sentiment_tokenizer():
    """The zoo's sentiment BERT tokenizer (built from the Rotten Tomatoes training split only,
    exactly as :func:`raot_hf.zoo.build_bert` builds it, so the two tokenizers are equal)."""
    from raot_hf.zoo import build_wordpiece_tokenizer, load_text_dataset

    return build_wordpiece_tokenizer(list(load_text_dataset("rotten_tomatoes")["train"]["text"]), 8000)


def _task_bert(seed, dataset, epochs, cache_dir=None):
    """A BERT shaped like the zoo's sentiment BERT, trained from scratch on another task with the
    sentiment tokenizer (so that A and B share a vocabulary)."""
    from raot_hf.zoo.training import cached_build

    params = {
        "kind": "bench-task-bert",
        "dataset": dataset,
        "tokenizer": "zoo rotten_tomatoes wordpiece 8000",
        "seed": seed,
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 256,
        "epochs": epochs,
        "max_length": 64,
        "batch_size": 64,
        "learning_rate": 1e-3,
    }
    return cached_build(
        f"bench-bert-{dataset}-seed{seed}", params, lambda out: _train_task_bert(params, out), cache_dir
    )


def _train_task_bert(params: dict, out_dir: Path) -> dict:
    from transformers import BertConfig, BertForSequenceClassification

    from raot_hf.zoo import load_text_dataset
    from raot_hf.zoo.training import (
        deterministic_torch,
        fit_and_score,
        steps_for_epochs,
    )

    splits = load_text_dataset(params["dataset"])
    tokenizer = _sentiment_tokenizer()
    names = splits["train"].features["label"].names
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=params["hidden_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        intermediate_size=params["intermediate_size"],
        max_position_embeddings=max(128, params["max_length"]),
        pad_token_id=tokenizer.pad_token_id,
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
    )
    steps = steps_for_epochs(len(splits["train"]), params["batch_size"], params["epochs"])
    with deterministic_torch(params["seed"]):
        model = BertForSequenceClassification(config)
        metrics = fit_and_score(
            model,
            tokenizer,
            splits["train"],
            splits["test"],
            seed=params["seed"],
            steps=steps,
            batch_size=params["batch_size"],
            learning_rate=params["learning_rate"],
            max_length=params["max_length"],
            description=f"BERT {params['dataset']} seed {params['seed']}",
        )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return metrics


def _tiny_root(cache_dir) -> Path:
    from raot_hf.zoo import default_cache_dir

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / "bench-tiny"


def _tiny_vit(seed, cache_dir=None, scrambled=False):
    """A tiny random ViT (``raot_hf.testing``) saved with its processor; with ``scrambled`` a
    copy of it under a random exact symmetry of the product."""
    import torch

    from raot_hf.symmetry import scramble
    from raot_hf.testing import tiny_image_processor, tiny_model

    out = _tiny_root(cache_dir) / f"vit-seed{seed}{'-scrambled' if scrambled else ''}"
    if (out / "config.json").is_file():
        return out
    model = tiny_model(
        "vit", "image", seed=seed, dtype=torch.float32, hidden_size=16, num_heads=4, intermediate_size=32
    )
    if scrambled:
        scramble(model, seed=seed + 1)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tiny_image_processor().save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
    return out


def _tiny_vit_scrambled(seed, cache_dir=None):
    return _tiny_vit(seed, cache_dir, scrambled=True)


# ------------------------------------------------------------------------- fine-tuned siblings
#: Fine-tuning recipe of the siblings: a short run at a lower learning rate than pre-training,
#: both siblings with the base's seed (same start, same data-order seed; only the data differ).
FINETUNE = {"vit": {"epochs": 3, "learning_rate": 5e-4}, "bert": {"learning_rate": 2e-4}}


def _minilm_base(seed=0, cache_dir=None):
    """The packaged all-MiniLM-L6-v2 (the MiniLM siblings' common start; nothing is trained)."""
    from raot_hf.zoo import minilm_path

    return minilm_path()


def _finetuned_vit(seed, dataset, hidden_size=64, epochs=3, cache_dir=None):
    """The digits ViT of ``seed`` (the base) fine-tuned on ``dataset`` ("digits" or "mnist5k",
    resized to 8×8 by the base's processor); the head is the base's (both label spaces are 0–9)."""
    from raot_hf.zoo.training import cached_build

    base = _zoo_vit(seed, "digits", hidden_size, cache_dir)
    params = {
        "kind": "bench-finetuned-vit",
        "base": Path(base).name,
        "dataset": dataset,
        "seed": seed,
        "epochs": epochs,
        "batch_size": 64,
        "learning_rate": FINETUNE["vit"]["learning_rate"],
    }
    return cached_build(
        f"bench-vit-ft-{dataset}-base{seed}", params, lambda out: _train_finetuned_vit(base, params, out), cache_dir
    )


def _train_finetuned_vit(base: Path, params: dict, out_dir: Path) -> dict:
    from transformers import AutoImageProcessor, ViTForImageClassification

    from raot_hf.zoo import load_image_dataset
    from raot_hf.zoo.training import deterministic_torch, fit_and_score, steps_for_epochs

    splits = load_image_dataset(params["dataset"])
    processor = AutoImageProcessor.from_pretrained(base)
    steps = steps_for_epochs(len(splits["train"]), params["batch_size"], params["epochs"])
    with deterministic_torch(params["seed"]):
        model = ViTForImageClassification.from_pretrained(base)
        metrics = fit_and_score(
            model,
            processor,
            splits["train"],
            splits["test"],
            seed=params["seed"],
            steps=steps,
            batch_size=params["batch_size"],
            learning_rate=params["learning_rate"],
            weight_decay=0.05,
            description=f"ViT fine-tune {params['dataset']} from {params['base']}",
        )
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return metrics


def _finetuned_bert(seed, dataset, epochs, cache_dir=None):
    """The sentiment BERT of ``seed`` (the base) fine-tuned on ``dataset`` with the base's
    tokenizer; for another task than the base's the classifier is re-initialized (seeded)."""
    from raot_hf.zoo.training import cached_build

    base = _zoo_bert(seed, cache_dir)
    params = {
        "kind": "bench-finetuned-bert",
        "base": Path(base).name,
        "dataset": dataset,
        "seed": seed,
        "epochs": epochs,
        "max_length": 64,
        "batch_size": 64,
        "learning_rate": FINETUNE["bert"]["learning_rate"],
    }
    return cached_build(
        f"bench-bert-ft-{dataset}-base{seed}", params, lambda out: _train_finetuned_bert(base, params, out), cache_dir
    )


def _train_finetuned_bert(base: Path, params: dict, out_dir: Path) -> dict:
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from raot_hf.zoo import load_text_dataset
    from raot_hf.zoo.training import deterministic_torch, fit_and_score, steps_for_epochs

    splits = load_text_dataset(params["dataset"])
    tokenizer = AutoTokenizer.from_pretrained(base)
    names = splits["train"].features["label"].names
    steps = steps_for_epochs(len(splits["train"]), params["batch_size"], params["epochs"])
    with deterministic_torch(params["seed"]):
        model = BertForSequenceClassification.from_pretrained(base)
        if [model.config.id2label[i] for i in range(model.config.num_labels)] != list(names):
            model.config.id2label, model.config.label2id = dict(enumerate(names)), {n: i for i, n in enumerate(names)}
            model.classifier = torch.nn.Linear(model.config.hidden_size, len(names))
            torch.nn.init.normal_(model.classifier.weight, std=model.config.initializer_range)
            torch.nn.init.zeros_(model.classifier.bias)
            model.config.num_labels = len(names)
        metrics = fit_and_score(
            model,
            tokenizer,
            splits["train"],
            splits["test"],
            seed=params["seed"],
            steps=steps,
            batch_size=params["batch_size"],
            learning_rate=params["learning_rate"],
            max_length=params["max_length"],
            description=f"BERT fine-tune {params['dataset']} from {params['base']}",
        )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return metrics


BUILDERS = {
    "zoo_vit": _zoo_vit,
    "zoo_bert": _zoo_bert,
    "zoo_minilm": _zoo_minilm,
    "resized_vit": _resized_vit,
    "task_bert": _task_bert,
    "tiny_vit": _tiny_vit,
    "tiny_vit_scrambled": _tiny_vit_scrambled,
    "minilm_base": _minilm_base,
    "finetuned_vit": _finetuned_vit,
    "finetuned_bert": _finetuned_bert,
}
