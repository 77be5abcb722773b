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

from benchmarks.report import _fmt  # mean ± sample std, as every results file writes it

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
    ("default, 1,000 refit steps", "default+refit-1000"),
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
    (
        "135 M-parameter LLM shape (49,152-token tied head), 64 texts of 16–128 tokens",
        "results_llama135m.json",
        "llama-135m-lm",
    ),
    (
        "6-layer d = 384 classifier, 256 × 128, B moved by 5 % noise, the refit under its default budget",
        "results_bert6l.json",
        "bert-6l-sequence",
    ),
    ("0.49 B Llama, 64 × 128, layer by layer", "results_layerwise_0.5b.json", "llama-0.5b-fp32, offload always"),
    (
        "4 of the 0.49 B Llama's layers, 64 × 128, layer by layer, B moved by 5 % noise (every Linear refitted)",
        "results_layerwise_4l.json",
        "llama-0.5b-fp32-4l-drift, offload always",
    ),
)


def _latest_perf_run(record: str, shape: str) -> tuple[dict, dict] | None:
    """The newest measured run of ``record`` (with a commit) holding ``shape``, and that shape's result."""
    for run in reversed(_load(f"perf/{record}")["runs"]):
        if run.get("kind") == "perf-run" and run.get("commit") and shape in run.get("results", {}):
            return run, run["results"][shape]
    return None


def cost_summary(links: str = "benchmarks/perf/") -> str:
    """The cost table: the newest run of each shape, merge ÷ floor and peak RSS ÷ the checkpoints
    (``links``: the perf folder as the table's file sees it)."""
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
            f"{run['commit']}, [`{record}`]({links}{record.replace('.json', '.md')})",
        ])  # fmt: skip
    header = ["shape (B = an exact symmetry of A unless said)", "time ÷ floor", "peak RSS ÷ (A + B)", "host", "record"]
    return _table(header, rows)


def pairs_table() -> str:
    """The encoder pairs of ``results/results.json``: family, name, what A and B are, runs."""
    record = _load("results/results.json")
    runs = _grouped(record)
    rows = [
        [p["family"], f"`{p['name']}`", p["description"], str(len(runs.get(p["name"], [])))] for p in record["pairs"]
    ]
    return _table(["family", "pair", "A and B", "runs"], rows)


def methods_table() -> str:
    """Every benchmarked method: its name, what it is, and the options of the product it runs with."""
    from benchmarks.methods import METHODS

    def options(method) -> str:
        return ", ".join(f"`{k}={v!r}`" for k, v in method.options.items()) or "(none: the defaults)"

    return _table(["method", "what", "options"], [[f"`{m.name}`", m.label, options(m)] for m in METHODS])


def _method_table(grouped: dict[str, list[dict]], rows: tuple, columns: tuple, value, first: tuple | None) -> str:
    """``rows`` (title, pair) × ``columns`` (title, method) of ``value(runs, method)``; ``first``: an
    extra first column (title, cell(runs))."""
    header = ["pair", *([first[0]] if first else []), *(title for title, _ in columns)]
    body = []
    for title, pair in rows:
        runs = grouped.get(pair, [])
        if not runs:
            continue
        cells = [first[1](runs)] if first else []
        body.append([title, *cells, *(_fmt(value(runs, method)) for _, method in columns)])
    return _table(header, body)


ENCODER_ROWS = (
    ("ViT digits, seeds, d = 32", "vit-digits-d32"),
    ("ViT digits, seeds, d = 64", "vit-digits-d64"),
    ("ViT digits, seeds, d = 128", "vit-digits-d128"),
    ("ViT digits vs MNIST", "vit-digits-vs-mnist"),
    ("BERT seeds", "bert-rt"),
    ("BERT sentiment vs party", "bert-sentiment-vs-party"),
    ("MiniLM siblings", "minilm-siblings"),
    ("BERT siblings", "bert-siblings"),
    ("ViT siblings", "vit-siblings"),
)
ENCODER_COLUMNS = (
    ("average", "average"), ("wm-rot (paper)", "wm-rot"), ("act-perm", "act-perm"), ("RaOT", "raot"),
    ("RaOT + RegMean", "raot+regmean"), ("RaOT + least squares", "raot+lsq"), ("default, no refit", "default-norefit"),
    ("**default**", "default"), ("default, 1,000 refit steps", "default+refit-1000"),
    ("default, confident teacher", "default+refit-confident"),
)  # fmt: skip


def encoder_headline() -> str:
    """Accuracy with A's head at α = ½ of the main methods on every encoder pair (``results/results.json``)."""
    parent = ("parent A", lambda runs: _fmt([float(r["parents"]["a"]["accuracy"]) for r in runs]))
    return _method_table(_grouped(_load("results/results.json")), ENCODER_ROWS, ENCODER_COLUMNS, _accuracies, parent)


DECODER_ROWS = (
    ("Llama, d = 32", "llama-seeds-d32"), ("Llama, d = 64", "llama-seeds-d64"), ("Llama, d = 128", "llama-seeds-d128"),
    ("Llama, d = 128, 4 layers", "llama-seeds-d128-l4"), ("GPT-2, d = 32", "gpt2-seeds-d32"),
    ("GPT-2, d = 64", "gpt2-seeds-d64"), ("GPT-2, d = 128", "gpt2-seeds-d128"),
    ("GPT-2, d = 128, 4 layers", "gpt2-seeds-d128-l4"), ("Llama siblings", "llama-siblings"),
)  # fmt: skip
DECODER_COLUMNS = (
    ("average", "average"), ("act-perm", "act-perm"), ("RaOT", "raot"), ("RaOT + RegMean", "raot+regmean"),
    ("RaOT + learned alignment", "raot+refine"), ("RaOT + least squares", "raot+lsq"), ("**default**", "default"),
    ("default, 1,000 refit steps", "default+refit-1000"), ("default, confident teacher", "default+refit-confident"),
)  # fmt: skip


def decoder_headline() -> str:
    """Perplexity over the parents' mean of the main methods on every decoder pair."""
    return _method_table(
        _grouped(_load("decoders/results/results.json")), DECODER_ROWS, DECODER_COLUMNS, _perplexity_ratios, None
    )


MERGEKIT_ROWS = (
    ("ViT digits, seeds, d = 64", "vit-digits-d64"), ("ViT digits, seeds, d = 128", "vit-digits-d128"),
    ("ViT siblings", "vit-siblings"), ("BERT siblings", "bert-siblings"), ("MiniLM siblings", "minilm-siblings"),
)  # fmt: skip
MERGEKIT_COLUMNS = (
    ("average", "average"), ("RaOT", "raot"), ("SLERP", "slerp"), ("SLERP after RaOT", "slerp-raot"),
    ("TIES", "ties"), ("Model Stock", "model-stock"), ("DELLA", "della"),
)  # fmt: skip


def mergekit_table() -> str:
    """mergekit's rules, as stored and after alignment, accuracy with A's head (``results/results.json``)."""
    return _method_table(_grouped(_load("results/results.json")), MERGEKIT_ROWS, MERGEKIT_COLUMNS, _accuracies, None)


THREE_MODEL_ROWS = (
    ("ViT d = 64 (accuracy)", "vit-seeds-d64"), ("ViT d = 128", "vit-seeds-d128"),
    ("Llama d = 64 (perplexity ÷ parents')", "llama-seeds-d64"), ("Llama d = 128", "llama-seeds-d128"),
    ("Llama siblings", "llama-siblings3"),
)  # fmt: skip
THREE_MODEL_COLUMNS = (
    ("plain average of 3", "average3"), ("chained pairwise (default)", "chained-default"),
    ("three at once (default)", "default3"), ("three at once, RaOT only", "raot3"),
    ("task arithmetic", "task_arithmetic3"), ("TIES", "ties3"),
)  # fmt: skip


def _three_model_value(runs: list[dict], method: str) -> list[float]:
    out = []
    for run in runs:
        row = run["methods"].get(method, {})
        value = row.get("accuracy", row.get("ratio", {}).get("reviews"))
        if isinstance(value, (int, float)):
            out.append(float(value))
    return out


def three_models_table() -> str:
    """Three models merged at once and chained (``results/results_three_models.json``)."""
    grouped: dict[str, list[dict]] = defaultdict(list)
    for run in sorted(_load("results/results_three_models.json"), key=lambda r: (r["family"], r["run"])):
        grouped[run["family"]].append(run)
    return _method_table(grouped, THREE_MODEL_ROWS, THREE_MODEL_COLUMNS, _three_model_value, None)


_COST_RECORDS = tuple(f"perf/{record}" for _, record, _ in COST_ROWS)

BLOCKS: tuple[Block, ...] = (
    Block("README.md", "results-summary", ("results/results.json", "decoders/results/results.json"), results_summary),
    Block("README.md", "cost-summary", _COST_RECORDS, cost_summary),
    Block("benchmarks/README.md", "pairs", ("results/results.json",), pairs_table),
    Block("benchmarks/README.md", "methods", (), methods_table),
    Block("benchmarks/README.md", "encoders", ("results/results.json",), encoder_headline),
    Block("benchmarks/README.md", "decoders", ("decoders/results/results.json",), decoder_headline),
    Block("benchmarks/README.md", "mergekit-rules", ("results/results.json",), mergekit_table),
    Block("benchmarks/README.md", "three-models", ("results/results_three_models.json",), three_models_table),
    Block(
        "benchmarks/README.md",
        "cost",
        tuple(f"perf/{record}" for _, record, _ in COST_ROWS),
        lambda: cost_summary("perf/"),
    ),
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
