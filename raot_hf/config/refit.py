"""The ``refit`` options section: the end-to-end refit of the merged model towards its parents'
predictions (docs/design.md §6.11; ``auto`` by default; the stage is :mod:`raot_hf.stages.refit`).

It lives here, not beside its stage, because :mod:`raot_hf.config.core` imports every built-in
section and the stage imports the member records (:mod:`raot_hf.stages.members`), which import
the report (:mod:`raot_hf.outputs`), which imports the config: the section beside the stage would
close an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raot_hf.config.options import check_choice, check_field_types, meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError

#: The most Adam steps a refit with ``steps="auto"`` takes, whatever its budget allows.
AUTO_MAX_STEPS = 1000
#: What the refit may fit (:func:`raot_hf.stages.refit.refit_parameter_names`).
REFIT_PARAMETERS = ("norms_biases", "all")
#: When the refit runs (:func:`raot_hf.stages.refit.refit_decision`).
REFIT_MODES = ("auto", "on", "off")
#: What the refit follows (:func:`raot_hf.stages.refit.refit_targets`).
REFIT_TARGETS = ("hidden", "output")
#: How the output target mixes the parents' predictions (``confident``: :func:`raot_hf.stages.refit.confident_mix`).
REFIT_TEACHERS = ("mix", "confident")


@register_section
@dataclass
class RefitOptions(OptionSection):
    """Refit of the merged model (docs/design.md §6.11): where ``mode`` says it runs, at most
    ``steps`` Adam steps (0: off, learning rate ``lr``) on at most ``examples`` fit examples; half
    the held-out examples are scored every ``eval_every`` steps, the best step is kept, and the
    refit stops after ``patience`` scores without a new best. The refit is kept only if it beats
    the merge without it on the other half."""

    section = "refit"

    mode: str = field(
        default="auto",
        metadata=meta("Refit of the merged model: auto (where the gate moved B, the merge is in memory, and the "
                      "model returns logits over labels its parents share and has at most 50 M parameters), on "
                      "or off.", "refit_mode",
                      flag="--refit", choices=REFIT_MODES),
    )  # fmt: skip
    steps: str = field(
        default="auto",
        metadata=meta("Refit of the merged model: Adam steps at most — auto (the default: as many as take at most "
                      "refit budget × the time the rest of the merge took, from the step time measured on this "
                      "host, at most 1000) or a number (0: off).", "refit_steps"),
    )  # fmt: skip
    budget: float = field(
        default=1.0,
        metadata=meta("Refit of the merged model, steps auto: its descent's time at most this many times the time "
                      "the rest of the merge took (default 1).", "refit_budget"),
    )  # fmt: skip
    lr: float = field(
        default=1e-4, metadata=meta("Refit of the merged model: Adam's learning rate (default 0.0001).", "refit_lr")
    )
    eval_every: int = field(
        default=10, metadata=meta("Refit of the merged model: steps between held-out scores (default 10).",
                                  "refit_eval_every")
    )  # fmt: skip
    patience: int = field(
        default=20, metadata=meta("Refit of the merged model: held-out scores without a new best before it stops "
                                  "(default 20).", "refit_patience")
    )  # fmt: skip
    examples: int = field(
        default=256, metadata=meta("Refit of the merged model: fit examples it descends on, and held-out examples "
                                   "it is scored on, at most (default 256).", "refit_examples")
    )  # fmt: skip
    parameters: str = field(
        default="all",
        metadata=meta("Refit of the merged model: what it fits — norms_biases (every norm's weight and bias and "
                      "every Linear's bias; a larger lr suits it, e.g. 1e-3) or all (the default: every trunk "
                      "parameter, weight matrices included).", "refit_parameters", choices=REFIT_PARAMETERS),
    )  # fmt: skip

    target: str = field(
        default="output",
        metadata=meta("Refit of the merged model: what it follows — hidden (the parents' mix of their last layer's "
                      "stream, relative squared error) or output (the parents' mix of their predicted "
                      "distributions, each through its own head; KL divergence).", "refit_target",
                      choices=REFIT_TARGETS),
    )  # fmt: skip

    teacher: str = field(
        default="mix",
        metadata=meta("Refit of the merged model, output target: how the parents' predictions are mixed — mix (the "
                      "merge weights) or confident (per token, each parent's weight times exp(−entropy) of its "
                      "prediction, normalised: where one parent is sure and the other is not, the sure one leads).",
                      "refit_teacher", choices=REFIT_TEACHERS),
    )  # fmt: skip

    z: float = field(
        default=0.0,
        metadata=meta("Refit of the merged model: standard errors by which its mean gain on the judged held-out "
                      "examples (half of them, which chose nothing) must exceed zero to be kept (default 0).",
                      "refit_z"),
    )  # fmt: skip

    @property
    def enabled(self) -> bool:
        """Whether a refit may run at all (not ``mode="off"``, not ``steps=0``)."""
        return self.mode != "off" and self.steps != 0

    @property
    def max_steps(self) -> int:
        """The most steps the descent takes: the number given, or :data:`AUTO_MAX_STEPS` for ``auto``."""
        return AUTO_MAX_STEPS if self.steps == "auto" else int(self.steps)

    @property
    def requested(self) -> bool:
        """Whether the refit was asked for whatever the pair (``mode="on"``); ``auto`` refits only a
        pair whose gate moved B, which needs an alignment (docs/design.md §6.11)."""
        return self.mode == "on" and self.enabled

    @property
    def reads_aligned(self) -> bool:
        """Whether a refit may run whose target is made from the aligned models (the hidden target:
        B′'s last stream is in A's basis, B's is not), which the one sweep cannot give it."""
        return self.enabled and self.target == "hidden"

    def __post_init__(self) -> None:
        check_field_types(self)
        check_choice("refit_mode", self.mode, REFIT_MODES)
        check_choice("refit_parameters", self.parameters, REFIT_PARAMETERS)
        check_choice("refit_target", self.target, REFIT_TARGETS)
        check_choice("refit_teacher", self.teacher, REFIT_TEACHERS)
        if self.teacher != "mix" and self.target != "output":
            raise RaotError(
                f"refit_teacher={self.teacher!r} weighs the parents' predicted distributions; set refit_target "
                "output or refit_teacher mix"
            )
        if self.z < 0:
            raise RaotError(f"refit_z={self.z} must be ≥ 0 (standard errors of the judged gain)")
        if isinstance(self.steps, str) and self.steps.strip().isdigit():  # a number from the command line
            self.steps = int(self.steps)
        if self.steps != "auto" and (not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0):
            raise RaotError(f"refit_steps={self.steps!r} must be auto or a non-negative integer (0: off)")
        if not (isinstance(self.budget, (int, float)) and self.budget > 0):
            raise RaotError(f"refit_budget={self.budget!r} must be > 0 (times the rest of the merge's time)")
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
