"""The JSON round trip every options section shares: :class:`raot_hf.RaotConfig`'s per-method
sections (:mod:`raot_hf.config.options`) and its calibration settings."""

from __future__ import annotations

import dataclasses
from typing import Any

from raot_hf.errors import RaotError
from raot_hf.registry import Registry, registry


class OptionSection:
    """Shared ``to_dict`` / ``from_dict`` of a dataclass section; ``section`` names it in errors
    and ``noun`` says what its fields are called there ("option", "setting")."""

    section = "options"
    noun = "option"
    #: The field a bare value of the section sets (``gate=False`` → ``enabled``), or None.
    switch: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-safe dict (the inverse of :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any):
        """Build the section from :meth:`to_dict` output; unknown keys are an error."""
        if not isinstance(data, dict):
            raise RaotError(f"{cls.section} {cls.noun}s must be a dict of setting names to values, got {data!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            names, valid = ", ".join(map(repr, unknown)), ", ".join(sorted(known))
            raise RaotError(f"unknown {cls.section} {cls.noun}(s) {names}; valid: {valid}")
        return cls(**data)


# ------------------------------------------------------------------------------- the registry

_SECTIONS: Registry[type] = registry("options section")


def register_section(cls: type) -> type:
    """Register an options section (an :class:`OptionSection` dataclass, every field defaulted) under
    its ``section`` name: ``config.<section>``, in JSON and as CLI flags ``--<section>-<field>``.
    Registering the same class again is a no-op; another class under a taken name is refused."""
    if not (isinstance(cls, type) and issubclass(cls, OptionSection) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"an options section must be a dataclass subclass of OptionSection, got {cls!r}")
    name = cls.section
    if not isinstance(name, str) or not name.isidentifier() or name == OptionSection.section:
        raise TypeError(f"{cls.__name__}.section must name the section (an identifier), got {name!r}")
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise TypeError(f"options section {name!r}: every field needs a default ({', '.join(missing)} has none)")
    return _SECTIONS.register(name, cls, same=lambda old, new: old is new)


def registered_sections() -> dict[str, type]:
    """Section name → options class, in registration order."""
    return dict(_SECTIONS.items())
