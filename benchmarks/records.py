"""Raw records of benchmark runs: where every figure of the results markdown comes from.

A *history file* is JSON ``{"schema": HISTORY_SCHEMA, "title": ..., "runs": [run, ...]}``, oldest run
first. A rerun appends a run (``append_run``); nothing is overwritten, so earlier figures stay
citable. Every run carries its provenance (``provenance``): commit (and whether the tree was dirty),
command, machine and a UTC timestamp.

Figures measured before the records existed were recovered from the markdown in the repository's
history: such a run is ``{"kind": "transcribed", "source": "transcribed from the markdown of commit X;
per-run values as printed", "blocks": [...]}`` whose blocks are the printed prose and tables
(``transcribe`` / ``render_blocks``), so the generated markdown shows them exactly as first printed.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

HISTORY_SCHEMA = "raot-hf-bench-history/1"
ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine() -> str:
    """The machine in words, as the records print it."""
    try:
        import torch

        torch_version = f", torch {torch.__version__}"
    except ImportError:  # pragma: no cover - the benchmarks need torch
        torch_version = ""
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible{torch_version}"


def provenance(command: str) -> dict[str, Any]:
    """Commit, dirty state, command, machine and timestamp of a run made now."""
    return {
        "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "command": command,
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def read_history(path: Path, title: str = "") -> dict[str, Any]:
    """The history in ``path`` (an empty one when the file does not exist)."""
    path = Path(path)
    if not path.is_file():
        return {"schema": HISTORY_SCHEMA, "title": title, "runs": []}
    history = json.loads(path.read_text(encoding="utf-8"))
    if not (isinstance(history, dict) and history.get("schema") == HISTORY_SCHEMA):
        raise ValueError(f"{path} is not a history file ({HISTORY_SCHEMA}); migrate it first")
    return history


def write_history(path: Path, history: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(history, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def append_run(path: Path, run: dict[str, Any], title: str = "") -> dict[str, Any]:
    """Append ``run`` to the history in ``path`` and write it back; returns the history."""
    history = read_history(path, title)
    history["runs"].append(run)
    write_history(path, history)
    return history


# -- printed markdown as blocks (for transcribed runs) ------------------------------------------


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip()[1:-1].split("|")]


def transcribe(markdown: str) -> list[dict[str, Any]]:
    """Printed markdown as blocks: ``{"text": line}`` for prose and headings, ``{"table": {"header":
    [...], "rows": [[...], ...]}}`` for a table, so that a table's values are separate JSON strings."""
    blocks: list[dict[str, Any]] = []
    lines = markdown.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        is_table = line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1].replace("|", "")) <= {"-", ":"}
        if is_table and lines[i + 1].startswith("|---"):
            header, rows = _cells(line), []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            blocks.append({"table": {"header": header, "rows": rows}})
            continue
        blocks.append({"text": line})
        i += 1
    return blocks


def render_blocks(blocks: list[dict[str, Any]]) -> list[str]:
    """The markdown lines of ``transcribe``'s blocks."""
    out: list[str] = []
    for block in blocks:
        if "table" in block:
            table = block["table"]
            out.append("| " + " | ".join(table["header"]) + " |")
            out.append("|" + "---|" * len(table["header"]))
            out += ["| " + " | ".join(row) + " |" for row in table["rows"]]
        else:
            out.append(block["text"])
    return out


def run_heading(run: dict[str, Any]) -> str:
    """One line of provenance for a run: commit, date, machine and command."""
    if run.get("source"):  # recovered from earlier markdown: no commit or date of its own
        return f"Record: {run['source']}."
    parts = [f"commit {run.get('commit', 'unknown')}" + (" (uncommitted changes)" if run.get("dirty") else "")]
    if run.get("date"):
        parts.append(run["date"])
    if run.get("machine"):
        parts.append(run["machine"])
    return "Record: " + "; ".join(parts) + (f"; `{run['command']}`" if run.get("command") else "") + "."
