"""What a merge will do, decided once from its options (docs/architecture.md); the stages read this
plan instead of each re-deriving it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raot_hf.estimators import estimator_spec
from raot_hf.merging import merge_rule_spec


@dataclass(frozen=True)
class MergePlan:
    """The decisions every stage shares.

    * ``estimator``: the registered estimator that proposes candidates (None: no alignment);
    * ``fit_moments``: it reads the calibration pass's fit moments;
    * ``gated``: the gate judges its candidates (they are exact symmetries);
    * ``grams`` / ``fisher`` / ``base``: what the merge rule reads besides A and B′;
    * ``correction``: the post-merge correction requested (``auto`` resolves after the gate);
    * ``refine_steps``: learned-alignment steps (0: none);
    * ``needs_data``: the merge cannot run without calibration data;
    * ``uses_data``: it uses calibration data when given (``auto`` corrections, gates)."""

    estimator: str | None
    fit_moments: bool
    gated: bool
    grams: bool
    fisher: bool
    base: bool
    correction: str
    refine_steps: int
    needs_data: bool
    uses_data: bool

    def statistics_pass(self, calibration: Any = None, source: Any = None) -> bool:
        """Whether the calibration pass runs: something reads it, and data is at hand (given or configured)."""
        reads = self.estimator is not None or self.grams or self.fisher
        return bool(reads and (self.needs_data or calibration is not None or source))

    def fit_forward(self) -> bool:
        """Whether the fit examples need a forward at all."""
        return self.fit_moments or self.grams


def plan_for(config) -> MergePlan:
    """The plan of a merge with ``config`` (a :class:`raot_hf.RaotConfig`)."""
    aligns = config.alignment != "none" and bool(config.scope)
    spec = estimator_spec(config.alignment) if aligns else None
    rule = merge_rule_spec(config.merge_rule)
    fit_moments = bool(spec and spec.needs_statistics)
    correction = config.correction.method
    explicit_correction = correction not in ("none", "auto")
    return MergePlan(
        estimator=config.alignment if aligns else None,
        fit_moments=fit_moments,
        gated=bool(spec and spec.gated and config.gate.enabled),
        grams=rule.needs_grams,
        fisher=rule.needs_fisher,
        base=rule.needs_base,
        correction=correction,
        refine_steps=config.refine.steps,
        needs_data=fit_moments or rule.needs_grams or rule.needs_fisher or explicit_correction,
        uses_data=aligns or rule.needs_grams or rule.needs_fisher or correction != "none",
    )


#: How a merge runs (docs/design.md §7.3, §7.4): the models loaded whole, offloaded to working
#: files and run layer by layer, or never loaded — the merge streamed from the files.
EXECUTION_MODES = ("in memory", "layer-wise", "streamed")


@dataclass(frozen=True)
class ExecutionPlan:
    """How a merge runs, chosen once before any weights are read
    (:func:`raot_hf.stages.execution.plan_execution`): ``mode`` (:data:`EXECUTION_MODES`), ``why``
    it is not streamed ("" when it is) and the output's shard size (smaller under a memory cap)."""

    mode: str
    why: str
    shard_bytes: int
