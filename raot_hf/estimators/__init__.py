"""Estimators of the alignment of B to A: activation-based (RaOT, docs/design.md §4) and the
weight-based baseline of the rotation-symmetry paper."""

from raot_hf.estimators.activation import (
    estimate_head_alignment,
    estimate_mlp_permutation,
    estimate_residual_map,
    head_gains,
    mlp_gains,
    residual_gains,
)

__all__ = [
    "estimate_head_alignment",
    "estimate_mlp_permutation",
    "estimate_residual_map",
    "head_gains",
    "mlp_gains",
    "residual_gains",
]
