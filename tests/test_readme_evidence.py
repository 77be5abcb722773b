"""README.md's measured figures are generated from the records under benchmarks/, byte for byte.

Every table of measurements in README.md sits in a generated block (:mod:`benchmarks.blocks`) that
``python -m benchmarks.report_all`` rewrites from its JSON records; every results markdown under
benchmarks/ is generated the same way (``benchmarks.report_all.GENERATED``). Outside the blocks README
quotes no measurement. No model runs: the tests read JSON and render markdown.
"""

from __future__ import annotations

import re

import pytest

from benchmarks.blocks import BLOCKS, ROOT, block_text, outside_blocks, stale_blocks
from benchmarks.report_all import BENCH, GENERATED, stale

README = ROOT / "README.md"
#: What a measurement looks like in prose: a spread, a percentage, a decimal ratio or a time.
_MEASURED = re.compile(r"±|\d\s*%|\d\.\d+\s*×|\d\s*(s|min|MiB|GiB)\b")


def test_generated_markdown_and_tables_equal_their_records():
    assert stale() == [], "run `python -m benchmarks.report_all` and commit the records, not the markdown"


def test_every_block_is_in_its_file():
    for block in BLOCKS:
        assert block_text((ROOT / block.file).read_text(encoding="utf-8"), block.name) is not None, block.name


def test_swapped_figures_fail():
    text = README.read_text(encoding="utf-8")
    body = block_text(text, "results-summary")
    first, second = re.findall(r"\d\.\d{3}", body)[:2]
    assert first != second
    swapped = body.replace(first, "\0").replace(second, first).replace("\0", second)
    assert stale_blocks({"README.md": text.replace(body, swapped)}) != []


def test_a_changed_spread_fails():
    text = README.read_text(encoding="utf-8")
    body = block_text(text, "results-summary")
    spread = re.search(r"± (\d\.\d{3})", body).group(1)
    changed = body.replace(f"± {spread}", f"± {float(spread) + 0.001:.3f}", 1)
    assert stale_blocks({"README.md": text.replace(body, changed)}) != []


def test_readme_quotes_no_measurement_outside_the_generated_tables():
    prose = outside_blocks(README.read_text(encoding="utf-8"))
    found = [line for line in prose.splitlines() if _MEASURED.search(line)]
    assert found == [], f"measured figures outside a generated block: {found}"


def test_a_planted_measurement_fails():
    planted = README.read_text(encoding="utf-8").replace("## Limitations\n", "## Limitations\n\nIt is 1.23 × faster.\n")
    assert any(_MEASURED.search(line) for line in outside_blocks(planted).splitlines())


@pytest.mark.parametrize("entry", GENERATED, ids=[e.markdown for e in GENERATED])
def test_records_exist(entry):
    for record in entry.records:
        assert (BENCH / record).is_file()
