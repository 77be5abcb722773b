"""Options of a merge of several models: per-model weights and densities, and the reference
(docs/design.md §6.9). Every merge rule takes any number of models (:mod:`raot_hf.merging.rules`);
these options say how the merger weights them and which one the others are aligned to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from raot_hf.config.options import meta
from raot_hf.config.sections import OptionSection, register_section
from raot_hf.errors import RaotError

#: How the reference model (the basis every other model is moved into) is chosen.
REFERENCE_CHOICES = ("first", "central")


def _numbers(name: str, value: Any) -> tuple[float, ...]:
    """A comma-separated string or a sequence of numbers as a tuple of floats."""
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    try:
        numbers = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise RaotError(f"{name}={value!r} must be numbers, one per model (e.g. 0.5,0.25,0.25)") from None
    if not all(math.isfinite(v) for v in numbers):
        raise RaotError(f"{name}={value!r} must be finite numbers")
    return numbers


@register_section
@dataclass
class ModelsOptions(OptionSection):
    """Options of a merge of several models (docs/design.md §6.9).

    ``weights``: one weight per model, in the order given (empty: equal weights; with two models
    they set α = w₂/(w₁ + w₂)); ``densities``: per-model densities of ``ties`` / ``dare_ties``
    (empty: ``base_rules.density`` for every model); ``reference``: the model every other one is
    aligned to — ``first``, or ``central``, the model whose representations agree most with all
    the others (mean linear CKA over layers, a quantity no rotation, permutation or scale changes).
    """

    section = "models"

    weights: tuple = field(
        default=(),
        metadata=meta("Per-model weights, comma list in model order (default equal).", "weights", flag="--weights"),
    )
    densities: tuple = field(
        default=(),
        metadata=meta(
            "Per-model densities of ties / dare_ties, comma list (default --density).", "densities", flag="--densities"
        ),
    )
    reference: str = field(
        default="first",
        metadata=meta(
            "Model the others are aligned to: first, or central (most similar to the rest).",
            "reference",
            flag="--reference",
            choices=REFERENCE_CHOICES,
        ),
    )

    def __post_init__(self) -> None:
        self.weights = _numbers("weights", self.weights)
        self.densities = _numbers("densities", self.densities)
        if any(w < 0 for w in self.weights) or (self.weights and not sum(self.weights) > 0):
            raise RaotError(f"weights={list(self.weights)} must be non-negative and not all zero")
        if any(not 0.0 < d <= 1.0 for d in self.densities):
            raise RaotError(f"densities={list(self.densities)} must each lie in (0, 1]")
        if self.reference not in REFERENCE_CHOICES:
            raise RaotError(f"reference={self.reference!r} is not valid; choose one of: {', '.join(REFERENCE_CHOICES)}")

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-safe dict (lists of numbers)."""
        return {"weights": list(self.weights), "densities": list(self.densities), "reference": self.reference}
