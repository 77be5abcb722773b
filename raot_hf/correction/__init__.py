"""Post-merge corrections (docs/design.md §6.7): after the merge rule, a sequential pass of A, B′
and the merged model over a few calibration examples, one layer at a time, corrects each merged
layer before the next one runs, so errors do not compound through depth.

* ``lsq`` — merged-input least squares: each Linear of a layer, in call order, refitted to the
  α-mix of the parents' outputs on the merged model's own inputs (with RegMean's shrinkage
  towards the rule's merged weight);
* ``repair`` — REPAIR for Transformers: value channels and MLP pre-activations reset to the
  α-interpolation of the parents' statistics, folded into the weights and biases.

Both keep a merge of A with an exact scramble of itself equal to A, and write nothing but merged
weights: the output loads with ``AutoModel*`` as before. Both are registered by name
(:mod:`raot_hf.correction.registry`, :func:`register_correction`), as a correction added from
outside the package is.
"""

from dataclasses import dataclass, field

import raot_hf.correction.builtin  # noqa: F401 (registers the built-in corrections, lsq and repair)
from raot_hf.config.options import check_choice, check_field_types, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.correction.carry import Carried, LayerCall, capture
from raot_hf.correction.fits import Site, least_squares_layer, least_squares_readers, linear_out, repair_layer
from raot_hf.correction.layer import LayerPass
from raot_hf.correction.registry import (
    CorrectionRequest,
    CorrectionSpec,
    available_corrections,
    correction_description,
    get_correction,
    register_correction,
    unregister_correction,
)
from raot_hf.errors import RaotError

__all__ = [
    "Carried",
    "CorrectionRequest",
    "CorrectionSpec",
    "LayerCall",
    "LayerPass",
    "Site",
    "available_corrections",
    "capture",
    "correction_description",
    "get_correction",
    "register_correction",
    "unregister_correction",
    "least_squares_layer",
    "least_squares_readers",
    "linear_out",
    "repair_layer",
]


@register_section
@dataclass
class CorrectionOptions(OptionSection):
    """A correction of the merged model after the merge rule (docs/design.md §6.7), layer by layer
    on ``examples`` fit examples, ``batch_size`` per forward: ``lsq`` refits every Linear to the
    parents' outputs on the merged model's own inputs (``shrink``: RegMean's off-diagonal scale,
    towards the rule's merged weight); ``repair`` resets value channels and MLP pre-activations to
    the interpolation of the parents' statistics; ``none`` runs no pass; ``auto`` (default) is
    ``lsq`` when the gate moved B (the parents differ in basis) and ``none`` when they share one
    (fine-tuned siblings keep the plain merge their rules define) or the rule is base-relative.
    ``compete`` (default on, with the gate): each layer's correction competes with the rule's merge
    of that layer on held-out examples and is kept only where it makes the merge follow its
    parents more closely."""

    section = "correction"

    method: str = field(
        default="auto",
        metadata=meta(
            "Post-merge correction: auto (lsq when the gate moved B, else none), lsq (merged-input least "
            "squares), repair (REPAIR statistics) or none.",
            "correction_method",
            flag="--correction",
            choices=available_corrections,
        ),
    )
    examples: int = field(
        default=64, metadata=meta("Fit examples the correction pass runs on (default 64).", "correction_examples")
    )
    batch_size: int = field(
        default=64,
        metadata=meta(
            "Examples per forward of the correction pass (default 64). When every correction example fits in "
            "one, M's layer runs once per layer, each group of Linears refitted as the forward reaches it; "
            "otherwise once per group. Lower it for long sequences or large models.",
            "correction_batch_size",
        ),
    )
    shrink: float = field(
        default=0.99,
        metadata=meta("lsq: off-diagonal scale of the merged inputs' Gram (default 0.99).", "correction_shrink"),
    )
    compete: bool = field(
        default=True,
        metadata=meta(
            "Keep each layer's correction only where, on the gate's held-out examples, the merge follows its "
            "parents more closely with it than with the rule's merge of that layer (default on; needs the gate).",
            flag="--correction-compete",
        ),
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_choice("correction_method", self.method, tuple(available_corrections()))
        if self.examples < 1:
            raise RaotError(f"correction_examples={self.examples} must be ≥ 1 (fit examples the correction runs on)")
        if self.batch_size < 1:
            raise RaotError(f"correction_batch_size={self.batch_size} must be ≥ 1 (examples per correction forward)")
        if not 0.0 <= self.shrink <= 1.0:
            raise RaotError(f"correction_shrink={self.shrink} must lie in [0, 1]")
