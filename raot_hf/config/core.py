"""One typed options object for the Python API and the CLI; round-trips through JSON.

The top level says what to align and how to merge; each method's options live in a section
registered beside its code (:func:`raot_hf.config.sections.register_section`), read as
``config.<section>``: this module imports no method, and reads the merge rules and estimators it
validates from their registries (:mod:`raot_hf.registry`). Flat keys of earlier versions
(``gate_z``, ``gate=False`` …), sections under earlier names (``group``, now ``models``) and every
section field's command-line name (``correction="none"``)
are read by :meth:`RaotConfig.from_dict` and :meth:`RaotConfig.replace`. Field metadata (``help``,
``flag``, ``choices``) generates the CLI options (:func:`raot_hf.config.options.cli_options`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from difflib import get_close_matches
from typing import Any

from raot_hf.config.options import check_choice, check_field_types, check_non_negative_int, option_keywords
from raot_hf.config.sections import registered_sections
from raot_hf.errors import RaotError
from raot_hf.registry import registry
from raot_hf.version import __version__


def alignments() -> tuple[str, ...]:
    """The registered estimators now, and "none"."""
    return (*registry("alignment", fixed=("none",)), "none")


def merge_rules() -> tuple[str, ...]:
    """The registered merge rules now, sorted."""
    return tuple(sorted(registry("merge rule")))


SCOPES = ("mlp", "heads", "residual")
RESIDUAL_MODES = ("auto", "permutation", "rotation")
#: Which classifier head the merged model keeps: A's, B's (two models) or the models' average.
HEAD_POLICIES = ("a", "b", "average")
DTYPES = ("float32", "float64", "bfloat16", "float16", "auto")
#: Sections of earlier versions → their names now: a config or merge file written before the
#: rename still reads (``group`` was the options of a merge of several models, now ``models``).
RENAMED_SECTIONS = {"group": "models"}

__all__ = ["DTYPES", "HEAD_POLICIES", "RENAMED_SECTIONS", "RESIDUAL_MODES", "SCOPES", "RaotConfig", "alignments"]


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(init=False)
class RaotConfig:
    """Every option of a merge (each field's ``help`` says what it does).

    * ``alignment``: ``activation`` (RaOT), ``weight`` (data-free baseline), ``soft_ot`` or ``none``;
      ``scope``: any subset of ``mlp``, ``heads``, ``residual``.
    * ``residual``: ``auto`` (a mean-fixing rotation where it is exact, else a permutation),
      ``rotation`` (approximate for post-LN, reported as such) or ``permutation``.
    * ``head_scales``: with the rotations, the head group's positive scales (docs/design.md §4.4);
      ``rope_restricted`` off: free Q/K maps on RoPE models, inexact (an ablation).
    * ``merge_rule``: a rule of :mod:`raot_hf.merging`'s registry (the base-relative ones need a base,
      docs/design.md §6); ``alpha``: weight of B′ (0 gives A; base-relative: of B's task vector).
    * Each method's options are a **section** registered beside the method's code
      (:func:`raot_hf.config.sections.register_section`) and read as ``config.<section>``:
      ``gate``, ``calibration``, ``correction`` (docs/design.md §6.7), ``models`` (a merge of several
      models, §6.9), ``refine`` (§5.6), ``refit`` (§6.11), the rules' and estimators' own.
    """

    alignment: str = field(default="activation", metadata=_help("Estimator (default activation).", choices=alignments))
    scope: tuple[str, ...] = field(
        default=SCOPES, metadata=_help("Comma list of mlp,heads,residual, or 'none' (default all).")
    )
    residual: str = field(default="auto", metadata=_help("Residual map kind.", choices=RESIDUAL_MODES))
    rotations: bool = field(default=True, metadata=_help("Estimate within-head rotations (off: permutations only)."))
    head_scales: bool = field(
        default=True,
        metadata=_help("Estimate per-head scales with the head rotations: Q/K (per rotary pair under RoPE) and V/O "
                       "(off: orthogonal head maps only)."),
    )  # fmt: skip
    rope_restricted: bool = field(
        default=True,
        metadata=_help("RoPE models: Q/K maps rotate within rotary pairs only, the exact symmetry "
                       "(off: a free per-head rotation, inexact; an ablation)."),
    )  # fmt: skip
    merge_rule: str = field(
        default="linear",
        metadata=_help(
            "Merge rule (default linear); task_arithmetic, ties and dare_ties need --base.", choices=merge_rules
        ),
    )
    alpha: float = field(default=0.5, metadata=_help("Weight of B′ in the merge (default 0.5)."))
    head: str = field(default="a", metadata=_help("Classifier head policy (default a).", choices=HEAD_POLICIES))
    dtype: str = field(default="auto", metadata=_help("Dtype the models load in (default auto).", choices=DTYPES))
    seed: int = field(
        default=0, metadata=_help("Seed of dare_ties' masks, the Fisher's examples and the check inputs (default 0).")
    )
    check_batches: int = field(
        default=1, metadata=_help("Held-out batches the B′ ≡ B functional check replays (default 1).")
    )
    version: str = field(default=__version__, metadata={"cli": False})
    #: Every registered section's options, by section name (read as ``config.<section>``).
    sections: dict[str, Any] = field(default_factory=dict, metadata={"cli": False}, repr=False)

    def __init__(self, **options: Any) -> None:
        """Top-level options and whole sections (objects or dicts) by name; every other field and
        section takes its default."""
        sections = options.pop("sections", None) or {}
        options = current_section_names(options)
        top = {f.name: f for f in fields(self) if f.name != "sections"}
        unknown = sorted(set(options) - set(top) - set(registered_sections()))
        if unknown:
            raise RaotError(f"unknown option(s) {', '.join(map(repr, unknown))}; valid: "
                            f"{', '.join([*top, *registered_sections()])}")  # fmt: skip
        for name, f in top.items():
            setattr(self, name, options.pop(name) if name in options else f.default)
        self.sections = {**sections, **options}
        self.__post_init__()

    @classmethod
    def section_classes(cls) -> dict[str, type]:
        """Every registered section (each gets its CLI flags), by name."""
        return registered_sections()

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("sections") or {}
        if name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__} has no option {name!r}")

    def __post_init__(self) -> None:
        self._normalise_sections()
        if isinstance(self.scope, str):
            self.scope = tuple(s for s in self.scope.replace("+", ",").split(",") if s) if self.scope != "none" else ()
        if not isinstance(self.scope, (tuple, list)):
            raise RaotError(f"scope={self.scope!r} must be a list of {', '.join(SCOPES)} (or a comma-separated string)")
        self.scope = tuple(self.scope)
        check_field_types(self)
        check_choice("alignment", self.alignment, alignments())
        for s in self.scope:
            check_choice("scope entry", s, SCOPES)
        if len(set(self.scope)) != len(self.scope):
            raise RaotError(f"scope {self.scope} repeats an entry; list each of {', '.join(SCOPES)} at most once")
        check_choice("residual", self.residual, RESIDUAL_MODES)
        check_choice("head", self.head, HEAD_POLICIES)
        check_choice("dtype", self.dtype, DTYPES)
        if not 0.0 <= float(self.alpha) <= 1.0:
            raise RaotError(f"alpha={self.alpha} must lie in [0, 1] (the weight of B′; 0 keeps A)")
        for name in ("check_batches", "seed"):
            check_non_negative_int(name, getattr(self, name))
        check_choice("merge_rule", self.merge_rule, merge_rules())
        if registry("merge rule").get(self.merge_rule).needs_base:
            self._check_base_relative()

    def _normalise_sections(self) -> None:
        """Every registered section becomes its option object (given as one, as a dict, or absent:
        the defaults); a section with a ``switch`` field takes a bare value as that field's
        (``gate=False`` is ``gate.enabled=False``)."""
        unknown = sorted(set(self.sections) - set(registered_sections()))
        if unknown:
            raise RaotError(f"unknown options section(s) {', '.join(map(repr, unknown))}; registered: "
                            f"{', '.join(registered_sections())}")  # fmt: skip
        normalised = {}
        for name, cls in registered_sections().items():
            value = self.sections.get(name, cls())
            if isinstance(value, cls):
                pass
            elif isinstance(value, dict):
                value = cls.from_dict(value)
            elif getattr(cls, "switch", None):  # ``gate=False``: the section's on/off field
                value = cls(**{cls.switch: value})
            else:
                raise RaotError(f"{name}={value!r} must be a {cls.__name__} or a dict of its settings")
            normalised[name] = value
        self.sections = normalised

    def _check_base_relative(self) -> None:
        """Base-relative rules need A, B and the base in one basis (docs/design.md §6): refuse the
        alignments that would move B without the gate's check that the pair shares a basis."""
        if self.alignment == "none" or not self.scope:
            return
        why = {
            "weight": "alignment='weight' applies its matching to B with no gate",
            "soft_ot": "alignment='soft_ot' always moves B",
        }.get(self.alignment, None if self.gate.enabled else "gate=False applies every estimate to B")
        if why:
            raise RaotError(
                f"merge_rule={self.merge_rule!r} measures B's task vector against the base, so B must stay in the "
                f"base's basis, but {why}; use alignment='activation' with the gate (it checks the pair) or 'none'"
            )

    def lookup(self, path: str) -> Any:
        """The value of the dotted field ``path``, e.g. ``cfg.lookup("base_rules.density")``."""
        value: Any = self
        for part in path.split("."):
            value = getattr(value, part)
        return value

    def to_dict(self) -> dict[str, Any]:
        """The options as a nested JSON-safe dict: the top-level fields and one dict per section
        (the inverse of :meth:`from_dict`)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sections"}
        d.update({name: section.to_dict() for name, section in self.sections.items()})
        d["scope"] = list(self.scope)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RaotConfig:
        """Build a config from :meth:`to_dict` output (or the flat keys and section names of earlier
        versions, :data:`RENAMED_SECTIONS`);
        unknown keys are an error that lists the valid ones."""
        if not isinstance(data, dict):
            raise RaotError(f"options must be a dict of option names to values, got {type(data).__name__}")
        typed = {f.name for f in fields(cls)} - {"sections"}
        known = typed | set(registered_sections()) | _earlier_sections()
        keywords = option_keywords()
        unknown = sorted(str(k) for k in set(data) - known - set(keywords))
        if unknown:
            valid = sorted(known | set(keywords))
            hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := get_close_matches(k, valid, 1)) else repr(k)
                     for k in unknown]  # fmt: skip
            raise RaotError(
                f"unknown option(s) {', '.join(hints)}; valid: {', '.join(sorted(known))} "
                f"and each section field by its command-line name ({', '.join(sorted(keywords))})"
            )
        data = _fold_keywords({}, data)
        data.pop("version", None)
        return cls(**data)

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON with sorted keys."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RaotConfig:
        """Parse :meth:`to_json` output (or any JSON object :meth:`from_dict` accepts)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RaotError(f"options are not valid JSON ({exc.msg} at line {exc.lineno}); fix the file") from None
        if not isinstance(data, dict):
            raise RaotError("options JSON must be an object of option names to values")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> RaotConfig:
        """A copy with ``changes``: top-level fields, whole sections (objects or dicts), or flat
        keys of earlier versions (``gate_z=2``, ``gate=False``), which change one section field.
        ``calibration=None`` keeps the calibration settings."""
        if "calibration" in changes and changes["calibration"] is None:
            changes = {k: v for k, v in changes.items() if k != "calibration"}
        return RaotConfig.from_dict(_fold_keywords(self.to_dict(), changes))


def current_section_names(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with every section given under an earlier name (:data:`RENAMED_SECTIONS`) moved
    to its name now, and every setting a section's ``moved_from`` names moved into it; a section
    given under both names is an error."""
    out = dict(options)
    for old, new in RENAMED_SECTIONS.items():
        if old in out:
            if new in out:
                raise RaotError(f"options give both {old!r} (the earlier name of {new!r}) and {new!r}; keep {new!r}")
            out[new] = out.pop(old)
    for name, cls in registered_sections().items():
        for path, field_name in getattr(cls, "moved_from", {}).items():
            section, old_field = path.split(".")
            if not (isinstance(out.get(section), dict) and old_field in out[section]):
                continue
            earlier = dict(out[section])
            value = earlier.pop(old_field)
            target = out.get(name, {})
            target = dict(target.to_dict() if hasattr(target, "to_dict") else target)
            target.setdefault(field_name, value)
            out[name] = target
            if earlier or section in registered_sections():
                out[section] = earlier
            else:
                out.pop(section)
    return out


def _earlier_sections() -> set[str]:
    """Sections of earlier versions whose settings live elsewhere now (still read)."""
    moved = {path.split(".")[0] for cls in registered_sections().values() for path in getattr(cls, "moved_from", {})}
    return set(RENAMED_SECTIONS) | moved


def _is_section_value(name: str, value: Any) -> bool:
    return isinstance(value, (dict, registered_sections()[name]))


def _fold_keywords(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``changes``: fields and whole sections replace, then each flat keyword
    (:func:`raot_hf.config.options.option_keywords`) sets its field inside its section. A section's
    name given a dict or its object is the section, anything else its flag's field (``gate=False``
    → ``gate.enabled``)."""
    out = dict(base)
    flat_values = {}
    flat, sections = option_keywords(), registered_sections()
    for key, value in current_section_names(changes).items():
        if key in flat and not (key in sections and _is_section_value(key, value)):
            flat_values[key] = value
        else:
            out[key] = value
    for key, value in flat_values.items():
        section, name = flat[key]
        current = out.get(section, {})
        if isinstance(current, sections[section]):
            current = current.to_dict()
        if isinstance(current, dict):  # anything else is a malformed section its validation reports
            out[section] = {**current, name: value}
    return out
