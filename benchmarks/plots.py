"""PNG plots of the results (matplotlib, headless): barrier curves, per-layer gate gains, the
width series. Each function returns the written path, or None when there is nothing to draw."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.methods import BARRIER_PLOT_METHODS  # noqa: E402


def _grid(n: int):
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def barrier_plot(results: dict, grouped: dict, out: Path) -> Path | None:
    """Test loss (task A) along (1−α)·A + α·B′ for the main methods, mean ± std over runs."""
    alphas = np.asarray(results["meta"]["alphas"])
    pairs = [p for p, runs in grouped.items() if any("path_loss" in r for run in runs for r in run["methods"].values())]
    if not pairs or len(alphas) < 2:
        return None
    fig, axes = _grid(len(pairs))
    for ax, pair in zip(axes, pairs, strict=False):
        for m in BARRIER_PLOT_METHODS:
            curves = [
                run["methods"][m]["path_loss"]["a"] for run in grouped[pair] if "path_loss" in run["methods"].get(m, {})
            ]
            if not curves:
                continue
            c = np.asarray(curves)
            mean = c.mean(0)
            ax.plot(alphas, mean, marker="o", ms=3, label=m)
            if len(c) > 1:
                std = c.std(0, ddof=1)
                ax.fill_between(alphas, mean - std, mean + std, alpha=0.2)
        ax.set_title(pair, fontsize=9)
        ax.set_xlabel("α (weight of B′)")
        ax.set_ylabel("test loss, task A")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle("Loss along the linear path A → B′ (mean ± std over runs)", fontsize=10)
    fig.tight_layout()
    path = out / "barrier_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gate_gain_plot(grouped: dict, out: Path) -> Path | None:
    """RaOT's held-out gain over the identity per layer (MLP, heads) and for the residual map,
    with the gate's margin; filled markers were applied."""
    pairs = [
        p
        for p, runs in grouped.items()
        if any(run["methods"].get("raot", {}).get("gate", {}).get("decisions") for run in runs)
    ]
    if not pairs:
        return None
    fig, axes = _grid(len(pairs))
    for ax, pair in zip(axes, pairs, strict=False):
        for kind, colour, offset in (("mlp", "C0", -0.1), ("heads", "C1", 0.1), ("residual", "C2", 0.0)):
            xs, gains, margins, applied = [], [], [], []
            for run in grouped[pair]:
                for d in run["methods"].get("raot", {}).get("gate", {}).get("decisions", []):
                    if d["transform"] != kind or d["gain"] is None:
                        continue
                    xs.append((-1 if d["layer"] is None else d["layer"]) + offset)
                    gains.append(d["gain"])
                    margins.append(d["margin"] if d["margin"] is not None else np.nan)
                    applied.append(d["applied"])
            if not xs:
                continue
            xs, gains, margins, applied = map(np.asarray, (xs, gains, margins, applied))
            ax.scatter(xs[applied], gains[applied], color=colour, s=18, label=f"{kind} (applied)")
            ax.scatter(
                xs[~applied], gains[~applied], facecolors="none", edgecolors=colour, s=18, label=f"{kind} (rejected)"
            )
            ax.scatter(xs, margins, color=colour, marker="_", s=60)
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_title(pair, fontsize=9)
        ax.set_xlabel("layer (−1: residual stream)")
        ax.set_ylabel("held-out gain over identity")
        ax.legend(fontsize=6)
    fig.suptitle("RaOT gate: per-layer held-out gains (dash = margin to beat)", fontsize=10)
    fig.tight_layout()
    path = out / "gate_gains.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def width_plot(results: dict, grouped: dict, out: Path) -> Path | None:
    """Accuracy (A's head) and barrier against width for the ViT seed pairs."""
    pairs = sorted(
        (p for p in results["pairs"] if p["family"].startswith("(a)") and p["name"] in grouped),
        key=lambda p: p["width"],
    )
    if len(pairs) < 2:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    widths = [p["width"] for p in pairs]
    for m in ("average", "wm-perm", "wm-rot", "act-perm", "raot"):
        for ax, key in ((left, "acc_head_a"), (right, "barrier_a")):
            means, stds = [], []
            for p in pairs:
                vals = [run["methods"].get(m, {}).get(key) for run in grouped[p["name"]]]
                vals = [v for v in vals if v is not None]
                means.append(np.mean(vals) if vals else np.nan)
                stds.append(np.std(vals, ddof=1) if len(vals) > 1 else 0.0)
            ax.errorbar(widths, means, yerr=stds, marker="o", capsize=3, label=m)
    left.set_ylabel("merged accuracy, A's head")
    right.set_ylabel("loss barrier, task A")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.set_xlabel("width d (ViT on digits, 4 heads)")
        ax.legend(fontsize=7)
    fig.suptitle("Width series (a): mean ± std over runs", fontsize=10)
    fig.tight_layout()
    path = out / "width_series.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
