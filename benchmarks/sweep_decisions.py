"""Decisions and quality of the benchmark families before and after a change of the numerics: the
record of which gate decisions, kept corrections and scores a change moved. One record per change
(``CHANGES``): ``sweep``, the one sweep after the solve and the float32 scoring of candidates against
the three stages (docs/design.md §5.7), and ``statistics``, the calibration statistics' whole-batch
16-bit MLP co-moment products (§4.3).

The rows come from the benchmark runners' own results (``benchmarks.run`` for the encoder
families, ``benchmarks.decoders.run`` for the decoders), run on one machine over the same cached
parents, once per code version: a run on the commit before the change and one on the commit with
it. ``record`` reads such a results file and appends its rows, with the commit the runner ran on,
its command and the machine, to the change's record; the markdown is generated from that record
only::

    python -m benchmarks.run --workers 1 --pairs vit-digits,bert-rt,bert-sentiment \\
        --methods default,default-staged --out OUT
    python -m benchmarks.sweep_decisions record --change sweep --results OUT/results.json --label after --commit C
    python -m benchmarks.sweep_decisions --change sweep --report      # or python -m benchmarks.report_all
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, stdev
from typing import Any

BENCH = Path(__file__).resolve().parent
if __package__ in (None, ""):  # pragma: no cover - run as a script
    sys.path.insert(0, str(BENCH.parent))

from benchmarks.records import append_run, machine, read_history, run_heading  # noqa: E402


@dataclass(frozen=True)
class Change:
    """A change of the numerics whose effect on the families is recorded: its record, its
    generated markdown (paths relative to ``benchmarks/``), the title and what the columns mean."""

    name: str
    record: str
    markdown: str
    title: str
    columns: str
    #: the mean table also gives each column's paired difference from the first column, mean ± std
    #: over runs, and whether it lies within one std of the first column's runs
    paired: bool = False

    @property
    def record_path(self) -> Path:
        return BENCH / self.record

    @property
    def markdown_path(self) -> Path:
        return BENCH / self.markdown


CHANGES: dict[str, Change] = {
    "sweep": Change(
        "sweep",
        "results/results_sweep.json",
        "results/RESULTS_sweep.md",
        "The one sweep after the solve against the three stages: decisions and quality",
        "`before` ran on the commit before the one sweep and the float32 scoring of candidates, `after` on "
        "the commit with both; `default` is the product's defaults (on `after`, the one sweep), "
        "`default-staged` the gate, the apply and the correction as three passes.",
    ),
    "statistics": Change(
        "statistics",
        "results/results_statistics_decisions.json",
        "results/RESULTS_statistics_decisions.md",
        "Whole-batch 16-bit MLP co-moment products: decisions and quality",
        "`before` ran on the commit before the calibration statistics took the MLP co-moment's 16-bit "
        "products over whole batches (and dropped the stream's Σbᵀb), `after` on the commit with it; "
        "`default` is the product's defaults, which on the recording machine (bf16 matrix instructions) "
        "take bf16 MLP co-moment products. Both ran with `OMP_NUM_THREADS=1`.",
    ),
    "token_cap": Change(
        "token_cap",
        "results/results_token_budget.json",
        "results/RESULTS_token_budget.md",
        "The MLP cross moments' token cap: decisions and quality",
        "`before` ran on the commit before the cap of 16,384 fit tokens per MLP cross moment became the "
        "default, `cap` on the commit with it; `default` is the product's defaults (no benchmark calibration "
        "holds 16,384 fit tokens, so the cap does not bind there) and `default-cap2k` the defaults with the "
        "cap at 2,048 fit tokens, which binds on every family (a fifth to a half of their fit tokens enter each "
        "MLP moment; the default keeps a third of BERT-base's at 512 × 128). Both ran with `OMP_NUM_THREADS=1`.",
        paired=True,
    ),
    "hidden_token_cap": Change(
        "hidden_token_cap",
        "results/results_hidden_token_budget.json",
        "results/RESULTS_hidden_token_budget.md",
        "The d × d cross moments' token cap: decisions and quality",
        "Both columns ran on the commit that made the cap of 16,384 fit tokens per query, key, context and "
        "stream cross moment the default; `default` is the product's defaults (no benchmark calibration holds "
        "16,384 fit tokens, so the cap does not bind there and those merges are those of no cap, bit for bit) "
        "and `default-hcap2k` the defaults with that cap at 2,048 fit tokens, which binds on every family. "
        "Both ran with `OMP_NUM_THREADS=1`.",
        paired=True,
    ),
}
# the sweep's record: record()'s default
RECORD, TITLE = CHANGES["sweep"].record_path, CHANGES["sweep"].title


def _decisions(method: dict[str, Any]) -> list[list]:
    """The gate's decisions as [transform, layer, applied] (the encoder runner records them)."""
    return [[d["transform"], d["layer"], bool(d["applied"])] for d in method.get("gate", {}).get("decisions", [])]


def _row(pair: str, run: int, name: str, method: dict[str, Any]) -> dict[str, Any]:
    correction = method.get("correction") or {}
    check = (correction.get("competition") or {}).get("model_check") or {}
    if "acc_head_a" in method:  # an encoder family: accuracy with A's head
        score, applied = method["acc_head_a"], method.get("gate", {}).get("applied")
    else:  # a decoder family: held-out perplexity of the merge (α = ½) on every corpus
        score, applied = method["ppl"], method.get("applied")
    return {
        "pair": pair,
        "run": run,
        "method": name,
        "score": score,
        "applied": applied,
        "decisions": _decisions(method),
        "verdict": method.get("verdict", ""),
        "layers_kept": correction.get("layers_kept"),
        "correction_kept": check.get("kept"),
        "tokens": method.get("calibration_tokens"),
    }


def rows_of(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (pair, run, method) row of a runner's results.json, encoder or decoder."""
    return [
        _row(r["pair"], r["run"], name, method)
        for r in results["runs"]
        for name, method in sorted(r["methods"].items())
        if isinstance(method, dict) and ("acc_head_a" in method or "ppl" in method)
    ]


def parents_of(results: dict[str, Any]) -> dict[str, Any]:
    """The parents' own scores per pair and run (what makes rows of two records comparable)."""
    return {f"{r['pair']}/{r['run']}": r.get("parents") for r in results["runs"]}


def _command(results: dict[str, Any], command: str | None) -> str:
    meta = results.get("meta") or {}
    if command:
        return command
    if meta.get("argv") is not None:
        return "python -m benchmarks.run " + " ".join(meta["argv"])
    return results.get("command", "")


def record(
    results_path: Path, label: str, commit: str, path: Path = RECORD, command: str | None = None, title: str = TITLE
) -> dict[str, Any]:
    """Append the rows of a runner's ``results_path`` as run ``label`` on ``commit`` (``command``:
    the runner's command line, where its results do not hold it)."""
    results = json.loads(Path(results_path).read_text(encoding="utf-8"))
    run = {
        "label": label,
        "commit": commit,
        "command": _command(results, command),
        "machine": machine(),
        "date": (results.get("meta") or {}).get("date") or "",
        "rows": rows_of(results),
        "parents": parents_of(results),
    }
    return append_run(path, run, title)


def _ppl_ratio(row: dict[str, Any], parents: dict[str, Any]) -> float:
    """A decoder merge's perplexity over the mean of the parents' (their records hold held-out
    losses), averaged over corpora — the decoder report's ratio."""
    own = parents.get(f"{row['pair']}/{row['run']}") or {}
    ratios = []
    for corpus, ppl in row["score"].items():
        losses = [own.get(side, {}).get(corpus) for side in ("a", "b")]
        if None not in losses:
            ratios.append(ppl / mean(math.exp(loss) for loss in losses))
    return mean(ratios) if ratios else float("nan")


def _score(row: dict[str, Any], parents: dict[str, Any]) -> float:
    return row["score"] if isinstance(row["score"], float) else _ppl_ratio(row, parents)


def _table(history: dict[str, Any]) -> tuple[list[str], dict[tuple[str, int], dict[str, dict[str, Any]]]]:
    """The columns (``label/method``, in record order) and the rows by (pair, run) and column; a
    later record's row replaces an earlier one of the same label, method, pair and run."""
    columns: list[str] = []
    table: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for run in history["runs"]:
        for row in run["rows"]:
            name = f"{run['label']}/{row['method']}"
            if name not in columns:
                columns.append(name)
            table.setdefault((row["pair"], row["run"]), {})[name] = {**row, "value": _score(row, run["parents"])}
    return columns, table


def render(history: dict[str, Any], change: Change = CHANGES["sweep"]) -> str:
    lines = [f"# {history.get('title') or change.title}", ""]
    lines.append(
        f"Generated from `benchmarks/{change.record}` by `python -m benchmarks.sweep_decisions --change {change.name} "
        "--report` (do not edit by hand). Encoder families: accuracy with A's head; decoder families: held-out "
        "perplexity of the merge over the mean of the parents' (mean over corpora). α = ½. "
        f"A column is `label/method`: {change.columns} "
        '"Gate decisions" compares every layer decision (transform, layer, applied) where the runner records '
        'them (the encoder families) and the number of transforms applied (every family); "correction layers '
        "kept\" the layers whose correction was kept and the correction's model-level check."
    )
    lines.append("")
    for run in history["runs"]:
        lines.append(f"* `{run['label']}`: " + run_heading(run).removeprefix("Record: "))
    lines.append("")
    columns, table = _table(history)
    if not columns:
        return "\n".join(lines) + "\n"
    tokens = any((c.get("tokens") or {}).get("mlp_moment") for cells in table.values() for c in cells.values())
    header = ["pair", "run", *columns, "gate decisions", "correction layers kept"]
    header += ["MLP moment tokens / fit tokens"] if tokens else []
    lines += ["## Per run", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (pair, index), cells in sorted(table.items()):
        values = [f"{cells[n]['value']:.4f}" if n in cells else "–" for n in columns]
        present = [cells[n] for n in columns if n in cells]
        first = present[0]
        same_decisions = all((c["decisions"], c["applied"]) == (first["decisions"], first["applied"]) for c in present)
        kept_of = [(c["layers_kept"], c["correction_kept"]) for c in present]
        same_kept = all(k == kept_of[0] for k in kept_of)
        decisions = "equal" if same_decisions else "differ: applied " + " / ".join(str(c["applied"]) for c in present)
        kept = (
            f"equal ({first['layers_kept']})"
            if same_kept
            else "differ: " + " / ".join(str(c["layers_kept"]) for c in present)
        )
        counted = [" / ".join(_tokens(cells.get(n)) for n in columns)] if tokens else []
        lines.append(f"| {pair} | {index} | " + " | ".join([*values, decisions, kept, *counted]) + " |")
    paired = [f"{name} − {columns[0]}" for name in columns[1:]] if change.paired else []
    lines += ["", "## Mean ± std over runs", "", "| " + " | ".join(["pair", *columns, *paired]) + " |"]
    lines.append("|" + "---|" * (len(columns) + len(paired) + 1))
    for pair in sorted({p for p, _ in table}):
        out = []
        for name in columns:
            values = [cells[name]["value"] for (p, _), cells in table.items() if p == pair and name in cells]
            spread = stdev(values) if len(values) > 1 else 0.0
            out.append(f"{mean(values):.4f} ± {spread:.4f}" if values else "–")
        if change.paired:
            out += [_paired(table, pair, columns[0], name) for name in columns[1:]]
        lines.append(f"| {pair} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def _tokens(cell: dict[str, Any] | None) -> str:
    """The fewest fit tokens an MLP cross moment of the row took, over the fit tokens (– unrecorded)."""
    counts = (cell or {}).get("tokens") or {}
    if not counts.get("mlp_moment"):
        return "–"
    return f"{min(counts['mlp_moment']):,}/{counts['moment']:,}"


def _paired(table: dict, pair: str, reference: str, name: str) -> str:
    """``name``'s difference from ``reference`` over the runs that have both: the mean ± std of the
    paired differences, and whether the mean lies within one std of ``reference``'s own runs."""
    runs = [cells for (p, _), cells in table.items() if p == pair and reference in cells and name in cells]
    if not runs:
        return "–"
    shifts = [c[name]["value"] - c[reference]["value"] for c in runs]
    own = [c[reference]["value"] for c in runs]
    spread = stdev(own) if len(own) > 1 else 0.0
    within = "within" if abs(mean(shifts)) <= spread else "outside"
    deviation = stdev(shifts) if len(shifts) > 1 else 0.0
    return f"{mean(shifts):+.4f} ± {deviation:.4f} ({within} 1 std)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=["record"], help="record: append a runner's results")
    parser.add_argument("--change", choices=sorted(CHANGES), default="sweep", help="which change's record")
    parser.add_argument("--results", type=Path, help="a benchmark runner's results.json")
    parser.add_argument("--label", help="before or after (the column label)")
    parser.add_argument("--commit", help="the commit the runner ran on")
    parser.add_argument("--command", help="the runner's command line, where its results do not hold it")
    parser.add_argument("--report", action="store_true", help="only re-render the markdown")
    args = parser.parse_args(argv)
    if args.action == "record" and not (args.results and args.label and args.commit):
        parser.error("record needs --results, --label and --commit")
    change = CHANGES[args.change]
    if args.action == "record":
        record(args.results, args.label, args.commit, change.record_path, command=args.command, title=change.title)
    change.markdown_path.write_text(render(read_history(change.record_path, change.title), change), encoding="utf-8")
    print(f"wrote {change.markdown_path.relative_to(BENCH.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
