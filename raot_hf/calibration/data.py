"""Calibration data: load a small sample, split it into fit / held-out rows, and batch it.

The merger runs models A and B over the same calibration batches (one forward pass each) and
accumulates sufficient statistics. This module is the data side of that pass:

* :class:`CalibrationConfig` says where the data comes from and how much of it to use.
* :func:`load_calibration_dataset` loads it (Hub id, local file, ``save_to_disk`` directory,
  image folder, or an in-memory :class:`datasets.Dataset`) and draws a seeded sample.
* :func:`iter_calibration_batches` turns the sample into model-ready batches, sharded across
  data-parallel ranks without padding or duplication, each row tagged with its global example
  id and its fit / held-out flag (:func:`is_heldout`).
* :func:`dataset_fingerprint` hashes the sampled content for the provenance report.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import datasets
import numpy as np
import torch

from raot_hf.errors import RaotError

logger = logging.getLogger("raot_hf.calibration.data")

Modality = Literal["text", "image"]

#: Column names tried first (in this order) when ``column`` is not given.
TEXT_COLUMN_NAMES = (
    "text",
    "sentence",
    "content",
    "review",
    "document",
    "sentence1",
    "question",
    "premise",
    "title",
)
IMAGE_COLUMN_NAMES = ("image", "img", "picture", "photo", "pixel_values")

#: Local file extensions and the ``datasets`` builder that reads them.
FILE_BUILDERS = {
    ".csv": "csv",
    ".tsv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
_SAVE_TO_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_MAX_REASON_CHARS = 240


@dataclass
class CalibrationConfig:
    """Where the calibration data comes from and how it is sampled and batched.

    ``source`` is a Hub dataset id, a local data file (csv/tsv/json/jsonl/parquet/arrow/txt),
    a directory written by ``Dataset.save_to_disk``, or a folder of images. ``split`` accepts
    ``datasets`` slicing syntax (``"train[:2000]"``) for Hub ids and local files. ``column``
    is auto-detected when ``None``. Rows whose example id is a multiple of ``heldout_every``
    are held out (scored by the gate, never fitted). ``moment_stride`` > 1 computes the fit
    cross moments from every s-th real token of each example only (see
    :class:`~raot_hf.calibration.collector.StatisticsCollector`): s times cheaper, 1/√s noisier.
    """

    source: str | None = None
    config_name: str | None = None
    split: str = "train"
    column: str | None = None
    num_samples: int = 512
    max_length: int = 128
    batch_size: int = 32
    seed: int = 0
    heldout_every: int = 4
    moment_stride: int = 1

    def __post_init__(self) -> None:
        for name in ("source", "config_name", "column"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RaotError(f"calibration {name} must be a non-empty string or None, got {value!r}")
        if not isinstance(self.split, str) or not self.split:
            raise RaotError(f"calibration split must be a non-empty string like 'train', got {self.split!r}")
        for name in ("num_samples", "max_length", "batch_size"):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("seed", self.seed, minimum=0)
        _require_int("heldout_every", self.heldout_every, minimum=2)
        _require_int("moment_stride", self.moment_stride, minimum=1)

    def to_dict(self) -> dict[str, Any]:
        """Return the settings as a JSON-safe dict (the inverse of :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationConfig:
        """Build a config from :meth:`to_dict` output; unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            raise RaotError(
                f"unknown calibration setting(s) {', '.join(map(repr, unknown))}; valid: {', '.join(sorted(known))}"
            )
        return cls(**data)


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RaotError(
            f"calibration {name} must be an integer >= {minimum}, got {value!r}; set it to an integer >= {minimum}"
        )


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


# ----------------------------------------------------------------------------------- loading


def load_calibration_dataset(
    config_or_dataset: CalibrationConfig | datasets.Dataset | datasets.DatasetDict,
    *,
    config: CalibrationConfig | None = None,
    trust_remote_code: bool = False,
    token: str | bool | None = None,
    revision: str | None = None,
) -> datasets.Dataset:
    """Load the calibration data and draw its seeded sample.

    ``config_or_dataset`` is a :class:`CalibrationConfig` (its ``source`` says what to load) or
    an in-memory ``datasets.Dataset`` / ``DatasetDict``; an in-memory dataset is sampled like
    any other source, with ``config``'s seed and ``num_samples`` (defaults when ``config`` is
    None). The sample is a seeded permutation truncated to ``num_samples`` rows (all rows if
    fewer). ``token``/``revision``/``trust_remote_code`` only matter for Hub ids (recent
    ``datasets`` releases no longer run loading scripts at all).
    """
    if isinstance(config_or_dataset, CalibrationConfig):
        config = config_or_dataset
        if config.source is None:
            raise RaotError(
                "no calibration data given; set source to a Hub dataset id, a local file or "
                "directory, or pass a datasets.Dataset"
            )
        dataset = _load_source(config, trust_remote_code=trust_remote_code, token=token, revision=revision)
        where = config.source
    elif isinstance(config_or_dataset, datasets.DatasetDict | datasets.Dataset):
        config = config if config is not None else CalibrationConfig()
        dataset = config_or_dataset
        if isinstance(dataset, datasets.DatasetDict):
            dataset = _pick_split(dataset, config.split, "the given DatasetDict")
        where = "the given dataset"
    else:
        raise RaotError(
            f"calibration data must be a CalibrationConfig or a datasets.Dataset, got "
            f"{type(config_or_dataset).__name__}; load streaming/iterable data into a Dataset first"
        )

    if len(dataset) == 0:
        raise RaotError(
            f"calibration data from {where} (split {config.split!r}) has no rows; "
            "pass a non-empty dataset or another split"
        )
    if config.column is not None and config.column not in dataset.column_names:
        raise RaotError(
            f"column {config.column!r} not in the calibration data from {where} "
            f"(columns: {', '.join(dataset.column_names)}); pass --column with one of them"
        )
    total = len(dataset)
    keep = min(config.num_samples, total)
    if keep < 2:
        raise RaotError(
            f"calibration data from {where} has {keep} row; need at least 2 so that both fit "
            "and held-out rows exist; pass more data or raise num_samples"
        )
    order = np.random.default_rng(config.seed).permutation(total)[:keep]
    sample = dataset.select(order.tolist(), keep_in_memory=True)
    stage = {"stage": True}  # a line the CLI shows by default (raot_hf.cli.verbosity)
    message = "calibration data: %d rows sampled from %d in %s (seed %d)"
    logger.info(message, keep, total, where, config.seed, extra=stage)
    return sample


def _load_source(
    config: CalibrationConfig, *, trust_remote_code: bool, token: str | bool | None, revision: str | None
) -> datasets.Dataset:
    """Dispatch on what ``config.source`` is and return the requested split."""
    source = config.source
    path = os.path.expanduser(source)
    split_name = config.split.split("[", 1)[0]
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, marker)) for marker in _SAVE_TO_DISK_MARKERS):
            logger.info("loading calibration data saved with save_to_disk from %s", path)
            loaded = _guarded(lambda: datasets.load_from_disk(path), source, allow_dict=True)
            if isinstance(loaded, datasets.DatasetDict):
                return _pick_split(loaded, config.split, source)
            return loaded
        if _holds_images(path):
            logger.info("loading calibration images from folder %s", path)
            return _guarded(lambda: datasets.load_dataset("imagefolder", data_dir=path, split=config.split), source)
        if _holds_data_files(path):
            logger.info("loading calibration data files from directory %s", path)
            return _guarded(lambda: datasets.load_dataset(path, split=config.split), source)
        raise RaotError(
            f"calibration directory {source!r} holds no dataset (no save_to_disk files, images, "
            f"or {'/'.join(sorted({e[1:] for e in FILE_BUILDERS}))} files); point source at one"
        )
    if os.path.isfile(path):
        extension = os.path.splitext(path)[1].lower()
        builder = FILE_BUILDERS.get(extension)
        if builder is None:
            raise RaotError(
                f"calibration file {source!r} has unsupported extension {extension!r}; use one of "
                f"{', '.join(sorted(FILE_BUILDERS))}, a save_to_disk directory, or an image folder"
            )
        kwargs: dict[str, Any] = {"delimiter": "\t"} if extension == ".tsv" else {}
        logger.info("loading calibration data from %s file %s", builder, path)
        return _guarded(
            lambda: datasets.load_dataset(builder, data_files={split_name: path}, split=config.split, **kwargs),
            source,
        )
    if _looks_like_local_path(source):
        raise RaotError(
            f"calibration source {source!r} not found: no such file or directory, and it is not a "
            "Hub dataset id; check the path"
        )
    logger.info("loading calibration data %r (config %r) from the Hub", source, config.config_name)
    hub_kwargs: dict[str, Any] = {"token": token, "revision": revision}
    if trust_remote_code:
        hub_kwargs["trust_remote_code"] = True
    return _guarded(
        lambda: datasets.load_dataset(source, config.config_name, split=config.split, **hub_kwargs),
        source,
        hint="check the id, config and split, pass a token for gated datasets, or use a local path",
    )


def _guarded(load, source: str, hint: str = "check the data and the split", *, allow_dict: bool = False):
    """Run a ``datasets`` load and turn its failures into one-line :class:`RaotError`."""
    try:
        loaded = load()
    except RaotError:
        raise
    except Exception as exc:  # any loader failure is a user-facing data problem
        if "corresponds to no data" in str(exc):  # datasets' wording for an empty file or split
            raise RaotError(
                f"calibration data {source!r} has no rows in the requested split; "
                "pass a non-empty dataset or another split"
            ) from None
        raise RaotError(f"could not load calibration data {source!r}: {_one_line(exc)}; {hint}") from exc
    if not isinstance(loaded, datasets.Dataset) and not (allow_dict and isinstance(loaded, datasets.DatasetDict)):
        raise RaotError(
            f"calibration data {source!r} loaded as {type(loaded).__name__}, not a Dataset; "
            "pass a split such as 'train'"
        )
    return loaded


def _pick_split(dataset_dict: datasets.DatasetDict, split: str, where: str) -> datasets.Dataset:
    if split not in dataset_dict:
        raise RaotError(
            f"split {split!r} not in the calibration data from {where} "
            f"(splits: {', '.join(dataset_dict)}); pass --split with one of them"
        )
    return dataset_dict[split]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    reason = f"{type(exc).__name__}: {text}"
    return reason if len(reason) <= _MAX_REASON_CHARS else reason[: _MAX_REASON_CHARS - 3] + "..."


def _walk_extensions(path: str) -> set[str]:
    found = set()
    for _, _, files in os.walk(path):
        found.update(os.path.splitext(name)[1].lower() for name in files)
    return found


def _holds_images(path: str) -> bool:
    return bool(_walk_extensions(path) & IMAGE_EXTENSIONS)


def _holds_data_files(path: str) -> bool:
    return bool(_walk_extensions(path) & set(FILE_BUILDERS))


def _looks_like_local_path(source: str) -> bool:
    """True when ``source`` cannot be a Hub id, so a missing file must not go to the network."""
    if os.path.isabs(source) or source.startswith((".", "~")) or "\\" in source:
        return True
    if os.path.splitext(source)[1].lower() in FILE_BUILDERS:
        return True
    return _HUB_ID.match(source) is None


# --------------------------------------------------------------------- modality and columns


def detect_modality(processor: Any) -> Modality:
    """Return ``"text"`` for a tokenizer and ``"image"`` for an image processor.

    A multi-part processor (``ProcessorMixin``) counts by the part it has; one with both a
    tokenizer and an image processor is ambiguous and rejected (raot_hf merges text-only or
    image-only models).
    """
    from transformers import ImageProcessingMixin, PreTrainedTokenizerBase, ProcessorMixin

    if isinstance(processor, PreTrainedTokenizerBase):
        return "text"
    if isinstance(processor, ImageProcessingMixin):
        return "image"
    if isinstance(processor, ProcessorMixin):
        has_text = getattr(processor, "tokenizer", None) is not None
        has_image = getattr(processor, "image_processor", None) is not None
        if has_text != has_image:
            return "text" if has_text else "image"
    raise RaotError(
        f"unsupported processor {type(processor).__name__}; pass a tokenizer (text models) "
        "or an image processor (image models)"
    )


def _feature_kind(feature: Any) -> str:
    """``"text"``, ``"image"``, or a short description of what a column holds."""
    if isinstance(feature, datasets.Image):
        return "image"
    if isinstance(feature, datasets.Value):
        return "text" if feature.dtype in ("string", "large_string") else feature.dtype
    return type(feature).__name__


def _describe_kind(kind: str) -> str:
    return {"text": "text", "image": "images"}.get(kind, f"{kind} values")


def check_column(
    dataset: datasets.Dataset, column: str | None, modality: Modality, *, model_label: str = "the model"
) -> str:
    """Resolve the calibration column for a model taking ``modality`` and return its name.

    With ``column=None`` the first preferred name (:data:`TEXT_COLUMN_NAMES` /
    :data:`IMAGE_COLUMN_NAMES`) of the right kind is picked, else the first column of the right
    kind. A missing column, or one holding the wrong kind of data, is a :class:`RaotError`.
    """
    if modality not in ("text", "image"):
        raise RaotError(f"modality must be 'text' or 'image', got {modality!r}")
    kinds = {name: _feature_kind(feature) for name, feature in dataset.features.items()}
    matching = [name for name, kind in kinds.items() if kind == modality]
    other = "an image" if modality == "image" else "a text"
    if column is not None:
        if column not in kinds:
            raise RaotError(
                f"column {column!r} not in the calibration data (columns: {', '.join(kinds)}); "
                "pass --column with one of them"
            )
        if kinds[column] != modality:
            choices = f" (candidates: {', '.join(matching)})" if matching else ""
            raise RaotError(
                f"column {column!r} holds {_describe_kind(kinds[column])} but {model_label} takes "
                f"{_describe_kind(modality)}; pass --column with {other} column{choices}"
            )
        return column
    preferred = TEXT_COLUMN_NAMES if modality == "text" else IMAGE_COLUMN_NAMES
    for name in (*preferred, *matching):
        if kinds.get(name) == modality:
            logger.info("calibration column auto-detected: %r", name)
            return name
    described = ", ".join(f"{name} ({_describe_kind(kind)})" for name, kind in kinds.items())
    raise RaotError(
        f"the calibration data has no {modality} column (columns: {described}) but {model_label} "
        f"takes {_describe_kind(modality)}; pass {other} dataset"
    )


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


def count_calibration_batches(
    dataset: datasets.Dataset,
    config: CalibrationConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    split: str | None = None,
) -> int:
    """Number of batches :func:`iter_calibration_batches` yields on this rank (for progress bars)."""
    ids = _split_ids(shard_example_ids(len(dataset), rank=rank, world_size=world_size), config, split)
    return -(-len(ids) // config.batch_size)


def iter_calibration_batches(
    dataset: datasets.Dataset,
    processor: Any,
    config: CalibrationConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    split: str | None = None,
) -> Iterator[CalibrationBatch]:
    """Yield this rank's calibration batches in a fixed order.

    Rank ``r`` takes examples ``r, r + world_size, ...`` of the sampled ``dataset`` (see
    :func:`shard_example_ids`) — only the fit or only the held-out ones when ``split`` is
    ``"fit"`` / ``"heldout"`` (:func:`is_heldout`) — in chunks of ``config.batch_size``. Text is tokenized with
    ``padding=True, truncation=True, max_length=config.max_length``; images are converted to
    the colour mode the image processor expects and processed as one list per batch. Inputs
    never contain labels.
    """
    modality = detect_modality(processor)
    column = check_column(dataset, config.column, modality)
    ids = _split_ids(shard_example_ids(len(dataset), rank=rank, world_size=world_size), config, split)
    if modality == "text":
        encode = _text_encoder(_component(processor, "tokenizer"), config)
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


def _text_encoder(tokenizer: Any, config: CalibrationConfig):
    max_length = config.max_length
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and 0 < model_max < max_length:
        logger.warning("max_length %d exceeds the tokenizer's limit %d; using %d", max_length, model_max, model_max)
        max_length = model_max
    if config.batch_size > 1 and tokenizer.pad_token is None:
        tokenizer = _padding_copy(tokenizer)

    def encode(values: list, batch_ids: list[int], column: str):
        for value, example_id in zip(values, batch_ids):
            if not isinstance(value, str):
                raise RaotError(
                    f"row {example_id} of calibration column {column!r} is {value!r}, not text; "
                    "drop such rows or pick another column"
                )
        encoded = tokenizer(values, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        inputs = _model_inputs(encoded)
        return inputs, inputs["attention_mask"].bool()

    return encode


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


# ------------------------------------------------------------------------------ provenance


def dataset_fingerprint(dataset: datasets.Dataset, column: str) -> dict[str, Any]:
    """Summarize the sampled calibration data for the provenance report.

    Returns ``num_examples``, ``column``, ``sha256`` (over the column's content in row order:
    UTF-8 text, or the encoded image bytes) and ``datasets_fingerprint`` (``datasets``' own
    ``_fingerprint``, or None).
    """
    if column not in dataset.column_names:
        raise RaotError(
            f"column {column!r} not in the calibration data (columns: {', '.join(dataset.column_names)}); "
            "pass one of them"
        )
    kind = _feature_kind(dataset.features[column])
    if kind not in ("text", "image"):
        raise RaotError(f"column {column!r} holds {_describe_kind(kind)}; fingerprint a text or image column")
    digest = hashlib.sha256(f"raot-calibration-{kind}\0".encode())
    view = dataset.select_columns([column])
    if kind == "image":
        view = view.cast_column(column, datasets.Image(decode=False))
    for chunk in view.iter(batch_size=256):
        for value in chunk[column]:
            payload = _text_bytes(value) if kind == "text" else _image_bytes(value)
            digest.update(len(payload).to_bytes(8, "little"))
            digest.update(payload)
    return {
        "num_examples": len(dataset),
        "column": column,
        "sha256": digest.hexdigest(),
        "datasets_fingerprint": getattr(dataset, "_fingerprint", None),
    }


def _text_bytes(value: str | None) -> bytes:
    return b"\xff" if value is None else value.encode("utf-8")


def _image_bytes(value: dict | None) -> bytes:
    if value is None:
        return b"\xff"
    if value.get("bytes") is not None:
        return value["bytes"]
    with open(value["path"], "rb") as handle:
        return handle.read()
