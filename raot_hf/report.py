"""From the provenance report to the model card's context (DESIGN.md §6)."""

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
    return {
        "model_a": a.get("id", "A"),
        "model_b": b.get("id", "B"),
        "revision_a": a.get("commit") or a.get("revision"),
        "revision_b": b.get("commit") or b.get("revision"),
        "method": method,
        "merge_rule": settings.get("merge_rule"),
        "alpha": settings.get("alpha"),
        "scope": ", ".join(scope) if scope else "none",
        "gate_rows": rows,
        "checks": checks,
        "summary": report.get("summary", ""),
        "command": report.get("command") or _command(a.get("id"), b.get("id"), settings),
        "pipeline_tag": tag,
        "version": report.get("raot_hf_version", __version__),
    }


def _command(a: str | None, b: str | None, settings: dict[str, Any]) -> str:
    cal = (settings.get("calibration") or {}).get("source")
    parts = ["raot-hf merge", str(a), str(b)]
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
