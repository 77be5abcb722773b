"""Calibration settings: the ``calibration`` part of :class:`raot_hf.config.RaotConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError

MOMENT_PRECISIONS = ("auto", "float32", "bfloat16")


@register_section
@dataclass
class CalibrationConfig(OptionSection):
    """Where the calibration data comes from and how it is sampled and batched.

    ``source``: a Hub dataset id, a local data file (csv/tsv/json/jsonl/parquet/arrow/txt), a
    ``Dataset.save_to_disk`` directory or a folder of images; ``split`` accepts slicing syntax
    (``"train[:2000]"``); ``column`` is auto-detected when ``None``. Example ids that are multiples
    of ``heldout_every`` are held out (gate only). ``moment_stride`` s > 1: fit cross moments from
    every s-th real token (s times cheaper, 1/√s noisier). ``moment_precision``: ``auto``, ``float32``
    or ``bfloat16`` MLP products (:mod:`raot_hf.calibration.precision`). ``mlp_cross_tokens``: the most fit
    tokens an MLP cross moment takes, at seeded random positions (default 16,384; 0: every token);
    ``mlp_tokens_per_unit`` > 0 caps them at that many per MLP unit as well (the smaller cap
    binds). ``hidden_cross_tokens``: the same for the d × d cross moments of the queries, keys,
    attention contexts and residual stream (default 16,384; 0: every token). Means and variances
    always take every token (docs/design.md §4.3).
    """

    section, noun = "calibration", "setting"  # in from_dict errors: "unknown calibration setting(s) …"

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
    moment_precision: str = "auto"
    mlp_cross_tokens: int = 16384
    mlp_tokens_per_unit: int = 0
    hidden_cross_tokens: int = 16384

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
        _require_int("mlp_cross_tokens", self.mlp_cross_tokens, minimum=0)
        _require_int("mlp_tokens_per_unit", self.mlp_tokens_per_unit, minimum=0)
        _require_int("hidden_cross_tokens", self.hidden_cross_tokens, minimum=0)
        if self.moment_precision not in MOMENT_PRECISIONS:
            raise RaotError(
                f"calibration moment_precision must be one of {', '.join(MOMENT_PRECISIONS)}, "
                f"got {self.moment_precision!r}"
            )


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RaotError(
            f"calibration {name} must be an integer >= {minimum}, got {value!r}; set it to an integer >= {minimum}"
        )
