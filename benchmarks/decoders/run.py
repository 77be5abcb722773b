"""Decoder evidence: merge trained decoder pairs with every method, measure perplexity.

For each run: build (or reuse) A, B and the siblings' base; merge with every method through
``RaotMerger.from_pretrained``; measure held-out perplexity of the merge at α = ½ on each corpus
and, for the linear rule, the test loss along (1 − α)·A + α·B′ (α ∈ {0, ¼, ½, ¾, 1}) and its
barrier. B′ ≡ B is checked by the product; its deviation and the exactness flag are recorded.
Writes ``results.json``, ``RESULTS.md`` and plots into ``--out`` (default
``benchmarks/decoders/results``); ``--methods`` folds its rows into the stored runs, and every stored
row a rerun replaces goes to ``results.json``'s history (``benchmarks.row_history``)::

    python -m benchmarks.decoders.run --cache-dir benchmarks/.cache --workers 2
    python -m benchmarks.decoders.run --pairs llama-siblings --workers 1
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import math
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.metrics import calibration_tokens, correction_summary, refit_summary
from benchmarks.row_history import replaced_rows
from benchmarks.update import today

HERE = Path(__file__).resolve().parent
ALPHAS = [0.0, 0.25, 0.5, 0.75, 1.0]
CALIBRATION_TEXTS = 256
SEED_METHODS = (
    "default",
    "default-cap2k",
    "default-hcap2k",
    "average",
    "wm-perm",
    "wm-rot",
    "act-perm",
    "raot",
    "raot-norope",
    "raot-budget16",
    "regmean",
    "raot+regmean",
    "raot+lsq",
    "raot+repair",
    "raot+regmean+lsq",
    "raot+lsq-all",
    "lsq",
    "raot+refine",
    "raot+refine+lsq",
    "slerp",
    "slerp-raot",
)
SIBLING_METHODS = (
    "average",
    "raot",
    "raot-nosibcheck",
    "task-arithmetic",
    "ties",
    "dare-ties",
    "regmean",
    "raot+lsq",
    "raot+repair",
    "slerp",
    "model-stock",
    "della",
)
#: Relative difference of a parent's held-out loss above which a rebuilt parent is another model
#: (retrained on another CPU, whose float kernels differ): its rows are not folded into the old run's.
SAME_PARENT_RTOL = 1e-5
logger = logging.getLogger("benchmarks.decoders")


def _methods_for(pair) -> list[str]:
    if pair.siblings:
        return list(SIBLING_METHODS)
    # without RoPE the restriction is void: the ablation would repeat RaOT
    return [m for m in SEED_METHODS if m != "raot-norope" or pair.arch == "llama"]


def _losses(model, corpora) -> dict[str, float]:
    from benchmarks.decoders.lm import evaluation_texts, mean_loss

    return {c: mean_loss(model, evaluation_texts(c)) for c in corpora}


def _merge(pair, method, dirs) -> tuple[Any, Any, float]:
    from datasets import Dataset

    from benchmarks.decoders.lm import MAX_LENGTH, corpus_split, tokenizer
    from benchmarks.methods import base_keyword
    from raot_hf import RaotMerger

    options = dict(method.options)
    options["calibration"] = {
        "num_samples": CALIBRATION_TEXTS,
        "max_length": MAX_LENGTH,
        "batch_size": 32,
        **options.get("calibration", {}),
    }
    if method.needs_base:
        options[base_keyword()] = dirs["base"]
    texts = corpus_split(pair.calibration_corpus, "calibration")[:CALIBRATION_TEXTS]
    encoder = tokenizer()  # before the clock; a cached parent may hold a tokenizer that returned token types
    started = time.perf_counter()
    merger = RaotMerger.from_pretrained(dirs["a"], dirs["b"], **options)
    # calibration encoded as the decoders are trained and scored: without token types (a GPT-2
    # given them adds the embedding of token 0 to every position)
    merger.preprocessor = encoder
    result = merger.merge(calibration=Dataset.from_dict({"text": list(texts)}))
    return merger, result, time.perf_counter() - started


def _path(pair, model_a, merger, result, parents) -> dict[str, Any]:
    """Loss along the linear path from A (in the merge's parameterization) to B′, and barriers."""
    from benchmarks.metrics import barrier, interpolate, matching_reference, path_check

    reference = matching_reference(model_a, result, merger.schema)
    scratch = copy.deepcopy(merger.model_b)
    curves: dict[str, list[float]] = {c: [] for c in pair.corpora}
    row: dict[str, Any] = {}
    for alpha in ALPHAS:
        if alpha == 0.0:
            losses = {c: parents["a"][c] for c in pair.corpora}
        else:
            point = interpolate(reference, merger.model_b, alpha, scratch)
            if alpha == 0.5:
                row["path_check"] = path_check(point, result.model, merger.schema)
            losses = _losses(point, pair.corpora)
        for c in pair.corpora:
            curves[c].append(losses[c])
    row["path_loss"] = curves
    row["barrier"] = {c: barrier(ALPHAS, curves[c]) for c in pair.corpora}
    return row


def _evaluate_method(pair, method, dirs, model_a, parents) -> dict[str, Any]:
    merger, result, seconds = _merge(pair, method, dirs)
    decisions = result.alignment.decisions
    checks = result.report.get("checks") or [{}]
    row: dict[str, Any] = {
        "merge_seconds": seconds,
        "loss": _losses(result.model, pair.corpora),
        "exact": bool(result.alignment.exact),
        "deviation": checks[0].get("value"),  # max|Δ| / max|B| (B′ ≡ B)
        "deviation_norm": checks[0].get("norm_value"),  # ‖Δ‖ / ‖B‖
        "applied": sum(int(d.applied) for d in decisions),
        "candidates": len(decisions),
        "shares_basis": bool(result.alignment.shares_basis),
        "verdict": None if result.alignment.verdict is None else str(result.alignment.verdict),
        "correction": correction_summary(result.report),
        "refit": refit_summary(result.report),
        "timings": dict(result.report["timings"]),
        "calibration_tokens": calibration_tokens(result.report),
    }
    row["ppl"] = {c: math.exp(v) for c, v in row["loss"].items()}
    if method.linear:
        row.update(_path(pair, model_a, merger, result, parents))
    return row


def evaluate_run(pair_name: str, run: int, cache_dir: str | None, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every method (or those in ``only``) on run ``run`` of the named pair (runs in a worker process)."""
    import transformers

    from benchmarks.decoders.pairs import decoder_pairs, run_models
    from benchmarks.methods import BY_NAME

    pair = next(p for p in decoder_pairs() if p.name == pair_name)
    dirs = run_models(pair, run, cache_dir)
    models = {k: transformers.AutoModelForCausalLM.from_pretrained(v).eval() for k, v in dirs.items() if v}
    parents = {k: _losses(m, pair.corpora) for k, m in models.items()}
    out: dict[str, Any] = {
        "pair": pair.name,
        "run": run,
        "models": {k: Path(v).name for k, v in dirs.items() if v},
        "parents": parents,
        "methods": {},
    }
    # named methods run even outside the family's list, unless they need a base it does not have
    names = [m for m in only if pair.siblings or not BY_NAME[m].needs_base] if only else _methods_for(pair)
    for name in names:
        try:
            out["methods"][name] = _evaluate_method(pair, BY_NAME[name], dirs, models["a"], parents)
        except Exception as exc:  # one failing method must not hide the others
            logger.exception("%s run %d: %s failed", pair.name, run, name)
            out["methods"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
    return out


def _parents_differ(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a rerun's parents are not the stored run's (their held-out losses differ)."""
    for side, losses in old["parents"].items():
        for corpus, loss in losses.items():
            other = new["parents"].get(side, {}).get(corpus)
            if other is None or abs(other - loss) > SAME_PARENT_RTOL * max(1.0, abs(loss)):
                return True
    return set(old["parents"]) != set(new["parents"])


def _ran(command: str, pair: str, run: int, method: str) -> bool:
    """Whether ``command`` (a recorded ``benchmarks.decoders.run`` invocation) ran (pair, run, method)."""
    args = shlex.split(command)

    def named(flag: str, value: str, default: str | None) -> bool:
        listed = args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else default
        return listed is None or value in listed.split(",")

    return named("--pairs", pair, None) and named("--methods", method, None) and named("--runs", str(run), "0,1,2")


def invocation_of(results: dict[str, Any], pair: str, run: int, method: str) -> dict[str, Any]:
    """The recorded invocation (command and, where recorded, date) whose row (pair, run, method) the
    results hold: the last of ``results["commands"]`` that ran it."""
    commands = results.get("commands", [results.get("command", "")])
    dates = results.get("dates", [])
    for index in reversed(range(len(commands))):
        if commands[index] and _ran(commands[index], pair, run, method):
            return {"command": commands[index], "date": dates[index] if index < len(dates) else None}
    return {}


def fold_run(results: dict[str, Any], row: dict[str, Any], only: tuple[str, ...]) -> str | None:
    """Put one evaluated run into ``results``: with ``only`` (a partial rerun) its methods replace
    those of the stored run and the others stay; every stored row it replaces is appended to
    ``results["history"]`` (``benchmarks.row_history``). Returns a note instead when the rerun's
    parents differ from the stored run's (nothing is folded then)."""
    key = (row["pair"], row["run"])
    old = next((r for r in results["runs"] if (r["pair"], r["run"]) == key), None)
    if only and old is not None and _parents_differ(old, row):
        note = (
            f"{row['pair']} run {row['run']}: not folded, its parents differ from the stored run's "
            f"(held-out loss {row['parents']} against {old['parents']}); rerun every method of it instead"
        )
        results.setdefault("notes", []).append(note)
        return note
    if old is not None:
        replaced = [m for m in old["methods"] if m in row["methods"] or not only]
        history = replaced_rows(*key, old["methods"], replaced, lambda m: invocation_of(results, *key, m))
        if history:
            results["history"] = [*results.get("history", []), *history]
    if only and old is not None:  # fold the rerun methods into the run's row, keep the others
        row = {**old, "methods": {**old["methods"], **row["methods"]}}
    results["runs"] = [r for r in results["runs"] if (r["pair"], r["run"]) != key]
    results["runs"].append(row)
    return None


def _worker_init() -> None:
    from benchmarks.run import _quiet_worker

    _quiet_worker(1)


def _build(spec: tuple[str, int, int, str, int], cache_dir: str | None) -> str:
    from benchmarks.decoders.pairs import pretrained

    arch, width, seed, corpus, layers = spec
    return str(pretrained(arch, width, seed, corpus, cache_dir, layers))


def main(argv: list[str] | None = None) -> int:
    from benchmarks.decoders.pairs import decoder_pairs
    from benchmarks.decoders.report import write_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", help="comma list (default: all): " + ", ".join(p.name for p in decoder_pairs()))
    parser.add_argument("--runs", default="0,1,2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-dir")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--report-only", action="store_true", help="re-render RESULTS.md and plots from results.json")
    parser.add_argument("--methods", help="comma list: run only these, folding them into --out's results.json")
    args = parser.parse_args(argv)
    only = tuple(m for m in (args.methods or "").split(",") if m)
    from benchmarks.methods import BY_NAME

    unknown = [m for m in only if m not in BY_NAME]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    if args.report_only:
        write_report(json.loads((Path(args.out) / "results.json").read_text()), Path(args.out))
        return 0
    pairs = [p for p in decoder_pairs() if not args.pairs or p.name in args.pairs.split(",")]
    jobs = [(p.name, int(r)) for p in pairs for r in args.runs.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers, initializer=_worker_init) as pool:
        from benchmarks.decoders.pairs import pretrained_specs

        specs = sorted({spec for p in pairs for spec in pretrained_specs(p)}, key=lambda s: -s[1])  # widest first
        list(pool.map(_build, specs, [args.cache_dir] * len(specs)))  # train every parent once (cached)
        for row in pool.map(evaluate_run, *zip(*jobs), [args.cache_dir] * len(jobs), [only] * len(jobs)):
            note = fold_run(results, row, only)
            if note:
                print(note, flush=True)
                continue
            path.write_text(json.dumps(results, indent=1))
            print(f"{row['pair']} run {row['run']}: done ({time.perf_counter() - started:.0f} s)", flush=True)
    command = " ".join(["python -m benchmarks.decoders.run", *(sys.argv[1:] if argv is None else argv)])
    dates = results.get("dates", [])
    if only:  # a partial rerun: the commands that produced the table
        commands = results.get("commands", [results.get("command", "")])
        results["commands"] = [*commands, command]
        results["dates"] = [*dates, *[None] * (len(commands) - len(dates)), today()]
    else:
        results["command"], results["commands"], results["dates"] = command, [command], [today()]
    path.write_text(json.dumps(results, indent=1))
    write_report(results, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
