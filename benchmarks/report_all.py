"""Regenerate every results markdown under ``benchmarks/`` from its JSON record(s) — no model runs.

    python -m benchmarks.report_all            # rewrite every generated markdown
    python -m benchmarks.report_all --check    # exit 1 if a committed markdown differs from its records

Each entry of ``GENERATED`` names a markdown file, the records it is generated from and the function
that renders it. The markdown is never edited by hand: a change goes into the record (a rerun
appends a run to it), and this command re-renders. The tables inside README.md and
benchmarks/README.md are generated the same way (:mod:`benchmarks.blocks`).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Generated:
    """A markdown file, the records it is generated from (paths relative to ``benchmarks/``) and its renderer."""

    markdown: str
    records: tuple[str, ...]
    render: Callable[[], str]


def _load(rel: str):
    return json.loads((BENCH / rel).read_text(encoding="utf-8"))


def _evidence(results_dir: str) -> Callable[[], str]:
    def render() -> str:
        from benchmarks.report import write_report

        return write_report(_load(f"{results_dir}/results.json"), BENCH / results_dir, markdown_only=True)

    return render


def _decoders() -> str:
    from benchmarks.decoders.report import write_report

    return write_report(_load("decoders/results/results.json"), BENCH / "decoders/results", markdown_only=True)


def _group() -> str:
    from benchmarks.three_models import HISTORY_FILE, write_report

    history = _load(f"results/{HISTORY_FILE}") if (BENCH / "results" / HISTORY_FILE).is_file() else []
    return write_report(
        _load("results/results_three_models.json"), BENCH / "results", markdown_only=True, history=history
    )


def _perf(record: str) -> Callable[[], str]:
    def render() -> str:
        from benchmarks.perf.run import render_history

        return render_history(_load(record), Path(record).name)

    return render


def _recovery_real() -> str:
    from benchmarks.perf.recovery_real import read_records, render_markdown

    return render_markdown(read_records(BENCH / "perf/results_recovery_real.json"))


def _real_pair(name: str) -> Callable[[], str]:
    def render_pair() -> str:
        from benchmarks.real_pair import PAIRS, render
        from benchmarks.records import read_history

        pair = PAIRS[name]
        return render(read_history(pair.record_path, pair.title), pair)

    return render_pair


def _experts() -> str:
    from benchmarks.experts.report import render
    from benchmarks.experts.run import RESULTS
    from benchmarks.records import read_history

    return render(read_history(RESULTS))


def _decisions(name: str) -> Callable[[], str]:
    def render_change() -> str:
        from benchmarks.records import read_history
        from benchmarks.sweep_decisions import CHANGES, render

        change = CHANGES[name]
        return render(read_history(change.record_path, change.title), change)

    return render_change


def _if_present(record: str) -> tuple[str, ...]:
    return (record,) if (BENCH / record).is_file() else ()


_PERF = (
    "results",
    "results_bert6l",
    "results_bertbase",
    "results_corrections",
    "results_layerwise",
    "results_layerwise_0.5b",
    "results_layerwise_4l",
    "results_llama",
    "results_llama135m",
    "results_llama16",
    "results_precision",
    "results_recovery",
    "results_rules",
    "results_stream",
    "results_sweep_threads",
)

GENERATED: tuple[Generated, ...] = (
    Generated("results/RESULTS.md", ("results/results.json",), _evidence("results")),
    Generated("results/precision/RESULTS.md", ("results/precision/results.json",), _evidence("results/precision")),
    Generated(
        "results/precision/SUMMARY.md", ("results/precision/summary.json",), _perf("results/precision/summary.json")
    ),
    Generated(
        "results/RESULTS_three_models.md",
        # the history of rerun rows, once a rerun has replaced some (benchmarks.three_models)
        ("results/results_three_models.json", *_if_present("results/results_three_models_history.json")),
        _group,
    ),
    Generated("results/RESULTS_real_pair.md", ("results/results_real_pair.json",), _real_pair("minilm-finetune")),
    Generated(
        "results/RESULTS_real_pair_categorium.md",
        ("results/results_real_pair_categorium.json",),
        _real_pair("categorium-en-fr"),  # every categorium pair writes this record
    ),
    Generated("results/RESULTS_sweep.md", ("results/results_sweep.json",), _decisions("sweep")),
    Generated(
        "results/RESULTS_statistics_decisions.md",
        ("results/results_statistics_decisions.json",),
        _decisions("statistics"),
    ),
    Generated("results/RESULTS_token_budget.md", ("results/results_token_budget.json",), _decisions("token_cap")),
    Generated(
        "results/RESULTS_hidden_token_budget.md",
        ("results/results_hidden_token_budget.json",),
        _decisions("hidden_token_cap"),
    ),
    Generated("decoders/results/RESULTS.md", ("decoders/results/results.json",), _decoders),
    Generated("experts/results/RESULTS.md", ("experts/results/results.json",), _experts),
    Generated("perf/results_recovery_real.md", ("perf/results_recovery_real.json",), _recovery_real),
    *(Generated(f"perf/{name}.md", (f"perf/{name}.json",), _perf(f"perf/{name}.json")) for name in _PERF),
)


def records_of(markdown: str) -> tuple[str, ...]:
    """The records (paths relative to ``benchmarks/``) a generated markdown comes from."""
    for entry in GENERATED:
        if entry.markdown == markdown:
            return entry.records
    raise KeyError(f"{markdown} is not generated from records")


def stale() -> list[tuple[str, str]]:
    """Every generated markdown whose committed text differs from its regeneration, and every generated
    table of README.md and benchmarks/README.md that differs from its records (:mod:`benchmarks.blocks`):
    (path, diff)."""
    from benchmarks.blocks import stale_blocks

    out = stale_blocks()
    for entry in GENERATED:
        path = BENCH / entry.markdown
        want = entry.render()
        have = path.read_text(encoding="utf-8") if path.is_file() else ""
        if want != have:
            diff = difflib.unified_diff(have.splitlines(), want.splitlines(), "committed", "regenerated", lineterm="")
            out.append((entry.markdown, "\n".join(list(diff)[:40])))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a markdown is stale")
    args = parser.parse_args(argv)
    from benchmarks.blocks import BLOCKS, write_blocks

    if args.check:
        bad = stale()
        for path, diff in bad:
            print(f"benchmarks/{path} differs from its records:\n{diff}\n")
        total = len(GENERATED) + len(BLOCKS)
        print(f"{total - len(bad)}/{total} generated markdown files and tables match their records")
        return 1 if bad else 0
    for entry in GENERATED:
        (BENCH / entry.markdown).write_text(entry.render(), encoding="utf-8")
        print(f"wrote benchmarks/{entry.markdown} from {', '.join(entry.records)}")
    for written in write_blocks():
        print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
