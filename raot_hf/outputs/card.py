"""The model card ``README.md`` and every rendering of the gate's decisions (docs/design.md §6): the
gate table as markdown and as plain text, and the sentences around the basis verdict."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raot_hf.errors import RaotError
from raot_hf.version import __version__

logger = logging.getLogger("raot_hf.outputs.card")

CARD_NAME = "README.md"
_TEMPLATE_NAME = "raot_merge.md"
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_FALLBACK_TEMPLATE = """---
{{front_matter}}
---

# {{title}}

Merge of **{{model_a}}** ({{revision_a}}) and **{{model_b}}** ({{revision_b}}) after aligning B to A
under the Transformer's exact symmetries, written by raot-hf {{version}}.

{{summary}}

## Method

* Alignment: {{method}}
* Alignment scope: {{scope}}
* Merge rule: {{merge_rule}}
* Interpolation weight α: {{alpha}}
* Base model (task vectors are measured from it): {{base_model}}

## Gate

{{gate_summary}}

{{gate_table}}

## Functional checks

{{checks_table}}

## Reproduction

```bash
{{command}}
```
"""

__all__ = ["CARD_NAME", "alignment_summary", "gate_table_text", "render_model_card", "summary_with_verdict"]


def gate_table_text(decisions: Sequence[Any]) -> str:
    """The gate table as aligned plain text, the alignment-objective gain as a diagnostic column."""
    head = (
        f"{'transform':<10} {'layer':>5} {'identity':>10} {'estimate':>10} {'gain':>10} {'margin':>10} "
        f"{'align.gain':>10}  applied"
    )
    lines = [head, "-" * len(head)]

    def num(x):
        return f"{'–':>10}" if x is None or x != x else f"{x:>10.4f}"

    for d in decisions:
        layer = "-" if d.layer is None else str(d.layer)
        diagnostic = d.alignment_gain if d.objective == "merge" else d.gain
        lines.append(
            f"{d.transform:<10} {layer:>5} {num(d.identity)} {num(d.estimate)} {num(d.gain)} "
            f"{num(d.margin)} {num(diagnostic)}  {'yes' if d.applied else 'no'} ({d.reason})"
        )
    return "\n".join(lines)


def alignment_summary(decisions: Sequence[Any]) -> str:
    """One line on what the gate applied."""
    if not decisions:
        return "no alignment requested: plain merge in the parents' own bases"
    n = sum(d.applied for d in decisions)
    untested = [d for d in decisions if d.untested]
    if n == 0 and untested and len(untested) == len(decisions):
        return (
            f"none of the {len(decisions)} estimated transforms could be tested ({untested[0].reason}): "
            "the identity stands; calibrate on more data for a verdict"
        )
    if n == 0:
        return (
            f"the gate rejected all {len(decisions)} estimated transforms: "
            "the pair already shares a basis (nothing to align)"
        )
    kinds = sorted({d.transform for d in decisions if d.applied})
    return f"{n} of {len(decisions)} transforms applied ({', '.join(kinds)})"


def summary_with_verdict(summary: str, verdict: str | None, quality: str | None = None) -> str:
    """The card's summary, then the basis verdict (docs/design.md §5) and the label-free check (§6.8)."""
    if verdict:
        summary = f"{summary}\n\n**Basis verdict:** {verdict}."
    if quality:
        summary = f"{summary}\n\n**How the merge follows its parents:** {quality}"
    return summary


def _template_text() -> str:
    """The packaged card template, else the repository's ``model_cards/`` copy, else the built-in one."""
    package_dir = Path(__file__).resolve().parent.parent
    for candidate in (package_dir / "templates" / _TEMPLATE_NAME, package_dir.parent / "model_cards" / _TEMPLATE_NAME):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
    return _FALLBACK_TEMPLATE


def _yaml_string(value: str) -> str:
    """A YAML scalar: plain when unambiguous, else double-quoted (JSON strings are valid YAML)."""
    plain = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", value) and not re.fullmatch(
        r"[0-9._eE+-]*|true|false|yes|no|on|off|null", value, flags=re.IGNORECASE
    )
    return value if plain else json.dumps(value)


def _front_matter(card: dict) -> str:
    """The YAML front matter: ``base_model`` (the Hub ids among A, B and the base), library and tags."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    base_models = []
    for key in ("model_a", "model_b", "base_model"):
        if not card.get(key):
            continue
        try:
            validate_repo_id(str(card[key]))
        except HFValidationError:
            logger.info("%s %r is not a Hub id (a local path?); it is left out of base_model", key, card[key])
            continue
        base_models.append(str(card[key]))
    lines = []
    if base_models:
        lines += ["base_model:", *(f"- {_yaml_string(m)}" for m in base_models), "base_model_relation: merge"]
    lines.append("library_name: transformers")
    if card.get("pipeline_tag"):
        lines.append(f"pipeline_tag: {_yaml_string(str(card['pipeline_tag']))}")
    lines += ["tags:", "- merge", "- raot"]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    """One markdown table cell: numbers to 4 significant digits, ``None`` as a dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) or (hasattr(value, "item") and hasattr(value, "dtype")):
        return f"{float(value):.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _gate_markdown(rows: list[dict]) -> tuple[str, str]:
    """The card's gate summary sentence and markdown table."""
    if not rows:
        return "No gate decisions were recorded.", ""
    applied = sum(bool(row.get("applied")) for row in rows)
    if applied == 0:
        summary = (
            f"None of the {len(rows)} transforms beat the identity: A and B already share a basis "
            "(detection, not repair), so B was merged as it is."
        )
    else:
        summary = f"{applied} of {len(rows)} transforms beat the identity and were applied."
    header = ["transform", "layer", "score (identity)", "score (estimate)", "margin", "applied"]
    keys = ["transform", "layer", "identity", "estimate", "margin"]
    table = _table(header, [[row.get(k) for k in keys] + [bool(row.get("applied"))] for row in rows])
    return summary, table


def _base_rows(card: dict) -> str:
    """The inputs-table rows of models 3, 4, … (a merge of several) and of the base (if any)."""
    rows = [
        f"| model {i} (aligned to A) | `{_cell(m['id'])}` | {_cell(m.get('revision') or 'not pinned')} |"
        for i, m in enumerate(card.get("more_models") or [], start=3)
    ]
    if card.get("base_model"):
        revision = card.get("revision_base") or "not pinned"
        rows.append(f"| base (task vectors are measured from it) | `{_cell(card['base_model'])}` | {_cell(revision)} |")
    return "\n".join(rows)


def _placeholder_values(card: dict) -> dict[str, str]:
    """The text of every template placeholder, from the card context."""
    gate_summary, gate_table = _gate_markdown(list(card.get("gate_rows") or []))
    alpha, checks = card.get("alpha"), list(card.get("checks") or [])
    names = [str(card["model_a"]), str(card["model_b"]), *(str(m["id"]) for m in card.get("more_models") or [])]
    check_keys = ["name", "kind", "value", "norm_value", "threshold", "passed"]
    return {
        "front_matter": _front_matter(card),
        "title": f"RaOT merge of {', '.join(names[:-1])} and {names[-1]}",
        "model_a": str(card["model_a"]),
        "model_b": str(card["model_b"]),
        "revision_a": str(card.get("revision_a") or "not pinned"),
        "revision_b": str(card.get("revision_b") or "not pinned"),
        "method": str(card.get("method") or "—"),
        "scope": str(card.get("scope") or "—"),
        "merge_rule": str(card.get("merge_rule") or "—"),
        "base_model": f"`{card['base_model']}`" if card.get("base_model") else "none",
        "base_rows": _base_rows(card),
        "alpha": _cell(float(alpha)) if alpha is not None else "—",
        "gate_summary": gate_summary,
        "gate_table": gate_table,
        "checks_table": (
            _table(
                ["check", "kind", "max relative", "norm relative", "threshold (max)", "passed"],
                [[r.get(k) for k in check_keys] for r in checks],
            )  # fmt: skip
            if checks
            else "No functional checks were recorded."
        ),
        "summary": str(card.get("summary") or ""),
        "command": str(card.get("command") or "# command not recorded"),
        "version": str(card.get("version") or __version__),
    }


def render_model_card(card: dict, *, template: str | None = None) -> str:
    """Render the model card ``README.md`` from ``card`` (``template``: text with ``{{name}}``
    placeholders, default ``model_cards/raot_merge.md``). Keys of ``card``, only the first two required:
    ``model_a``, ``model_b`` (ids or local paths; Hub ids go into the YAML ``base_model`` list),
    ``revision_a``, ``revision_b``, ``base_model``, ``revision_base``, ``more_models`` (``{"id",
    "revision"}`` of models 3, 4, …), ``method``, ``scope``, ``merge_rule``, ``alpha``, ``gate_rows``
    (``transform``, ``layer``, ``identity``, ``estimate``, ``margin``, ``applied``), ``checks``
    (``name``, ``value``, ``norm_value``, ``threshold``, ``passed``, ``kind``), ``summary``, ``command``,
    ``pipeline_tag``, ``version``.
    """
    missing = [key for key in ("model_a", "model_b") if not card.get(key)]
    if missing:
        raise RaotError(f"model card needs {' and '.join(missing)}; pass the ids of both input models")
    context = _placeholder_values(card)

    def substitute(match: re.Match) -> str:
        name = match.group(1)
        if name not in context:
            raise RaotError(
                f"model card template uses unknown placeholder {{{{{name}}}}}; use one of {sorted(context)}"
            )
        return context[name]

    text = _PLACEHOLDER.sub(substitute, _template_text() if template is None else template)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"
