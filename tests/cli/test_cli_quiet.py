"""What ``raot-hf merge`` prints: stage lines and our own progress bars by
default, no transformers/datasets bars, the calibration data announced once, nothing under -q."""

import logging

import pytest
import torch
import transformers
from click.testing import CliRunner
from huggingface_hub import utils as hub_utils

from raot_hf.cli import main
from raot_hf.testing import tiny_model, tiny_text_dataset, tiny_tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("quiet")
    for name, seed in (("a", 0), ("b", 1)):
        tiny_model("bert", "sequence", dtype=torch.float32, seed=seed).save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    tiny_text_dataset(48).to_csv(root / "text.csv")
    return root


def _merge(pair, out, *flags):
    args = [*flags, "merge", str(pair / "a"), str(pair / "b"), "--calibration", str(pair / "text.csv")]
    res = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert res.exit_code == 0, (res.output, repr(res.exception))
    return res


def _state():
    package = logging.getLogger("raot_hf")
    return (
        package.level,
        list(package.handlers),
        transformers.utils.logging.get_verbosity(),
        transformers.utils.logging.is_progress_bar_enabled(),
        hub_utils.are_progress_bars_disabled(),
    )


def test_default_shows_stages_once_and_no_library_bars(pair, tmp_path):
    before = _state()
    res = _merge(pair, tmp_path / "out")
    lines = res.stderr.split("\n")  # a bar redraws itself with \r on one line
    assert not [line for line in lines if "Loading weights" in line or "Generating" in line], res.stderr
    assert sum("calibration data" in line for line in lines) == 1, res.stderr
    assert any(line.startswith("loading A (") for line in lines), res.stderr
    assert not [line for line in lines if line.startswith("INFO ")], res.stderr  # INFO needs -v
    if not before[-1]:  # our bars, unless the environment switched huggingface_hub's off
        assert sum("calibration (fit)" in line for line in lines) == 1, res.stderr
        # the gate, layer by layer: in the one sweep after the solve (gate, merge and correction together)
        assert sum("\rsweep (lsq):" in line for line in lines) == 1, res.stderr
    assert "transform" in res.stdout and f"wrote {tmp_path / 'out'}" in res.stdout
    assert _state() == before  # an in-process run leaves logging and bars as it found them


def test_quiet_prints_nothing_on_success(pair, tmp_path):
    before = _state()
    res = _merge(pair, tmp_path / "out", "-q")
    assert res.stdout == "" and res.stderr == ""
    assert (tmp_path / "out" / "config.json").is_file()
    assert _state() == before


def test_verbose_shows_info_records(pair, tmp_path):
    res = _merge(pair, tmp_path / "out", "-v")
    info = [line for line in res.stderr.splitlines() if line.startswith("INFO raot_hf.")]
    assert any("raot_hf.calibration.sources: calibration data" in line for line in info), res.stderr
    assert any("raot_hf.output" in line for line in info), res.stderr
    assert sum("calibration data:" in line for line in info) == 1, res.stderr
    assert "Loading weights" not in res.stderr
