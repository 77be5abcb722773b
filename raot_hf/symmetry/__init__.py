"""The exact symmetry group of a Transformer encoder and its action on weights (docs/design.md §3)."""

from raot_hf.symmetry.apply import (
    apply_transform,
    fold_layernorms,
    fold_model,
    is_folded,
    load_state,
    model_state,
    transform_model,
)
from raot_hf.symmetry.group import (
    mean_axis_basis,
    mean_fixing,
    random_group_element,
    random_orthogonal,
    scramble,
)
from raot_hf.symmetry.io import TRANSFORM_NAME, load_transform, save_transform
from raot_hf.symmetry.transforms import (
    HeadAlignment,
    HeadRescale,
    MLPPermutation,
    ResidualPermutation,
    ResidualRotation,
    SoftTransport,
    SpaceAction,
    Transform,
    TransformSequence,
    UnrestrictedHeadAlignment,
    is_exact,
)

__all__ = [
    "TRANSFORM_NAME",
    "load_transform",
    "save_transform",
    "HeadAlignment",
    "UnrestrictedHeadAlignment",
    "HeadRescale",
    "MLPPermutation",
    "ResidualPermutation",
    "ResidualRotation",
    "SoftTransport",
    "SpaceAction",
    "Transform",
    "TransformSequence",
    "apply_transform",
    "fold_layernorms",
    "fold_model",
    "is_exact",
    "is_folded",
    "load_state",
    "mean_axis_basis",
    "mean_fixing",
    "model_state",
    "random_group_element",
    "random_orthogonal",
    "scramble",
    "transform_model",
]
