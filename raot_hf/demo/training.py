"""Training machinery of the demo's model zoo: deterministic splits, cached builds (keyed by every
hyper-parameter plus :data:`ZOO_CODE_VERSION`), a training loop, evaluation."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from huggingface_hub.utils import tqdm

from raot_hf.errors import RaotError

#: Seed of the fixed train/calibration/test split rule of every zoo dataset (independent of any model seed).
SPLIT_SEED = 20240521
#: Examples in every zoo dataset's calibration split.
CALIBRATION_SIZE = 300

logger = logging.getLogger("raot_hf.demo.training")

#: Bumped whenever a change here would change what a zoo build produces (invalidates caches).
ZOO_CODE_VERSION = "zoo-1"

#: Name of the metadata file written into every zoo model directory.
ZOO_INFO_FILE = "zoo_info.json"


def default_cache_dir() -> Path:
    """Return the zoo cache root: ``$RAOT_HF_CACHE`` if set, else ``~/.cache/raot_hf/zoo``."""
    configured = os.environ.get("RAOT_HF_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "raot_hf" / "zoo"


def split_three_ways(
    labels: Sequence[int], n_test: int, n_calibration: int, split_seed: int, sources: Sequence[Any] | None = None
) -> tuple[list[int], list[int], list[int]]:
    """Split example indices into (train, calibration, test), stratified by label; the
    examples of one source (``sources[i]``, e.g. one speech) never straddle two splits. Within each
    label, shuffled sources (``split_seed``) fill test, then calibration, the rest is train; each
    split keeps the original order."""
    sources = list(range(len(labels))) if sources is None else list(sources)
    if len(sources) != len(labels):
        raise RaotError(f"got {len(labels)} labels but {len(sources)} source ids; pass one source per example")
    members: dict[Any, list[int]] = {}
    for index, source in enumerate(sources):
        members.setdefault(source, []).append(index)
    by_label: dict[int, list[Any]] = {}
    for source, indices in members.items():
        by_label.setdefault(int(labels[indices[0]]), []).append(source)
    rng = np.random.default_rng(split_seed)
    test: list[int] = []
    calibration: list[int] = []
    train: list[int] = []
    for label in sorted(by_label):
        label_sources = by_label[label]
        share = sum(len(members[source]) for source in label_sources) / len(labels)
        test_target, calibration_target = round(n_test * share), round(n_calibration * share)
        label_test: list[int] = []
        label_calibration: list[int] = []
        for position in rng.permutation(len(label_sources)):
            source_members = members[label_sources[position]]
            if len(label_test) < test_target:
                label_test.extend(source_members)
            elif len(label_calibration) < calibration_target:
                label_calibration.extend(source_members)
            else:
                train.extend(source_members)
        test.extend(label_test)
        calibration.extend(label_calibration)
    if not train:
        raise RaotError(
            f"split left no training examples ({len(labels)} examples, {n_test} test, "
            f"{n_calibration} calibration); use a larger data set"
        )
    return sorted(train), sorted(calibration), sorted(test)


def build_key(params: dict[str, Any]) -> str:
    """Return a stable hex digest of ``params`` together with :data:`ZOO_CODE_VERSION`."""
    payload = json.dumps({"code_version": ZOO_CODE_VERSION, **params}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cached_build(
    name: str,
    params: dict[str, Any],
    build: Callable[[Path], dict[str, Any]],
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """The cache directory for ``params``, running ``build(tmp_dir)`` (which returns metrics, stored
    in ``zoo_info.json``) only if it is missing; the directory appears atomically (rename)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"{name}-{build_key(params)}"
    if (target / ZOO_INFO_FILE).is_file():
        logger.info("zoo: reusing %s", target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        metrics = build(tmp_dir)
        info = {"name": name, "code_version": ZOO_CODE_VERSION, "params": params, "metrics": metrics}
        (tmp_dir / ZOO_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True, default=str))
        try:
            tmp_dir.rename(target)
        except OSError:
            if not (target / ZOO_INFO_FILE).is_file():
                raise
            logger.info("zoo: %s was built concurrently; keeping the existing copy", target)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("zoo: built %s (%s)", target, metrics)
    return target


def read_zoo_info(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Return the ``zoo_info.json`` of a zoo model directory (params, accuracy, training time)."""
    path = Path(model_dir) / ZOO_INFO_FILE
    if not path.is_file():
        raise RaotError(f"{model_dir} is not a zoo model directory (no {ZOO_INFO_FILE}); build it first")
    return json.loads(path.read_text())


def check_seed_pair(seeds: Sequence[int]) -> tuple[int, int]:
    """Validate a pair of distinct integer seeds and return it as a tuple."""
    pair = tuple(seeds)
    if len(pair) != 2 or not all(isinstance(seed, int) for seed in pair) or pair[0] == pair[1]:
        raise RaotError(f"seeds must be two different integers, got {seeds!r}; pass e.g. seeds=(0, 1)")
    return pair  # type: ignore[return-value]


def build_seed_pair(build, seeds: Sequence[int], **settings) -> tuple:
    """``build(seed=s, **settings)`` for each of two distinct seeds: a pair that differs only in seed."""
    first, second = check_seed_pair(seeds)
    return build(seed=first, **settings), build(seed=second, **settings)


def check_heads(hidden_size: int, num_heads: int) -> None:
    """Raise RaotError unless ``num_heads`` divides ``hidden_size``."""
    if hidden_size <= 0 or num_heads <= 0 or hidden_size % num_heads:
        raise RaotError(
            f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}; "
            "pick a hidden size that is a multiple of the head count"
        )


@contextlib.contextmanager
def deterministic_torch(seed: int) -> Iterator[None]:
    """Seed torch, run single-threaded (weights independent of the core count) with deterministic
    algorithms, and restore the settings and random state after."""
    previous_threads = torch.get_num_threads()
    previous_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(previous_threads)
        torch.use_deterministic_algorithms(previous_deterministic)


def encode_examples(dataset, processor, max_length: int = 64) -> dict[str, torch.Tensor]:
    """Turn a split with an ``image`` or ``text`` column into the model's input tensors."""
    columns = dataset.column_names
    if "image" in columns:
        return dict(processor(list(dataset["image"]), return_tensors="pt"))
    if "text" in columns:
        return dict(
            processor(
                list(dataset["text"]), padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
            )
        )
    raise RaotError(f"dataset has columns {columns}; expected an 'image' or a 'text' column")


def _batch(inputs: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Select rows ``index`` of every input; trim text batches to their longest real sequence."""
    batch = {key: value[index] for key, value in inputs.items()}
    if "attention_mask" in batch:
        length = int(batch["attention_mask"].sum(dim=1).max())
        batch = {key: value[:, :length] for key, value in batch.items()}
    return batch


def train_classifier(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    *,
    seed: int,
    steps: int,
    batch_size: int,
    learning_rate: float,
    weight_decay: float = 0.01,
    warmup_fraction: float = 0.1,
    description: str = "training",
) -> dict[str, float]:
    """Train ``model`` for ``steps`` AdamW steps on mini-batches shuffled by ``seed``, the learning
    rate warmed up over ``warmup_fraction`` then decayed linearly to zero; return loss and time."""
    if steps <= 0:
        raise RaotError(f"training needs at least one step, got steps={steps}; raise epochs or steps")
    n_examples = labels.shape[0]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
    warmup_steps = max(1, int(warmup_fraction * steps))

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (steps - step) / max(1, steps - warmup_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    started = time.perf_counter()
    order = torch.randperm(n_examples, generator=generator)
    cursor = 0
    recent_losses: list[float] = []
    for _ in tqdm(range(steps), desc=description, leave=False):
        if cursor + batch_size > n_examples and cursor > 0:
            order = torch.randperm(n_examples, generator=generator)
            cursor = 0
        index = order[cursor : cursor + batch_size]
        cursor += batch_size
        output = model(**_batch(inputs, index), labels=labels[index])
        optimizer.zero_grad(set_to_none=True)
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        recent_losses = (recent_losses + [output.loss.item()])[-20:]
    model.eval()
    final_loss = sum(recent_losses) / len(recent_losses)
    if not math.isfinite(final_loss):
        raise RuntimeError(f"{description}: training diverged (loss {final_loss}); lower the learning rate")
    return {"train_seconds": round(time.perf_counter() - started, 3), "final_train_loss": final_loss}


def fit_and_score(
    model: torch.nn.Module, processor, train_split, test_split, *, max_length: int = 64, **training
) -> dict[str, float]:
    """Encode ``train_split``, train ``model`` on it (:func:`train_classifier`, which takes the
    ``training`` options: ``seed``, ``steps``, ``batch_size``, ``learning_rate``, ...), and return the
    training metrics with ``test_accuracy`` on ``test_split`` and the step / example counts.
    Call inside :func:`deterministic_torch` for reproducible weights."""
    inputs = encode_examples(train_split, processor, max_length=max_length)
    labels = torch.tensor(train_split["label"])
    metrics = train_classifier(model, inputs, labels, **training)
    metrics["test_accuracy"] = evaluate_accuracy(model, test_split, processor, max_length=max_length)
    metrics.update(steps=training["steps"], train_examples=len(labels), test_examples=len(test_split))
    return metrics


def steps_for_epochs(n_examples: int, batch_size: int, epochs: float) -> int:
    """Return the number of optimizer steps that make ``epochs`` passes over ``n_examples``."""
    if epochs <= 0:
        raise RaotError(f"epochs must be positive, got {epochs}")
    return max(1, math.ceil(epochs * n_examples / batch_size))


def limit_examples(split, max_examples: int | None):
    """Return the first ``max_examples`` examples of ``split`` (all of them when ``None``)."""
    if max_examples is None:
        return split
    return split.select(range(min(max_examples, len(split))))


def label_maps(label_names: Sequence[str]) -> dict[str, Any]:
    """Return the ``num_labels`` / ``id2label`` / ``label2id`` config arguments for ``label_names``."""
    return {
        "num_labels": len(label_names),
        "id2label": dict(enumerate(label_names)),
        "label2id": {name: index for index, name in enumerate(label_names)},
    }


def train_and_save(
    out_dir: Path,
    params: dict[str, Any],
    make_model: Callable[[], torch.nn.Module],
    processor,
    train_split,
    test_split,
    *,
    steps: int | None = None,
    weight_decay: float = 0.01,
    description: str,
) -> dict[str, float]:
    """Train a classifier reproducibly (``make_model()`` runs seeded, inside :func:`deterministic_torch`),
    score it and save it with its processor into ``out_dir``; ``steps`` defaults to
    ``params["epochs"]`` passes. Returns the metrics :func:`cached_build` stores."""
    if steps is None:
        steps = steps_for_epochs(len(train_split), params["batch_size"], params["epochs"])
    with deterministic_torch(params["seed"]):
        model = make_model()
        metrics = fit_and_score(
            model,
            processor,
            train_split,
            test_split,
            seed=params["seed"],
            steps=steps,
            batch_size=params["batch_size"],
            learning_rate=params["learning_rate"],
            max_length=params.get("max_length", 64),
            weight_decay=weight_decay,
            description=description,
        )
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    logger.info(
        "%s: test accuracy %.3f after %d steps in %.1fs",
        description,
        metrics["test_accuracy"],
        steps,
        metrics["train_seconds"],
    )
    return metrics


@torch.no_grad()
def evaluate_accuracy(model, dataset, processor, batch_size: int = 128, max_length: int = 64) -> float:
    """The fraction of ``dataset`` (``label`` plus ``image`` or ``text``) that ``model`` (or a
    directory to load it from) classifies correctly."""
    if isinstance(model, (str, os.PathLike)):
        model = _load_classifier(Path(model))
    if not hasattr(dataset, "column_names") or isinstance(dataset.column_names, dict):
        raise RaotError("evaluate_accuracy needs one split (a datasets.Dataset), e.g. dataset['test']")
    if "label" not in dataset.column_names:
        raise RaotError(f"dataset has columns {dataset.column_names}; expected a 'label' column")
    if len(dataset) == 0:
        raise RaotError("evaluate_accuracy got an empty dataset; pass a split with examples")
    was_training = model.training
    model.eval()
    labels = torch.tensor(dataset["label"])
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, len(dataset), batch_size):
        chunk = dataset.select(range(start, min(start + batch_size, len(dataset))))
        inputs = encode_examples(chunk, processor, max_length=max_length)
        inputs = _batch(inputs, torch.arange(len(chunk)))
        logits = model(**{key: value.to(device) for key, value in inputs.items()}).logits
        correct += int((logits.argmax(dim=-1).cpu() == labels[start : start + len(chunk)]).sum())
    model.train(was_training)
    return correct / len(dataset)


def _load_classifier(path: Path):
    """Load an image- or sequence-classification model from a directory, by its config."""
    from transformers import AutoConfig, AutoModelForImageClassification, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "model_type", "") == "vit":
        return AutoModelForImageClassification.from_pretrained(path)
    return AutoModelForSequenceClassification.from_pretrained(path)
