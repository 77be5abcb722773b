"""Calibration data loading, batching, sharding and fingerprinting (offline, tiny processors)."""

from __future__ import annotations

import json
import time

import datasets
import huggingface_hub.constants
import pytest
import torch
from PIL import Image
from transformers import BertTokenizerFast, ViTImageProcessorPil

from raot_hf.calibration import (
    CalibrationConfig,
    check_column,
    count_calibration_batches,
    dataset_fingerprint,
    detect_modality,
    is_heldout,
    iter_calibration_batches,
    load_calibration_dataset,
)
from raot_hf.errors import RaotError

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
SENTENCES = [
    "hello world",
    "the cat sat on the mat",
    "a dog ran",
    "the dog sat",
    "hello cat",
    "a mat",
    "the world ran on a dog and the cat sat on the mat",
    "dog",
    "cat world",
    "on the mat",
    "hello hello hello",
]


@pytest.fixture(autouse=True)
def _isolated_datasets_cache(tmp_path, monkeypatch):
    """Keep ``datasets``' build cache inside the test's tmp dir and the Hub offline."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    return BertTokenizerFast(vocab=vocab)


@pytest.fixture(scope="module")
def image_processor():
    return ViTImageProcessorPil(size={"height": 8, "width": 8})


def text_dataset(sentences=SENTENCES):
    return datasets.Dataset.from_dict({"label": list(range(len(sentences))), "sentence": list(sentences)})


def write_images(folder, count, mode="RGB"):
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        color = (i * 40 % 256, 255 - i * 30 % 256, 7 * i % 256)
        image = Image.new("RGB", (5 + i, 6), color).convert(mode)
        path = folder / f"img_{i:02d}.png"
        image.save(path)
        paths.append(path)
    return paths


def config(**kwargs):
    return CalibrationConfig(**{"num_samples": 1000, **kwargs})


# ------------------------------------------------------------------------------------ config


def test_config_round_trips_through_json():
    original = CalibrationConfig(
        source="glue",
        config_name="sst2",
        split="validation[:50]",
        column="sentence",
        num_samples=64,
        max_length=32,
        batch_size=8,
        seed=3,
        heldout_every=5,
    )
    restored = CalibrationConfig.from_dict(json.loads(json.dumps(original.to_dict())))
    assert restored == original


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_samples": 0},
        {"batch_size": -1},
        {"max_length": 2.5},
        {"seed": -1},
        {"heldout_every": 1},
        {"batch_size": True},
        {"split": ""},
        {"column": ""},
    ],
)
def test_config_rejects_bad_values_in_one_line(kwargs):
    with pytest.raises(RaotError) as info:
        CalibrationConfig(**kwargs)
    assert "\n" not in str(info.value)


def test_config_from_dict_rejects_unknown_keys():
    with pytest.raises(RaotError, match="num_sample"):
        CalibrationConfig.from_dict({"num_sample": 4})


# ----------------------------------------------------------------------------------- loading


def test_in_memory_dataset_is_sampled_deterministically():
    base = text_dataset()
    first = load_calibration_dataset(base, config=CalibrationConfig(num_samples=5, seed=1))
    second = load_calibration_dataset(base, config=CalibrationConfig(num_samples=5, seed=1))
    other_seed = load_calibration_dataset(base, config=CalibrationConfig(num_samples=5, seed=2))
    assert len(first) == 5
    assert first["sentence"] == second["sentence"]
    assert first["sentence"] != other_seed["sentence"]
    assert set(first["sentence"]) <= set(SENTENCES)
    everything = load_calibration_dataset(base, config=CalibrationConfig(num_samples=100))
    assert sorted(everything["sentence"]) == sorted(SENTENCES)


def _write_csv(path):
    lines = ["idx,text"] + [f'{i},"{s}"' for i, s in enumerate(SENTENCES)]
    path.write_text("\n".join(lines) + "\n")


def _write_jsonl(path):
    path.write_text("".join(json.dumps({"idx": i, "text": s}) + "\n" for i, s in enumerate(SENTENCES)))


def _write_parquet(path):
    datasets.Dataset.from_dict({"idx": list(range(len(SENTENCES))), "text": SENTENCES}).to_parquet(str(path))


@pytest.mark.parametrize(
    "filename, writer",
    [("data.csv", _write_csv), ("data.jsonl", _write_jsonl), ("data.parquet", _write_parquet)],
)
def test_local_files_load_by_extension(tmp_path, filename, writer):
    path = tmp_path / filename
    writer(path)
    loaded = load_calibration_dataset(config(source=str(path)))
    assert sorted(loaded["text"]) == sorted(SENTENCES)
    for idx, text in zip(loaded["idx"], loaded["text"]):
        assert SENTENCES[idx] == text


def test_json_array_file_and_named_split_slicing(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"text": s} for s in SENTENCES]))
    loaded = load_calibration_dataset(config(source=str(path), split="validation[:4]"))
    assert sorted(loaded["text"]) == sorted(SENTENCES[:4])


def test_save_to_disk_directory_and_dataset_dict(tmp_path):
    text_dataset().save_to_disk(str(tmp_path / "single"))
    loaded = load_calibration_dataset(config(source=str(tmp_path / "single")))
    assert sorted(loaded["sentence"]) == sorted(SENTENCES)

    datasets.DatasetDict({"train": text_dataset(), "test": text_dataset(SENTENCES[:3])}).save_to_disk(
        str(tmp_path / "dict")
    )
    test_split = load_calibration_dataset(config(source=str(tmp_path / "dict"), split="test"))
    assert sorted(test_split["sentence"]) == sorted(SENTENCES[:3])
    with pytest.raises(RaotError, match="splits: train, test"):
        load_calibration_dataset(config(source=str(tmp_path / "dict"), split="validation"))


def test_image_folder_loads_and_batches(tmp_path, image_processor):
    write_images(tmp_path / "images", 5)
    dataset = load_calibration_dataset(config(source=str(tmp_path / "images")))
    assert len(dataset) == 5
    assert check_column(dataset, None, "image") == "image"
    batches = list(iter_calibration_batches(dataset, image_processor, config(batch_size=2)))
    assert [len(b) for b in batches] == [2, 2, 1]
    for batch in batches:
        assert set(batch.inputs) == {"pixel_values"}
        assert batch.inputs["pixel_values"].shape == (len(batch), 3, 8, 8)
        assert batch.token_mask is None
    assert torch.cat([b.example_ids for b in batches]).tolist() == [0, 1, 2, 3, 4]


def test_images_are_converted_to_the_processor_mode(tmp_path, image_processor):
    paths = write_images(tmp_path / "gray", 3, mode="L") + write_images(tmp_path / "rgba", 2, mode="RGBA")
    dataset = datasets.Dataset.from_dict({"img": [str(p) for p in paths]}).cast_column("img", datasets.Image())
    dataset = load_calibration_dataset(dataset, config=config())
    (batch,) = iter_calibration_batches(dataset, image_processor, config(batch_size=8))
    assert batch.inputs["pixel_values"].shape == (5, 3, 8, 8)
    gray = ViTImageProcessorPil(size={"height": 8, "width": 8}, image_mean=[0.5], image_std=[0.5])
    (gray_batch,) = iter_calibration_batches(dataset, gray, config(batch_size=8))
    assert gray_batch.inputs["pixel_values"].shape[1] == 1


def test_missing_local_path_fails_fast_without_the_hub(tmp_path):
    for source in [str(tmp_path / "missing"), str(tmp_path / "missing.csv"), "./nope/data.jsonl", "a/b/c"]:
        started = time.monotonic()
        with pytest.raises(RaotError, match="not found") as info:
            load_calibration_dataset(config(source=source))
        assert time.monotonic() - started < 5
        assert "\n" not in str(info.value)


def test_unreachable_hub_id_is_a_clean_error():
    started = time.monotonic()
    with pytest.raises(RaotError, match="could not load calibration data 'no-such-org/no-such-data'") as info:
        load_calibration_dataset(config(source="no-such-org/no-such-data"))
    assert time.monotonic() - started < 30
    assert "\n" not in str(info.value)


def test_empty_and_missing_column_and_unsupported_file_errors(tmp_path):
    with pytest.raises(RaotError, match="no rows"):
        load_calibration_dataset(text_dataset([]), config=config())
    with pytest.raises(RaotError, match=r"column 'txt' not in .*columns: label, sentence"):
        load_calibration_dataset(text_dataset(), config=config(column="txt"))
    with pytest.raises(RaotError, match="at least 2"):
        load_calibration_dataset(text_dataset(), config=config(num_samples=1))
    odd = tmp_path / "data.xlsx"
    odd.write_bytes(b"x")
    with pytest.raises(RaotError, match="unsupported extension"):
        load_calibration_dataset(config(source=str(odd)))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(RaotError, match="holds no dataset"):
        load_calibration_dataset(config(source=str(tmp_path / "nothing")))
    with pytest.raises(RaotError, match="no calibration data given"):
        load_calibration_dataset(CalibrationConfig())


# --------------------------------------------------------------------- modality and columns


def test_detect_modality(tokenizer, image_processor):
    assert detect_modality(tokenizer) == "text"
    assert detect_modality(image_processor) == "image"
    with pytest.raises(RaotError, match="unsupported processor"):
        detect_modality(object())


def test_column_auto_detect_and_modality_mismatch(tmp_path):
    paths = write_images(tmp_path / "imgs", 2)
    mixed = datasets.Dataset.from_dict(
        {"id": [0, 1], "body": ["x y", "z"], "content": ["a", "b"], "picture": [str(p) for p in paths]}
    ).cast_column("picture", datasets.Image())
    assert check_column(mixed, None, "text") == "content"  # preferred name beats the first string column
    assert check_column(mixed, None, "image") == "picture"
    assert check_column(mixed.remove_columns("content"), None, "text") == "body"
    assert check_column(mixed, "body", "text") == "body"
    with pytest.raises(RaotError, match=r"column 'picture' holds images but model A takes text; pass --column"):
        check_column(mixed, "picture", "text", model_label="model A")
    with pytest.raises(RaotError, match="column 'body' holds text but the model takes images"):
        check_column(mixed, "body", "image")
    with pytest.raises(RaotError, match="column 'id' holds int64 values"):
        check_column(mixed, "id", "text")
    with pytest.raises(RaotError, match="no image column"):
        check_column(text_dataset(), None, "image")
    with pytest.raises(RaotError, match="not in the calibration data"):
        check_column(mixed, "nope", "text")


# ---------------------------------------------------------------------------------- batching


def test_text_batches_are_model_ready(tokenizer):
    dataset = load_calibration_dataset(text_dataset(), config=config())
    cfg = config(batch_size=4, max_length=6)
    batches = list(iter_calibration_batches(dataset, tokenizer, cfg))
    assert len(batches) == count_calibration_batches(dataset, cfg) == 3
    for batch in batches:
        assert set(batch.inputs) == {"input_ids", "attention_mask", "token_type_ids"}
        ids = batch.inputs["input_ids"]
        assert ids.shape[0] == len(batch) and ids.shape[1] <= 6
        assert batch.token_mask.dtype == torch.bool
        assert torch.equal(batch.token_mask, batch.inputs["attention_mask"].bool())
        assert torch.equal(ids[~batch.token_mask], torch.zeros_like(ids[~batch.token_mask]))  # [PAD] id
        rows = dataset[batch.example_ids.tolist()]["sentence"]
        expected = tokenizer(rows, padding=True, truncation=True, max_length=6, return_tensors="pt")
        assert torch.equal(ids, expected["input_ids"])
    assert any((~b.token_mask).any() for b in batches)  # padding really happened and is masked
    again = list(iter_calibration_batches(dataset, tokenizer, cfg))
    assert all(torch.equal(a.inputs["input_ids"], b.inputs["input_ids"]) for a, b in zip(batches, again))


def test_shards_partition_the_examples_exactly(tokenizer):
    dataset = load_calibration_dataset(text_dataset(), config=config())
    cfg = config(batch_size=2, heldout_every=3)
    seen = []
    for rank in range(3):
        rank_ids = [
            i
            for batch in iter_calibration_batches(dataset, tokenizer, cfg, rank=rank, world_size=3)
            for i in batch.example_ids.tolist()
        ]
        assert rank_ids == list(range(rank, len(dataset), 3))
        seen.extend(rank_ids)
    assert len(seen) == len(set(seen)) == len(dataset)
    assert sorted(seen) == list(range(len(dataset)))
    with pytest.raises(RaotError, match="rank"):
        next(iter_calibration_batches(dataset, tokenizer, cfg, rank=3, world_size=3))


def test_heldout_flag_follows_the_rule(tokenizer):
    dataset = load_calibration_dataset(text_dataset(), config=config())
    for every in (2, 3, 4):
        cfg = config(batch_size=3, heldout_every=every)
        for rank in range(2):
            for batch in iter_calibration_batches(dataset, tokenizer, cfg, rank=rank, world_size=2):
                assert batch.heldout.dtype == torch.bool
                assert batch.heldout.tolist() == [i % every == 0 for i in batch.example_ids.tolist()]
    assert is_heldout([0, 1, 4, 7, 8], 4).tolist() == [True, False, True, False, True]


def test_non_text_value_in_text_column_is_reported(tokenizer):
    dataset = datasets.Dataset.from_dict({"text": ["a dog", None, "the cat"]})
    with pytest.raises(RaotError, match="row 1 of calibration column 'text'"):
        list(iter_calibration_batches(dataset, tokenizer, config()))


# ------------------------------------------------------------------------------ provenance


def test_text_fingerprint_is_stable_and_content_sensitive():
    cfg = CalibrationConfig(num_samples=6, seed=4)
    first = dataset_fingerprint(load_calibration_dataset(text_dataset(), config=cfg), "sentence")
    second = dataset_fingerprint(load_calibration_dataset(text_dataset(), config=cfg), "sentence")
    assert first["sha256"] == second["sha256"] and first["num_examples"] == 6 and first["column"] == "sentence"
    assert first["datasets_fingerprint"] is not None
    changed = list(SENTENCES)
    changed[load_calibration_dataset(text_dataset(), config=cfg)["label"][2]] += "!"
    third = dataset_fingerprint(load_calibration_dataset(text_dataset(changed), config=cfg), "sentence")
    assert third["sha256"] != first["sha256"]
    reseeded = dataset_fingerprint(load_calibration_dataset(text_dataset(), config=config(seed=9)), "sentence")
    assert reseeded["sha256"] != first["sha256"]  # same rows, different order: ids and split differ


def test_image_fingerprint_follows_pixels(tmp_path):
    paths = write_images(tmp_path / "images", 4)
    cfg = config(source=str(tmp_path / "images"))
    first = dataset_fingerprint(load_calibration_dataset(cfg), "image")
    assert first == dataset_fingerprint(load_calibration_dataset(cfg), "image")
    Image.new("RGB", (5, 6), (1, 2, 3)).save(paths[1])
    second = dataset_fingerprint(load_calibration_dataset(cfg), "image")
    assert second["sha256"] != first["sha256"]
    assert second["num_examples"] == 4


def test_tokenizer_without_pad_token_pads_with_eos_on_the_right(tokenizer):
    """GPT-2 / Llama tokenizers have no pad token: calibration pads a private copy with the
    end-of-text token on the right, so every real token keeps the id and position it has alone,
    and the caller's tokenizer (saved with the merge) is left without a pad token."""
    import copy

    gpt_like = copy.deepcopy(tokenizer)
    gpt_like.eos_token = "[SEP]"
    gpt_like.pad_token = None
    gpt_like.padding_side = "left"
    data = load_calibration_dataset(text_dataset(), config=config())
    cfg = config(batch_size=4, max_length=16)
    batches = list(iter_calibration_batches(data, gpt_like, cfg))
    assert gpt_like.pad_token is None and gpt_like.padding_side == "left"
    texts = data["sentence"]
    for batch in batches:
        ids, mask = batch.inputs["input_ids"], batch.token_mask
        for row, example in enumerate(batch.example_ids.tolist()):
            alone = gpt_like(texts[example], truncation=True, max_length=16)["input_ids"]
            n = len(alone)
            assert int(mask[row].sum()) == n and bool(mask[row, :n].all())  # right padding
            assert ids[row, :n].tolist() == alone
            assert set(ids[row, n:].tolist()) <= {gpt_like.eos_token_id}
    no_eos = copy.deepcopy(gpt_like)
    no_eos.eos_token = None
    with pytest.raises(RaotError, match="neither a pad nor an end-of-text token"):
        list(iter_calibration_batches(data, no_eos, cfg))


def test_texts_are_tokenized_once_and_padded_alike():
    """Every pass of a merge shares one cache of tokens per example: a second pass tokenizes
    nothing, and the batches equal a direct ``tokenizer(texts, padding=True)``."""
    from unittest import mock

    from raot_hf.calibration import CalibrationConfig, iter_calibration_batches
    from raot_hf.testing import tiny_text_dataset, tiny_tokenizer

    tok, data, cfg = tiny_tokenizer(), tiny_text_dataset(40), CalibrationConfig(batch_size=8)
    cache: dict = {}
    first = list(iter_calibration_batches(data, tok, cfg, encodings=cache))
    assert sorted(cache) == list(range(40))
    with mock.patch.object(type(tok), "__call__", side_effect=AssertionError("tokenized twice")):
        again = list(iter_calibration_batches(data, tok, cfg, encodings=cache, split="heldout"))
    assert again and all(len(b) for b in again)
    direct = tok(list(data.select(first[0].example_ids.tolist())["text"]), padding=True, truncation=True,
                 max_length=128, return_tensors="pt")  # fmt: skip
    assert all(torch.equal(direct[k], first[0].inputs[k]) for k in direct)
