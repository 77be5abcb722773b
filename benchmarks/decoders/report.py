"""Tables and plots of the decoder benchmark (``results.json`` → ``RESULTS.md``, PNGs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.methods import BY_NAME
from benchmarks.report import _by_pair as by_pair
from benchmarks.report import _fmt as fmt
from benchmarks.row_history import history_lines


def _by_pair(results: dict) -> dict[str, list[dict]]:
    """Runs grouped by pair, pairs and runs in order."""
    return {name: sorted(runs, key=lambda r: r["run"]) for name, runs in sorted(by_pair(results).items())}


def _fmt(values: list[float], digits: int = 2) -> str:
    return fmt(values, digits)


def _method_values(runs: list[dict], method: str, get) -> list[float]:
    out = []
    for run in runs:
        row = run["methods"].get(method)
        if row and "error" not in row:
            value = get(row)
            if value is not None:
                out.append(value)
    return out


def _exact_cell(runs: list[dict], method: str) -> str:
    rows = [r["methods"][method] for r in runs if method in r["methods"] and "error" not in r["methods"][method]]
    if not rows:
        errors = {r["methods"][method]["error"] for r in runs if method in r["methods"]}
        return "failed: " + "; ".join(sorted(errors))[:120] if errors else "–"
    if all(r["exact"] for r in rows):
        return "exact"
    worst = max(r["deviation"] or 0.0 for r in rows)
    norms = [r["deviation_norm"] for r in rows if r.get("deviation_norm") is not None]
    norm = f"; in norm ≤ {max(norms):.2g}" if norms else ""
    return f"**inexact** (B′ dev. ≤ {worst:.2g}{norm})"


def _gate_cell(runs: list[dict], method: str) -> str:
    rows = [r["methods"][method] for r in runs if method in r["methods"] and "error" not in r["methods"][method]]
    return ", ".join(f"{r['applied']}/{r['candidates']}" for r in rows) or "–"


def pair_table(runs: list[dict]) -> list[str]:
    """One row per method: perplexity at α = ½ on each corpus, barrier, exactness, gate."""
    corpora = list(runs[0]["parents"]["a"])
    methods = list(runs[0]["methods"])
    head = ["method"] + [f"ppl {c} @ α=½" for c in corpora] + [f"ppl / parents' {c}" for c in corpora]
    head += [f"barrier {c} (nats)" for c in corpora]
    head += ["exactness", "applied / candidates"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for side in ("a", "b", "base"):
        if side in runs[0]["parents"]:
            cells = [_fmt([float(np.exp(r["parents"][side][c])) for r in runs]) for c in corpora]
            lines.append(f"| parent {side.upper()} | " + " | ".join(cells + ["–"] * 2 * len(corpora) + ["", ""]) + " |")
    for m in methods:
        cells = [_fmt(_method_values(runs, m, lambda row, c=c: row["ppl"][c])) for c in corpora]
        cells += [_fmt(_ratios(runs, m, c), 3) for c in corpora]
        cells += [_fmt(_method_values(runs, m, lambda row, c=c: row.get("barrier", {}).get(c)), 3) for c in corpora]
        lines.append(f"| {m} | " + " | ".join(cells + [_exact_cell(runs, m), _gate_cell(runs, m)]) + " |")
    return lines


def _ratios(runs: list[dict], method: str, corpus: str) -> list[float]:
    """Per run: the merge's perplexity over the mean of the parents' (A's and B's)."""
    out = []
    for r in runs:
        row = r["methods"].get(method, {})
        if "ppl" in row:
            parents = [float(np.exp(r["parents"][side][corpus])) for side in ("a", "b")]
            out.append(row["ppl"][corpus] / float(np.mean(parents)))
    return out


def _paired(runs: list[dict], method: str, baseline: str, corpus: str) -> list[float]:
    out = []
    for r in runs:
        a, b = r["methods"].get(method, {}), r["methods"].get(baseline, {})
        if "ppl" in a and "ppl" in b:
            out.append(a["ppl"][corpus] - b["ppl"][corpus])
    return out


def headline(grouped: dict[str, list[dict]], baseline: str = "average") -> list[str]:
    """Every method against ``baseline`` (paired by run; negative = better)."""
    lines = [
        f"| pair | method | Δ ppl vs {baseline} (reviews) | verdict |",
        "|---|---|---|---|",
    ]
    for name, runs in grouped.items():
        methods = sorted({m for r in runs for m in r["methods"]}, key=list(BY_NAME).index)
        for m in methods:
            if m == baseline:
                continue
            diffs = _paired(runs, m, baseline, "reviews")
            if not diffs:
                continue
            mean, std = float(np.mean(diffs)), float(np.std(diffs, ddof=1)) if len(diffs) > 1 else 0.0
            verdict = "better" if mean + std < 0 else "worse" if mean - std > 0 else "within 1 std"
            lines.append(f"| {name} | {m} | {mean:+.2f} ± {std:.2f} | {verdict} |")
    return lines


def _plot_barriers(grouped: dict[str, list[dict]], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [n for n in grouped if "-d64" in n or "siblings" in n]
    if not names:  # a partial run (e.g. one d32 pair): nothing to draw
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        runs = grouped[name]
        for m in ("average", "wm-rot", "act-perm", "raot", "raot-norope"):
            curves = [r["methods"][m]["path_loss"]["reviews"] for r in runs if "path_loss" in r["methods"].get(m, {})]
            if curves:
                ax.plot([0, 0.25, 0.5, 0.75, 1], np.mean(curves, axis=0), marker="o", label=m)
        ax.set_title(name)
        ax.set_xlabel("α (A → B′)")
        ax.set_ylabel("test loss, reviews (nats/token)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    path = out / "decoder_barriers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_widths(grouped: dict[str, list[dict]], out: Path) -> Path | None:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, arch in zip(axes, ("gpt2", "llama"), strict=True):
        series = (n for n in grouped if n.startswith(f"{arch}-seeds-d") and n.rsplit("d", 1)[1].isdigit())  # 2 layers
        names = sorted(series, key=lambda n: int(n.rsplit("d", 1)[1]))
        widths = [int(n.rsplit("d", 1)[1]) for n in names]
        for m in ("average", "wm-rot", "act-perm", "raot", "regmean"):
            means = [np.mean(_method_values(grouped[n], m, lambda r: r["ppl"]["reviews"]) or [np.nan]) for n in names]
            ax.plot(widths, means, marker="o", label=m)
        parents = [np.mean([np.exp(r["parents"]["a"]["reviews"]) for r in grouped[n]]) for n in names]
        ax.plot(widths, parents, "k--", label="parent A")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{arch}: merge at α = ½")
        ax.set_xlabel("width d")
        ax.set_ylabel("held-out perplexity (reviews)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "decoder_widths.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(results: dict[str, Any], out: Path, markdown_only: bool = False) -> str:
    """Write ``RESULTS.md`` (and the plots) from ``results.json``'s runs; returns the markdown.
    ``markdown_only``: return it without writing anything, linking the plots already in ``out``."""
    grouped = _by_pair(results)
    lines = [
        "# Decoder benchmark",
        "",
        "Commands: " + "; ".join(f"`{c}`" for c in results.get("commands", [results.get("command", "")])) + ". "
        "Mean ± std over runs "
        "(3 per family). Perplexity is per token (the shared 1,024-token WordPiece) on 400 held-out texts; "
        "the barrier is max over α of loss(α) minus the chord, on the path (1 − α)·A + α·B′. "
        "Exactness: whether B′ computes B's function (the product's B′ ≡ B check; its deviation when not).",
        "",
        "Methods: " + "; ".join(f"`{m}` {BY_NAME[m].label}" for m in _methods_seen(grouped)) + ".",
        "",
        "## Against the plain average (paired by run; negative Δ = lower perplexity)",
        "",
        *headline(grouped),
        "",
    ]
    corrected = [m for m in CORRECTED if m in _methods_seen(grouped)]
    for baseline in ("raot", "raot+regmean") if corrected else ():
        lines += [
            f"## Corrections and learned alignment against {baseline} (paired by run)",
            "",
            f"| pair | method | Δ ppl vs {baseline} (reviews) | verdict |",
            "|---|---|---|---|",
        ]
        lines += [row for row in headline(grouped, baseline)[2:] if row.split(" | ")[1] in corrected]
        lines.append("")
    for name, runs in grouped.items():
        lines += [f"## {name}", "", *pair_table(runs), *_notes(runs), ""]
    lines += _history(results.get("history", []))
    if markdown_only:
        plots = [out / name for name in ("decoder_barriers.png", "decoder_widths.png") if (out / name).is_file()]
    else:
        plots = [p for p in (_plot_barriers(grouped, out), _plot_widths(grouped, out)) if p is not None]
    for plot in plots:
        lines += [f"![{plot.stem}]({plot.name})", ""]
    text = "\n".join(lines)
    if not markdown_only:
        (out / "RESULTS.md").write_text(text)
    return text


def _history(history: list[dict]) -> list[str]:
    """The earlier runs of rerun rows (``results["history"]``): perplexity and barrier per corpus."""
    corpora = list(dict.fromkeys(c for entry in history for c in entry["row"].get("ppl", {})))
    columns = [(f"ppl {c} @ α=½", lambda row, c=c: row.get("ppl", {}).get(c), 2) for c in corpora]
    columns += [(f"barrier {c} (nats)", lambda row, c=c: row.get("barrier", {}).get(c), 3) for c in corpora]
    return history_lines(history, columns, "`results.json` (`history`)")


#: The rows compared, paired by run, with RaOT and with RaOT + RegMean.
CORRECTED = ("raot+lsq", "raot+repair", "raot+regmean+lsq", "raot+lsq-all", "raot+refine", "raot+refine+lsq", "lsq")


def _notes(runs: list[dict]) -> list[str]:
    """What a reader must know about a pair's table: the gate's verdicts (runs where RaOT said
    "shares a basis"), and for an inexact method that its path ends at B′, not at B."""
    out = []
    verdicts = [r["methods"]["raot"] for r in runs if "verdict" in r["methods"].get("raot", {})]
    if verdicts:
        shared = sum(bool(v["shares_basis"]) for v in verdicts)
        out.append("")
        out.append(f'RaOT\'s verdict: "shares a basis" in {shared} of {len(verdicts)} runs.')
    for m in runs[0]["methods"]:
        rows = [r["methods"][m] for r in runs if "exact" in r["methods"].get(m, {})]
        if rows and not all(row["exact"] for row in rows) and all("path_loss" in row for row in rows):
            b_prime = [float(np.exp(row["path_loss"]["reviews"][-1])) for row in rows]
            b = [float(np.exp(r["parents"]["b"]["reviews"])) for r in runs]
            out.append("")
            out.append(
                f"`{m}` is inexact: B′ is not B (perplexity of B′ {_fmt(b_prime)} against B's {_fmt(b)}), "
                "so its path ends at B′ and its barrier is not comparable with the exact rows'."
            )
    return out


def _methods_seen(grouped: dict[str, list[dict]]) -> list[str]:
    seen: list[str] = []
    for runs in grouped.values():
        for r in runs:
            seen += [m for m in r["methods"] if m not in seen]
    return seen
