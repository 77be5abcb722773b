"""Tables inside README.md and benchmarks/README.md, generated from the records — no model runs.

A generated table sits between two marker lines::

    <!-- generated: results-summary (python -m benchmarks.report_all) -->
    | … |
    <!-- end generated: results-summary -->

``python -m benchmarks.report_all`` rewrites every such block from its records; ``--check`` (and
``tests/test_readme_evidence.py``) fails when a committed block differs from its regeneration, byte for
byte. Each :class:`Block` names the file it lives in, the records it reads and its renderer.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

_BEGIN = "<!-- generated: {name} (python -m benchmarks.report_all) -->"
_END = "<!-- end generated: {name} -->"


@dataclass(frozen=True)
class Block:
    """A generated table: the file it lives in (relative to the repository root), its name, the
    records it is generated from (relative to ``benchmarks/``) and its renderer."""

    file: str
    name: str
    records: tuple[str, ...]
    render: Callable[[], str]


def _load(rel: str) -> dict:
    return json.loads((BENCH / rel).read_text(encoding="utf-8"))


def _fmt(values: list[float], digits: int = 3) -> str:
    """Mean ± sample std (the mean alone for one value; – for none)."""
    if not values:
        return "–"
    mean = float(np.mean(values))
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {float(np.std(values, ddof=1)):.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _grouped(record: dict) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = defaultdict(list)
    for run in sorted(record["runs"], key=lambda r: (r["pair"], r["run"])):
        grouped[run["pair"]].append(run)
    return grouped


def _accuracies(runs: list[dict], method: str) -> list[float]:
    """The merged model's accuracy with A's head, per run (runs without the method are skipped)."""
    values = (run["methods"].get(method, {}).get("acc_head_a") for run in runs)
    return [float(v) for v in values if isinstance(v, (int, float))]


def _perplexity_ratios(runs: list[dict], method: str, corpus: str = "reviews") -> list[float]:
    """Per run: the merge's perplexity over the mean of its parents' (A's and B's)."""
    out = []
    for run in runs:
        row = run["methods"].get(method, {})
        if "ppl" in row:
            parents = [float(np.exp(run["parents"][side][corpus])) for side in ("a", "b")]
            out.append(row["ppl"][corpus] / float(np.mean(parents)))
    return out


#: The summary's columns: (title, method in the records).
SUMMARY_METHODS = (
    ("plain average", "average"),
    ("RaOT", "raot"),
    ("RaOT + RegMean", "raot+regmean"),
    ("**default**", "default"),
)
#: The summary's encoder rows: (title, pair); accuracy with A's head.
SUMMARY_ENCODERS = (
    ("ViT digits, seeds, d = 64 (accuracy)", "vit-digits-d64"),
    ("ViT digits, seeds, d = 128", "vit-digits-d128"),
    ("ViT digits vs MNIST", "vit-digits-vs-mnist"),
    ("BERT seeds", "bert-rt"),
    ("BERT sentiment vs party", "bert-sentiment-vs-party"),
    ("MiniLM fine-tuned siblings", "minilm-siblings"),
)
#: The summary's decoder rows: (title, pair); perplexity over the parents'.
SUMMARY_DECODERS = (
    ("Llama, seeds, d = 128 (perplexity ÷ parents')", "llama-seeds-d128"),
    ("Llama, seeds, d = 128, 4 layers", "llama-seeds-d128-l4"),
    ("GPT-2, seeds, d = 128", "gpt2-seeds-d128"),
    ("GPT-2, seeds, d = 128, 4 layers", "gpt2-seeds-d128-l4"),
)


def results_summary() -> str:
    """README's results table: per family the parents, the plain average, RaOT, RaOT + RegMean and
    the default, mean ± std over the runs of ``results/results.json`` and ``decoders/results/results.json``."""
    encoders = _grouped(_load("results/results.json"))
    decoders = _grouped(_load("decoders/results/results.json"))
    rows = []
    for title, pair in SUMMARY_ENCODERS:
        runs = encoders[pair]
        parent = _fmt([float(run["parents"]["a"]["accuracy"]) for run in runs])
        rows.append([title, parent] + [_fmt(_accuracies(runs, method)) for _, method in SUMMARY_METHODS])
    for title, pair in SUMMARY_DECODERS:
        runs = decoders[pair]
        rows.append([title, "1"] + [_fmt(_perplexity_ratios(runs, method)) for _, method in SUMMARY_METHODS])
    return _table(["family", "parent A", *(title for title, _ in SUMMARY_METHODS)], rows)


#: The cost table's rows: (title, record under ``benchmarks/perf/``, the shape's key in its runs).
COST_ROWS = (
    ("BERT-base, 512 × 128, in memory", "results_bertbase.json", "bert-base"),
    ("135 M-parameter Llama shape, 64 short texts", "results_llama135m.json", "llama-135m-like"),
    ("0.49 B Llama, 64 × 128, layer by layer", "results_layerwise_0.5b.json", "llama-0.5b-fp32, offload always"),
)


def _latest_perf_run(record: str, shape: str) -> tuple[dict, dict] | None:
    """The newest measured run of ``record`` (with a commit) holding ``shape``, and that shape's result."""
    for run in reversed(_load(f"perf/{record}")["runs"]):
        if run.get("kind") == "perf-run" and run.get("commit") and shape in run.get("results", {}):
            return run, run["results"][shape]
    return None


def cost_summary() -> str:
    """README's cost table: the newest run of each shape, merge ÷ floor and peak RSS ÷ the checkpoints."""
    rows = []
    for title, record, shape in COST_ROWS:
        found = _latest_perf_run(record, shape)
        if found is None:
            continue
        run, result = found
        floor, merge = result["floor"], result["merge"]
        rows.append([
            title,
            f"{merge['total_s'] / floor['total_s']:.2f} ×",
            f"{merge['peak_rss'] / result['size']:.2f} ×",
            f"{run['machine']}, {run['threads']} threads",
            f"{run['commit']}, [`{record}`](benchmarks/perf/{record.replace('.json', '.md')})",
        ])  # fmt: skip
    return _table(["shape (B = an exact symmetry of A)", "time ÷ floor", "peak RSS ÷ (A + B)", "host", "record"], rows)


BLOCKS: tuple[Block, ...] = (
    Block("README.md", "results-summary", ("results/results.json", "decoders/results/results.json"), results_summary),
    Block("README.md", "cost-summary", tuple(f"perf/{record}" for _, record, _ in COST_ROWS), cost_summary),
)


def _pattern(name: str) -> re.Pattern:
    return re.compile(
        re.escape(_BEGIN.format(name=name)) + r"\n(.*?)" + re.escape(_END.format(name=name)), flags=re.DOTALL
    )


def outside_blocks(text: str) -> str:
    """``text`` with the body of every generated block removed (the prose around them)."""
    return re.sub(r"<!-- generated: .*?<!-- end generated: [^>]*-->", "", text, flags=re.DOTALL)


def block_text(text: str, name: str) -> str | None:
    """The body of the block ``name`` in ``text`` (None when the file has no such block)."""
    match = _pattern(name).search(text)
    return None if match is None else match.group(1)


def splice(text: str, name: str, body: str) -> str:
    """``text`` with the body of the block ``name`` replaced by ``body`` (which ends in a newline)."""
    if block_text(text, name) is None:
        raise KeyError(f"no generated block {name!r}; add the marker lines {_BEGIN.format(name=name)!r} and "
                       f"{_END.format(name=name)!r}")  # fmt: skip
    replacement = _BEGIN.format(name=name) + "\n" + body + _END.format(name=name)
    return _pattern(name).sub(lambda _: replacement, text, count=1)


def rendered(block: Block) -> str:
    """The block's body as generated now (with its final newline)."""
    return block.render().rstrip("\n") + "\n"


def stale_blocks(texts: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """Every block whose committed body differs from its regeneration: (file#name, what differs).
    ``texts``: the files' texts by path (default: read from the repository)."""
    out = []
    for block in BLOCKS:
        text = (texts or {}).get(block.file) or (ROOT / block.file).read_text(encoding="utf-8")
        have, want = block_text(text, block.name), rendered(block)
        if have != want:
            out.append((f"{block.file}#{block.name}", "missing" if have is None else "differs from its records"))
    return out


def write_blocks() -> list[str]:
    """Rewrite every block from its records; returns what was written."""
    written = []
    for block in BLOCKS:
        path = ROOT / block.file
        path.write_text(splice(path.read_text(encoding="utf-8"), block.name, rendered(block)), encoding="utf-8")
        written.append(f"{block.file}#{block.name} from {', '.join(block.records)}")
    return written
