"""The record a merge rule returns with ``return_log=True`` (docs/design.md §6.1, §6.4).

A :class:`RuleLog` holds what the rule did — its name, its settings, how many tensors each method
merged, per-tensor notes — and, once the stages are done, the post-merge correction's record.
Chunked merges add their chunks' logs into one (:meth:`RuleLog.add`); the provenance report's
``"merge"`` entry is :meth:`RuleLog.to_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: A setting whose value differs between the parts of a merge (evaluated per tensor).
VARIES = "varies by tensor"


@dataclass
class RuleLog:
    """One merge rule's record: ``settings`` it ran with (JSON-serialisable; a list is a per-entry
    record that chunks extend, a tuple a setting given once); ``counts``: method → tensors merged;
    ``params``: tensor name → ``{"method", **details}`` for the rule's callers (never reported, not
    carried by :meth:`add`); ``totals``: entry counts (base-relative rules; None when not kept);
    ``correction``: the post-merge correction's record (docs/design.md §6.7), set by the stages."""

    rule: str
    settings: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    totals: dict[str, int] | None = None
    correction: dict[str, Any] | None = None

    def note(self, key: str, method: str, **details: Any) -> None:
        """Record that tensor ``key`` was merged by ``method`` (counted), with ``details``."""
        self.params[key] = {"method": method, **details}
        self.counts[method] = self.counts.get(method, 0) + 1

    def add_totals(self, entries: int, fractions: Mapping[str, float]) -> None:
        """Count a tensor of ``entries`` entries and, per name, the entries its ``fractions`` cover."""
        if not fractions:
            return
        if self.totals is None:
            self.totals = {"entries": 0}
        self.totals["entries"] += entries
        for name, fraction in fractions.items():
            self.totals[name] = self.totals.get(name, 0) + round(fraction * entries)

    def add(self, part: RuleLog | Mapping[str, Any] | None) -> None:
        """Add one chunk's log (a plain dict is read by :meth:`from_dict`): counts and totals add,
        list settings (such as ``not_in_base``) extend, other settings take the part's value
        (:data:`VARIES` where parts differ)."""
        if part is None:
            return
        if not isinstance(part, RuleLog):
            part = RuleLog.from_dict(part)
        for key, value in part.settings.items():
            if isinstance(value, list):
                self.settings.setdefault(key, []).extend(value)
            elif key in self.settings and self.settings[key] != value:
                self.settings[key] = VARIES  # a merge file's settings, evaluated tensor by tensor
            else:
                self.settings[key] = value
        for method, n in part.counts.items():
            self.counts[method] = self.counts.get(method, 0) + n
        for name, n in (part.totals or {}).items():
            if self.totals is None:
                self.totals = {}
            self.totals[name] = self.totals.get(name, 0) + n

    def to_dict(self) -> dict[str, Any]:
        """The report's ``"merge"`` entry: rule, settings, counts, then totals and correction when
        present (the per-tensor ``params`` are left out)."""
        out: dict[str, Any] = {"rule": self.rule, "settings": self.settings, "counts": self.counts}
        if self.totals is not None:
            out["totals"] = self.totals
        if self.correction is not None:
            out["correction"] = self.correction
        return out

    @classmethod
    def from_dict(cls, log: Mapping[str, Any]) -> RuleLog:
        """A log given as a plain dict (``{"rule", "settings", "counts"}`` and optionally
        ``"params"``, ``"totals"``, ``"correction"``), as a rule registered from outside may return."""
        return cls(
            rule=log.get("rule"),
            settings=dict(log.get("settings") or {}),
            counts=dict(log.get("counts") or {}),
            params=dict(log.get("params") or {}),
            totals=dict(log["totals"]) if log.get("totals") is not None else None,
            correction=log.get("correction"),
        )
