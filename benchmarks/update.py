"""Fold a partial rerun (some pairs, some methods) into an existing ``results.json``.

``python -m benchmarks.run --update --pairs siblings --methods average,raot`` reruns only what it
names and keeps every other number of the results it updates. Each update is recorded in
``meta["updates"]`` (date, arguments, pairs, methods, time), and where a rerun method replaces a
number of the previous results, the row it replaces is appended to ``results["history"]`` with the
invocation that produced it (``benchmarks.row_history``): reruns append, nothing is lost, and the
report lists the earlier runs below the tables, which show the latest. The headline values a RaOT
row had before its first rerun also stay beside it in ``run["previous"][method]`` (the gate
comparison reads them). When a run's parents are not the previous ones (retrained on another
machine, whose float kernels differ), rows of the two are never mixed in one run: the rows not rerun
are dropped (kept in the history and under ``previous``).
"""

from __future__ import annotations

import copy
import datetime
import re
from typing import Any

from benchmarks.row_history import replaced_rows

#: Values of a replaced method row that are kept under ``run["previous"]``.
PREVIOUS_KEYS = ("acc_head_a", "acc_head_b", "probe_a", "probe_b", "barrier_a", "barrier_b", "shares_basis")


def update_record(results: dict[str, Any]) -> dict[str, Any]:
    """What one benchmark invocation ran: when, with which arguments, pairs and methods."""
    meta = results["meta"]
    return {
        "date": meta.get("date") or "before updates were recorded",
        "source_digest": meta.get("source_digest"),
        "argv": meta.get("argv", []),
        "suite": meta.get("suite"),
        "pairs": sorted({run["pair"] for run in results["runs"]}),
        "runs": sorted([run["pair"], run["run"]] for run in results["runs"]),
        "methods": [m["name"] for m in results["methods"]],
        "seconds": meta.get("seconds"),
        "notes": meta.get("notes", []),
    }


def _previous(row: dict[str, Any]) -> dict[str, Any]:
    kept = {k: row[k] for k in PREVIOUS_KEYS if k in row}
    if row.get("gate"):
        kept["applied"], kept["total"] = row["gate"]["applied"], row["gate"]["total"]
    return kept


#: Relative difference of a parent's test loss below which a retrained parent counts as the same
#: model (float rounding of one training run on another CPU; accuracies must be equal).
SAME_PARENT_RTOL = 1e-5


def _parents_differ(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a rerun's parents are not the previous ones (retrained elsewhere: CPU kernels differ)."""
    for side in ("a", "b"):
        before, after = old["parents"][side], new["parents"][side]
        if before.get("accuracy") != after.get("accuracy"):
            return True
        loss_a, loss_b = before.get("loss"), after.get("loss")
        if loss_a is None or loss_b is None or abs(loss_a - loss_b) > SAME_PARENT_RTOL * max(1.0, abs(loss_a)):
            return True
    return False


def _merge_run(
    old: dict[str, Any], new: dict[str, Any], notes: list[str], replaced: list[str] | None = None
) -> dict[str, Any]:
    """``new`` with the methods of ``old`` that it did not rerun — unless the parents differ: then
    paired comparisons across the two would compare different models, so only ``new``'s methods
    stay, and every replaced or dropped row's values are kept under ``previous``. The names of the
    rows of ``old`` replaced or dropped are appended to ``replaced``."""
    merged = copy.deepcopy(new)
    differ = _parents_differ(old, new)
    merged["methods"] = dict(new["methods"]) if differ else {**old["methods"], **new["methods"]}
    if replaced is not None:
        replaced += [name for name in old["methods"] if differ or name in new["methods"]]
    previous = dict(old.get("previous", {}))
    for name, row in old["methods"].items():
        if (differ or name in new["methods"]) and "error" not in row:
            previous.setdefault(name, _previous(row))  # the values before the first rerun
    if previous:
        merged["previous"] = previous
    if differ:
        dropped = sorted(set(old["methods"]) - set(new["methods"]))
        notes.append(
            f"pair {new['pair']} run {new['run']}: the rerun's parents differ from the previous results' (parent A "
            f"accuracy {new['parents']['a'].get('accuracy'):.4f} vs {old['parents']['a'].get('accuracy'):.4f}); "
            f"rows not rerun were dropped from this run ({len(dropped)}: {', '.join(dropped) or 'none'}) — their "
            "previous values are under run['previous'] in results.json"
        )
    return merged


def _superseded(note: str, runs: dict) -> bool:
    """A note about rows of a (pair, run) that have all since been rerun without error: "method M
    failed", or "rows not rerun were dropped (…: M1, M2)"."""
    failed = re.fullmatch(r"pair (\S+) run (\d+): method (\S+) failed: .*", note, flags=re.S)
    dropped = re.fullmatch(r"pair (\S+) run (\d+): .*rows not rerun were dropped [^(]*\(\d+: ([^)]*)\).*", note)
    match = failed or dropped
    if not match:
        return False
    run = runs.get((match[1], int(match[2])))
    names = [match[3]] if failed else [n for n in match[3].split(", ") if n != "none"]
    rows = [run and run["methods"].get(name) for name in names]
    return all(bool(row) and "error" not in row for row in rows)


def live_notes(results: dict[str, Any]) -> list[str]:
    """The notes of ``results`` that still describe its rows (not superseded by a later rerun)."""
    runs = {(r["pair"], r["run"]): r for r in results["runs"]}
    return [n for n in results["meta"].get("notes", []) if not _superseded(n, runs)]


def _runs_of(update: dict[str, Any]) -> list[tuple[str, int]]:
    """The (pair, run) keys an invocation ran (older records: from ``--runs`` in its arguments, or
    all three runs)."""
    if "runs" in update:
        return [(pair, int(run)) for pair, run in update["runs"]]
    argv = update.get("argv", [])
    runs = [int(r) for r in argv[argv.index("--runs") + 1].split(",")] if "--runs" in argv else [0, 1, 2]
    return [(pair, run) for pair in update["pairs"] for run in runs]


def contributing(updates: list[dict[str, Any]]) -> list[bool]:
    """For each recorded invocation: whether some (pair, method) it ran was not rerun by a later one
    (an invocation whose every row was replaced contributes no number to the results)."""
    later: set[tuple[str, int, str]] = set()
    out = []
    for update in reversed(updates):
        ran = {(pair, run, method) for pair, run in _runs_of(update) for method in update["methods"]}
        out.append(bool(ran - later))
        later |= ran
    return out[::-1]


def invocation_of(updates: list[dict[str, Any]], pair: str, run: int, method: str) -> dict[str, Any]:
    """The recorded invocation (date, command, source digest) whose row (pair, run, method) the
    results hold: the last of ``updates`` that ran it."""
    for update in reversed(updates):
        if method in update["methods"] and (pair, run) in _runs_of(update):
            return {
                "date": update["date"],
                "command": " ".join(["python -m benchmarks.run", *update.get("argv", [])]),
                "source_digest": update.get("source_digest"),
            }
    return {}


def merge_results(old: dict[str, Any], new: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """``old`` with ``new``'s runs folded in (per pair, run and method); every row it replaces goes
    to the history with the invocation that produced it; ``order``: pair names in the order of the
    suite (pairs not in it go last)."""
    notes: list[str] = []
    old_updates = old["meta"].get("updates") or [update_record(old)]
    history = list(old.get("history", []))
    runs = {(r["pair"], r["run"]): r for r in old["runs"]}
    for run in new["runs"]:
        key = (run["pair"], run["run"])
        if key not in runs:
            runs[key] = run
            continue
        replaced: list[str] = []
        previous, runs[key] = runs[key], _merge_run(runs[key], run, notes, replaced)
        history += replaced_rows(
            *key, previous["methods"], replaced, lambda method, key=key: invocation_of(old_updates, *key, method)
        )
    method_rows = {m["name"]: m for m in old["methods"]}
    method_rows.update({m["name"]: m for m in new["methods"]})
    from benchmarks.methods import BY_NAME

    rank = {name: i for i, name in enumerate(BY_NAME)}
    pair_rows = {p["name"]: p for p in old["pairs"]}
    pair_rows.update({p["name"]: p for p in new["pairs"]})
    pair_rank = {name: i for i, name in enumerate(order)}
    record = update_record(new)
    record["notes"] = record["notes"] + notes
    meta = {**new["meta"], "updates": [*old_updates, record]}
    meta["seconds"] = sum(u["seconds"] or 0.0 for u in meta["updates"])
    meta["notes"] = [n for u in meta["updates"] for n in u["notes"] if not _superseded(n, runs)]
    merged = {
        "meta": meta,
        "methods": sorted(method_rows.values(), key=lambda m: rank.get(m["name"], len(rank))),
        "pairs": sorted(pair_rows.values(), key=lambda p: pair_rank.get(p["name"], len(pair_rank))),
        "runs": sorted(runs.values(), key=lambda r: (r["pair"], r["run"])),
    }
    if history:
        merged["history"] = history
    return merged


def superseded_history(old: dict[str, Any]) -> list[dict[str, Any]]:
    """The history a plain (not folded) run keeps when it replaces ``old`` whole: ``old``'s own
    history, then every row of ``old`` with the invocation that produced it (a rerun appends, it
    does not overwrite, whatever the flags)."""
    updates = old["meta"].get("updates") or [update_record(old)]
    history = list(old.get("history", []))
    for run in old["runs"]:
        key = (run["pair"], run["run"])
        history += replaced_rows(
            *key, run["methods"], list(run["methods"]), lambda method, key=key: invocation_of(updates, *key, method)
        )
    return history


def today() -> str:
    """The date (UTC) recorded with each invocation."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
