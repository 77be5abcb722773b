"""The JSON round trip every options section shares: :class:`raot_hf.RaotConfig`'s per-method
sections (:mod:`raot_hf.options`) and its calibration settings."""

from __future__ import annotations

import dataclasses
from typing import Any

from raot_hf.errors import RaotError


class OptionSection:
    """Shared ``to_dict`` / ``from_dict`` of a dataclass section; ``section`` names it in errors
    and ``noun`` says what its fields are called there ("option", "setting")."""

    section = "options"
    noun = "option"

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
