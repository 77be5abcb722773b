"""Estimators of the alignment of B to A: activation-based (RaOT, docs/design.md §4), the
weight-based baseline of the rotation-symmetry paper and soft transport — registered by name in
:mod:`raot_hf.estimators.registry` (``alignment=<name>`` is looked up there)."""

from raot_hf.estimators.activation import (
    estimate_head_alignment,
    estimate_mlp_permutation,
    estimate_residual_map,
    head_gains,
    mlp_gains,
    residual_gains,
)
from raot_hf.estimators.builtin import is_identity, residual_mode
from raot_hf.estimators.registry import (
    EstimationRequest,
    EstimatorSpec,
    available_estimators,
    estimator_spec,
    register_estimator,
)

__all__ = [
    "EstimationRequest",
    "EstimatorSpec",
    "available_estimators",
    "estimator_spec",
    "is_identity",
    "register_estimator",
    "residual_mode",
    "estimate_head_alignment",
    "estimate_mlp_permutation",
    "estimate_residual_map",
    "head_gains",
    "mlp_gains",
    "residual_gains",
]
