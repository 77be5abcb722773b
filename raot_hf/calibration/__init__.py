"""Calibration data for the merger's statistics pass."""

from raot_hf.calibration.data import (
    CalibrationBatch,
    CalibrationConfig,
    check_column,
    count_calibration_batches,
    dataset_fingerprint,
    detect_modality,
    is_heldout,
    iter_calibration_batches,
    load_calibration_dataset,
    shard_example_ids,
)

__all__ = [
    "CalibrationBatch",
    "CalibrationConfig",
    "check_column",
    "count_calibration_batches",
    "dataset_fingerprint",
    "detect_modality",
    "is_heldout",
    "iter_calibration_batches",
    "load_calibration_dataset",
    "shard_example_ids",
]
