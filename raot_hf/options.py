"""Per-method option sections of :class:`raot_hf.RaotConfig`, and the table that turns a
config class into command-line flags.

Each section is a small dataclass with its own validation and ``to_dict`` / ``from_dict``.
Field metadata drives the CLI (:func:`cli_options`): ``help``, ``flag`` (a nested field's flag
defaults to ``--{section}-{field}``, underscores as dashes), ``choices`` (a tuple, or a callable
returning one, read when the CLI is built) and ``cli=False`` for a field that is no option.
``legacy`` names the flat key the field had before the sections existed; validation messages
use it, so they read as they always did. This module must not import :mod:`raot_hf.config`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raot_hf.calibration.settings import CalibrationConfig
from raot_hf.errors import RaotError
from raot_hf.sections import OptionSection

GATE_OBJECTIVES = ("merge", "alignment")


def check_choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    """Refuse ``value`` unless it is one of ``valid``; the message lists the valid values."""
    if value not in valid:
        raise RaotError(f"{name}={value!r} is not valid; choose one of: {', '.join(valid)}")


def check_field_types(options: Any) -> None:
    """Types follow the defaults: booleans must be booleans ("false" is truthy), integers
    integers, and numbers finite numbers (stored as float, so JSON round-trips exactly).
    Sections (dataclass-valued fields) are skipped: they check themselves."""
    for f in dataclasses.fields(options):
        default, value = f.default, getattr(options, f.name)
        label = f.metadata.get("legacy", f.name)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise RaotError(f"{label}={value!r} must be true or false")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise RaotError(f"{label}={value!r} must be an integer")
        elif isinstance(default, float):
            try:
                number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
            except OverflowError:
                number = None
            if number is None or not math.isfinite(number):
                raise RaotError(f"{label}={value!r} must be a finite number")
            setattr(options, f.name, number)


def check_non_negative_int(name: str, value: Any) -> None:
    """Refuse anything but an integer ≥ 0 (booleans included)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RaotError(f"{name}={value!r} must be a non-negative integer")


def _meta(help: str, legacy: str, **extra: Any) -> dict[str, Any]:
    return {"help": help, "legacy": legacy, **extra}


@dataclass
class GateOptions(OptionSection):
    """The gate: the identity competes with every estimate on held-out data.

    ``z``: margin in standard errors of the per-unit gains (3 ⇒ a one-sided false-accept rate
    of ~0.1% per transform); ``min_gain``: floor on the mean gain (objectives are cosines or
    correlations in [−1, 1]: below 0.01 the bases already agree); ``min_heldout_tokens``: below
    it an estimate loses to the identity with a warning. ``objective``: ``merge`` decides each
    transform by the merged computation's fidelity to A and B′ on ``examples`` held-out
    examples (docs/design.md §5), ``alignment`` by the alignment objective's held-out gain alone
    (the earlier gate, an ablation). ``sibling_check`` (merge objective): when every estimate
    is identity-dominated the parents are fine-tuned siblings and the gate keeps the identity
    everywhere (docs/design.md §5.4); False lets the merge-fidelity comparison repair drift.
    """

    section = "gate"

    enabled: bool = field(
        default=True,
        metadata=_meta("Let the identity compete with every estimate (default on).", "gate", flag="--gate"),
    )
    objective: str = field(
        default="merge",
        metadata=_meta(
            "What the gate scores: merged fidelity to A and B′ (default merge) or the alignment objective.",
            "gate_objective",
            choices=GATE_OBJECTIVES,
        ),
    )
    z: float = field(default=3.0, metadata=_meta("Gate margin in standard errors (default 3).", "gate_z"))
    min_gain: float = field(
        default=0.01, metadata=_meta("Gate floor on the mean gain (default 0.01).", "gate_min_gain")
    )
    min_heldout_tokens: int = field(
        default=64,
        metadata=_meta(
            "Below this, estimates lose to the identity.", "min_heldout_tokens", flag="--min-heldout-tokens"
        ),
    )
    examples: int = field(
        default=16, metadata=_meta("Held-out examples the merge gate scores (default 16).", "gate_examples")
    )
    sibling_check: bool = field(
        default=True,
        metadata=_meta(
            "Keep the identity when every estimate is near it: fine-tuned siblings (default on).",
            "sibling_check",
            flag="--sibling-check",
        ),
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if not 0.0 <= self.min_gain <= 2.0:
            raise RaotError(f"gate_min_gain={self.min_gain} must lie in [0, 2] (a gain in cosine units)")
        check_choice("gate_objective", self.objective, GATE_OBJECTIVES)
        if self.examples < 4:
            raise RaotError(f"gate_examples={self.examples} must be ≥ 4 (held-out examples the merge gate scores)")
        if self.z < 0:
            raise RaotError(f"gate_z={self.z} must be ≥ 0 (standard errors of margin)")
        check_non_negative_int("min_heldout_tokens", self.min_heldout_tokens)


@dataclass
class WeightMatchingOptions(OptionSection):
    """Options of the data-free ``weight`` estimator (the rotation-symmetry paper's baseline)."""

    section = "weight"

    rescale: bool = field(default=False, metadata=_meta("Weight-based estimator: rescale heads.", "weight_rescale"))
    match_heads: bool = field(
        default=True,
        metadata=_meta(
            "Weight-based estimator: assign heads by their Procrustes score first (default on).", "weight_match_heads"
        ),
    )

    def __post_init__(self) -> None:
        check_field_types(self)


@dataclass
class SoftOTOptions(OptionSection):
    """Options of the ``soft_ot`` baseline (Sinkhorn plans on MLP units and heads; not a
    symmetry, so B′ only approximates B and the report says so)."""

    section = "soft_ot"

    reg: float = field(
        default=0.05, metadata=_meta("Entropic regularisation of --alignment soft_ot (default 0.05).", "soft_ot_reg")
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.reg > 0:
            raise RaotError(f"soft_ot_reg={self.reg} must be > 0 (Sinkhorn's entropic regularisation)")


@dataclass
class RegMeanOptions(OptionSection):
    """Options of ``merge_rule="regmean"``: ``shrink`` scales the Grams' off-diagonal."""

    section = "regmean"

    shrink: float = field(default=0.9, metadata=_meta("RegMean off-diagonal scale (default 0.9).", "regmean_shrink"))

    def __post_init__(self) -> None:
        check_field_types(self)
        if not 0.0 <= self.shrink <= 1.0:
            raise RaotError(f"regmean_shrink={self.shrink} must lie in [0, 1]")


@dataclass
class FisherOptions(OptionSection):
    """Options of ``merge_rule="fisher"``: examples for the label-free diagonal Fisher."""

    section = "fisher"

    samples: int = field(
        default=64, metadata=_meta("Examples for the Fisher of --merge-rule fisher (default 64).", "fisher_samples")
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_non_negative_int("fisher_samples", self.samples)


@dataclass
class BaseRuleOptions(OptionSection):
    """Options of the base-relative rules ``task_arithmetic``, ``ties`` and ``dare_ties``.

    ``density``: fraction of each task vector that ``ties`` keeps (top magnitudes; 0.2 is the
    TIES paper's k) and ``dare_ties`` keeps at random (seeded by the config's ``seed``);
    ``task_scale``: λ in ``base + λ·((1−α)·τ_A + α·τ_B)`` (with α = ½, 1 averages the task
    vectors, 2 sums them).
    """

    section = "base_rules"

    density: float = field(
        default=0.2,
        metadata=_meta(
            "ties / dare_ties: fraction of each task vector kept (default 0.2).", "density", flag="--density"
        ),
    )
    task_scale: float = field(
        default=1.0,
        metadata=_meta(
            "Base-relative rules: λ in base + λ·((1−α)·τA + α·τB) (default 1).", "task_scale", flag="--task-scale"
        ),
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if not 0.0 < self.density <= 1.0:
            raise RaotError(f"density={self.density} must lie in (0, 1] (the fraction of each task vector kept)")


CORRECTION_METHODS = ("auto", "none", "lsq", "repair")


@dataclass
class CorrectionOptions(OptionSection):
    """A correction of the merged model after the merge rule (docs/design.md §6.7), layer by layer
    on ``examples`` fit examples: ``lsq`` refits every Linear to the parents' outputs on the
    merged model's own inputs (``shrink``: RegMean's off-diagonal scale, towards the rule's merged
    weight); ``repair`` resets value channels and MLP pre-activations to the interpolation of the
    parents' statistics; ``none`` runs no pass; ``auto`` (default) is ``lsq`` when the gate moved B
    (the parents differ in basis) and ``none`` when they share one (fine-tuned siblings keep the
    plain merge their rules define) or the rule is base-relative."""

    section = "correction"

    method: str = field(
        default="auto",
        metadata=_meta(
            "Post-merge correction: auto (lsq when the gate moved B, else none), lsq (merged-input least "
            "squares), repair (REPAIR statistics) or none.",
            "correction_method",
            flag="--correction",
            choices=CORRECTION_METHODS,
        ),
    )
    examples: int = field(
        default=64, metadata=_meta("Fit examples the correction pass runs on (default 64).", "correction_examples")
    )
    shrink: float = field(
        default=0.99,
        metadata=_meta("lsq: off-diagonal scale of the merged inputs' Gram (default 0.99).", "correction_shrink"),
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_choice("correction_method", self.method, CORRECTION_METHODS)
        if self.examples < 1:
            raise RaotError(f"correction_examples={self.examples} must be ≥ 1 (fit examples the correction runs on)")
        if not 0.0 <= self.shrink <= 1.0:
            raise RaotError(f"correction_shrink={self.shrink} must lie in [0, 1]")


@dataclass
class RefineOptions(OptionSection):
    """Learned alignment (docs/design.md §5.6): ``steps`` gradient steps (0: off) on the continuous
    symmetries of B′ — the stream rotation and each applied layer's Q/K and V/O maps and scales,
    parametrised on their groups — minimising the half-way merge's label-free error to its
    parents on ``examples`` fit examples (Adam, learning rate ``lr``); the held-out gate set is
    scored every ``eval_every`` steps, the best step kept, and the refinement applied only if it
    beats the estimated alignment there."""

    section = "refine"

    steps: int = field(default=0, metadata=_meta("Learned alignment: gradient steps (default 0: off).", "refine_steps"))
    lr: float = field(
        default=0.01, metadata=_meta("Learned alignment: Adam's learning rate (default 0.01).", "refine_lr")
    )
    examples: int = field(
        default=64, metadata=_meta("Learned alignment: fit examples it descends on (default 64).", "refine_examples")
    )
    eval_every: int = field(
        default=10,
        metadata=_meta("Learned alignment: steps between held-out scores (default 10).", "refine_eval_every"),
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_non_negative_int("refine_steps", self.steps)
        if not self.lr > 0:
            raise RaotError(f"refine_lr={self.lr} must be > 0 (Adam's learning rate)")
        for name, value in (("refine_examples", self.examples), ("refine_eval_every", self.eval_every)):
            if value < 1:
                raise RaotError(f"{name}={value} must be ≥ 1")


#: Option sections of RaotConfig by field name (calibration is a section too; its class lives
#: with the calibration data code).
SECTIONS: dict[str, type] = {
    "gate": GateOptions,
    "weight": WeightMatchingOptions,
    "soft_ot": SoftOTOptions,
    "regmean": RegMeanOptions,
    "fisher": FisherOptions,
    "base_rules": BaseRuleOptions,
    "correction": CorrectionOptions,
    "refine": RefineOptions,
    "calibration": CalibrationConfig,
}

#: The flat keys of RaotConfig before the sections existed → (section, field); still read.
LEGACY_KEYS: dict[str, tuple[str, str]] = {
    f.metadata["legacy"]: (name, f.name)
    for name, cls in SECTIONS.items()
    if cls is not CalibrationConfig
    for f in dataclasses.fields(cls)
}

#: CLI metadata of CalibrationConfig's fields (that class keeps plain fields): today's flags.
CALIBRATION_CLI: dict[str, dict[str, Any]] = {
    "source": {
        "flag": "--calibration",
        "help": "Hub dataset id, csv/json/parquet file, imagefolder or save_to_disk dir.",
    },
    "config_name": {"flag": "--calibration-config", "help": "Dataset config name (Hub datasets)."},
    "split": {"flag": "--split", "help": "Dataset split (default: train)."},
    "column": {"flag": "--column", "help": "Text or image column (auto-detected if omitted)."},
    "num_samples": {"flag": "--num-samples", "help": "Calibration examples (default 512)."},
    "max_length": {"flag": "--max-length", "help": "Token limit per text example (default 128)."},
    "batch_size": {"flag": "--batch-size", "help": "Calibration batch size (default 32)."},
    "seed": {"help": "Seed that draws the calibration sample (default 0)."},
    "heldout_every": {
        "flag": "--heldout-every",
        "help": "Hold out every k-th calibration example: scored by the gate, never fitted (default 4).",
    },
    "moment_stride": {
        "flag": "--moment-stride",
        "help": "Fit cross moments from every s-th token only (default 1: all; s>1 is s× cheaper, noisier).",
    },
    "moment_precision": {
        "flag": "--moment-precision",
        "choices": ("auto", "float32", "bfloat16"),
        "help": "Precision of the MLP cross moments' products (default auto: bf16 where the device runs it fast).",
    },
    "mlp_tokens_per_unit": {
        "flag": "--mlp-tokens-per-unit",
        "help": "Cap the fit tokens of each MLP cross moment at N per unit, random positions (default 0: all).",
    },
}
_EXTERNAL_METADATA: dict[type, dict[str, dict[str, Any]]] = {CalibrationConfig: CALIBRATION_CLI}


def field_metadata(cls: type, f: dataclasses.Field) -> Mapping[str, Any]:
    """``f``'s metadata, with the CLI table of a class whose fields carry none (CalibrationConfig)."""
    return {**f.metadata, **_EXTERNAL_METADATA.get(cls, {}).get(f.name, {})}


def field_default(f: dataclasses.Field) -> Any:
    """The default of ``f`` (calling its factory)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclass(frozen=True)
class CliOption:
    """One config field as a command-line option: ``path`` into the config, the ``flag``
    (booleans also get ``--no-…``), the click parameter name ``dest``, the value ``kind``
    (bool, int, float or str), its ``choices`` and ``help``."""

    path: tuple[str, ...]
    flag: str
    dest: str
    kind: type
    choices: tuple[str, ...] | None
    help: str | None


def _kind(default: Any) -> type:
    for kind in (bool, int, float):
        if isinstance(default, kind):
            return kind
    return str  # strings, None (optional strings) and the comma-separated scope


def cli_options(cls: type, prefix: tuple[str, ...] = ()) -> list[CliOption]:
    """Every option field of the dataclass ``cls``, recursively into its sections, as a
    :class:`CliOption` (fields with ``cli=False`` metadata are skipped)."""
    out: list[CliOption] = []
    for f in dataclasses.fields(cls):
        meta = field_metadata(cls, f)
        if meta.get("cli", True) is False:
            continue
        default = field_default(f)
        path = (*prefix, f.name)
        if dataclasses.is_dataclass(default):
            out += cli_options(type(default), path)
            continue
        choices: Any = meta.get("choices")
        if callable(choices):
            choices = choices()
        out.append(
            CliOption(
                path=path,
                flag=meta.get("flag") or "--" + "-".join(path).replace("_", "-"),
                dest="__".join(path),
                kind=_kind(default),
                choices=tuple(choices) if choices is not None else None,
                help=meta.get("help"),
            )
        )
    return out


def setting_at(settings: Mapping[str, Any], path: str) -> Any:
    """The value at the dotted ``path`` (``"base_rules.density"``) of a nested settings dict
    (a report's ``settings``), or None where it is missing."""
    value: Any = settings
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value
