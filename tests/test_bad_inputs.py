"""User mistakes get a one-line RaotError before heavy work (issue: bad inputs and faults)."""

import json

import pytest
import torch
from click.testing import CliRunner

from raot_hf import RaotError, RaotMerger
from raot_hf.cli import main
from raot_hf.testing import tiny_model, tiny_tokenizer


@pytest.fixture
def saved_pair(tmp_path):
    for name, seed in (("a", 0), ("b", 1)):
        model = tiny_model("bert", "sequence", dtype=torch.float32, seed=seed)
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    return tmp_path / "a", tmp_path / "b"


def test_pickle_checkpoint_refused_unless_allowed(saved_pair):
    a, b = saved_pair
    state = {k: v for k, v in tiny_model("bert", "sequence", dtype=torch.float32, seed=1).state_dict().items()}
    (b / "model.safetensors").unlink()
    torch.save(state, b / "pytorch_model.bin")
    with pytest.raises(RaotError, match="pickle.*--allow-pickle"):
        RaotMerger.from_pretrained(a, b, alignment="none")


def test_missing_shard_and_bad_index(saved_pair):
    a, b = saved_pair
    (b / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(RaotError, match="not a valid index"):
        RaotMerger.from_pretrained(a, b, alignment="none")
    (b / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(RaotError, match="missing"):
        RaotMerger.from_pretrained(a, b, alignment="none")


def test_truncated_safetensors(saved_pair):
    a, b = saved_pair
    data = (b / "model.safetensors").read_bytes()
    (b / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(RaotError, match="model B"):
        RaotMerger.from_pretrained(a, b, alignment="none")


def test_nan_weights_refused(saved_pair, tmp_path):
    a, _ = saved_pair
    model = tiny_model("bert", "sequence", dtype=torch.float32, seed=1)
    with torch.no_grad():
        model.bert.encoder.layer[0].output.dense.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    tiny_tokenizer().save_pretrained(tmp_path / "nan")
    with pytest.raises(RaotError, match="NaN/Inf"):
        RaotMerger.from_pretrained(a, tmp_path / "nan", alignment="none")


def test_cli_errors_are_one_line_exit_2(saved_pair, tmp_path):
    a, b = saved_pair
    runner = CliRunner()
    res = runner.invoke(main, ["merge", str(a), str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert res.stderr.strip().startswith("Error:") and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    res = runner.invoke(main, ["merge", str(a), str(b), "--alpha", "3", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "alpha" in res.stderr
    res = runner.invoke(main, ["merge", str(a), str(b), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "calibration" in res.stderr
    assert not (tmp_path / "o").exists()


def test_head_average_needs_same_label_space(tmp_path):
    a = tiny_model("bert", "sequence", dtype=torch.float32)
    b = tiny_model("bert", "sequence", dtype=torch.float32, num_labels=5)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    with pytest.raises(RaotError, match="same label space"):
        RaotMerger.from_pretrained(tmp_path / "a", tmp_path / "b", head="average")
