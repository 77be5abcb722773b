"""Calibration data sources: load a small seeded sample (:func:`load_calibration_dataset`), resolve
the column a model reads (:func:`check_column`), fingerprint it for provenance."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import Any, Literal

import datasets
import numpy as np

from raot_hf.calibration.settings import CalibrationConfig
from raot_hf.errors import RaotError, lookup

logger = logging.getLogger("raot_hf.calibration.sources")

Modality = Literal["text", "image"]

#: Column names tried first (in this order) when ``column`` is not given.
TEXT_COLUMN_NAMES = ("text", "sentence", "content", "review", "document", "sentence1", "question", "premise", "title")
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


def load_calibration_dataset(
    config_or_dataset: CalibrationConfig | datasets.Dataset | datasets.DatasetDict,
    *,
    config: CalibrationConfig | None = None,
    trust_remote_code: bool = False,
    token: str | bool | None = None,
    revision: str | None = None,
) -> datasets.Dataset:
    """Load the calibration data (a :class:`CalibrationConfig`'s ``source``, or an in-memory
    ``Dataset`` / ``DatasetDict`` sampled with ``config``'s settings) and draw its sample: a seeded
    permutation truncated to ``num_samples`` rows. ``token``/``revision``/``trust_remote_code``: Hub ids only.
    """
    dataset, config, where = _dataset_to_sample(
        config_or_dataset, config, trust_remote_code=trust_remote_code, token=token, revision=revision
    )
    _check_rows_and_column(dataset, config, where)
    total = len(dataset)
    keep = min(config.num_samples, total)
    if keep < 2:
        raise RaotError(
            f"calibration data from {where} has {keep} row; need at least 2 so that both fit "
            "and held-out rows exist; pass more data or raise num_samples"
        )
    order = np.random.default_rng(config.seed).permutation(total)[:keep]
    sample = dataset.select(order.tolist(), keep_in_memory=True)
    message = "calibration data: %d rows sampled from %d in %s (seed %d)"
    # a stage line: the CLI shows it by default (raot_hf.cli.verbosity)
    logger.info(message, keep, total, where, config.seed, extra={"stage": True})
    return sample


def _dataset_to_sample(
    config_or_dataset: Any,
    config: CalibrationConfig | None,
    *,
    trust_remote_code: bool,
    token: str | bool | None,
    revision: str | None,
) -> tuple[datasets.Dataset, CalibrationConfig, str]:
    """The dataset to sample from, the config that applies, and how to name the data in messages."""
    if isinstance(config_or_dataset, CalibrationConfig):
        config = config_or_dataset
        if config.source is None:
            raise RaotError(
                "no calibration data given; set source to a Hub dataset id, a local file or "
                "directory, or pass a datasets.Dataset"
            )
        dataset = _load_source(config, trust_remote_code=trust_remote_code, token=token, revision=revision)
        return dataset, config, config.source
    if isinstance(config_or_dataset, datasets.DatasetDict | datasets.Dataset):
        config = config if config is not None else CalibrationConfig()
        dataset = config_or_dataset
        if isinstance(dataset, datasets.DatasetDict):
            dataset = _pick_split(dataset, config.split, "the given DatasetDict")
        return dataset, config, "the given dataset"
    raise RaotError(
        f"calibration data must be a CalibrationConfig or a datasets.Dataset, got "
        f"{type(config_or_dataset).__name__}; load streaming/iterable data into a Dataset first"
    )


def _check_rows_and_column(dataset: datasets.Dataset, config: CalibrationConfig, where: str) -> None:
    """Reject a dataset without rows, or one without the column ``config`` names."""
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
        extensions = _walk_extensions(path)
        if extensions & IMAGE_EXTENSIONS:
            logger.info("loading calibration images from folder %s", path)
            return _guarded(lambda: datasets.load_dataset("imagefolder", data_dir=path, split=config.split), source)
        if extensions & set(FILE_BUILDERS):
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
            lambda: datasets.load_dataset(builder, data_files={split_name: path}, split=config.split, **kwargs), source
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
    splits = ", ".join(dataset_dict)
    return lookup(
        dataset_dict,
        split,
        f"split {split!r} not in the calibration data from {where} (splits: {splits}); pass --split with one of them",
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    reason = f"{type(exc).__name__}: {text}"
    return reason if len(reason) <= _MAX_REASON_CHARS else reason[: _MAX_REASON_CHARS - 3] + "..."


def _walk_extensions(path: str) -> set[str]:
    found = set()
    for _, _, files in os.walk(path):
        found.update(os.path.splitext(name)[1].lower() for name in files)
    return found


def _looks_like_local_path(source: str) -> bool:
    """True when ``source`` cannot be a Hub id, so a missing file must not go to the network."""
    if os.path.isabs(source) or source.startswith((".", "~")) or "\\" in source:
        return True
    if os.path.splitext(source)[1].lower() in FILE_BUILDERS:
        return True
    return _HUB_ID.match(source) is None


def detect_modality(processor: Any) -> Modality:
    """``"text"`` for a tokenizer, ``"image"`` for an image processor; a ``ProcessorMixin`` counts by
    the one part it has (both is ambiguous and rejected)."""
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
    """The calibration column for a model taking ``modality``: ``column``, or when None the first
    preferred name (:data:`TEXT_COLUMN_NAMES` / :data:`IMAGE_COLUMN_NAMES`) of the right kind, else
    the first column of that kind. A missing or wrong-kind column is a :class:`RaotError`."""
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


def dataset_fingerprint(dataset: datasets.Dataset, column: str) -> dict[str, Any]:
    """The sample's provenance: ``num_examples``, ``column``, ``sha256`` (over the column's content in
    row order: UTF-8 text or encoded image bytes) and ``datasets_fingerprint`` (or None)."""
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
            payload = b"\xff" if value is None else value.encode("utf-8") if kind == "text" else _image_bytes(value)
            digest.update(len(payload).to_bytes(8, "little"))
            digest.update(payload)
    return {
        "num_examples": len(dataset),
        "column": column,
        "sha256": digest.hexdigest(),
        "datasets_fingerprint": getattr(dataset, "_fingerprint", None),
    }


def _image_bytes(value: dict) -> bytes:
    if value.get("bytes") is not None:
        return value["bytes"]
    with open(value["path"], "rb") as handle:
        return handle.read()
