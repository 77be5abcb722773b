"""Three-model merges: three independently trained ViTs or Llamas of one recipe, and three fine-tuned
Llama siblings of one base, merged at once (``RaotMerger.from_pretrained(a, b, c)``) against the
plain average of the three and against chaining two-model merges (merge A with B, then the result
with C at α = ⅓, so each parent weighs ⅓).

Runs: for the seed families the three orders of the models (each model the reference once); for
the siblings one base per seed 0, 1, 2 (fine-tuned on reviews, on speeches and on both). ViT:
accuracy on digits with the reference's head; Llama: held-out perplexity, and its ratio to the
parents' mean perplexity. Writes ``results_three_models.json`` and ``RESULTS_three_models.md`` into ``--out``;
a rerun of some methods keeps the run's other methods, and every method row it replaces is appended
to ``results_three_models_history.json`` (``benchmarks.row_history``; the report lists them)::

    python -m benchmarks.three_models --workers 2
    python -m benchmarks.three_models --families vit-seeds-d64 --methods average3,raot3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.row_history import history_lines, replaced_rows
from benchmarks.update import today

HERE = Path(__file__).resolve().parent
#: The earlier runs of rerun method rows, beside ``results_three_models.json``.
HISTORY_FILE = "results_three_models_history.json"
ORDERS = ((0, 1, 2), (1, 2, 0), (2, 0, 1))
FAMILIES = ("vit-seeds-d64", "vit-seeds-d128", "llama-seeds-d64", "llama-seeds-d128", "llama-siblings3")
#: method → (options of RaotMerger.from_pretrained, needs the base, chains two-model merges)
METHODS: dict[str, tuple[dict[str, Any], bool, bool]] = {
    "average3": ({"alignment": "none"}, False, False),
    "raot3": ({"correction": {"method": "none"}, "refit": {"mode": "off"}}, False, False),
    "default3": ({}, False, False),  # RaOT, then the least squares and the refit when the gate moved a model
    "chained-average": ({"alignment": "none"}, False, True),
    "chained-default": ({}, False, True),
    "task_arithmetic3": ({"merge_rule": "task_arithmetic"}, True, False),
    "ties3": ({"merge_rule": "ties", "task_vectors": {"density": 0.5}}, True, False),
    "dare_ties3": ({"merge_rule": "dare_ties", "task_vectors": {"density": 0.5}}, True, False),
}
SEED_METHODS = ("average3", "raot3", "default3", "chained-average", "chained-default")
SIBLING_METHODS = ("average3", "default3", "chained-default", "task_arithmetic3", "ties3", "dare_ties3")


# ----------------------------------------------------------------------------- the models of a run


def _vit_dirs(width: int, order: tuple[int, ...]) -> list[Path]:
    from benchmarks.builders import build_model
    from benchmarks.pairs import ModelSpec

    return [
        build_model(ModelSpec("zoo_vit", (("dataset", "digits"), ("hidden_size", width), ("seed", s)))) for s in order
    ]


def _llama_dirs(family: str, run: int, cache_dir: str | None) -> tuple[list[Path], Path | None]:
    from benchmarks.decoders.pairs import SIBLING_WIDTH, finetuned, pretrained

    if family == "llama-siblings3":
        base = pretrained("llama", SIBLING_WIDTH, run, "mixed", cache_dir)
        return [finetuned(base, run, corpus, cache_dir) for corpus in ("reviews", "speeches", "mixed")], base
    width = int(family.rsplit("d", 1)[1])
    return [pretrained("llama", width, s, "reviews", cache_dir) for s in ORDERS[run]], None


# ----------------------------------------------------------------------------- merging


def _merge(dirs: list[Path], base: Path | None, method: str, calibration, preprocessor_dir: Path):
    """The method's merge of ``dirs`` (a model), and its report."""
    from raot_hf import RaotMerger

    options, needs_base, chained = METHODS[method]
    options = {**options, "calibration": {"num_samples": 256, "batch_size": 32}}
    extra = {"base": base} if needs_base else {}
    if not chained:
        result = RaotMerger.from_pretrained(*dirs, **options, **extra).merge(calibration=calibration)
        return result.model, result.report
    first = RaotMerger.from_pretrained(dirs[0], dirs[1], **options).merge(calibration=calibration)
    with tempfile.TemporaryDirectory() as tmp:
        path = first.save_pretrained(Path(tmp) / "ab")
        second = RaotMerger.from_pretrained(path, dirs[2], alpha=1 / 3, **options).merge(calibration=calibration)
    return second.model, {"first": first.report, "second": second.report}


def _applied(report: dict) -> list[int]:
    if "first" in report:
        return [_applied(report["first"])[0], _applied(report["second"])[0]]
    models = report.get("models") or [{"decisions": report.get("decisions", [])}]
    return [sum(bool(d["applied"]) for d in m["decisions"]) for m in models]


# ----------------------------------------------------------------------------- one run


def _vit_run(family: str, run: int, methods: list[str]) -> dict[str, Any]:
    import transformers

    from benchmarks.harness import _TaskData
    from benchmarks.metrics import evaluate
    from benchmarks.pairs import calibration_set, suite
    from raot_hf import schema_for

    width = int(family.rsplit("d", 1)[1])
    pair = next(p for p in suite("full") if p.name == f"vit-digits-d{width}")
    dirs = _vit_dirs(width, ORDERS[run])
    load = transformers.AutoModelForImageClassification.from_pretrained
    processor = transformers.AutoImageProcessor.from_pretrained(dirs[0])
    task = _TaskData("digits", processor, pair)
    parents = [load(d).eval() for d in dirs]
    schema = schema_for(parents[0])
    out = {"parents": [evaluate(m, task.test, schema)["accuracy"] for m in parents], "methods": {}}
    calibration = calibration_set(pair)
    for method in methods:
        started = time.perf_counter()
        model, report = _merge(dirs, None, method, calibration, dirs[0])
        out["methods"][method] = {
            "accuracy": evaluate(model, task.test, schema)["accuracy"],
            "applied": _applied(report),
            "seconds": time.perf_counter() - started,
        }
    return out


def _llama_run(family: str, run: int, methods: list[str], cache_dir: str | None) -> dict[str, Any]:
    import transformers
    from datasets import Dataset

    from benchmarks.decoders.lm import corpus_split, evaluation_texts, mean_loss

    siblings = family == "llama-siblings3"
    dirs, base = _llama_dirs(family, run, cache_dir)
    corpora = ("reviews", "speeches") if siblings else ("reviews",)
    texts = {c: evaluation_texts(c) for c in corpora}

    def ppl(model) -> dict[str, float]:
        return {c: math.exp(mean_loss(model, texts[c])) for c in corpora}

    parents = [ppl(transformers.AutoModelForCausalLM.from_pretrained(d).eval()) for d in dirs]
    out = {"parents": parents, "methods": {}}
    cal_texts = corpus_split("mixed" if siblings else "reviews", "calibration")[:256]
    calibration = Dataset.from_dict({"text": list(cal_texts)})
    for method in methods:
        started = time.perf_counter()
        model, report = _merge(dirs, base, method, calibration, dirs[0])
        values = ppl(model)
        out["methods"][method] = {
            "ppl": values,
            "ratio": {c: values[c] / statistics.mean(p[c] for p in parents) for c in corpora},
            "applied": _applied(report),
            "seconds": time.perf_counter() - started,
        }
    return out


def evaluate_run(family: str, run: int, methods: tuple[str, ...], cache_dir: str | None) -> dict[str, Any]:
    """Every method on run ``run`` of ``family`` (runs in a worker process)."""
    import torch

    torch.set_num_threads(1)
    wanted = [
        m for m in (SIBLING_METHODS if family == "llama-siblings3" else SEED_METHODS) if not methods or m in methods
    ]
    vit = family.startswith("vit")
    result = _vit_run(family, run, wanted) if vit else _llama_run(family, run, wanted, cache_dir)
    return {"family": family, "run": run, **result}


# ----------------------------------------------------------------------------- the report


def _fmt(values: list[float], digits: int = 3) -> str:
    if not values:
        return "—"
    mean = statistics.mean(values)
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def _machine() -> str:
    import os
    import platform

    import torch

    return f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, one thread per run"


def write_report(runs: list[dict], out: Path, markdown_only: bool = False, history: list[dict] | None = None) -> str:
    """``RESULTS_three_models.md``: one table per family, mean ± std over runs, and the earlier runs
    of rerun rows (``history``); returns the markdown (``markdown_only``: without writing it)."""
    # the machine each run recorded (re-rendering elsewhere must not print the renderer's machine)
    machine = "; ".join(dict.fromkeys(r.get("machine") or _machine() for r in runs))
    lines = ["# Three-model merges", "", "Generated by `python -m benchmarks.three_models`; mean ± std over runs."]
    lines += [f"Machine: {machine}. Seed families: each run takes another model as the reference (model 1).", ""]
    lines += [
        "`transforms applied`: per run, the transforms applied to model 2 / model 3 (chained: first / second merge).",
        "",
    ]
    for family in FAMILIES:
        rows = [r for r in runs if r["family"] == family]
        if not rows:
            continue
        vit = family.startswith("vit")
        lines += [f"## {family} ({len(rows)} runs)", ""]
        if vit:
            parents = [v for r in rows for v in r["parents"]]
            lines += [
                f"Parents' accuracy: {_fmt(parents)}.",
                "",
                "| method | accuracy | transforms applied | seconds |",
            ]
            lines += ["|---|---|---|---|"]
        else:
            corpora = list(rows[0]["parents"][0])
            for c in corpora:
                lines.append(f"Parents' perplexity on {c}: {_fmt([p[c] for r in rows for p in r['parents']], 2)}.")
            head = " | ".join(f"ppl {c} | ÷ parents' mean" for c in corpora)
            lines += ["", f"| method | {head} | transforms applied | seconds |", "|---" * (3 + 2 * len(corpora)) + "|"]
        for method in rows[0]["methods"]:
            cells = [r["methods"][method] for r in rows if method in r["methods"]]
            applied = ", ".join("/".join(map(str, c["applied"])) for c in cells)
            seconds = _fmt([c["seconds"] for c in cells], 1)
            if vit:
                lines.append(f"| {method} | {_fmt([c['accuracy'] for c in cells])} | {applied} | {seconds} |")
            else:
                values = " | ".join(
                    f"{_fmt([c['ppl'][k] for c in cells], 2)} | {_fmt([c['ratio'][k] for c in cells])}" for k in corpora
                )
                lines.append(f"| {method} | {values} | {applied} | {seconds} |")
        lines.append("")
    columns = [("accuracy", lambda row: row.get("accuracy"), 3)]
    corpora = dict.fromkeys(c for entry in history or () for c in entry["row"].get("ppl", {}))
    columns += [(f"ppl {c}", lambda row, c=c: row.get("ppl", {}).get(c), 2) for c in corpora]
    lines += history_lines(history or [], columns, f"`{HISTORY_FILE}`")
    text = "\n".join(lines)
    if not markdown_only:
        (out / "RESULTS_three_models.md").write_text(text, encoding="utf-8")
    return text


def fold_runs(stored: list[dict], runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """``runs`` folded into the ``stored`` runs: a rerun of some methods keeps the run's other
    methods. Returns the runs and the history entries of the stored method rows it replaced."""
    merged = {(r["family"], r["run"]): r for r in stored}
    replaced: list[dict] = []
    for r in runs:
        key = (r["family"], r["run"])
        old = merged.get(key, {}).get("methods", {})
        replaced += replaced_rows(*key, old, [m for m in old if m in r["methods"]], lambda m, old=old: old[m])
        merged[key] = {**r, "methods": {**old, **r["methods"]}}
    return sorted(merged.values(), key=lambda r: (FAMILIES.index(r["family"]), r["run"])), replaced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--methods", default="")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    methods = tuple(m for m in args.methods.split(",") if m)
    jobs = [(f, r, methods, args.cache_dir) for f in families for r in range(args.runs)]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        runs = list(pool.map(evaluate_run, *zip(*jobs, strict=True)))
    arguments = sys.argv[1:] if argv is None else argv
    invocation = {"date": today(), "command": " ".join(["python -m benchmarks.three_models", *arguments])}
    for r in runs:
        r["machine"] = _machine()
        for row in r["methods"].values():
            row.update(invocation)  # which invocation produced the row, for the history once replaced
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path, history_path = out / "results_three_models.json", out / HISTORY_FILE
    stored = json.loads(path.read_text()) if path.exists() else []
    history = json.loads(history_path.read_text()) if history_path.exists() else []
    runs, replaced = fold_runs(stored, runs)
    path.write_text(json.dumps(runs, indent=1), encoding="utf-8")
    if replaced:
        history_path.write_text(json.dumps([*history, *replaced], indent=1), encoding="utf-8")
    write_report(runs, out, history=[*history, *replaced])
    print((out / "RESULTS_three_models.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
