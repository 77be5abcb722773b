"""Option-section helpers of :class:`raot_hf.RaotConfig` and the table that turns a config class
into command-line flags (:func:`cli_options`). Field metadata: ``help``, ``flag`` (default
``--{section}-{field}``), ``choices`` (a tuple or a callable returning one), ``cli=False`` (no option),
``legacy`` (the flat key of earlier versions, used in messages) and ``aliases`` (earlier flags,
still read). Must not import :mod:`raot_hf.config`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raot_hf.config.sections import registered_sections
from raot_hf.errors import RaotError


def check_choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    """Refuse ``value`` unless it is one of ``valid``; the message lists the valid values."""
    if value not in valid:
        raise RaotError(f"{name}={value!r} is not valid; choose one of: {', '.join(valid)}")


def check_field_types(options: Any) -> None:
    """Types follow the defaults: booleans must be booleans, integers integers, numbers finite
    numbers (stored as float, so JSON round-trips exactly); sections check themselves."""
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


def meta(help: str, legacy: str | None = None, **extra: Any) -> dict[str, Any]:
    """A section field's metadata: its help line, the flat key it had before sections existed
    (``legacy``; messages use it), and CLI extras (``flag``, ``choices``, ``cli=False``)."""
    return {"help": help, **({"legacy": legacy} if legacy else {}), **extra}


def __getattr__(name: str) -> Any:
    """``SECTIONS`` (name → class) and ``LEGACY_KEYS`` (flat key → (section, field)), read from the
    live section registry."""
    if name == "SECTIONS":
        return registered_sections()
    if name == "LEGACY_KEYS":
        return legacy_keys()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def legacy_keys() -> dict[str, tuple[str, str]]:
    """The flat keys of RaotConfig before the sections existed → (section, field); still read."""
    return {
        f.metadata["legacy"]: (name, f.name)
        for name, cls in registered_sections().items()
        for f in dataclasses.fields(cls)
        if "legacy" in f.metadata
    }


def flag_keyword(flag: str) -> str:
    """The Python keyword of a command-line flag: ``--moment-precision`` → ``moment_precision``."""
    return flag.lstrip("-").replace("-", "_")


def option_keywords() -> dict[str, tuple[str, str]]:
    """Every flat keyword that sets one field of a section → (section, field): the fields'
    command-line flags as keywords (``moment_precision="float32"``) and :func:`legacy_keys`."""
    out = dict(legacy_keys())
    for name, cls in registered_sections().items():
        for f in dataclasses.fields(cls):
            meta = field_metadata(cls, f)
            if meta.get("cli", True) is False or dataclasses.is_dataclass(field_default(f)):
                continue
            flag = meta.get("flag") or f"--{name}-{f.name}".replace("_", "-")
            for each in (flag, *meta.get("aliases", ())):
                out.setdefault(flag_keyword(each), (name, f.name))
    return out


def field_metadata(cls: type, f: dataclasses.Field) -> Mapping[str, Any]:
    """``f``'s metadata (its help line, flag and choices)."""
    return f.metadata


def field_default(f: dataclasses.Field) -> Any:
    """The default of ``f`` (calling its factory)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclass(frozen=True)
class CliOption:
    """One config field as a command-line option (booleans also get ``--no-…``; ``dest``: the click
    parameter name; ``kind``: bool, int, float or str)."""

    path: tuple[str, ...]
    flag: str
    dest: str
    kind: type
    choices: tuple[str, ...] | None
    help: str | None
    aliases: tuple[str, ...] = ()


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
        flag = meta.get("flag") or "--" + "-".join(path).replace("_", "-")
        choices = tuple(choices) if choices is not None else None
        aliases = tuple(meta.get("aliases", ()))
        out.append(CliOption(path, flag, "__".join(path), _kind(default), choices, meta.get("help"), aliases))
    sections = cls.section_classes() if not prefix and hasattr(cls, "section_classes") else {}
    for name, section in sections.items():  # the sections registered beside their methods
        out += cli_options(section, (name,))
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
