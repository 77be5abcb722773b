"""Calibration data for the merger's statistics pass."""

from raot_hf.calibration.batches import (
    CalibrationBatch,
    count_calibration_batches,
    is_heldout,
    iter_calibration_batches,
    shard_example_ids,
)
from raot_hf.calibration.settings import CalibrationConfig
from raot_hf.calibration.sources import check_column, dataset_fingerprint, detect_modality, load_calibration_dataset

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
