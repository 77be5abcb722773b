"""The provenance report ``raot_report.json``: its serialisation, and the model card's context
built from it (docs/design.md §6)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from raot_hf.config.options import cli_options, setting_at
from raot_hf.correction import correction_description
from raot_hf.outputs.card import summary_with_verdict
from raot_hf.outputs.quality import describe_quality
from raot_hf.version import __version__

REPORT_NAME = "raot_report.json"

__all__ = ["REPORT_NAME", "Check", "model_card_context", "report_to_json"]


@dataclass(frozen=True)
class Check:
    """One functional check (B′ ≡ B, docs/design.md §5.5): the largest relative deviation of B′'s outputs
    from B's on held-out inputs (max|Δ| / max|B|) against the threshold an exact transform meets in the
    model's dtype (``exact``: above it is a bug, raised before a check is recorded); ``norm_value``:
    the same deviation in norm, ‖Δ‖ / ‖B‖ over the real tokens (None where it was not measured)."""

    name: str
    value: float
    threshold: float
    exact: bool
    passed: bool
    norm_value: float | None = None

    kind = property(lambda self: "exact" if self.exact else "approximate", doc="The kind the model card lists.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> Check:
        """A check from its report entry (``exact`` absent: approximate)."""
        fields = (entry["name"], entry["value"], entry["threshold"], bool(entry.get("exact")), entry["passed"])
        return cls(*fields, entry.get("norm_value"))


_PIPELINE_TAGS = {
    "ForSequenceClassification": "text-classification",
    "ForTokenClassification": "token-classification",
    "ForMaskedLM": "fill-mask",
    "ForQuestionAnswering": "question-answering",
    "ForImageClassification": "image-classification",
}


def _method_description(alignment: str | None) -> str | None:
    """The card's line for the estimator, from its registration."""
    from raot_hf.estimators import available_estimators, estimator_spec

    if alignment == "none":
        return "no alignment (plain merge)"
    if alignment in available_estimators():
        return estimator_spec(alignment).description or alignment
    return alignment


def model_card_context(report: Mapping[str, Any]) -> dict[str, Any]:
    """The ``card`` dict :func:`raot_hf.outputs.card.render_model_card` renders, from a report (a
    :class:`~raot_hf.outputs.record.MergeReport` or its JSON form)."""
    settings = report.get("settings", {})
    models = report.get("models") or []
    a, b = (models[0] if models else {}), (models[1] if len(models) > 1 else {})
    arch = a.get("architecture", "")
    tag = next((t for suffix, t in _PIPELINE_TAGS.items() if arch.endswith(suffix)), None)
    method = _method_description(settings.get("alignment"))
    precision = (report.get("calibration") or {}).get("moment_precision")
    if method and precision:
        method += f"; MLP cross moments from {precision['used']} products ({precision['why']})"
    scope = settings.get("scope") or []
    base = report.get("base") or {}
    return {
        "model_a": a.get("id", "A"),
        "model_b": b.get("id", "B"),
        "revision_a": a.get("commit") or a.get("revision"),
        "revision_b": b.get("commit") or b.get("revision"),
        "more_models": [{"id": m.get("id"), "revision": m.get("commit") or m.get("revision")} for m in models[2:]],
        "method": method,
        "merge_rule": _with_refit(_rule_description(report), report.get("refit")),
        "base_model": base.get("id"),
        "revision_base": base.get("commit") or base.get("revision"),
        "alpha": settings.get("alpha"),
        "scope": ", ".join(scope) if scope else "none",
        "gate_rows": [
            {
                "transform": d["transform"] if "model" not in d else f"{d['transform']} (model {d['model']})",
                "layer": "-" if d.get("layer") is None else d["layer"],
                **{k: d.get(k) for k in ("identity", "estimate", "margin", "applied")},
            }
            for d in report.get("decisions", [])
        ],
        "checks": [
            dict(
                name=c.name, value=c.value, norm_value=c.norm_value, threshold=c.threshold, passed=c.passed, kind=c.kind
            )  # fmt: skip
            for c in map(Check.from_dict, report.get("checks", []))
        ],
        "summary": summary_with_verdict(
            report.get("summary", ""), report.get("verdict"), describe_quality(report.get("quality"))
        ),
        "command": report.get("command")
        or _command([a.get("id"), b.get("id"), *(m.get("id") for m in models[2:])], settings, base.get("id")),
        "pipeline_tag": tag,
        "version": report.get("raot_hf_version", __version__),
    }


def _rule_description(report: dict[str, Any]) -> str | None:
    """The rule's name (with the options a base-relative rule read, e.g. ``ties (density 0.2, …)``,
    or those of the merge file), and the post-merge correction when one ran."""
    settings, merge_log = report.get("settings", {}), report.get("merge") or {}
    described = _rule_with_options(settings, merge_log)
    if report.get("merge_file") is not None:
        rule = settings.get("merge_rule")
        described = f"{rule} with the merge file's parameters — mergekit's definition on the checkpoints as stored"
    correction = merge_log.get("correction") if merge_log else None
    if not correction or correction.get("method", "none") == "none":
        return described
    how = correction_description(correction["method"])
    return f"{described}, then corrected layer by layer ({how} on {correction['examples']} calibration examples)"


def _with_refit(described: str | None, refit: dict[str, Any] | None) -> str | None:
    """The rule's description, then the end-to-end refit (docs/design.md §6.11) when it was written."""
    if not described or not refit or not refit.get("kept"):
        return described
    follows = "predictions" if refit.get("target") == "output" else "last hidden states"
    if refit.get("teacher") == "confident":
        follows = "predictions, each weighted per token by its confidence"
    return (
        f"{described}, then refitted end to end towards the parents' {follows} ({refit['best_step']} label-free "
        f"steps on {refit['examples']} calibration examples; judged loss {refit['heldout_loss_before']:.4g} → "
        f"{refit['heldout_loss_after']:.4g} on {refit['heldout_examples']} held-out examples)"
    )


def _mergekit_note(rule: str | None, settings: dict[str, Any]) -> str:
    """For a mergekit rule, whether the merge is mergekit's own (no alignment) or ran on A and B′."""
    from raot_hf.merging import available_merge_rules, merge_rule_spec

    if rule not in available_merge_rules() or not merge_rule_spec(rule).layered:
        return ""
    if settings.get("alignment") == "none":
        return " — mergekit's definition on the checkpoints as stored: the merge mergekit writes"
    return " — mergekit's definition run on A and B′ (B aligned to A), not on the checkpoints as stored"


def _rule_with_options(settings: dict[str, Any], merge_log: dict[str, Any]) -> str | None:
    from raot_hf.merging import available_merge_rules, merge_rule_spec

    rule = settings.get("merge_rule")
    base_relative = rule in available_merge_rules() and merge_rule_spec(rule).needs_base
    fields = tuple(merge_rule_spec(rule).options.values()) if base_relative else ()  # the RaotConfig paths it reads
    note = _mergekit_note(rule, settings)
    if not fields:
        return f"{rule}{note}" if rule else rule
    shown = [(key.rsplit(".", 1)[-1], setting_at(settings, key)) for key in fields]  # None: the rule's default
    options = ", ".join(f"{name} {'default' if value is None else value}" for name, value in shown)
    fallback = len((merge_log.get("settings") or {}).get("not_in_base") or [])
    tail = f"; {fallback} parameter(s) not in the base merged linearly" if fallback else ""
    totals = merge_log.get("totals") or {}
    if totals.get("entries") and "sign_conflicts" in totals:
        tail += f"; kept signs conflict in {totals['sign_conflicts'] / totals['entries']:.2%} of the entries"
    return f"{rule} ({options}; relative to the base{tail}){note}"


def _command(models: list[str | None], settings: dict[str, Any], base: str | None = None) -> str:
    """The ``raot-hf merge`` command line that reproduces a merge run from Python: every option
    whose value differs from its default, by its generated flag."""
    from raot_hf.config import RaotConfig

    defaults = RaotConfig().to_dict()
    parts = ["raot-hf merge", *map(str, models)]
    if base:
        parts += ["--base", str(base)]
    essential = {"alignment", "merge_rule", "alpha", "calibration.source"}
    for option in cli_options(RaotConfig):
        key = ".".join(option.path)
        value = setting_at(settings, key)
        if value is None or (value == setting_at(defaults, key) and key not in essential):
            continue
        if option.kind is bool:
            parts.append(option.flag if value else "--no-" + option.flag[2:])
        elif isinstance(value, (list, tuple)):
            parts += [option.flag, ",".join(map(str, value)) or "none"]
        else:
            parts += [option.flag, str(value)]
    return " ".join([*parts, "--out", "OUT"])


def _json_default(value: Any) -> Any:
    """``json.dump`` hook for the tensors, scalars and containers a report may still hold."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar or 0-d array
        return value.item() if getattr(value, "ndim", 0) == 0 else value.tolist()
    raise TypeError(f"report value of type {type(value).__name__} is not JSON serializable")


def report_to_json(report: Mapping[str, Any]) -> str:
    """The report (a :class:`~raot_hf.outputs.record.MergeReport` or its JSON form) as written to
    ``raot_report.json``: indented, sorted keys, final newline."""
    return json.dumps(dict(report), indent=2, sort_keys=True, default=_json_default) + "\n"
