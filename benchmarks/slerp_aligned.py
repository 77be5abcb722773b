"""SLERP of a trained-like tiny BERT and a scrambled copy of it (the same function in another
basis), with and without alignment: the merged model's relative output deviation from A.

    python -m benchmarks.slerp_aligned
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import transformers
from click.testing import CliRunner

from raot_hf import scramble
from raot_hf.cli import main
from raot_hf.symmetry.equivalence import example_inputs, output_deviation
from raot_hf.testing import clone, tiny_model, tiny_text_dataset, tiny_tokenizer, trained_like


def run() -> dict[str, float]:
    """The deviation of each merge (``none``: mergekit's SLERP as stored; ``aligned``: SLERP of A and B′)."""
    a = trained_like(tiny_model("bert", "sequence", hidden_size=32, num_heads=4, num_layers=4, intermediate_size=80))
    a = a.float()
    root = Path(tempfile.mkdtemp())
    b = clone(a)
    scramble(b, seed=1)  # in place: B computes what A computes, in another basis
    for name, model in (("a", a), ("b", b)):
        model.save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    tiny_text_dataset(128).to_csv(root / "cal.csv")
    args = ["-q", "merge", str(root / "a"), str(root / "b"), "--merge-rule", "slerp", "--t", "0.5"]
    runs = {"none": ["--alignment", "none"], "aligned": ["--calibration", str(root / "cal.csv")]}
    out = {}
    for label, extra in runs.items():
        res = CliRunner().invoke(main, [*args, *extra, "--out", str(root / label)])
        assert res.exit_code == 0, res.output
        merged = transformers.AutoModelForSequenceClassification.from_pretrained(root / label)
        out[label] = float(output_deviation(a, merged, example_inputs(a), relative=True))
    return out


if __name__ == "__main__":
    for label, deviation in run().items():
        print(f"slerp t=0.5, alignment {label}: relative output deviation from A {deviation:.4g}")
