"""From the provenance report to the model card's context (docs/design.md §6)."""

from __future__ import annotations

from typing import Any

from raot_hf.version import __version__

_PIPELINE_TAGS = {
    "ForSequenceClassification": "text-classification",
    "ForTokenClassification": "token-classification",
    "ForMaskedLM": "fill-mask",
    "ForQuestionAnswering": "question-answering",
    "ForImageClassification": "image-classification",
}


def _base_rule_options(rule: str | None) -> tuple[str, ...]:
    """The RaotConfig fields a base-relative rule reads, from its registration (none for other rules)."""
    from raot_hf.merging import available_merge_rules, merge_rule_spec

    if rule not in available_merge_rules() or not merge_rule_spec(rule).needs_base:
        return ()
    return tuple(merge_rule_spec(rule).options.values())


def model_card_context(report: dict[str, Any]) -> dict[str, Any]:
    """The ``card`` dict :func:`raot_hf.output.render_model_card` renders, built from a report."""
    settings = report.get("settings", {})
    inputs = report.get("inputs", {})
    a, b = inputs.get("a", {}), inputs.get("b", {})
    arch = a.get("architecture", "")
    tag = next((t for suffix, t in _PIPELINE_TAGS.items() if arch.endswith(suffix)), None)
    method = {
        "activation": "RaOT: activation-estimated alignment from one calibration pass, gated against the identity",
        "weight": "weight-based matching (rotation-symmetry paper baseline, no data)",
        "none": "no alignment (plain merge)",
    }.get(settings.get("alignment"), settings.get("alignment"))
    rows = []
    for d in report.get("decisions", []):
        rows.append(
            {
                "transform": d["transform"],
                "layer": "-" if d.get("layer") is None else d["layer"],
                "identity": d.get("identity"),
                "estimate": d.get("estimate"),
                "margin": d.get("margin"),
                "applied": d.get("applied"),
            }
        )
    checks = [
        {
            "name": c["name"],
            "value": c["value"],
            "threshold": c["threshold"],
            "passed": c["passed"],
            "kind": "exact" if c.get("exact") else "approximate",
        }
        for c in report.get("checks", [])
    ]
    scope = settings.get("scope") or []
    base = inputs.get("base") or {}
    return {
        "model_a": a.get("id", "A"),
        "model_b": b.get("id", "B"),
        "revision_a": a.get("commit") or a.get("revision"),
        "revision_b": b.get("commit") or b.get("revision"),
        "method": method,
        "merge_rule": _rule_description(settings, report.get("merge") or {}),
        "base_model": base.get("id"),
        "revision_base": base.get("commit") or base.get("revision"),
        "alpha": settings.get("alpha"),
        "scope": ", ".join(scope) if scope else "none",
        "gate_rows": rows,
        "checks": checks,
        "summary": _summary_with_verdict(report),
        "command": report.get("command") or _command(a.get("id"), b.get("id"), settings, base.get("id")),
        "pipeline_tag": tag,
        "version": report.get("raot_hf_version", __version__),
    }


def _rule_description(settings: dict[str, Any], merge_log: dict[str, Any]) -> str | None:
    """The rule's name, with the options it read for a base-relative rule (e.g. ``ties (density 0.2, …)``)."""
    rule = settings.get("merge_rule")
    fields = _base_rule_options(rule)
    if not fields:
        return rule
    options = ", ".join(f"{key} {settings.get(key)}" for key in fields)
    fallback = len((merge_log.get("settings") or {}).get("not_in_base") or [])
    tail = f"; {fallback} parameter(s) not in the base merged linearly" if fallback else ""
    totals = merge_log.get("totals") or {}
    if totals.get("entries") and "sign_conflicts" in totals:
        tail += f"; kept signs conflict in {totals['sign_conflicts'] / totals['entries']:.2%} of the entries"
    return f"{rule} ({options}; relative to the base{tail})"


def _command(a: str | None, b: str | None, settings: dict[str, Any], base: str | None = None) -> str:
    cal = (settings.get("calibration") or {}).get("source")
    parts = ["raot-hf merge", str(a), str(b)]
    if base:
        parts += ["--base", str(base)]
    for key in _base_rule_options(settings.get("merge_rule")):
        parts += [f"--{key.replace('_', '-')}", str(settings.get(key))]
    if cal:
        parts += ["--calibration", str(cal)]
    parts += [
        "--alignment",
        str(settings.get("alignment")),
        "--merge-rule",
        str(settings.get("merge_rule")),
        "--alpha",
        str(settings.get("alpha")),
        "--out",
        "OUT",
    ]
    return " ".join(parts)


def _summary_with_verdict(report: dict[str, Any]) -> str:
    """The report's summary, then the one-line basis verdict with its evidence (docs/design.md §5)."""
    summary, verdict = report.get("summary", ""), report.get("verdict")
    if not verdict:
        return summary
    return f"{summary}\n\n**Basis verdict:** {verdict}."
