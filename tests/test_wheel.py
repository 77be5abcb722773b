"""The built wheel is the library: it carries the model-card template of ``model_cards/`` and a
merge run from the installed wheel (not this checkout) writes its card from that template."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from raot_hf import supported_model_types

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "model_cards" / "raot_merge.md"

MERGE_FROM_WHEEL = r"""
import sys
from pathlib import Path
import raot_hf
assert Path(raot_hf.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), raot_hf.__file__
from raot_hf import RaotMerger, supported_model_types
from raot_hf.testing import tiny_model, tiny_tokenizer
assert len(supported_model_types()) == int(sys.argv[3]), supported_model_types()
a, b = tiny_model("bert", "sequence", seed=0), tiny_model("bert", "sequence", seed=1)
result = RaotMerger.from_models(a, b, preprocessor=tiny_tokenizer(), alignment="none").merge()
result.save_pretrained(sys.argv[2])
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = out.glob("raot_hf-*.whl")
    return path


def test_wheel_ships_the_model_card_template(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert "raot_hf/templates/raot_merge.md" in names, sorted(n for n in names if "template" in n or ".md" in n)
        assert zf.read("raot_hf/templates/raot_merge.md").decode() == TEMPLATE.read_text(encoding="utf-8")
        assert "raot_hf/merger.py" in names
        # every family's spec ships as package data, and the wheel's registry reads them all
        specs = sorted((ROOT / "raot_hf" / "adapters" / "families").glob("*.json"))
        assert specs and all(f"raot_hf/adapters/families/{p.name}" in names for p in specs)
        assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_merge_from_the_installed_wheel_writes_the_template_card(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    out = tmp_path / "merged"
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", MERGE_FROM_WHEEL, str(site), str(out), str(len(supported_model_types()))],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    card = (out / "README.md").read_text(encoding="utf-8")
    # headings of the template (the built-in fallback has none of these beyond "Method")
    headings = [line for line in TEMPLATE.read_text(encoding="utf-8").splitlines() if line.startswith("## ")]
    assert len(headings) >= 3
    from raot_hf.outputs.card import _FALLBACK_TEMPLATE

    assert any(h not in _FALLBACK_TEMPLATE for h in headings)
    for heading in headings:
        assert heading in card, heading
