"""Section of RESULTS.md on making the merge work after alignment: the post-merge corrections
(merged-input least squares, REPAIR statistics) and the learned alignment, against RaOT with the
linear rule and with RegMean, paired by run.

Every cell is computed from the runs, like :mod:`benchmarks.report`.
"""

from __future__ import annotations

from benchmarks.report import _comparison_table, _fmt, _table, _values

#: Rows of the section, in the order they are shown (those a results file lacks are left out).
CORRECTED = (
    "raot+lsq",
    "raot+repair",
    "raot+regmean+lsq",
    "raot+lsq-all",
    "raot+refine",
    "raot+refine+lsq",
    "lsq",
    "default-norefit",
    "default+refit-hidden",
    "default+refit-confident",
    "default+refit-1000",
    "default",
)
BASELINES = ("raot", "raot+regmean")


def _parent_a(runs: list[dict]) -> list[float]:
    return [float(r["parents"]["a"]["accuracy"]) for r in runs]


def summary_table(grouped: dict[str, list[dict]], methods: list[str]) -> list[str]:
    """Per pair: parent A's accuracy on task A and each merge's accuracy with A's head there."""
    shown = [m for m in ("average", *BASELINES, *CORRECTED) if m in methods]
    rows = []
    for pair, runs in grouped.items():
        if not any(_values(runs, m, "acc_head_a") for m in CORRECTED):
            continue
        rows.append([pair, _fmt(_parent_a(runs))] + [_fmt(_values(runs, m, "acc_head_a")) for m in shown])
    return _table(["pair", "parent A"] + [f"`{m}`" for m in shown], rows)


def sections(grouped: dict[str, list[dict]], methods: list[str]) -> list[str]:
    """The corrections section, or nothing when no corrected method was run."""
    corrected = [m for m in CORRECTED if m in methods]
    if not corrected or "raot" not in methods:
        return []
    lines = [
        "## Corrections and learned alignment after RaOT",
        "",
        "Accuracy with A's head on task A (mean ± std over runs). `default` is the product's defaults, whose",
        "correction is chosen by the gate's verdict (least squares after an applied alignment, none for",
        "siblings), followed where the gate moved B by the refit towards the parents' predictions",
        "(`default-norefit`: without it; `default+refit-hidden`: towards their last hidden states;",
        "`default+refit-confident`: towards their predictions, each weighted per example by its confidence).",
        "",
        *summary_table(grouped, methods),
        "",
    ]
    for baseline in (b for b in BASELINES if b in methods):
        rows = [(p, m, baseline) for p, runs in grouped.items() for m in corrected if _values(runs, m, "acc_head_a")]
        if rows:
            lines += [f"**Against `{baseline}`** (paired Δ over runs; ✓ ✗ · as above):", ""]
            lines += _comparison_table(grouped, rows) + [""]
    return lines
