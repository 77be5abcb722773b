"""One typed options object for the Python API and the CLI; round-trips through JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from raot_hf.calibration.data import CalibrationConfig
from raot_hf.errors import RaotError
from raot_hf.merging import available_merge_rules, merge_rule_spec
from raot_hf.version import __version__

ALIGNMENTS = ("activation", "weight", "soft_ot", "none")
SCOPES = ("mlp", "heads", "residual")
RESIDUAL_MODES = ("auto", "permutation", "rotation")
HEAD_POLICIES = ("a", "b", "average")
GATE_OBJECTIVES = ("merge", "alignment")
#: The merge rules registered when this module was imported (validation reads the live registry).
MERGER_RULES = tuple(available_merge_rules())
DTYPES = ("float32", "float64", "bfloat16", "float16", "auto")


def _choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise RaotError(f"{name}={value!r} is not valid; choose one of: {', '.join(valid)}")


@dataclass
class RaotConfig:
    """Every option of a merge.

    * ``alignment``: ``activation`` (RaOT: estimated from one calibration pass), ``weight``
      (the rotation-symmetry paper's data-free weight matching, a baseline) or ``none``.
    * ``scope``: which symmetry factors to align, any subset of ``mlp``, ``heads``, ``residual``.
    * ``residual``: ``auto`` — a mean-fixing rotation where it is exact (pre-LN, ViT), a
      permutation otherwise; ``rotation`` forces the rotation (approximate for post-LN models,
      reported as such); ``permutation``.
    * ``rotations``: estimate within-head Q/K and V/O rotations (False: heads are matched by
      permutation only, R = I — with ``residual="permutation"`` the permutation-only baseline).
    * ``gate``: let the identity compete with every estimate on held-out statistics;
      ``gate_z`` is the margin in standard errors of the per-unit gains (3 ⇒ a one-sided
      false-accept rate of ~0.1% per transform) and ``gate_min_gain`` a floor on the mean gain
      (objectives are cosines/correlations in [−1, 1]: below 0.01 the bases already agree and
      the transform would barely move B); ``min_heldout_tokens``: below it an estimate
      loses to the identity with a warning. ``gate_objective``: ``merge`` (default) decides each
      transform by the merged computation's fidelity to A and B′ on ``gate_examples`` held-out
      examples, with a model-level check against the identity merge (docs/design.md §5);
      ``alignment`` by the alignment objective's held-out gain alone (the earlier gate, an ablation).
    * ``merge_rule``: a rule of :mod:`raot_hf.merging`'s registry — ``linear``, ``regmean`` (Grams
      from the same calibration pass), ``fisher``, or the base-relative ``task_arithmetic``,
      ``ties`` and ``dare_ties`` (they need a base model; docs/design.md §6); ``alpha``: weight of
      B′ (0 gives A; in the base-relative rules, the weight of B's task vector);
      ``regmean_shrink``: RegMean off-diagonal scale.
    * ``density``: fraction of each task vector that ``ties`` keeps (top magnitudes; 0.2 is the
      TIES paper's k) and ``dare_ties`` keeps at random (seeded by ``seed``); ``task_scale``: λ
      in ``base + λ·((1−α)·τ_A + α·τ_B)`` (with α = ½, 1 averages the task vectors, 2 sums them).
    * ``head``: classifier head policy — keep ``a``'s, ``b``'s, or ``average`` (needs equal label spaces).
    * ``weight_rescale`` / ``weight_match_heads``: options of the weight-based estimator.
    * ``soft_ot_reg``: entropic regularisation of the ``soft_ot`` baseline (Sinkhorn plans on
      MLP units and heads; not a symmetry, so B′ only approximates B and the report says so).
    * ``fisher_samples``: examples for the label-free diagonal Fisher of ``merge_rule="fisher"``.
    """

    alignment: str = "activation"
    scope: tuple[str, ...] = SCOPES
    residual: str = "auto"
    rotations: bool = True
    gate: bool = True
    gate_z: float = 3.0
    gate_min_gain: float = 0.01
    min_heldout_tokens: int = 64
    gate_objective: str = "merge"
    gate_examples: int = 16
    merge_rule: str = "linear"
    alpha: float = 0.5
    regmean_shrink: float = 0.9
    density: float = 0.2
    task_scale: float = 1.0
    head: str = "a"
    weight_rescale: bool = False
    weight_match_heads: bool = True
    soft_ot_reg: float = 0.05
    fisher_samples: int = 64
    dtype: str = "auto"
    seed: int = 0
    check_batches: int = 1
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    version: str = __version__

    def __post_init__(self) -> None:
        import math

        if isinstance(self.calibration, dict):
            self.calibration = CalibrationConfig.from_dict(self.calibration)
        elif not isinstance(self.calibration, CalibrationConfig):
            raise RaotError(f"calibration={self.calibration!r} must be a CalibrationConfig or a dict of its settings")
        if isinstance(self.scope, str):
            self.scope = tuple(s for s in self.scope.replace("+", ",").split(",") if s) if self.scope != "none" else ()
        if not isinstance(self.scope, (tuple, list)):
            raise RaotError(f"scope={self.scope!r} must be a list of {', '.join(SCOPES)} (or a comma-separated string)")
        self.scope = tuple(self.scope)
        # Types follow the defaults: booleans must be booleans ("false" is truthy), integers
        # integers, and numbers finite numbers (stored as float, so JSON round-trips exactly).
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, bool):
                if not isinstance(value, bool):
                    raise RaotError(f"{f.name}={value!r} must be true or false")
            elif isinstance(f.default, int):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise RaotError(f"{f.name}={value!r} must be an integer")
            elif isinstance(f.default, float):
                try:
                    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
                except OverflowError:
                    number = None
                if number is None or not math.isfinite(number):
                    raise RaotError(f"{f.name}={value!r} must be a finite number")
                setattr(self, f.name, number)
        _choice("alignment", self.alignment, ALIGNMENTS)
        for s in self.scope:
            _choice("scope entry", s, SCOPES)
        if len(set(self.scope)) != len(self.scope):
            raise RaotError(f"scope {self.scope} repeats an entry; list each of {', '.join(SCOPES)} at most once")
        _choice("residual", self.residual, RESIDUAL_MODES)
        _choice("head", self.head, HEAD_POLICIES)
        _choice("dtype", self.dtype, DTYPES)
        if not 0.0 <= float(self.alpha) <= 1.0:
            raise RaotError(f"alpha={self.alpha} must lie in [0, 1] (the weight of B′; 0 keeps A)")
        if not 0.0 <= float(self.regmean_shrink) <= 1.0:
            raise RaotError(f"regmean_shrink={self.regmean_shrink} must lie in [0, 1]")
        if not 0.0 <= float(self.gate_min_gain) <= 2.0:
            raise RaotError(f"gate_min_gain={self.gate_min_gain} must lie in [0, 2] (a gain in cosine units)")
        _choice("gate_objective", self.gate_objective, GATE_OBJECTIVES)
        if self.gate_examples < 4:
            raise RaotError(f"gate_examples={self.gate_examples} must be ≥ 4 (held-out examples the merge gate scores)")
        if float(self.gate_z) < 0:
            raise RaotError(f"gate_z={self.gate_z} must be ≥ 0 (standard errors of margin)")
        if not float(self.soft_ot_reg) > 0:
            raise RaotError(f"soft_ot_reg={self.soft_ot_reg} must be > 0 (Sinkhorn's entropic regularisation)")
        for name in ("min_heldout_tokens", "check_batches", "seed", "fisher_samples"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise RaotError(f"{name}={v!r} must be a non-negative integer")
        if not 0.0 < float(self.density) <= 1.0:
            raise RaotError(f"density={self.density} must lie in (0, 1] (the fraction of each task vector kept)")
        _choice("merge_rule", self.merge_rule, tuple(available_merge_rules()))
        if merge_rule_spec(self.merge_rule).needs_base:
            self._check_base_relative()

    def _check_base_relative(self) -> None:
        """Base-relative rules need A, B and the base in one basis (docs/design.md §6): refuse the
        alignments that would move B without the gate's check that the pair shares a basis."""
        if self.alignment == "none" or not self.scope:
            return
        why = {
            "weight": "alignment='weight' applies its matching to B with no gate",
            "soft_ot": "alignment='soft_ot' always moves B",
        }.get(self.alignment, None if self.gate else "gate=False applies every estimate to B")
        if why:
            raise RaotError(
                f"merge_rule={self.merge_rule!r} measures B's task vector against the base, so B must stay in the "
                f"base's basis, but {why}; use alignment='activation' with the gate (it checks the pair) or 'none'"
            )

    @property
    def needs_calibration(self) -> bool:
        spec = merge_rule_spec(self.merge_rule)
        return self.alignment in ("activation", "soft_ot") and bool(self.scope) or spec.needs_grams or spec.needs_fisher

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["scope"] = list(self.scope)
        d["calibration"] = self.calibration.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RaotConfig:
        if not isinstance(data, dict):
            raise RaotError(f"options must be a dict of option names to values, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            raise RaotError(f"unknown option(s) {', '.join(map(repr, unknown))}; valid: {', '.join(sorted(known))}")
        data = dict(data)
        data.pop("version", None)
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RaotConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RaotError(f"options are not valid JSON ({exc.msg} at line {exc.lineno}); fix the file") from None
        if not isinstance(data, dict):
            raise RaotError("options JSON must be an object of option names to values")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> RaotConfig:
        d = self.to_dict()
        cal = changes.pop("calibration", None)
        d.update(changes)
        if cal is not None:
            d["calibration"] = cal.to_dict() if isinstance(cal, CalibrationConfig) else cal
        return RaotConfig.from_dict(d)
