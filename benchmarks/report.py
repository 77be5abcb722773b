"""Aggregate runs into RESULTS.md (mean ± std over runs) and PNG plots.

Every sentence of the "where alignment does not help" section is generated from the numbers of
this run (paired differences over runs), so the text cannot drift from the tables.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

#: Metrics of a method row: key, column title, higher is better.
METRICS = (
    ("acc_head_a", "acc, A's head", True),
    ("acc_head_b", "acc, B's head", True),
    ("probe_a", "probe, task A", True),
    ("probe_b", "probe, task B", True),
    ("barrier_a", "barrier, task A", False),
    ("barrier_b", "barrier, task B", False),
    ("distance_after", "‖A−B′‖/‖A‖", False),
)
HEADLINE_METHODS = ("average", "wm-perm", "wm-rot", "soft-ot", "act-perm", "raot")
ABLATIONS = ("raot-nogate", "raot-heads", "raot-mlp", "raot-nores")
#: A paired difference smaller than this (accuracy points, or loss units for barriers) is "no effect".
NEGLIGIBLE = 0.005


def _values(runs: list[dict], method: str, key: str) -> list[float]:
    out = []
    for run in runs:
        row = run["methods"].get(method, {})
        v = row.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            out.append(float(v))
    return out


def _fmt(values: list[float], digits: int = 3) -> str:
    if not values:
        return "–"
    mean = float(np.mean(values))
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {float(np.std(values, ddof=1)):.{digits}f}"


def _paired(runs: list[dict], method: str, baseline: str, key: str) -> list[float]:
    diffs = []
    for run in runs:
        a, b = run["methods"].get(method, {}), run["methods"].get(baseline, {})
        if isinstance(a.get(key), (int, float)) and isinstance(b.get(key), (int, float)):
            diffs.append(float(a[key]) - float(b[key]))
    return diffs


def verdict(diffs: list[float], higher_is_better: bool) -> str:
    """``helps`` / ``hurts`` when every run moves the same way by more than :data:`NEGLIGIBLE`
    on average; otherwise ``no clear effect``."""
    if not diffs:
        return "n/a"
    signed = [d if higher_is_better else -d for d in diffs]
    mean = float(np.mean(signed))
    if mean > NEGLIGIBLE and min(signed) > 0:
        return "helps"
    if mean < -NEGLIGIBLE and max(signed) < 0:
        return "hurts"
    return "no clear effect"


def _delta(diffs: list[float]) -> str:
    if not diffs:
        return "–"
    if len(diffs) == 1:
        return f"{diffs[0]:+.3f}"
    return f"{np.mean(diffs):+.3f} ± {np.std(diffs, ddof=1):.3f}"


def _by_pair(results: dict) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = defaultdict(list)
    for run in results["runs"]:
        grouped[run["pair"]].append(run)
    return grouped


def _method_names(results: dict) -> list[str]:
    return [m["name"] for m in results["methods"]]


def _columns(runs: list[dict]) -> list[tuple[str, str, bool]]:
    """Metric columns that hold a number in some run."""
    keep = []
    for key, title, hib in METRICS:
        if any(isinstance(r.get(key), (int, float)) for run in runs for r in run["methods"].values()):
            keep.append((key, title, hib))
    return keep


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _gate_cell(runs: list[dict], method: str) -> str:
    cells = []
    for run in runs:
        g = run["methods"].get(method, {}).get("gate")
        if g and g["total"]:
            cells.append(f"{g['applied']}/{g['total']}")
    return ", ".join(cells) if cells else "–"


def _exact_cell(runs: list[dict], method: str) -> str:
    rows = [run["methods"].get(method, {}) for run in runs]
    rows = [r for r in rows if "exact" in r]
    if not rows:
        return "–"
    if all(r["exact"] for r in rows):
        return "exact"
    worst = max(r.get("deviation") or 0.0 for r in rows)
    return f"approx. (dev {worst:.2g})"


def pair_table(runs: list[dict], methods: list[str], labels: dict[str, str]) -> list[str]:
    """All methods of one pair: metrics mean ± std over runs, gate decisions, exactness."""
    cols = _columns(runs)
    header = ["method"] + [t for _, t, _ in cols] + ["transforms applied (per run)", "B′ vs B"]
    rows = []
    for m in methods:
        if not any(m in run["methods"] and "error" not in run["methods"][m] for run in runs):
            continue
        rows.append(
            [f"`{m}`"] + [_fmt(_values(runs, m, k)) for k, _, _ in cols] + [_gate_cell(runs, m), _exact_cell(runs, m)]
        )
    return _table(header, rows)


def parents_table(grouped: dict[str, list[dict]]) -> list[str]:
    rows = []
    for pair, runs in grouped.items():
        acc_a = [r["parents"]["a"]["accuracy"] for r in runs]
        acc_b = [r["parents"]["b"]["accuracy"] for r in runs]
        pa = [r["parents"]["a"].get("probe_a") for r in runs]
        pb = [r["parents"]["b"].get("probe_b") for r in runs]
        cross = [r["parents"]["a"].get("probe_b") for r in runs if r["parents"]["a"].get("probe_b") is not None]
        rows.append(
            [
                pair,
                _fmt(acc_a),
                _fmt(acc_b),
                _fmt([x for x in pa if x is not None]),
                _fmt([x for x in pb if x is not None]),
                _fmt(cross),
                _fmt([r["distance_before"] for r in runs]),
                str(len(runs)),
            ]
        )
    return _table(
        [
            "pair",
            "A on task A",
            "B on task B",
            "probe A feats, task A",
            "probe B feats, task B",
            "probe A feats, task B",
            "‖A−B‖/‖A‖",
            "runs",
        ],
        rows,
    )


def headline_rows(grouped: dict[str, list[dict]], methods: list[str]) -> list[str]:
    rows = []
    for pair, runs in grouped.items():
        for m in HEADLINE_METHODS:
            if m not in methods or not _values(runs, m, "acc_head_a"):
                continue
            rows.append(
                [
                    pair,
                    f"`{m}`",
                    _fmt(_values(runs, m, "acc_head_a")),
                    _fmt(_values(runs, m, "acc_head_b")),
                    _fmt(_values(runs, m, "probe_a")),
                    _fmt(_values(runs, m, "barrier_a")),
                    _gate_cell(runs, m),
                ]
            )
    return _table(
        ["pair", "method", "acc, A's head", "acc, B's head", "probe, task A", "barrier, task A", "transforms applied"],
        rows,
    )


def rules_table(grouped: dict[str, list[dict]], methods: list[str]) -> list[str]:
    variants = (
        ("none", {"linear": "average", "regmean": "regmean", "fisher": "fisher"}),
        ("weight rotation (paper)", {"linear": "wm-rot", "regmean": "wm-rot+regmean", "fisher": "wm-rot+fisher"}),
        ("RaOT", {"linear": "raot", "regmean": "raot+regmean", "fisher": "raot+fisher"}),
    )
    rows = []
    for pair, runs in grouped.items():
        for rule in ("linear", "regmean", "fisher"):
            cells = []
            for _, names in variants:
                m = names[rule]
                cells.append(
                    f"{_fmt(_values(runs, m, 'acc_head_a'))} / {_fmt(_values(runs, m, 'acc_head_b'))}"
                    if m in methods
                    else "–"
                )
            rows.append([pair, rule] + cells)
    return _table(["pair", "rule", "no alignment", "weight rotation (paper, ungated)", "RaOT"], rows)


def width_table(results: dict, grouped: dict[str, list[dict]], methods: list[str]) -> list[str]:
    pairs = [p for p in results["pairs"] if p["family"].startswith("(a)") and p["name"] in grouped]
    pairs.sort(key=lambda p: p["width"] or 0)
    rows = []
    for p in pairs:
        runs = grouped[p["name"]]
        rows.append(
            [
                str(p["width"]),
                *(_fmt(_values(runs, m, "acc_head_a")) for m in ("average", "wm-perm", "wm-rot", "act-perm", "raot")),
                _delta(_paired(runs, "raot", "act-perm", "acc_head_a")),
                _delta(_paired(runs, "raot", "act-perm", "probe_a")),
                _delta(_paired(runs, "raot", "act-perm", "barrier_a")),
            ]
        )
    return _table(
        [
            "width",
            "average",
            "wm-perm",
            "wm-rot",
            "act-perm",
            "RaOT",
            "Δ acc RaOT − act-perm",
            "Δ probe RaOT − act-perm",
            "Δ barrier RaOT − act-perm",
        ],
        rows,
    )


def gate_table(grouped: dict[str, list[dict]]) -> list[str]:
    rows = []
    for pair, runs in grouped.items():
        kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        basis = 0
        for run in runs:
            row = run["methods"].get("raot", {})
            for kind, (applied, total) in row.get("gate", {}).get("by_kind", {}).items():
                kinds[kind][0] += applied
                kinds[kind][1] += total
            basis += int(row.get("shares_basis", False))
        rows.append(
            [pair]
            + [f"{kinds[k][0]}/{kinds[k][1]}" if k in kinds else "–" for k in ("mlp", "heads", "residual")]
            + [f"{basis}/{len(runs)}"]
        )
    return _table(
        ["pair", "MLP layers applied", "head layers applied", "residual applied", "runs: 'shares a basis'"], rows
    )


def timing_table(grouped: dict[str, list[dict]]) -> list[str]:
    stages = ("load", "calibration", "solve", "gate", "apply", "merge")
    rows = []
    for pair, runs in grouped.items():
        cells = []
        for stage in stages:
            vals = [
                run["methods"]["raot"]["timings"].get(stage)
                for run in runs
                if "timings" in run["methods"].get("raot", {})
            ]
            cells.append(_fmt([v for v in vals if v is not None], 2))
        fisher = [
            run["methods"]["raot+fisher"]["timings"].get("fisher")
            for run in runs
            if "timings" in run["methods"].get("raot+fisher", {})
        ]
        total = [
            run["methods"]["raot"]["merge_seconds"] for run in runs if "merge_seconds" in run["methods"].get("raot", {})
        ]
        rows.append([pair] + cells + [_fmt([v for v in fisher if v is not None], 2), _fmt(total, 2)])
    return _table(["pair (RaOT, seconds)", *stages, "fisher (raot+fisher)", "whole merge"], rows)


MARKS = {"helps": "✓", "hurts": "✗", "no clear effect": "·", "n/a": ""}


def _comparison_table(grouped: dict[str, list[dict]], pairs_methods: list[tuple[str, str, str]]) -> list[str]:
    """Rows (pair, method, baseline): paired Δ per metric with its verdict mark."""
    keys = [m for m in METRICS if m[0] != "distance_after"]
    present = [k for k in keys if any(_paired(grouped[p], m, b, k[0]) for p, m, b in pairs_methods)]
    rows = []
    for pair, method, baseline in pairs_methods:
        cells = []
        for key, _, hib in present:
            diffs = _paired(grouped[pair], method, baseline, key)
            cells.append(f"{_delta(diffs)} {MARKS[verdict(diffs, hib)]}".strip() if diffs else "–")
        rows.append([pair, f"`{method}` − `{baseline}`"] + cells)
    return _table(["pair", "comparison"] + [f"Δ {t}" for _, t, _ in present], rows)


def does_not_help(grouped: dict[str, list[dict]], methods: list[str]) -> list[str]:
    """Tables of paired differences and generated bullet points where alignment does not help."""
    lines: list[str] = []
    pairs = list(grouped)
    if "raot" in methods and "average" in methods:
        lines += ["**RaOT against plain averaging** (paired Δ over runs; barrier: lower is better):", ""]
        lines += _comparison_table(grouped, [(p, "raot", "average") for p in pairs]) + [""]
    if "raot" in methods and "act-perm" in methods:
        lines += ["**What the rotations add** (RaOT against the same estimator restricted to permutations):", ""]
        lines += _comparison_table(grouped, [(p, "raot", "act-perm") for p in pairs]) + [""]
    baselines = [m for m in ("wm-perm", "wm-rot", "wm-rot-rescale", "soft-ot", "act-perm") if m in methods]
    if baselines and "average" in methods:
        lines += ["**Other alignments against plain averaging:**", ""]
        lines += _comparison_table(grouped, [(p, m, "average") for p in pairs for m in baselines]) + [""]
    lines += ["**Generated from these numbers:**", ""]
    for pair, runs in grouped.items():
        notes = []
        cols = [c for c in _columns(runs) if c[0] != "distance_after"]
        if "raot" in methods and "average" in methods:
            weak = []
            for key, title, hib in cols:
                diffs = _paired(runs, "raot", "average", key)
                v = verdict(diffs, hib)
                if v in ("no clear effect", "hurts"):
                    weak.append(f"{title} ({v}, Δ {_delta(diffs)})")
            if weak:
                notes.append("RaOT does not beat plain averaging on " + "; ".join(weak))
        for m in baselines:
            if all(verdict(_paired(runs, m, "average", k), hib) != "helps" for k, _, hib in cols):
                notes.append(f"`{m}` helps on no metric against plain averaging")
        for ab in ABLATIONS:
            if ab in methods and "raot" in methods:
                diffs = _paired(runs, ab, "raot", "acc_head_a")
                if verdict(diffs, True) == "helps":
                    notes.append(f"the ablation `{ab}` beats full RaOT on A's-head accuracy (Δ {_delta(diffs)})")
        for rule in ("regmean", "fisher"):
            if rule in methods and f"raot+{rule}" in methods:
                diffs = _paired(runs, f"raot+{rule}", rule, "acc_head_a")
                v = verdict(diffs, True)
                if v != "helps":
                    notes.append(f"RaOT before {rule} does not help A's-head accuracy ({v}, Δ {_delta(diffs)})")
        raot_rows = [run["methods"].get("raot", {}) for run in runs]
        basis = sum(int(r.get("shares_basis", False)) for r in raot_rows)
        if basis:
            notes.append(
                f"the gate rejected every RaOT transform in {basis}/{len(runs)} runs: the pair already shares a "
                "basis (detection, not repair)"
            )
        applied = [r["gate"]["applied"] for r in raot_rows if r.get("gate")]
        before = [run["distance_before"] for run in runs]
        after = [r["distance_after"] for r in raot_rows if "distance_after" in r]
        if applied and after and np.mean(after) > np.mean(before) * 1.5 and np.mean(before) < 0.1:
            notes.append(
                f"parents already close in weight space (‖A−B‖/‖A‖ = {np.mean(before):.3f}), yet the gate applied "
                f"{np.mean(applied):.1f} transforms per run on average, moving B′ away from A "
                f"({np.mean(after):.3f}): the held-out activation gains passed the margin although the parents "
                "start from one initialization"
            )
        accs = [np.mean(_values(runs, m, "acc_head_a")) for m in methods if _values(runs, m, "acc_head_a")]
        best = max(accs, default=float("nan"))
        parent = np.mean([r["parents"]["a"]["accuracy"] for r in runs])
        if best < parent - 0.05:
            notes.append(f"no merge comes near parent A on its own task (best mean {best:.3f} vs parent {parent:.3f})")
        lines.append(f"* **{pair}**")
        lines += [f"  * {n}" for n in notes] or ["  * alignment helped on every reported metric"]
    return lines


PLOT_FILES = ("barrier_curves.png", "gate_gains.png", "width_series.png")


def write_report(results: dict[str, Any], out: Path, markdown_only: bool = False) -> str:
    """Write RESULTS.md and the plots into ``out``; returns the markdown. ``markdown_only``: return
    the markdown without writing anything, linking the plots already in ``out``."""
    from benchmarks.report_corrections import sections as correction_sections
    from benchmarks.report_mergekit import sections as mergekit_sections
    from benchmarks.report_siblings import sections as sibling_sections
    from benchmarks.row_history import history_lines
    from benchmarks.update import contributing, live_notes

    grouped = _by_pair(results)
    methods = _method_names(results)
    labels = {m["name"]: m["label"] for m in results["methods"]}
    meta = results["meta"]
    plots = [out / name for name in PLOT_FILES if (out / name).is_file()] if markdown_only else []
    try:
        if markdown_only:
            raise StopIteration
        from benchmarks.plots import barrier_plot, gate_gain_plot, width_plot

        plots = [
            p
            for p in (
                barrier_plot(results, grouped, out),
                gate_gain_plot(grouped, out),
                width_plot(results, grouped, out),
            )
            if p
        ]
    except StopIteration:
        pass
    except ImportError as exc:
        meta.setdefault("notes", []).append(f"plots skipped: {exc} (pip install matplotlib)")
    md = ["# RaOT evidence: results", ""]
    md.append(
        f"Suite `{meta['suite']}`, {len(results['runs'])} runs, α grid of {len(meta['alphas'])} points, "
        + (
            f"assembled from {len(meta['updates'])} invocations (listed below). Versions: "
            if meta.get("updates")
            else f"{meta['workers']} worker(s), {meta['seconds'] / 60:.1f} min. Versions: "
        )
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + "."
    )
    md += [
        "",
        "Regenerate with `python -m benchmarks.run"
        + (" --quick" if meta["suite"] == "quick" else "")
        + "` (offline; parents cached by the zoo).",
        "Cells are mean ± std over runs (sample std; a single run shows its value). Accuracy with A's head is on",
        "task A's test split, with B's head on task B's; probes are logistic regressions on the frozen",
        "classifier-input features (CLS / pooled) of the merged trunk; the barrier is the largest excess of the",
        "test loss along (1−α)·A + α·B′ over the straight line between its ends; ‖A−B′‖/‖A‖ is over the trunk,",
        "LayerNorms folded for pre-LN models. `B′ vs B`: whether the applied alignment is an exact symmetry.",
        "",
    ]
    if meta.get("updates"):
        live = contributing(meta["updates"])
        md += ["**Which numbers come from which run** (later runs replace the rows they rerun):", ""]
        md += [
            f"* {u['date']}: `python -m benchmarks.run {' '.join(u['argv'])}` — pairs {', '.join(u['pairs'])}; "
            f"methods {', '.join(u['methods'])} ({(u['seconds'] or 0) / 60:.1f} min"
            + (f"; raot_hf source digest {u['source_digest']}" if u.get("source_digest") else "")
            + ")"
            for u, kept in zip(meta["updates"], live)
            if kept
        ]
        if not all(live):
            md.append(
                f"* and {live.count(False)} earlier invocation(s) whose rows have all been rerun since "
                "(listed in `results.json`, `meta.updates`)"
            )
        md.append("")
    notes = live_notes(results)
    if notes:
        md += ["**Notes (skipped or failed):**", ""] + [f"* {n}" for n in notes] + [""]
    md += ["## Methods", ""] + [f"* `{m['name']}` — {m['label']}: `{m['options']}`" for m in results["methods"]] + [""]
    md += ["## Pairs", ""]
    for p in results["pairs"]:
        md.append(f"* `{p['name']}` {p['family']}: {p['description']}; runs (seeds A, B): {p['seeds']}")
    md += ["", "## Headline", ""] + headline_rows(grouped, methods) + [""]
    md += ["## Parents", ""] + parents_table(grouped) + [""]
    if any(p["family"].startswith("(a)") for p in results["pairs"]):
        md += (
            ["## Width series (a): does the isometries' share grow with width?", ""]
            + width_table(results, grouped, methods)
            + [""]
        )
    md += ["## Where alignment does not help", ""]
    md += (
        [
            "Differences are paired over runs (same parents, same data). ✓: better in every run and by more than",
            f"{NEGLIGIBLE} on average; ✗: worse in every run (same threshold); ·: no clear effect (runs disagree in",
            "sign, or the mean difference is below the threshold). Barrier and distance: lower is better.",
            "",
        ]
        + does_not_help(grouped, methods)
        + [""]
    )
    md += (
        ["## Merge rules, with and without alignment (acc with A's head / with B's head)", ""]
        + rules_table(grouped, methods)
        + [""]
    )
    md += correction_sections(grouped, methods)
    md += mergekit_sections(grouped, methods)
    md += ["## Gate decisions of RaOT (summed over runs)", ""] + gate_table(grouped) + [""]
    md += sibling_sections(results, grouped, methods)
    md += ["## Time per stage (RaOT merge, seconds per run)", ""] + timing_table(grouped) + [""]
    md += ["## All methods per pair", ""]
    for pair, runs in grouped.items():
        md += [f"### {pair}", ""] + pair_table(runs, methods, labels) + [""]
    md += history_lines(
        results.get("history", []),
        [(title, lambda row, key=key: row.get(key), 3) for key, title, _ in METRICS],
        "`results.json` (`history`)",
    )
    if plots:
        md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    text = "\n".join(md)
    if not markdown_only:
        (out / "RESULTS.md").write_text(text)
    return text
