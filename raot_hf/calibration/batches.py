"""Calibration batches: the sampled data as model-ready batches, split and sharded.

The merger runs models A and B over the same calibration batches (one forward pass each) and
accumulates sufficient statistics. :func:`iter_calibration_batches` turns the sample drawn by
:func:`~raot_hf.calibration.sources.load_calibration_dataset` into batches, sharded across
data-parallel ranks without padding or duplication (:func:`shard_example_ids`), each row tagged
with its global example id and its fit / held-out flag (:func:`is_heldout`).
"""

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
    """One batch of calibration rows, ready for ``model(**batch.inputs)``.

    ``example_ids`` are the rows' global indices in the sampled dataset (identical on every
    rank); ``heldout`` flags the held-out rows (:func:`is_heldout`). ``token_mask`` is
    ``(batch, seq)`` and marks real tokens for text (the attention mask). For images it is
    ``None``: every position the model produces (patches plus any special tokens) is real,
    so consumers treat all positions as real.
    """

    inputs: dict[str, torch.Tensor]
    example_ids: torch.Tensor
    heldout: torch.Tensor
    token_mask: torch.Tensor | None

    def __len__(self) -> int:
        return int(self.example_ids.numel())


def is_heldout(example_ids: torch.Tensor | Sequence[int], heldout_every: int) -> torch.Tensor:
    """Return the held-out flag per example id: ``example_id % heldout_every == 0``.

    This is the fixed split between fit statistics (estimators) and held-out statistics (gate).
    """
    ids = torch.as_tensor(example_ids, dtype=torch.long)
    return ids % heldout_every == 0


# ---------------------------------------------------------------------------------- batching


def shard_example_ids(num_examples: int, *, rank: int = 0, world_size: int = 1) -> range:
    """Return the example ids rank ``rank`` processes: ``rank, rank + world_size, ...``.

    No padding or duplication: shards may differ in size by one and their union is exactly
    ``range(num_examples)``.
    """
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
    """Yield this rank's calibration batches in a fixed order.

    Rank ``r`` takes examples ``r, r + world_size, ...`` of the sampled ``dataset`` (see
    :func:`shard_example_ids`) — only the fit or only the held-out ones when ``split`` is
    ``"fit"`` / ``"heldout"`` (:func:`is_heldout`) — in chunks of ``config.batch_size``. Text is tokenized with
    ``padding=True, truncation=True, max_length=config.max_length``; images are converted to
    the colour mode the image processor expects and processed as one list per batch. Inputs
    never contain labels. ``encodings`` (a dict the caller keeps): texts are tokenized once per
    example id across every pass that shares it, and only padded per batch.
    """
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
        yield CalibrationBatch(
            inputs=inputs,
            example_ids=example_ids,
            heldout=is_heldout(example_ids, config.heldout_every),
            token_mask=token_mask,
        )


def _component(processor: Any, attribute: str) -> Any:
    from transformers import ProcessorMixin

    return getattr(processor, attribute) if isinstance(processor, ProcessorMixin) else processor


def _model_inputs(encoded: Any) -> dict[str, torch.Tensor]:
    return {
        key: value
        for key, value in encoded.items()
        if key not in ("labels", "label") and isinstance(value, torch.Tensor)
    }


def _padding_copy(tokenizer: Any) -> Any:
    """A copy of a tokenizer without a pad token (GPT-2, Llama) that pads with its end-of-text
    token on the right. Padded positions are masked out of every statistic (docs/design.md §4.1),
    and right padding leaves the real tokens' positions — and, under causal attention, their
    activations — as they are unpadded. The caller's tokenizer (saved with the merge) is untouched."""
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
    """Refuse calibration text that A's tokenizer cannot read, before any forward pass.

    Estimates from texts that all encode to the same ids are not identified: every example shows
    the models one input, the held-out split the same one, so the gate cannot tell a wrong map
    from a right one (a word-level test tokenizer reloaded as Qwen2's byte-level class turns every
    "w5 w17 …" into no tokens, and such a merge went through with a relative error of 0.4). Up to
    :data:`TOKENIZER_CHECK_TEXTS` texts are encoded without special tokens: if none has a token,
    or all encode alike, the data is refused; if over half their tokens are the unknown token, a
    warning says so."""
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
