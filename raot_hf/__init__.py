"""raot_hf: merge two Transformer checkpoints after aligning them under the Transformer's
exact symmetries (rotation-aware optimal transport, RaOT)."""

from raot_hf.adapters import get_adapter, register_adapter, schema_for, supported_model_types
from raot_hf.config import RaotConfig
from raot_hf.dual import DualEncoderMerger  # registers itself with RaotMerger, for two-tower models
from raot_hf.errors import EquivalenceError, RaotError
from raot_hf.merger import Alignment, MergeResult, RaotMerger, merge_checkpoints
from raot_hf.symmetry import scramble
from raot_hf.version import __version__

__all__ = [
    "merge_checkpoints",
    "DualEncoderMerger",
    "Alignment",
    "MergeResult",
    "RaotConfig",
    "RaotMerger",
    "EquivalenceError",
    "RaotError",
    "__version__",
    "get_adapter",
    "register_adapter",
    "schema_for",
    "scramble",
    "supported_model_types",
]
