"""Earlier runs of rerun rows: a rerun appends, it does not overwrite.

A benchmark's results hold one row per (pair, run, method) — the latest run of it, which every table
shows. When a rerun (``benchmarks.run --update`` / ``--fold``, ``benchmarks.decoders.run --methods``,
``benchmarks.three_models --methods``) replaces a row, the row it replaces is appended to the
results' *history*: a list, oldest first, of entries

    {"pair": ..., "run": ..., "method": ..., "date": ..., "command": ..., "row": {...}}

``row`` is the replaced row as it stood; ``date`` and ``command`` name the invocation that produced it
(``source_digest`` too where it was recorded; ``source`` says where an entry recovered from the
repository's history was found). ``history_lines`` renders the earlier runs of every (pair, method)
row that has some, one line per earlier invocation (mean ± std over its runs).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from typing import Any

#: A column of the history table: title, the value of a row (None: no value), digits printed.
Column = tuple[str, Callable[[dict[str, Any]], Any], int]


def history_entry(pair: str, run: int, method: str, row: dict[str, Any], invocation: dict[str, Any]) -> dict[str, Any]:
    """The entry keeping ``row`` (replaced by a rerun) with the invocation that produced it
    (``date``, ``command`` and, where known, ``source_digest`` / ``source``)."""
    keep = ("date", "command", "source_digest", "source")
    return {
        "pair": pair,
        "run": run,
        "method": method,
        **{k: invocation[k] for k in keep if invocation.get(k) is not None},
        "row": row,
    }


def replaced_rows(
    pair: str,
    run: int,
    old_methods: dict[str, dict[str, Any]],
    replaced: Iterable[str],
    invocation_of: Callable[[str], dict[str, Any]],
) -> list[dict[str, Any]]:
    """History entries for the rows of ``old_methods`` named in ``replaced`` (rows that failed hold
    no values and are not kept); ``invocation_of(method)``: the invocation that produced a row."""
    return [
        history_entry(pair, run, name, old_methods[name], invocation_of(name))
        for name in replaced
        if name in old_methods and "error" not in old_methods[name]
    ]


def _fmt(values: list[float], digits: int) -> str:
    if not values:
        return "–"
    mean = statistics.mean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def earlier_runs(history: list[dict[str, Any]]) -> dict[tuple[str, str], dict[tuple[str, str], list[dict]]]:
    """The history grouped: (pair, method) → (date, command) → entries, in order of first appearance
    (oldest first: the history is appended to)."""
    grouped: dict[tuple[str, str], dict[tuple[str, str], list[dict]]] = {}
    for entry in history:
        invocation = (entry.get("date") or "date not recorded", entry.get("command") or "command not recorded")
        grouped.setdefault((entry["pair"], entry["method"]), {}).setdefault(invocation, []).append(entry)
    return grouped


def history_lines(history: list[dict[str, Any]], columns: list[Column], where: str) -> list[str]:
    """A "history" section: per (pair, method) row with earlier runs, one table row per earlier
    invocation with the runs it holds and their values (mean ± std over those runs), then the
    invocations (date, command) the table numbers; ``where``: where the history is kept (the
    results file and its key). Empty without history."""
    if not history:
        return []
    grouped = earlier_runs(history)
    rows = [entry["row"] for entry in history]
    shown = [c for c in columns if any(_number(c[1](row)) is not None for row in rows)]
    invocations: dict[str, int] = {}  # an invocation's line in the list below the table → its number
    table = []
    for (pair, method), by_invocation in grouped.items():
        for (date, command), entries in by_invocation.items():
            source = f" ({entries[0]['source']})" if entries[0].get("source") else ""
            number = invocations.setdefault(f"{date}: `{command}`{source}", len(invocations) + 1)
            cells = []
            for _, value, digits in shown:
                values = [v for v in (_number(value(e["row"])) for e in entries) if v is not None]
                cells.append(_fmt(values, digits))
            runs = ", ".join(str(e["run"]) for e in entries)
            table.append(f"| {pair} | `{method}` | ({number}) | {runs} | " + " | ".join(cells) + " |")
    return [
        "## History: earlier runs of rerun rows",
        "",
        f"The tables above show the latest run of each row. {len(grouped)} (pair, method) row(s) have earlier "
        f"runs, kept in {where}; each earlier invocation's values (mean ± std over its runs), oldest first "
        "within a row:",
        "",
        "| pair | method | invocation | runs | " + " | ".join(title for title, _, _ in shown) + " |",
        "|" + "---|" * (4 + len(shown)),
        *table,
        "",
        "Invocations:",
        "",
        *(f"{number}. {line}" for line, number in invocations.items()),
        "",
    ]
