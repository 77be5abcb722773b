"""Identity affinity of RaOT's estimates per benchmark pair: the evidence behind the sibling
check's threshold (docs/design.md §5.4).

    python -m benchmarks.affinity --cache-dir benchmarks/.cache --pairs vit-siblings,vit-digits-d64 --runs 0

For each pair and run: calibrate and solve with the default options (no gate, no merge) and
print every estimate's affinity, the median and the smallest; models are built (or reused) from the cache.
"""

from __future__ import annotations

import argparse
import logging

from benchmarks.builders import build_model
from benchmarks.pairs import calibration_set, suite
from raot_hf import RaotMerger
from raot_hf.gate.lineage import detect_siblings


def pair_affinity(pair, run: int) -> dict:
    """Solve ``pair``'s run ``run`` and return the lineage evidence as a dict."""
    spec_a, spec_b = pair.runs()[run]
    merger = RaotMerger.from_pretrained(str(build_model(spec_a)), str(build_model(spec_b)), **pair.options)
    _, _, parts, _ = merger.calibrate_and_solve(calibration_set(pair))
    return detect_siblings(parts).to_dict()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", required=True, help="comma-separated pair names of the full suite")
    parser.add_argument("--runs", default="0", help="comma-separated run indices (default 0)")
    parser.add_argument("--cache-dir", help="zoo cache (default $RAOT_HF_CACHE or ~/.cache/raot_hf/zoo)")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    pairs = {p.name: p for p in suite("full", args.cache_dir)}
    for name in args.pairs.split(","):
        for run in (int(r) for r in args.runs.split(",")):
            e = pair_affinity(pairs[name], run)
            cells = " ".join(
                f"{a['transform']}{'' if a['layer'] is None else a['layer']}:{a['affinity']:.2f}"
                for a in e["estimates"]
            )
            largest = max(a["affinity"] for a in e["estimates"])
            print(
                f"{name} run {run}: median {e['median_affinity']:.3f} smallest {e['smallest_affinity']:.3f} "
                f"largest {largest:.3f} "
                f"siblings {e['siblings']} | {cells}",
                flush=True,
            )


if __name__ == "__main__":
    main()
