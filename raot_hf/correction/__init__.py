"""Post-merge corrections (docs/design.md §6.7): a sequential pass of the parents and the merged
model over a few calibration examples corrects each merged layer before the next one runs, so
errors do not compound through depth. ``lsq`` refits each Linear, in call order, to the α-mix of
the parents' outputs on the merged model's own inputs; ``repair`` resets value channels and MLP
pre-activations to the α-interpolation of the parents' statistics. Both keep a merge of A with a
scramble of itself equal to A, write only merged weights, and are registered by name
(:func:`register_correction`) as outside corrections are.
"""

from dataclasses import dataclass, field

import raot_hf.correction.builtin  # noqa: F401 (registers the built-in corrections, lsq and repair)
from raot_hf.config.options import check_choice, check_field_types, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.correction.carry import Carried, LayerCall, capture
from raot_hf.correction.fits import Site, least_squares_layer, least_squares_readers, linear_out, repair_layer
from raot_hf.correction.layer import KeptParents, LayerPass
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
    "KeptParents",
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


#: Examples per forward of the correction in memory (``batch_size="auto"``): the default 64 fit
#: examples in one, so M's layer runs once per layer.
IN_MEMORY_BATCH = 64
#: ... and layer by layer, where memory is what the merge is short of: the fit in chunks, M's layer
#: run once per input of its Linears over each (docs/design.md §6.7).
LAYERWISE_BATCH = 16


@register_section
@dataclass
class CorrectionOptions(OptionSection):
    """The post-merge correction (docs/design.md §6.7). ``auto`` is ``lsq`` when the gate moved B
    and ``none`` when the parents share a basis or the rule is base-relative; ``compete`` keeps a
    layer's correction only where it beats the rule's merge on held-out examples."""

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
    batch_size: str = field(
        default="auto",
        metadata=meta(
            "Examples per forward of the correction pass: auto (the default: 64 in memory, 16 layer by layer, "
            "where memory is what the merge is short of) or a number. When every correction example fits in "
            "one, M's layer runs once per layer, the Linears reading one input refitted as the forward reaches "
            "them; otherwise once per input. Lower it for long sequences or large models.",
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

    z: float = field(
        default=0.0,
        metadata=meta(
            "Standard errors by which a correction's mean held-out gain must exceed zero to be kept, per layer "
            "and for the whole merge (default 0: kept wherever the merge follows its parents more closely with "
            "it on average; the correction is fitted to exactly that, so it is not held to the gate's z).",
            "correction_z",
        ),
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_choice("correction_method", self.method, tuple(available_corrections()))
        if self.z < 0:
            raise RaotError(f"correction_z={self.z} must be ≥ 0 (standard errors of the held-out gain)")
        if self.examples < 1:
            raise RaotError(f"correction_examples={self.examples} must be ≥ 1 (fit examples the correction runs on)")
        if isinstance(self.batch_size, str) and self.batch_size.strip().isdigit():  # a number from the command line
            self.batch_size = int(self.batch_size)
        if self.batch_size != "auto" and (
            not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1
        ):
            raise RaotError(
                f"correction_batch_size={self.batch_size!r} must be auto or an integer ≥ 1 (examples per correction "
                "forward)"
            )
        if not 0.0 <= self.shrink <= 1.0:
            raise RaotError(f"correction_shrink={self.shrink} must lie in [0, 1]")

    def examples_per_forward(self, layer_wise: bool) -> int:
        """``batch_size``, or for ``auto`` :data:`IN_MEMORY_BATCH` in memory and :data:`LAYERWISE_BATCH`
        layer by layer (docs/design.md §6.7)."""
        if self.batch_size != "auto":
            return int(self.batch_size)
        return LAYERWISE_BATCH if layer_wise else IN_MEMORY_BATCH
