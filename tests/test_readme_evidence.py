"""Every figure README.md quotes as a measurement comes from a record under benchmarks/, and every
generated results markdown equals its regeneration from its records (so hand edits fail).

The scheme (README's own convention): a block of README — a paragraph or a table, blocks separated
by blank lines — that quotes measurements names the results file(s) they come from, a path of
``benchmarks.report_all.GENERATED`` (its markdown or its JSON record), in the block itself or, for
a table, in the line just above it. Every decimal figure and every figure with a unit (×, %, s,
min, MiB, GiB, GB) in such a block must be printed in one of those files' generated markdown or
equal, at its printed precision, a number in their JSON records. In the sections of
``RESULTS_SECTIONS`` a block with measured-looking figures (next to ±, ×, % or "s)") must be marked.
No model runs: the test reads JSON and renders markdown.
"""

from __future__ import annotations

import math
import re
from decimal import ROUND_HALF_UP, Decimal

import pytest

from benchmarks.report_all import BENCH, GENERATED, stale

ROOT = BENCH.parent
README = ROOT / "README.md"
RESULTS_SECTIONS = ("Evidence",)

_MEASURED_LOOKING = re.compile(r"\d\s*(±|×|%)|±\s*\d|\d\s*s\)")
_FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)(\s*(?:×|%|s\b|min\b|MiB|GiB|GB))?")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    """README's blocks as (section, lines); a table's block also holds the line just above it."""
    blocks, section, current, previous = [], "", [], []
    for line in [*text.split("\n"), ""]:
        if line.startswith("## "):
            section = line[3:].strip()
        if line.strip():
            if line.startswith("|") and not (current and current[-1].startswith("|")):
                if current:
                    blocks.append((section, current))
                # a table is marked by the paragraph just above it
                current = list(current or previous)
                current = current if current and not current[0].startswith("#") else []
            current.append(line)
        elif current:
            blocks.append((section, current))
            previous, current = current, []
    return blocks


def _cited(block: str) -> list:
    return [
        e
        for e in GENERATED
        if f"benchmarks/{e.markdown}" in block or any(f"benchmarks/{r}" in block for r in e.records)
    ]


_CACHE: dict[str, set[float]] = {}


def _evidence(entry) -> set[float]:
    """The figures of an entry's markdown as generated from its records (equal to the committed
    markdown: ``test_generated_markdown_equals_its_records``). Only what the records' tables print
    counts: a large record holds so many numbers that almost any figure would match one of them."""
    if entry.markdown not in _CACHE:
        numbers = {float(m.replace(",", "")) for m in _NUMBER.findall(entry.render())}
        # a commit such as 403e833 reads as a number too large for a float: not a figure
        _CACHE[entry.markdown] = {n for n in numbers if math.isfinite(n)}
    return _CACHE[entry.markdown]


def _supported(figure: str, entries) -> bool:
    """``figure`` equals, at its printed precision, a figure its records print."""
    plain = figure.replace(",", "")
    value = float(plain)
    if "e" in plain:  # 6.4e-6: two significant digits
        digits = len(plain.split("e")[0].split(".")[-1]) if "." in plain else 0
        return any(p and f"{p:.{digits}e}" == f"{value:.{digits}e}" for e in entries for p in _evidence(e))
    # half up, as a reader rounds a printed 2.485 to 2.49
    step = Decimal(1).scaleb(-(len(plain.split(".")[1]) if "." in plain else 0))
    return any(Decimal(repr(p)).quantize(step, ROUND_HALF_UP) == Decimal(plain) for e in entries for p in _evidence(e))


def readme_problems(text: str) -> list[str]:
    """What is wrong with README's quoted measurements (empty: nothing)."""
    problems = []
    for section, lines in _blocks(text):
        block = "\n".join(lines)
        entries = _cited(block)
        if not entries:
            if section in RESULTS_SECTIONS and _MEASURED_LOOKING.search(block):
                problems.append(f"unmarked measured figures in '{section}': {lines[0][:80]!r}")
            continue
        body = "\n".join(line for line in lines if line.startswith("|")) if lines[-1].startswith("|") else block
        body = re.sub(r"`[^`]*`|\([^)]*\.(md|json)\)|d ?= ?\d+|§[\d.–]+", " ", body)  # code, paths, widths, §
        for match in _FIGURE.finditer(body):
            figure, unit = match.group(1), match.group(2)
            if "." not in figure and not unit:
                continue  # a count or a setting, not a measurement
            if not _supported(figure, entries):
                problems.append(f"{figure}{unit or ''} in '{section}' is in none of {[e.markdown for e in entries]}")
    return problems


def test_readme_quotes_only_recorded_figures():
    assert readme_problems(README.read_text(encoding="utf-8")) == []


def test_a_wrong_figure_fails():
    text = README.read_text(encoding="utf-8")
    row = "| 0.374 ± 0.070 | 0.399 ± 0.042 |"  # RaOT on ViT d=64 in the Evidence table
    assert row in text
    problems = readme_problems(text.replace(row, "| 0.419 ± 0.070 | 0.399 ± 0.042 |"))  # no record prints 0.419
    assert any(p.startswith("0.419 in 'Evidence'") for p in problems), problems


def test_an_unmarked_measurement_fails():
    text = README.read_text(encoding="utf-8")
    planted = text.replace("## Evidence\n", "## Evidence\n\nThe merge is 1.23 × faster than before.\n", 1)
    assert any("unmarked" in p for p in readme_problems(planted))


def test_generated_markdown_equals_its_records():
    assert stale() == [], "run `python -m benchmarks.report_all` and commit the records, not the markdown"


@pytest.mark.parametrize("entry", GENERATED, ids=[e.markdown for e in GENERATED])
def test_records_exist(entry):
    for record in entry.records:
        assert (BENCH / record).is_file()
