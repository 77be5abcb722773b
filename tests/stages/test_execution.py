"""The execution mode is planned once, before any weights are read, for Python and the command line
alike (docs/design.md §7.3, §7.4): streamed, in memory or layer-wise give the same bytes, and every
mode refuses a checkpoint with a NaN in one line, writing nothing."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from raot_hf import RaotError, merge_checkpoints
from raot_hf.cli import main
from raot_hf.testing import clone, tiny_model, tiny_text_dataset, tiny_tokenizer

BAD = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A Llama and a perturbed copy, saved; B again with a NaN in one weight; calibration text."""
    root = tmp_path_factory.mktemp("pair")
    a = tiny_model("llama", "causal", dtype=torch.float32)
    b = clone(a)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    for name, model in (("a", a), ("b", b), ("nan", b)):
        model.save_pretrained(root / name)
        tiny_tokenizer(100).save_pretrained(root / name)
    weights = load_file(root / "nan" / "model.safetensors")
    weights[BAD][0, 0] = float("nan")
    save_file(weights, str(root / "nan" / "model.safetensors"), metadata={"format": "pt"})
    tiny_text_dataset(64, vocab_size=40).to_csv(root / "cal.csv")
    return root


MODES = {
    "streamed": ["--alignment", "none", "--merge-rule", "linear"],
    "in memory": ["--alignment", "none", "--no-stream"],
    "layer-wise": ["--alignment", "none", "--no-stream", "--offload", "always"],
    "aligned, in memory": ["--calibration", "{cal}"],
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_nan_is_refused_in_every_mode(pair, tmp_path, mode):
    args = [a.format(cal=pair / "cal.csv") for a in MODES[mode]]
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["-q", "merge", str(pair / "a"), str(pair / "nan"), *args, "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert f"model B has NaN/Inf in {BAD}" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_nan_in_the_base_is_refused_when_streamed(pair, tmp_path):
    with pytest.raises(RaotError, match=f"model base has NaN/Inf in {BAD}"):
        merge_checkpoints(pair / "a", pair / "b", base=pair / "nan", out=tmp_path / "o", alignment="none",
                          merge_rule="ties")  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_each_mode_reports_itself_and_writes_the_same_bytes(pair, tmp_path):
    outputs = {}
    for mode, extra in (("streamed", {}), ("in memory", {"stream": False}),
                        ("layer-wise", {"stream": False, "offload": "always"})):  # fmt: skip
        out, report = merge_checkpoints(pair / "a", pair / "b", out=tmp_path / mode, alignment="none",
                                        weights=[0.3, 0.7], **extra)  # fmt: skip
        assert report["execution"] == mode
        outputs[mode] = load_file(out / "model.safetensors")
    first = outputs["streamed"]
    for other in outputs.values():
        assert set(other) == set(first) and all(torch.equal(other[k], first[k]) for k in first)
