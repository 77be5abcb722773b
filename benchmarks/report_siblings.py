"""Sections of RESULTS.md: fine-tuned siblings (does the gate leave them alone?),
the merge-objective gate against the alignment-objective gate and the previous results, the
base-relative rules, and the linear rule against RegMean after RaOT (the default merge rule).

Like :mod:`benchmarks.report`, every cell is computed from the runs: nothing is typed in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.report import MARKS, _delta, _fmt, _paired, _table, _values, verdict

SIBLING_FAMILY = "(c)"
GATES = (("raot", "default gate"), ("raot-oldgate", "alignment-objective gate"))


def _row(run: dict, method: str) -> dict[str, Any]:
    row = run["methods"].get(method, {})
    return {} if "error" in row else row


def _applied(row: dict) -> str:
    gate = row.get("gate")
    return f"{gate['applied']}/{gate['total']}" if gate else "–"


def _num(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value == 0:
        return "0 (bitwise)"
    return f"{value:.{digits}g}" if abs(value) < 1e-3 else f"{value:.{digits}f}"


def sibling_rows(results: dict, grouped: dict[str, list[dict]]) -> list[str]:
    """Per sibling run and gate: transforms applied, shares_basis, the verdict, and whether the
    RaOT merge equals the plain average (largest absolute weight difference)."""
    pairs = [p["name"] for p in results["pairs"] if p["family"].startswith(SIBLING_FAMILY) and p["name"] in grouped]
    rows = []
    for pair in pairs:
        for run in grouped[pair]:
            average = _row(run, "average")
            for method, gate in GATES:
                row = _row(run, method)
                if not row:
                    continue
                rows.append(
                    [
                        pair,
                        str(run["run"]),
                        f"`{method}` ({gate})",
                        _applied(row),
                        _num(row.get("shares_basis")),
                        row.get("verdict") or "–",
                        _num(row.get("max_abs_vs_average")),
                        f"{_num(row.get('acc_head_a'))} / {_num(average.get('acc_head_a'))}",
                        f"{_num(row.get('acc_head_b'))} / {_num(average.get('acc_head_b'))}",
                    ]
                )
    if not rows:
        return []
    return _table(
        [
            "pair",
            "run",
            "RaOT gate",
            "transforms applied",
            "shares_basis",
            "verdict",
            "max abs(RaOT − average), weights",
            "acc A's head: RaOT / average",
            "acc B's head: RaOT / average",
        ],
        rows,
    )


def gate_comparison(grouped: dict[str, list[dict]]) -> list[str]:
    """RaOT with the merge-objective gate against the alignment-objective gate and against the
    RaOT numbers these results held before the rerun (``run["previous"]``)."""
    rows = []
    for pair, runs in grouped.items():
        new = _values(runs, "raot", "acc_head_a")
        old = _values(runs, "raot-oldgate", "acc_head_a")
        previous = [r.get("previous", {}).get("raot", {}) for r in runs]
        before = [p["acc_head_a"] for p in previous if "acc_head_a" in p]
        if not new or not (old or before):
            continue
        reference = before or old
        shortfall = float(np.mean(reference) - np.mean(new))
        spread = float(np.std(reference, ddof=1)) if len(reference) > 1 else 0.0
        rows.append(
            [
                pair,
                _fmt(before),
                _fmt(old),
                _fmt(new),
                f"{-shortfall:+.3f}",
                "yes" if shortfall <= spread + 1e-12 else "**no**",
                _delta(_paired(runs, "raot", "raot-oldgate", "acc_head_a")),
                ", ".join(_applied(_row(r, "raot")) for r in runs),
                ", ".join(_applied(_row(r, "raot-oldgate")) for r in runs) or "–",
            ]
        )
    return _table(
        [
            "pair",
            "RaOT acc A's head, previous results",
            "old gate, rerun",
            "new gate",
            "new − previous (or old gate)",
            "within one std",
            "new − old gate, paired (same parents)",
            "transforms applied, new gate (per run)",
            "old gate (per run)",
        ],
        rows,
    )


def base_rule_rows(grouped: dict[str, list[dict]], methods: list[str], groups: dict[str, str]) -> list[str]:
    """Accuracy (A's head / B's head) of the base-relative rules beside the other rules, on the
    pairs that have a base."""
    names = [m for m in ("average", "raot", "regmean", "raot+regmean") if m in methods]
    names += [m for m in methods if groups.get(m) == "base"]
    rows = []
    for pair, runs in grouped.items():
        if not any(r.get("base") for r in runs):
            continue
        for m in names:
            if _values(runs, m, "acc_head_a"):
                rows.append(
                    [pair, f"`{m}`", _fmt(_values(runs, m, "acc_head_a")), _fmt(_values(runs, m, "acc_head_b"))]
                    + [", ".join(_applied(_row(r, m)) for r in runs)]
                )
    return _table(["pair", "method", "acc, A's head", "acc, B's head", "transforms applied"], rows) if rows else []


def _seconds(runs: list[dict], method: str) -> list[float]:
    return [r["methods"][method]["merge_seconds"] for r in runs if "merge_seconds" in r["methods"].get(method, {})]


def default_rule_rows(grouped: dict[str, list[dict]]) -> list[str]:
    """Linear against RegMean after RaOT per pair: accuracy with each head, paired differences,
    and the time of the whole merge."""
    rows = []
    for pair, runs in grouped.items():
        if not (_values(runs, "raot", "acc_head_a") and _values(runs, "raot+regmean", "acc_head_a")):
            continue
        cells = [pair]
        for key in ("acc_head_a", "acc_head_b"):
            diffs = _paired(runs, "raot+regmean", "raot", key)
            cells += [
                _fmt(_values(runs, "raot", key)),
                _fmt(_values(runs, "raot+regmean", key)),
                f"{_delta(diffs)} {MARKS[verdict(diffs, True)]}".strip(),
            ]
        cells += [_fmt(_seconds(runs, "raot"), 2), _fmt(_seconds(runs, "raot+regmean"), 2)]
        rows.append(cells)
    header = ["pair"]
    for head in ("A's head", "B's head"):
        header += [f"linear, {head}", f"RegMean, {head}", f"Δ RegMean − linear, {head}"]
    return _table(header + ["merge s, linear", "merge s, RegMean"], rows) if rows else []


def sections(results: dict, grouped: dict[str, list[dict]], methods: list[str]) -> list[str]:
    """The markdown of this module's sections (empty where the runs hold nothing for them)."""
    groups = {m["name"]: m.get("group", "") for m in results["methods"]}
    md: list[str] = []
    siblings = sibling_rows(results, grouped)
    if siblings:
        md += [
            "## Fine-tuned siblings: does the gate leave them alone?",
            "",
            "Per run: transforms the gate applied, `shares_basis`, the alignment's verdict, and the largest absolute",
            "difference between the RaOT merge's weights and the plain average's (0: bitwise equal).",
            "",
            *siblings,
            "",
        ]
    gates = gate_comparison(grouped)
    if len(gates) > 2:
        md += [
            "## RaOT's gate: merge objective against alignment objective",
            "",
            "Accuracy with A's head (mean ± std over runs). *Previous results*: the RaOT numbers these results held",
            "before RaOT was rerun with the new gate; *within one std*: the new gate's mean is not lower than the",
            "previous mean (or, without one, the old gate's) by more than that reference's std.",
            "",
            *gates,
            "",
        ]
    base_rules = base_rule_rows(grouped, methods, groups)
    if base_rules:
        md += ["## Base-relative merge rules (pairs with a base model)", "", *base_rules, ""]
    rules = default_rule_rows(grouped)
    if rules:
        md += [
            "## Default merge rule: linear against RegMean after RaOT",
            "",
            f"Paired over runs; {MARKS['helps']} RegMean better in every run, {MARKS['hurts']} worse in every run,"
            f" {MARKS['no clear effect']} no clear effect. Merge seconds: the whole merge (load, calibration,"
            " solve, gate, merge), single-threaded.",
            "",
            *rules,
            "",
        ]
    return md
