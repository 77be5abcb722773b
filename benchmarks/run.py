"""Rerun the evidence offline with one command.

::

    python -m benchmarks.run                 # full: 7 pairs x 3 runs, 11 alphas (~20 min on 2 cores, cached)
    python -m benchmarks.run --quick         # 5 pairs x 1 run, 5 alphas (~2 min; ~40 s once cached)
    python -m benchmarks.run --out DIR --workers 2 --pairs vit --methods average,raot

Writes ``DIR/RESULTS.md`` (tables: mean ± std over runs), ``DIR/results.json`` (every number)
and ``DIR/*.png`` (barrier curves, per-layer gate gains, width series). Parents are trained
once and cached by :mod:`benchmarks.zoo` (``$RAOT_HF_CACHE``, default ``~/.cache/raot_hf/zoo``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from benchmarks.methods import available_methods
from benchmarks.pairs import ModelSpec, PairSpec, build_model, missing_packages, suite
from benchmarks.update import merge_results, superseded_history, today

logger = logging.getLogger("benchmarks.run")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"

#: Rough single-core cost of building / evaluating, to start the slowest jobs first.
_COST = {
    "zoo_minilm": 80,
    "finetuned_bert": 45,
    "zoo_bert": 40,
    "finetuned_vit": 30,
    "resized_vit": 30,
    "zoo_vit": 25,
    "task_bert": 20,
}
#: Builders that fine-tune another spec's model (built in a second wave, after the bases).
FINETUNED = "finetuned_"


def _alphas(n: int) -> list[float]:
    if n < 2:
        return []
    return [round(i / (n - 1), 6) for i in range(n)]


def _quiet_worker(threads: int = 1, blas: bool = True) -> None:
    """Per-process settings: intra-op threads, no progress bars, terse libraries."""
    import warnings

    import datasets
    import torch
    import transformers
    from huggingface_hub.utils import disable_progress_bars

    torch.set_num_threads(threads)
    if blas:
        _limit_blas(threads)
    disable_progress_bars()
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    logging.getLogger("raot_hf").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _limit_blas(threads: int):
    """Limit numpy's / scikit-learn's BLAS and OpenMP pools (POT's Sinkhorn, the probes) too:
    two workers with two BLAS threads each would oversubscribe two cores."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - ships with scikit-learn
        return None
    return threadpool_limits(limits=threads)


@contextlib.contextmanager
def _quiet_inline(threads: int = 1):
    """:func:`_quiet_worker` for a run in the caller's process, with every setting restored."""
    import warnings

    import datasets
    import torch
    import transformers
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    datasets_bars = datasets.is_progress_bar_enabled()
    previous = (
        torch.get_num_threads(),
        are_progress_bars_disabled(),
        transformers.utils.logging.is_progress_bar_enabled(),
        transformers.logging.get_verbosity(),
        logging.getLogger("raot_hf").level,
    )
    with warnings.catch_warnings():
        limits = _limit_blas(threads)  # remembers the caller's limits
        _quiet_worker(threads, blas=False)
        try:
            yield
        finally:
            if limits is not None:
                limits.restore_original_limits()
            torch.set_num_threads(previous[0])
            if not previous[1]:
                enable_progress_bars()
            if previous[2]:
                transformers.utils.logging.enable_progress_bar()
            if datasets_bars:
                datasets.enable_progress_bars()
            transformers.logging.set_verbosity(previous[3])
            logging.getLogger("raot_hf").setLevel(previous[4])


def _build_job(spec: ModelSpec) -> str:
    return str(build_model(spec))


def _run_job(pair: PairSpec, run_index: int, method_names: list[str], alphas: list[float]) -> dict[str, Any]:
    from benchmarks.harness import evaluate_run
    from benchmarks.methods import BY_NAME

    return evaluate_run(pair, run_index, [BY_NAME[m] for m in method_names], alphas)


def source_digest() -> str:
    """A digest of the product's source files (``raot_hf/**/*.py``): which code produced the numbers,
    also between commits (the tree may hold uncommitted work when the benchmarks run)."""
    import hashlib

    import raot_hf

    root = Path(raot_hf.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _versions() -> dict[str, str]:
    import sklearn
    import torch
    import transformers

    from raot_hf.version import __version__

    return {
        "raot_hf": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "scikit-learn": sklearn.__version__,
        "python": platform.python_version(),
    }


def run_benchmarks(
    *,
    suite_name: str = "full",
    out: Path = DEFAULT_OUT,
    workers: int = 2,
    alphas: int | None = None,
    pair_filter: list[str] | None = None,
    run_filter: list[int] | None = None,
    method_names: list[str] | None = None,
    cache_dir: str | None = None,
    update: bool = False,
    echo=print,
) -> dict[str, Any]:
    """Build, merge, measure and write the results; return the results dict. With ``update``,
    fold them into the ``results.json`` already in ``out`` (:mod:`benchmarks.update`)."""
    from benchmarks.report import write_report

    started = time.perf_counter()
    notes: list[str] = []
    pairs = suite(suite_name, cache_dir)
    if pair_filter:
        pairs = [p for p in pairs if any(f in p.name for f in pair_filter)]
    kept = []
    for pair in pairs:
        missing = missing_packages(pair)
        if missing:
            note = (
                f"pair {pair.name} skipped: a package it needs is not installed "
                f"({'; '.join('pip install ' + m for m in missing)})"
            )
            echo(note)
            notes.append(note)
        else:
            kept.append(pair)
    pairs = kept
    methods, method_notes = available_methods(method_names)
    for note in method_notes:
        echo(note)
    notes += method_notes
    n_alphas = alphas if alphas is not None else (5 if suite_name == "quick" else 3 if suite_name == "tiny" else 11)
    grid = _alphas(n_alphas)
    # One thread per worker: these models are too small for intra-op parallelism to pay, and
    # processes do not contend for cores.
    pool = ProcessPoolExecutor(max_workers=workers, initializer=_quiet_worker, initargs=(1,)) if workers > 1 else None
    inline = _quiet_inline(1) if pool is None else contextlib.nullcontext()
    inline.__enter__()

    def submit(fn, *args):
        if pool is not None:
            return pool.submit(fn, *args)
        from concurrent.futures import Future

        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as exc:  # reported like a worker's failure
            fut.set_exception(exc)
        return fut

    try:
        # Phase 1: build every parent once (the zoo caches them), slowest first; fine-tunes after
        # their bases, so that no base is trained twice by two workers at once.
        chosen = {p.name: [i for i in range(len(p.seeds)) if run_filter is None or i in run_filter] for p in pairs}
        needed = {s for p in pairs for i in chosen[p.name] for s in (*p.runs()[i], p.base_of(i)) if s is not None}
        specs = sorted(needed, key=lambda s: -_COST.get(s.builder, 1))
        echo(f"building {len(specs)} parent models (cached after the first run) with {workers} worker(s)")
        failed_specs: dict[ModelSpec, str] = {}
        for wave in (False, True):
            futures = {submit(_build_job, s): s for s in specs if s.builder.startswith(FINETUNED) == wave}
            for fut in as_completed(futures):
                spec = futures[fut]
                try:
                    fut.result()
                except Exception as exc:
                    failed_specs[spec] = f"{type(exc).__name__}: {exc}"
                    echo(f"  build failed: {spec.describe()}: {failed_specs[spec]}")
        echo(f"parents ready ({time.perf_counter() - started:.0f} s)")

        # Phase 2: one job per (pair, run), slowest families first.
        jobs = []
        for pair in pairs:
            for i, run in enumerate(pair.runs()):
                if i not in chosen[pair.name]:
                    continue
                bad = [failed_specs[s] for s in (*run, pair.base_of(i)) if s in failed_specs]
                if bad:
                    note = f"pair {pair.name} run {i} skipped: a parent failed to build ({bad[0]})"
                    echo(note)
                    notes.append(note)
                    continue
                jobs.append((pair, i))
        jobs.sort(key=lambda j: -max(_COST.get(s.builder, 1) for s in j[0].runs()[j[1]]))
        names = [m.name for m in methods]
        futures = {submit(_run_job, pair, i, names, grid): (pair, i) for pair, i in jobs}
        runs: list[dict[str, Any]] = []
        for fut in as_completed(futures):
            pair, i = futures[fut]
            try:
                result = fut.result()
            except Exception as exc:
                note = f"pair {pair.name} run {i} failed: {type(exc).__name__}: {exc}"
                echo(note)
                notes.append(note)
                continue
            runs.append(result)
            errors = [m for m, r in result["methods"].items() if "error" in r]
            for m in errors:
                notes.append(f"pair {pair.name} run {i}: method {m} failed: {result['methods'][m]['error']}")
            echo(
                f"  {pair.name} run {i}: {len(result['methods']) - len(errors)} methods in {result['seconds']:.0f} s"
                + (f" ({len(errors)} failed: {', '.join(errors)})" if errors else "")
            )
    finally:
        if pool is not None:
            pool.shutdown()
        inline.__exit__(None, None, None)

    results = {
        "meta": {
            "suite": suite_name,
            "workers": workers,
            "alphas": grid,
            "seconds": time.perf_counter() - started,
            "cpu_count": os.cpu_count(),
            "versions": _versions(),
            "argv": sys.argv[1:],
            "date": today(),
            "source_digest": source_digest(),
            "notes": notes,
        },
        "methods": [
            {"name": m.name, "label": m.label, "options": _jsonable(m.options), "group": m.group} for m in methods
        ],
        "pairs": [
            {
                "name": p.name,
                "family": p.family,
                "description": p.description,
                "width": p.width,
                "tasks": [p.task_a, p.task_b],
                "seeds": [list(s) for s in p.seeds],
            }
            for p in pairs
        ],
        "runs": sorted(runs, key=lambda r: (r["pair"], r["run"])),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "results.json").is_file():
        previous = json.loads((out / "results.json").read_text())
        if update:
            results = merge_results(previous, results, [p.name for p in suite("full", cache_dir)])
            echo(f"folded {len(runs)} runs into the {len(previous['runs'])} of {out / 'results.json'}")
        elif history := superseded_history(previous):  # a fresh run replaces the rows; they stay as history
            results["history"] = history
            echo(f"replaced {out / 'results.json'}; its {len(previous['runs'])} runs are kept in its history")
    (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True, default=str))
    write_report(results, out)
    echo(f"wrote {out / 'RESULTS.md'}, results.json and plots in {time.perf_counter() - started:.0f} s")
    return results


def _jsonable(options: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``python -m benchmarks.run``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick suite (5 pairs x 1 run, ~2 min)")
    parser.add_argument("--suite", choices=["full", "quick", "tiny"], help="overrides --quick (tiny: the smoke test's)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (each single-threaded; 1 runs inline)")
    parser.add_argument("--alphas", type=int, help="points of the interpolation grid (default 11; quick 5)")
    parser.add_argument("--pairs", help="comma-separated substrings of pair names to keep")
    parser.add_argument("--methods", help="comma-separated method names (default: all)")
    parser.add_argument("--runs", help="comma-separated run indices of each pair to run (default: all)")
    parser.add_argument("--cache-dir", help="zoo cache (default $RAOT_HF_CACHE or ~/.cache/raot_hf/zoo)")
    parser.add_argument(
        "--update", action="store_true", help="fold the results into OUT/results.json (keep what is not rerun)"
    )
    parser.add_argument(
        "--fold", type=Path, help="fold this results.json (of another --out) into OUT/results.json, then report"
    )
    parser.add_argument("--report-only", action="store_true", help="re-render RESULTS.md and plots from results.json")
    args = parser.parse_args(argv)
    if args.fold:
        from benchmarks.report import write_report

        target = args.out / "results.json"
        if not args.fold.is_file() or not target.is_file():
            parser.error(f"--fold needs {args.fold} and {target} to exist")
        order = [p.name for p in suite("full", args.cache_dir)]
        folded = merge_results(json.loads(target.read_text()), json.loads(args.fold.read_text()), order)
        target.write_text(json.dumps(folded, indent=1, sort_keys=True, default=str))
        write_report(folded, args.out)
        print(f"folded {args.fold} into {target}; wrote {args.out / 'RESULTS.md'} and plots")
        return 0
    if args.report_only:
        from benchmarks.report import write_report

        path = args.out / "results.json"
        if not path.is_file():
            parser.error(f"{path} does not exist; run the benchmarks first")
        write_report(json.loads(path.read_text()), args.out)
        print(f"wrote {args.out / 'RESULTS.md'} and plots from {path}")
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    suite_name = args.suite or ("quick" if args.quick else "full")
    run_benchmarks(
        suite_name=suite_name,
        out=args.out,
        workers=max(1, args.workers),
        alphas=args.alphas,
        pair_filter=args.pairs.split(",") if args.pairs else None,
        run_filter=[int(x) for x in args.runs.split(",")] if args.runs else None,
        method_names=args.methods.split(",") if args.methods else None,
        cache_dir=args.cache_dir,
        update=args.update,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
