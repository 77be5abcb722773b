"""Calibration settings: where the data comes from and how it is sampled and batched.

:class:`CalibrationConfig` is read by :mod:`raot_hf.calibration.sources` (loading and sampling)
and :mod:`raot_hf.calibration.batches` (splitting, encoding and batching), and it is the
``calibration`` part of :class:`raot_hf.config.RaotConfig`.
"""

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

    ``source`` is a Hub dataset id, a local data file (csv/tsv/json/jsonl/parquet/arrow/txt),
    a directory written by ``Dataset.save_to_disk``, or a folder of images. ``split`` accepts
    ``datasets`` slicing syntax (``"train[:2000]"``) for Hub ids and local files. ``column``
    is auto-detected when ``None``. Rows whose example id is a multiple of ``heldout_every``
    are held out (scored by the gate, never fitted). ``moment_stride`` > 1 computes the fit
    cross moments from every s-th real token of each example only (see
    :class:`~raot_hf.calibration.collector.StatisticsCollector`): s times cheaper, 1/√s noisier.
    ``moment_precision`` is the precision of the MLP cross moment's per-batch products: ``auto``
    (bf16 inputs where the device multiplies bf16 fast, float32 elsewhere; float64 models keep
    float64), ``float32`` or ``bfloat16`` (:mod:`raot_hf.calibration.precision`).
    ``mlp_tokens_per_unit`` > 0 caps the fit tokens entering each MLP cross moment at that many
    per MLP unit, drawn at random (seeded) positions; means and variances still use every token
    (0, the default: every token).
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
    mlp_tokens_per_unit: int = 0

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
        _require_int("mlp_tokens_per_unit", self.mlp_tokens_per_unit, minimum=0)
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
