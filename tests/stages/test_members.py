"""Merges of more than two models (docs/design.md §6.9): every model aligned to one reference and
gated on its own, N-ary rules as mergekit defines them, merge files, the central reference."""

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

from raot_hf import RaotError, RaotMerger, scramble
from raot_hf.adapters import is_decoder
from raot_hf.cli import main
from raot_hf.merging import merge_dare_ties, merge_linear, merge_task_arithmetic, merge_ties
from raot_hf.merging.base_rules import _tensor_seed
from raot_hf.testing import (
    architectures,
    clone,
    example_inputs,
    output_deviation,
    tiny_architecture,
    tiny_data,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
    trained_like,
)

VOCAB = 100
ARCHS = architectures()


def _trained_like(model_type):
    shape = dict(hidden_size=32, num_heads=4, num_layers=4, intermediate_size=80)
    head = tiny_architecture(model_type).task_head
    if is_decoder(model_type):
        model = tiny_model(model_type, head, vocab_size=VOCAB, num_kv_heads=2, **shape)
        return trained_like(model).float(), *tiny_data(model_type, 192, vocab_size=VOCAB)
    return trained_like(tiny_model(model_type, head, **shape)).float(), *tiny_data(model_type, 128)


# ----------------------------------------------------------------------------- the spine, with three models


@pytest.mark.parametrize("model_type", architectures(experts=None))  # mixtures of experts too (§10)
def test_three_scrambles_of_one_model_merge_back_to_it(model_type):
    """merge(A, s₁(A), s₂(A)) = A: each scramble is inverted on its own (whole group, scales included)."""
    a, pre, data = _trained_like(model_type)
    b, c = clone(a), clone(a)
    scramble(b, seed=1)
    scramble(c, seed=2)
    reference = clone(a)
    result = RaotMerger.from_models(a, b, c, preprocessor=pre).merge(calibration=data)
    assert output_deviation(reference, result.model, example_inputs(reference), relative=True) <= 1e-5
    assert [m["model"] for m in result.report["models"]] == [1, 2, 3] and result.report["models"][0][
        "alignment"
    ] is None
    records = [m["alignment"] for m in result.report["models"][1:]]
    for record in records:  # every transform of every model applied, each checked exact
        assert all(d["applied"] for d in record["decisions"]) and record["applied_exact"]
        assert all(check["passed"] for check in record["checks"])
    assert [m["role"] for m in result.report["models"]] == ["reference", "aligned", "aligned"]


def test_transforms_of_every_model_are_written(tmp_path):
    from raot_hf.symmetry import load_transform

    a, pre, data = _trained_like("bert")
    b, c = clone(a), clone(a)
    scramble(b, seed=1)
    scramble(c, seed=2)
    result = RaotMerger.from_models(a, b, c, preprocessor=pre).merge(calibration=data)
    out = result.save_pretrained(tmp_path / "m")
    assert (out / "raot_transform.safetensors").is_file() and (out / "raot_transform.model3.safetensors").is_file()
    assert len(load_transform(out / "raot_transform.model3.safetensors")) == len(result.more_transforms[
        "raot_transform.model3.safetensors"])  # fmt: skip
    card = (out / "README.md").read_text()
    assert "| model 3 (aligned to A) |" in card and "(model 3)" in card
    report = json.loads((out / "raot_report.json").read_text())
    assert report["applied_transform"]["files"] == ["raot_transform.safetensors", "raot_transform.model3.safetensors"]


# ----------------------------------------------------------------------------- N-ary rules by hand


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


BASE = {"w": _t(0.0, 0.0, 0.0, 0.0, 1.0)}
# task vectors: τ₁ = (3, −1, 0.5, 2, 0), τ₂ = (−2, −1, 1, −4, 1), τ₃ = (1, 2, −0.5, 1, −3)
SIBLINGS = [
    {"w": _t(3.0, -1.0, 0.5, 2.0, 1.0)},
    {"w": _t(-2.0, -1.0, 1.0, -4.0, 2.0)},
    {"w": _t(1.0, 2.0, -0.5, 1.0, -2.0)},
]
WEIGHTS = [0.5, 0.3, 0.2]


def test_task_arithmetic_of_three_is_base_plus_lambda_weighted_sum():
    merged = merge_task_arithmetic(SIBLINGS, WEIGHTS, BASE, scale=0.8)["w"]
    tau = [(3, -1, 0.5, 2, 0), (-2, -1, 1, -4, 1), (1, 2, -0.5, 1, -3)]
    expected = [b + 0.8 * sum(w * t[i] for w, t in zip(WEIGHTS, tau)) for i, b in enumerate((0, 0, 0, 0, 1))]
    torch.testing.assert_close(merged, _t(*expected), rtol=0, atol=1e-14)


def test_ties_of_three_follows_mergekit_by_hand():
    # int(0.6·5) = 3 entries of each task vector kept, by magnitude (no ties at the cut)
    siblings = [
        {"w": _t(3.0, -1.0, 0.5, 2.0, 1.0)},  # τ₁ = (3, −1, .5, 2, 0)   → keep 3, 2, −1
        {"w": _t(-2.0, -1.5, 1.0, -4.0, 1.25)},  # τ₂ = (−2, −1.5, 1, −4, .25) → keep −4, −2, −1.5
        {"w": _t(1.0, 2.0, -0.5, 1.5, -2.0)},  # τ₃ = (1, 2, −.5, 1.5, −3) → keep −3, 2, 1.5
    ]
    merged = merge_ties(siblings, WEIGHTS, BASE, density=0.6, scale=1.0)["w"]
    trimmed = [(3, -1, 0, 2, 0), (-2, -1.5, 0, -4, 0), (0, 2, 0, 1.5, -3)]
    expected = []
    for i in range(5):
        mass = sum(w * t[i] for w, t in zip(WEIGHTS, trimmed))
        sign = 1.0 if mass >= 0 else -1.0
        agree = [(w, t[i]) for w, t in zip(WEIGHTS, trimmed) if t[i] != 0 and (t[i] > 0) == (sign > 0)]
        divisor = sum(w for w, _ in agree) or 1.0
        expected.append(BASE["w"][i].item() + sum(w * v for w, v in agree) / divisor)
    # entry 0: mass 1.5 − 0.6 = 0.9 > 0 → only τ₁ agrees → 3; entry 3: 1 − 1.2 + 0.3 = 0.1 → τ₁, τ₃ agree
    assert expected[0] == 3.0 and expected[3] == pytest.approx((0.5 * 2 + 0.2 * 1.5) / 0.7)
    torch.testing.assert_close(merged, _t(*expected), rtol=0, atol=1e-14)


def test_dare_ties_of_three_follows_mergekit_by_hand():
    density, seed = 0.5, 7
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(40, generator=g, dtype=torch.float64)}
    siblings = [{"w": base["w"] + torch.randn(40, generator=g, dtype=torch.float64)} for _ in range(3)]
    merged = merge_dare_ties(siblings, WEIGHTS, base, density=density, scale=1.5, seed=seed)["w"]
    kept = []
    for i, s in enumerate(siblings):  # the documented mask: keep with probability density, L1 rescaled
        tau = (s["w"] - base["w"]).tolist()
        gen = torch.Generator().manual_seed(_tensor_seed(seed, "w", f"model{i}"))
        keep = (torch.rand(40, generator=gen, dtype=torch.float64) < density).tolist()
        dropped = [t if k else 0.0 for t, k in zip(tau, keep)]
        factor = sum(abs(t) for t in tau) / sum(abs(t) for t in dropped)
        kept.append([factor * t for t in dropped])
    expected = []
    for j in range(40):
        mass = sum(w * t[j] for w, t in zip(WEIGHTS, kept))
        sign = 1.0 if mass >= 0 else -1.0
        total = sum(w * t[j] for w, t in zip(WEIGHTS, kept) if t[j] != 0 and (t[j] > 0) == (sign > 0))
        expected.append(base["w"][j].item() + 1.5 * total)  # not normalised
    torch.testing.assert_close(merged, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    masks = [[t[j] != 0 for j in range(40)] for t in kept]
    assert masks[0] != masks[1] != masks[2]


def test_linear_of_three_is_the_normalised_weighted_mean_and_exact_at_one_model():
    states = [{"w": _t(1.0, 2.0)}, {"w": _t(3.0, -2.0)}, {"w": _t(5.0, 0.0)}]
    merged = merge_linear(states, [2, 1, 1])["w"]
    torch.testing.assert_close(merged, _t((2 + 3 + 5) / 4, (4 - 2) / 4), rtol=0, atol=1e-15)
    only = merge_linear(states, [0, 0, 3])["w"]
    assert torch.equal(only, states[2]["w"])
    with pytest.raises(RaotError, match="one weight per model"):
        merge_linear(states, [1, 1])


# ----------------------------------------------------------------------------- siblings through the merger


@pytest.fixture(scope="module")
def three_siblings():
    """A base and three fine-tunes of it (small drifts of every weight)."""
    base = tiny_model("bert", "sequence", dtype=torch.float32, hidden_size=32, num_heads=4, intermediate_size=48)
    out = []
    for seed in (1, 2, 3):
        model = clone(base)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=g))
        out.append(model)
    return base, out


@pytest.mark.parametrize("rule", ["task_arithmetic", "ties", "dare_ties"])
def test_three_siblings_are_detected_and_merged_by_the_rule(three_siblings, rule):
    base, siblings = three_siblings
    models = [clone(m) for m in siblings]
    states = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
    merger = RaotMerger.from_models(
        *models, preprocessor=tiny_tokenizer(), base_model=base, merge_rule=rule, weights=WEIGHTS, density=0.5
    )
    result = merger.merge(calibration=tiny_text_dataset(96))
    assert all(m["alignment"]["shares_basis"] for m in result.report["models"][1:]) and result.report["shares_basis"]
    assert not any(d["applied"] for d in result.report["decisions"])
    fn = {"task_arithmetic": merge_task_arithmetic, "ties": merge_ties, "dare_ties": merge_dare_ties}[rule]
    head = {"classifier.weight", "classifier.bias"}
    trunk = [{k: v for k, v in s.items() if k not in head} for s in states]
    base_state = {k: v for k, v in base.state_dict().items() if k not in head}
    options = {} if rule == "task_arithmetic" else {"density": 0.5}
    expected = fn(trunk, WEIGHTS, base_state, **options)
    merged = result.model.state_dict()
    assert all(torch.equal(merged[k], expected[k]) for k in expected)
    assert torch.equal(merged["classifier.weight"], states[0]["classifier.weight"])  # the reference's head


# ----------------------------------------------------------------------------- the reference


def test_central_reference_is_the_model_between_the_others():
    """Models 1 and 3 drift from model 2 in independent directions: model 2 is the centre."""
    center = trained_like(tiny_model("bert", "sequence", hidden_size=32, num_heads=4, num_layers=2)).float()
    outer = []
    for seed in (5, 6):
        model = clone(center)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
        outer.append(model)
    merger = RaotMerger.from_models(
        outer[0], center, outer[1], preprocessor=tiny_tokenizer(), reference="central", alignment="none"
    )
    result = merger.merge(calibration=tiny_text_dataset(64))
    assert result.report["reference"]["chosen"] == 2
    cka = result.report["reference"]["mean_cka"]
    assert cka[1] > max(cka[0], cka[2])
    assert result.model is center  # the merge is written into the reference's module


# ----------------------------------------------------------------------------- refusals


def test_group_refusals_name_the_fix():
    models = [tiny_model("bert", "sequence", dtype=torch.float32) for _ in range(3)]
    with pytest.raises(RaotError, match="one weight per model"):
        RaotMerger.from_models(*models, weights=[0.5, 0.5])
    with pytest.raises(RaotError, match="--head b names one of two models"):
        RaotMerger.from_models(*models, head="b")


def test_two_model_weights_set_alpha():
    a, b = (tiny_model("bert", "sequence", dtype=torch.float32, seed=s) for s in (0, 1))
    merger = RaotMerger.from_models(a, b, weights=[3, 1], alignment="none")
    assert merger.config.alpha == 0.25 and merger.config.models.weights == ()


# ----------------------------------------------------------------------------- merge files and the CLI


def _save_scrambles(root, names, calibration):
    """A trained-like BERT saved as ``names[0]`` and scrambles of it as the others, with a
    calibration csv; returns the model."""
    a, pre, _ = _trained_like("bert")
    for i, name in enumerate(names):
        model = clone(a)
        if i:
            scramble(model, seed=i)
        model.save_pretrained(root / name)
        pre.save_pretrained(root / name)
    tiny_text_dataset(128).to_csv(root / calibration)
    return a


@pytest.fixture(scope="module")
def three_seeds(tmp_path_factory):
    root = tmp_path_factory.mktemp("three")
    _save_scrambles(root, "abc", "cal.csv")
    return root


def _write(path, text):
    path.write_text(text)
    return path


def test_merge_file_runs_and_matches_the_command_line(three_seeds, tmp_path):
    root = three_seeds
    config = _write(
        tmp_path / "merge.yml",
        f"""models:
  - model: {root / "a"}
    parameters: {{weight: 0.5}}
  - model: {root / "b"}
    parameters: {{weight: 0.25}}
  - model: {root / "c"}
    parameters: {{weight: 0.25}}
merge_method: linear
dtype: float32
raot:
  calibration: {{source: {root / "cal.csv"}}}
""",
    )
    res = CliRunner().invoke(main, ["-q", "merge", "--config", str(config), "--out", str(tmp_path / "yml")])
    assert res.exit_code == 0, res.output
    args = [str(root / n) for n in "abc"]
    cal = ["--calibration", str(root / "cal.csv"), "--weights", "0.5,0.25,0.25"]
    res = CliRunner().invoke(main, ["-q", "merge", *args, *cal, "--out", str(tmp_path / "cli")])
    assert res.exit_code == 0, res.output
    load = transformers.AutoModelForSequenceClassification.from_pretrained
    from_file, from_flags, a = load(tmp_path / "yml"), load(tmp_path / "cli"), load(root / "a")
    assert all(torch.equal(p, q) for p, q in zip(from_file.state_dict().values(), from_flags.state_dict().values()))
    x = example_inputs(a)
    assert output_deviation(a, from_file, x, relative=True) <= 1e-5
    report = json.loads((tmp_path / "yml" / "raot_report.json").read_text())
    assert report["merge"]["settings"]["weights"] == [0.5, 0.25, 0.25]
    assert [m["model"] for m in report["models"]] == [1, 2, 3]


@pytest.mark.parametrize(
    "body,message",
    [
        (
            "models:\n  - model: {a}\n  - model: {b}\nmerge_method: karcher\n",
            "merge_method: 'karcher' is not supported",
        ),
        ("models:\n  - model: {a}\n  - parameters: {{weight: 1}}\nmerge_method: linear\n", "entry 2 has no 'model:'"),
        ("slices:\n  - sources: []\nmerge_method: linear\n", "slices: entry must hold sources"),
        ("models:\n  - model: {a}\n  - model: {b}\nmerge_method: passthrough\n", "copies one model's layers"),
        (
            "models:\n  - model: {a}\n    parameters: {{weight: [0, 1]}}\n  - model: {b}\nmerge_method: linear\n"
            "raot:\n  calibration: {{source: cal.csv}}\n",
            "weight varies by layer or module; an aligned merge takes one number per model",
        ),
        ("models: [\n", "not valid YAML"),
    ],
)
def test_bad_merge_files_are_refused_in_one_line(three_seeds, tmp_path, body, message):
    config = _write(tmp_path / "bad.yml", body.format(a=three_seeds / "a", b=three_seeds / "b"))
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["merge", "--config", str(config), "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [config]


def test_the_documented_merge_file_runs_as_written(tmp_path, monkeypatch):
    """docs/usage.md's merge.yml and command, verbatim, in a folder holding seed-a/b/c and calib.csv."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    yml = re.search(r"```yaml\n(# merge\.yml.*?)```", readme, re.S).group(1)
    command = re.search(r"```bash\n(raot-hf merge --config merge\.yml[^\n]*)\n```", readme).group(1)
    a = _save_scrambles(tmp_path, ("seed-a", "seed-b", "seed-c"), "calib.csv")
    (tmp_path / "merge.yml").write_text(yml)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["-q", *command.split()[1:]])
    assert res.exit_code == 0, res.output
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
    assert output_deviation(a, merged, example_inputs(a), relative=True) <= 1e-5
