"""Section of RESULTS.md on mergekit's rules (``slerp``, ``model_stock``, ``della``): each beside
the plain average and TIES, and SLERP with and without RaOT, paired by run.

Every cell is computed from the runs, like :mod:`benchmarks.report`.
"""

from __future__ import annotations

from benchmarks.report import MARKS, _delta, _fmt, _paired, _table, _values, verdict

#: Rows of the accuracy table, in order (those a pair lacks are left out).
ROWS = ("average", "raot", "ties", "slerp", "slerp-raot", "model-stock", "della")
#: Paired comparisons (method, baseline) of the second table.
COMPARISONS = (
    ("slerp", "average"),
    ("slerp-raot", "slerp"),
    ("slerp-raot", "raot"),
    ("model-stock", "average"),
    ("della", "average"),
    ("della", "ties"),
)
NEW = ("slerp", "slerp-raot", "model-stock", "della")


def accuracy_rows(grouped: dict[str, list[dict]], methods: list[str]) -> list[str]:
    """Accuracy with A's head and with B's head of each rule, per pair that ran one of them."""
    rows = []
    for pair, runs in grouped.items():
        if not any(_values(runs, m, "acc_head_a") for m in NEW if m in methods):
            continue
        parents = [[float(r["parents"][side]["accuracy"]) for r in runs] for side in ("a", "b")]
        rows.append([pair, "parents (A on task A, B on task B)", _fmt(parents[0]), _fmt(parents[1]), str(len(runs))])
        for m in ROWS:
            a = _values(runs, m, "acc_head_a")
            if m in methods and a:
                rows.append([pair, f"`{m}`", _fmt(a), _fmt(_values(runs, m, "acc_head_b")), str(len(a))])
    return _table(["pair", "method", "acc, A's head", "acc, B's head", "runs"], rows) if rows else []


def comparison_rows(grouped: dict[str, list[dict]], methods: list[str]) -> list[str]:
    """Paired differences (per run, same parents) of the comparisons both of whose rows exist."""
    rows = []
    for pair, runs in grouped.items():
        for method, baseline in COMPARISONS:
            if method not in methods or baseline not in methods:
                continue
            cells = []
            for key in ("acc_head_a", "acc_head_b"):
                diffs = _paired(runs, method, baseline, key)
                cells.append(f"{_delta(diffs)} {MARKS[verdict(diffs, True)]}".strip() if diffs else "–")
            if any(c != "–" for c in cells):
                rows.append([pair, f"`{method}` − `{baseline}`", *cells])
    return _table(["pair", "comparison", "Δ acc, A's head", "Δ acc, B's head"], rows) if rows else []


def sections(grouped: dict[str, list[dict]], methods: list[str]) -> list[str]:
    """The markdown of this section (empty where the runs hold no mergekit rule)."""
    accuracy = accuracy_rows(grouped, methods)
    if not accuracy:
        return []
    return [
        "## mergekit's rules: SLERP, Model Stock, DELLA",
        "",
        "`slerp` / `slerp-raot`: SLERP at t = 0.5 from A to B, of the checkpoints as stored / of A and B′ after",
        "RaOT (gated, no correction). `model-stock`, `della`: with the siblings' base (only pairs with one).",
        "Mean ± std over runs.",
        "",
        *accuracy,
        "",
        f"Paired by run: {MARKS['helps']} better in every run, {MARKS['hurts']} worse in every run, "
        f"{MARKS['no clear effect']} no clear effect (runs disagree or |mean| < 0.005).",
        "",
        *comparison_rows(grouped, methods),
        "",
    ]
