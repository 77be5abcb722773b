"""head="b": A's merged trunk with B′'s head and B's label config, or a one-line refusal
before any weights load."""

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

from raot_hf import RaotMerger
from raot_hf.adapters import schema_for
from raot_hf.cli import main
from raot_hf.symmetry import load_transform, transform_model
from raot_hf.symmetry.io import TRANSFORM_NAME
from raot_hf.testing import (
    example_inputs,
    tiny_image_processor,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
)

FIVE_LABELS = {0: "anger", 1: "joy", 2: "fear", 3: "love", 4: "surprise"}


def _save(path, head="sequence", model_type="bert", *, seed=0, labels=None, **config):
    if labels is not None:
        config["num_labels"] = len(labels)
    model = tiny_model(model_type, head, dtype=torch.float32, seed=seed, **config)
    if labels is not None:
        model.config.id2label = dict(labels)
        model.config.label2id = {name: i for i, name in labels.items()}
    model.save_pretrained(path)
    (tiny_image_processor() if model_type == "vit" else tiny_tokenizer()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("head_b")
    _save(root / "a", seed=0)  # 3 labels LABEL_0..2
    tiny_text_dataset(64).to_csv(root / "text.csv")
    return root


@pytest.fixture
def weights_loaded(monkeypatch):
    """Records every parent whose weights are loaded (the real loader still runs)."""
    from raot_hf.stages import load as load_stage

    calls, real = [], load_stage.load_model
    monkeypatch.setattr(
        load_stage, "load_model", lambda source, label, **kw: calls.append(label) or real(source, label, **kw)
    )
    return calls


def _merge(*args):
    return CliRunner().invoke(main, ["-q", "merge", *map(str, args)])


def _b_prime(b_dir, out_dir):
    """B with the alignment written next to the merge applied: the B′ the merge used."""
    b = transformers.AutoModelForSequenceClassification.from_pretrained(b_dir).eval()
    if (out_dir / TRANSFORM_NAME).is_file():
        transform_model(b, schema_for(b), load_transform(out_dir / TRANSFORM_NAME))
    return b


def _reload(out_dir):
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(out_dir, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def test_head_b_with_more_labels_writes_b_head_and_label_space(pair_dir, tmp_path):
    b_dir = _save(tmp_path / "b", seed=1, labels=FIVE_LABELS, problem_type="single_label_classification")
    out = tmp_path / "out"
    res = _merge(pair_dir / "a", b_dir, "--calibration", pair_dir / "text.csv", "--head", "b", "--out", out)
    assert res.exit_code == 0, (res.output, repr(res.exception))
    merged, b_prime = _reload(out), _b_prime(b_dir, out)
    assert merged.config.num_labels == 5 and merged.num_labels == 5
    assert merged.config.id2label == FIVE_LABELS
    assert merged.config.label2id == {name: i for i, name in FIVE_LABELS.items()}
    assert merged.config.problem_type == "single_label_classification"
    for name in ("classifier.weight", "classifier.bias"):
        assert torch.equal(merged.get_parameter(name), b_prime.get_parameter(name)), name
    written = json.loads((out / "config.json").read_text())
    assert len(written["id2label"]) == 5
    with torch.no_grad():
        assert merged(**example_inputs(merged)).logits.shape[-1] == 5


def test_head_b_at_alpha_1_is_b_itself(pair_dir, tmp_path):
    """α = 1 takes B′'s trunk and head: the written model must compute B's function."""
    b_dir = _save(tmp_path / "b", seed=1, num_labels=4)
    out = tmp_path / "out"
    args = ("--calibration", pair_dir / "text.csv", "--head", "b", "--alpha", "1", "--out", out)
    res = _merge(pair_dir / "a", b_dir, *args)
    assert res.exit_code == 0, (res.output, repr(res.exception))
    merged = _reload(out)
    b = transformers.AutoModelForSequenceClassification.from_pretrained(b_dir).eval()
    inputs = example_inputs(b)
    with torch.no_grad():
        want, got = b(**inputs).logits, merged(**inputs).logits
    assert got.shape == want.shape == (3, 4)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_head_b_with_renamed_labels_takes_b_names(pair_dir, tmp_path):
    names = {0: "neg", 1: "neu", 2: "pos"}
    b_dir = _save(tmp_path / "b", seed=1, labels=names, problem_type="multi_label_classification")
    out = tmp_path / "out"
    res = _merge(pair_dir / "a", b_dir, "--calibration", pair_dir / "text.csv", "--head", "b", "--out", out)
    assert res.exit_code == 0, (res.output, repr(res.exception))
    merged, b_prime = _reload(out), _b_prime(b_dir, out)
    assert merged.config.id2label == names and merged.config.label2id == {"neg": 0, "neu": 1, "pos": 2}
    assert merged.config.problem_type == "multi_label_classification"
    assert torch.equal(merged.classifier.weight, b_prime.classifier.weight)


def test_head_a_keeps_a_label_space(pair_dir, tmp_path):
    b_dir = _save(tmp_path / "b", seed=1, labels=FIVE_LABELS)
    out = tmp_path / "out"
    res = _merge(pair_dir / "a", b_dir, "--calibration", pair_dir / "text.csv", "--head", "a", "--out", out)
    assert res.exit_code == 0, (res.output, repr(res.exception))
    merged = _reload(out)
    a = transformers.AutoModelForSequenceClassification.from_pretrained(pair_dir / "a")
    assert merged.config.id2label == a.config.id2label and merged.config.num_labels == 3
    assert torch.equal(merged.classifier.weight, a.classifier.weight)


def _assert_refused(res, weights_loaded, out, *needles):
    assert res.exit_code == 2, (res.output, repr(res.exception))
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), res.stderr
    assert all(needle in lines[0] for needle in needles), lines[0]
    assert weights_loaded == [] and not out.exists()


def test_head_b_with_another_head_class_is_refused_before_weights(pair_dir, tmp_path, weights_loaded):
    b_dir = _save(tmp_path / "b", "token", seed=1, num_labels=5)
    out = tmp_path / "out"
    res = _merge(pair_dir / "a", b_dir, "--calibration", pair_dir / "text.csv", "--head", "b", "--out", out)
    _assert_refused(res, weights_loaded, out, "BertForSequenceClassification", "BertForTokenClassification")


def test_head_average_of_label_spaces_is_refused_before_weights(pair_dir, tmp_path, weights_loaded):
    b_dir = _save(tmp_path / "b", seed=1, labels=FIVE_LABELS)
    out = tmp_path / "out"
    res = _merge(pair_dir / "a", b_dir, "--calibration", pair_dir / "text.csv", "--head", "average", "--out", out)
    _assert_refused(res, weights_loaded, out, "same label space", "--head b")


def test_vit_classifier_against_no_classifier_is_refused_before_weights(tmp_path, weights_loaded):
    a_dir = _save(tmp_path / "a", "image", "vit", seed=0)
    b_dir = _save(tmp_path / "b", "image", "vit", seed=1, num_labels=0)
    out = tmp_path / "out"
    res = _merge(a_dir, b_dir, "--alignment", "none", "--head", "b", "--out", out)
    _assert_refused(res, weights_loaded, out, "no classifier")


def test_deberta_head_b_brings_b_pooler_config(tmp_path):
    """DeBERTa's pooler is part of its head: with head="b" at α = 1 the output is B itself only
    if B's pooler activation comes with B's pooler and classifier tensors."""
    a_dir = _save(tmp_path / "a", model_type="deberta-v2", seed=0)
    b_dir = _save(tmp_path / "b", model_type="deberta-v2", seed=1, pooler_hidden_act="tanh", num_labels=2)
    merger = RaotMerger.from_pretrained(a_dir, b_dir, head="b", alpha=1.0)
    merger.merge(calibration=tiny_text_dataset(48)).save_pretrained(tmp_path / "out")
    merged = _reload(tmp_path / "out")
    b = transformers.AutoModelForSequenceClassification.from_pretrained(b_dir).eval()
    assert merged.config.pooler_hidden_act == "tanh" and merged.config.num_labels == 2
    inputs = example_inputs(b)
    with torch.no_grad():
        want, got = b(**inputs).logits, merged(**inputs).logits
    assert got.shape == want.shape == (3, 2)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
