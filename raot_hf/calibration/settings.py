"""Calibration settings: the ``calibration`` part of :class:`raot_hf.config.RaotConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raot_hf.config.options import meta
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

    source: str | None = field(
        default=None,
        metadata=meta("Hub dataset id, csv/json/parquet file, imagefolder or save_to_disk dir.", flag="--calibration"),
    )
    config_name: str | None = field(
        default=None, metadata=meta("Dataset config name (Hub datasets).", flag="--calibration-config")
    )
    split: str = field(default="train", metadata=meta("Dataset split (default: train).", flag="--split"))
    column: str | None = field(
        default=None, metadata=meta("Text or image column (auto-detected if omitted).", flag="--column")
    )
    num_samples: int = field(default=512, metadata=meta("Calibration examples (default 512).", flag="--num-samples"))
    max_length: int = field(
        default=128, metadata=meta("Token limit per text example (default 128).", flag="--max-length")
    )
    batch_size: int = field(default=32, metadata=meta("Calibration batch size (default 32).", flag="--batch-size"))
    seed: int = field(default=0, metadata=meta("Seed that draws the calibration sample (default 0)."))
    heldout_every: int = field(
        default=4,
        metadata=meta(
            "Hold out every k-th calibration example: scored by the gate, never fitted (default 4).",
            flag="--heldout-every",
        ),
    )
    moment_stride: int = field(
        default=1,
        metadata=meta(
            "Fit cross moments from every s-th token only (default 1: all; s>1 is s× cheaper, noisier).",
            flag="--moment-stride",
        ),
    )
    moment_precision: str = field(
        default="auto",
        metadata=meta(
            "Precision of the MLP cross moments' products (default auto: bf16 where the device runs it fast).",
            flag="--moment-precision",
            choices=MOMENT_PRECISIONS,
        ),
    )
    mlp_cross_tokens: int = field(
        default=16384,
        metadata=meta(
            "Fit tokens of each MLP cross moment, random positions (default 16384; 0: all).", flag="--mlp-cross-tokens"
        ),
    )
    mlp_tokens_per_unit: int = field(
        default=0,
        metadata=meta(
            "Cap the fit tokens of each MLP cross moment at N per unit, random positions (default 0: all).",
            flag="--mlp-tokens-per-unit",
        ),
    )
    hidden_cross_tokens: int = field(
        default=16384,
        metadata=meta(
            "Fit tokens of each query, key, context and stream cross moment, random positions (default 16384; 0: all).",
            flag="--hidden-cross-tokens",
        ),
    )

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
