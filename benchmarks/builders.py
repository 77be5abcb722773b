"""Builders of the benchmarked parents: each turns a :class:`benchmarks.pairs.ModelSpec` into a
directory that ``from_pretrained`` loads, trained reproducibly and cached through
:func:`raot_hf.demo.cached_build` (or, for the tiny smoke-test models, written once).

Each builder is its settings (the cache key) plus one call into the zoo (:mod:`benchmarks.zoo`):
the zoo's own ViTs, BERTs and MiniLM siblings; ViTs on resized MNIST and BERTs on the party task
with the sentiment tokenizer (the zoo's trainers with other settings); and fine-tuned siblings:
two fine-tunes of one zoo parent (the *base*) on two different data sets or tasks.
"""

from __future__ import annotations

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
    from benchmarks.zoo import build_vit

    return build_vit(dataset, seed=seed, hidden_size=hidden_size, cache_dir=cache_dir)


def _zoo_bert(seed, cache_dir=None):
    from benchmarks.zoo import build_bert

    return build_bert(seed=seed, cache_dir=cache_dir)


def _zoo_minilm(seed, task, cache_dir=None):
    from benchmarks.zoo import build_minilm_sibling

    return build_minilm_sibling(task, seed=seed, cache_dir=cache_dir)


def _resized_vit(seed, dataset, image_size, hidden_size, epochs, cache_dir=None):
    """A ViT shaped like the zoo's digits ViT (8×8 input, 2×2 patches) trained on another data
    set whose images the processor resizes (MNIST 28×28 → 8×8)."""
    from benchmarks.zoo import cached_build, train_vit

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
        f"bench-vit-{dataset}{image_size}-seed{seed}", params, lambda out: train_vit(params, out), cache_dir
    )


def _task_bert(seed, dataset, epochs, cache_dir=None):
    """A BERT shaped like the zoo's sentiment BERT, trained from scratch on another task with the
    sentiment tokenizer (so that A and B share a vocabulary)."""
    from benchmarks.zoo import cached_build, sentiment_tokenizer, train_bert

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
        f"bench-bert-{dataset}-seed{seed}",
        params,
        lambda out: train_bert(params, out, tokenizer=sentiment_tokenizer()),
        cache_dir,
    )


def _tiny_root(cache_dir) -> Path:
    from benchmarks.zoo import default_cache_dir

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
    from benchmarks.zoo import minilm_path

    return minilm_path()


def _finetuned(family: str, base, seed, dataset, epochs, cache_dir, **extra):
    """``base`` fine-tuned on ``dataset`` (:func:`benchmarks.zoo.finetune`), cached by all settings."""
    from benchmarks.zoo import cached_build, finetune

    params = {
        "kind": f"bench-finetuned-{family}",
        "base": Path(base).name,
        "dataset": dataset,
        "seed": seed,
        "epochs": epochs,
        "batch_size": 64,
        "learning_rate": FINETUNE[family]["learning_rate"],
        **extra,
    }
    name = f"bench-{family}-ft-{dataset}-base{seed}"
    return cached_build(name, params, lambda out: finetune(base, params, out), cache_dir)


def _finetuned_vit(seed, dataset, hidden_size=64, epochs=3, cache_dir=None):
    """The digits ViT of ``seed`` (the base) fine-tuned on ``dataset`` ("digits" or "mnist5k",
    resized to 8×8 by the base's processor); the head is the base's (both label spaces are 0–9)."""
    return _finetuned("vit", _zoo_vit(seed, "digits", hidden_size, cache_dir), seed, dataset, epochs, cache_dir)


def _finetuned_bert(seed, dataset, epochs, cache_dir=None):
    """The sentiment BERT of ``seed`` (the base) fine-tuned on ``dataset`` with the base's
    tokenizer; for another task than the base's the classifier is re-initialized (seeded)."""
    return _finetuned("bert", _zoo_bert(seed, cache_dir), seed, dataset, epochs, cache_dir, max_length=64)


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
