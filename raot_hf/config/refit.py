"""The ``refit`` options section: the opt-in end-to-end refit of the merged model's norms and
biases (docs/design.md §6.11; the stage is :mod:`raot_hf.stages.refit`).

It lives here, not beside its stage, because :mod:`raot_hf.config.core` imports every built-in
section and the stage imports the member records (:mod:`raot_hf.stages.members`), which import
the report (:mod:`raot_hf.outputs`), which imports the config: the section beside the stage would
close an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raot_hf.config.options import check_choice, check_field_types, check_non_negative_int, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError

#: What the refit may fit (:func:`raot_hf.stages.refit.refit_parameter_names`).
REFIT_PARAMETERS = ("norms_biases", "all")


@register_section
@dataclass
class RefitOptions(OptionSection):
    """Refit of the merged model (docs/design.md §6.11): ``steps`` Adam steps (0: off, learning rate
    ``lr``) on at most ``examples`` fit examples; the held-out examples are scored every
    ``eval_every`` steps, the best step is kept, and the refit stops after ``patience`` scores
    without a new best. The refit is kept only if it beats the merge without it."""

    section = "refit"

    steps: int = field(
        default=0, metadata=meta("Refit of the merged model: Adam steps (default 0: off).", "refit_steps")
    )
    lr: float = field(
        default=1e-3, metadata=meta("Refit of the merged model: Adam's learning rate (default 0.001).", "refit_lr")
    )
    eval_every: int = field(
        default=10, metadata=meta("Refit of the merged model: steps between held-out scores (default 10).",
                                  "refit_eval_every")
    )  # fmt: skip
    patience: int = field(
        default=3, metadata=meta("Refit of the merged model: held-out scores without a new best before it stops "
                                 "(default 3).", "refit_patience")
    )  # fmt: skip
    examples: int = field(
        default=256, metadata=meta("Refit of the merged model: fit examples it descends on, and held-out examples "
                                   "it is scored on, at most (default 256).", "refit_examples")
    )  # fmt: skip
    parameters: str = field(
        default="norms_biases",
        metadata=meta("Refit of the merged model: what it fits — norms_biases (every norm's weight and bias and "
                      "every Linear's bias) or all (every trunk parameter, weight matrices included; a smaller "
                      "lr suits it, e.g. 1e-4).", "refit_parameters", choices=REFIT_PARAMETERS),
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_field_types(self)
        check_choice("refit_parameters", self.parameters, REFIT_PARAMETERS)
        check_non_negative_int("refit_steps", self.steps)
        if not self.lr > 0:
            raise RaotError(f"refit_lr={self.lr} must be > 0 (Adam's learning rate)")
        for name, value in (
            ("refit_eval_every", self.eval_every),
            ("refit_patience", self.patience),
            ("refit_examples", self.examples),
        ):
            if value < 1:
                raise RaotError(f"{name}={value} must be ≥ 1")


__all__ = ["RefitOptions"]
