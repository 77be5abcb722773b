"""Calibration batches: the sampled data as model-ready batches, sharded across data-parallel ranks
(:func:`shard_example_ids`), each row tagged with its global example id and fit / held-out flag."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import torch

from raot_hf.calibration.settings import CalibrationConfig
from raot_hf.calibration.sources import check_column, detect_modality
from raot_hf.errors import RaotError

logger = logging.getLogger("raot_hf.calibration.batches")


@dataclass
class CalibrationBatch:
    """One batch of calibration rows, ready for ``model(**batch.inputs)``: ``example_ids`` (global
    indices in the sample), ``heldout`` flags (:func:`is_heldout`), ``token_mask`` (``(batch, seq)``
    real tokens for text; ``None`` for images, where every position is real)."""

    inputs: dict[str, torch.Tensor]
    example_ids: torch.Tensor
    heldout: torch.Tensor
    token_mask: torch.Tensor | None

    def __len__(self) -> int:
        return int(self.example_ids.numel())


def is_heldout(example_ids: torch.Tensor | Sequence[int], heldout_every: int) -> torch.Tensor:
    """The held-out flag per example id, ``example_id % heldout_every == 0``: the fixed split between
    fit statistics (estimators) and held-out statistics (gate)."""
    ids = torch.as_tensor(example_ids, dtype=torch.long)
    return ids % heldout_every == 0


def shard_example_ids(num_examples: int, *, rank: int = 0, world_size: int = 1) -> range:
    """The example ids rank ``rank`` processes, ``rank, rank + world_size, ...``: no padding or
    duplication (the shards' union is exactly ``range(num_examples)``)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise RaotError(f"world_size must be an integer >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise RaotError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    return range(rank, num_examples, world_size)


def _split_ids(ids: range, config: CalibrationConfig, split: str | None) -> Sequence[int]:
    """This rank's example ids of one split (``"fit"`` / ``"heldout"``), or all for ``None``."""
    if split is None:
        return ids
    if split not in ("fit", "heldout"):
        raise RaotError(f"split must be 'fit', 'heldout' or None, got {split!r}")
    want = split == "heldout"
    return [i for i in ids if (i % config.heldout_every == 0) == want]


def count_calibration_examples(
    dataset: datasets.Dataset,
    config: CalibrationConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    split: str | None = None,
) -> int:
    """Number of examples of ``split`` :func:`iter_calibration_batches` yields on this rank."""
    return len(_split_ids(shard_example_ids(len(dataset), rank=rank, world_size=world_size), config, split))


def count_calibration_batches(dataset: datasets.Dataset, config: CalibrationConfig, **shard: Any) -> int:
    """Number of batches :func:`iter_calibration_batches` yields on this rank (for progress bars);
    ``shard``: ``rank``, ``world_size`` and ``split`` as for :func:`count_calibration_examples`."""
    return -(-count_calibration_examples(dataset, config, **shard) // config.batch_size)


def iter_calibration_batches(
    dataset: datasets.Dataset,
    processor: Any,
    config: CalibrationConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    split: str | None = None,
    encodings: dict | None = None,
) -> Iterator[CalibrationBatch]:
    """Yield this rank's calibration batches (:func:`shard_example_ids`; only fit or held-out ones
    for ``split``) in a fixed order, ``config.batch_size`` at a time. Text is tokenized with
    truncation to ``config.max_length`` and padded per batch; images are converted to the processor's
    colour mode. Inputs never contain labels. ``encodings`` (a dict the caller keeps): each example
    is tokenized once across every pass that shares it."""
    modality = detect_modality(processor)
    column = check_column(dataset, config.column, modality)
    ids = _split_ids(shard_example_ids(len(dataset), rank=rank, world_size=world_size), config, split)
    if modality == "text":
        encode = _text_encoder(_component(processor, "tokenizer"), config, encodings)
    else:
        encode = _image_encoder(_component(processor, "image_processor"))
    column_only = dataset.select_columns([column])
    for start in range(0, len(ids), config.batch_size):
        batch_ids = list(ids[start : start + config.batch_size])
        values = column_only[batch_ids][column]
        inputs, token_mask = encode(values, batch_ids, column)
        example_ids = torch.tensor(batch_ids, dtype=torch.long)
        yield CalibrationBatch(inputs, example_ids, is_heldout(example_ids, config.heldout_every), token_mask)


def _component(processor: Any, attribute: str) -> Any:
    from transformers import ProcessorMixin

    return getattr(processor, attribute) if isinstance(processor, ProcessorMixin) else processor


def _model_inputs(encoded: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in encoded.items() if k not in ("labels", "label") and isinstance(v, torch.Tensor)}


def _padding_copy(tokenizer: Any) -> Any:
    """A copy of a tokenizer without a pad token (GPT-2, Llama) that pads with its end-of-text token
    on the right: padded positions are masked out (docs/design.md §4.1) and right padding leaves the
    real tokens' activations as they are unpadded. The caller's tokenizer is untouched."""
    if tokenizer.eos_token is None:
        raise RaotError(
            f"the tokenizer {type(tokenizer).__name__} has neither a pad nor an end-of-text token, so batches "
            "cannot be padded; set batch_size to 1 or give the tokenizer a pad token"
        )
    padded = copy.deepcopy(tokenizer)
    padded.pad_token = padded.eos_token
    padded.padding_side = "right"
    logger.info("the tokenizer has no pad token: calibration batches are padded with %r (masked)", padded.eos_token)
    return padded


def _text_encoder(tokenizer: Any, config: CalibrationConfig, encodings: dict | None = None):
    max_length = config.max_length
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and 0 < model_max < max_length:
        logger.warning("max_length %d exceeds the tokenizer's limit %d; using %d", max_length, model_max, model_max)
        max_length = model_max
    if config.batch_size > 1 and tokenizer.pad_token is None:
        tokenizer = _padding_copy(tokenizer)
    cache = {} if encodings is None else encodings

    def encode(values: list, batch_ids: list[int], column: str):
        todo = [(i, v) for i, v in zip(batch_ids, values) if i not in cache]
        for value, example_id in zip(values, batch_ids):
            if not isinstance(value, str):
                raise RaotError(
                    f"row {example_id} of calibration column {column!r} is {value!r}, not text; "
                    "drop such rows or pick another column"
                )
        if todo:  # each example is tokenized once; a batch is only padded
            encoded = tokenizer([v for _, v in todo], truncation=True, max_length=max_length)
            for j, (example_id, _) in enumerate(todo):
                cache[example_id] = {k: v[j] for k, v in encoded.items() if k not in ("labels", "label")}
        padded = tokenizer.pad([cache[i] for i in batch_ids], padding=True, return_tensors="pt")
        inputs = _model_inputs(padded)
        return inputs, inputs["attention_mask"].bool()

    return encode


#: Texts of the sample the tokenizer check encodes (cheap against one forward pass).
TOKENIZER_CHECK_TEXTS = 64


def check_tokenizer_reads_text(dataset: datasets.Dataset, column: str, processor: Any) -> None:
    """Refuse calibration text that A's tokenizer cannot read, before any forward pass (texts that all
    encode alike identify nothing, and the gate cannot tell a wrong map from a right one). Up to
    :data:`TOKENIZER_CHECK_TEXTS` texts are encoded without special tokens: none with a token, or all
    alike, is refused; over half unknown tokens is a warning."""
    if detect_modality(processor) != "text" or len(dataset) == 0:
        return
    tokenizer = _component(processor, "tokenizer")
    rows = dataset.select_columns([column]).select(range(min(len(dataset), TOKENIZER_CHECK_TEXTS)))
    texts = [t for t in rows[column] if isinstance(t, str)]
    if not texts:
        return
    encoded = [tuple(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    name, shown = type(tokenizer).__name__, texts[0][:40]
    if not any(encoded):
        raise RaotError(
            f"A's tokenizer ({name}) encodes the calibration texts to no tokens at all (e.g. {shown!r} → []); "
            "it does not read this data — pass the tokenizer the models were trained with (preprocessor=)"
        )
    if len(texts) > 1 and len(set(encoded)) == 1:
        raise RaotError(
            f"A's tokenizer ({name}) encodes all {len(texts)} calibration texts checked to the same ids "
            f"{list(encoded[0])[:8]}; nothing can be estimated from one input — check the tokenizer and the column"
        )
    unk = getattr(tokenizer, "unk_token_id", None)
    total = sum(len(e) for e in encoded)
    if unk is not None and total and sum(e.count(unk) for e in encoded) > total / 2:
        logger.warning(
            "over half of the calibration tokens are %s's unknown token: the tokenizer may not match the data", name
        )


def expected_image_mode(image_processor: Any) -> str:
    """PIL mode the image processor expects: ``"L"`` for one-channel normalization, else RGB."""
    if getattr(image_processor, "do_convert_rgb", None):
        return "RGB"
    mean = getattr(image_processor, "image_mean", None)
    if isinstance(mean, list | tuple) and len(mean) == 1:
        return "L"
    return "RGB"


def _image_encoder(image_processor: Any):
    mode = expected_image_mode(image_processor)

    def encode(values: list, batch_ids: list[int], column: str):
        images = []
        for value, example_id in zip(values, batch_ids):
            if value is None:
                raise RaotError(f"row {example_id} of calibration column {column!r} has no image; drop such rows")
            images.append(value if value.mode == mode else value.convert(mode))
        encoded = image_processor(images=images, return_tensors="pt")
        return _model_inputs(encoded), None

    return encode
