"""RaotMerger end to end on tiny models (docs/design.md §4–6)."""

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

from raot_hf import RaotConfig, RaotError, RaotMerger, schema_for, scramble
from raot_hf.testing import (
    clone,
    example_inputs,
    fine_tune,
    output_deviation,
    tiny_image_dataset,
    tiny_image_processor,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
)


def _pair(model_type, head, seed=0, **kw):
    a = tiny_model(model_type, head, dtype=torch.float32, seed=seed, **kw)
    b = clone(a)
    scramble(b, seed=seed + 1)
    return a, b


def _data(model_type, n=96):
    if model_type in ("vit", "deit"):
        return tiny_image_processor(), tiny_image_dataset(n)
    return tiny_tokenizer(), tiny_text_dataset(n)


@pytest.mark.parametrize(
    "model_type,head",
    [
        ("bert", "sequence"),
        ("roberta", "sequence"),
        ("deberta-v2", "sequence"),
        ("deberta", "sequence"),
        ("vit", "image"),
        ("deit", "teacher"),
        ("bert", "mlm"),
    ],
)
def test_recovery_merge_of_scrambled_copy_returns_a(model_type, head):
    a, b = _pair(model_type, head)
    reference = clone(a)
    pre, data = _data(model_type)
    x = example_inputs(a)
    plain = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, alignment="none").merge(calibration=data)
    result = RaotMerger.from_models(a, b, preprocessor=pre).merge(calibration=data)
    aligned_err = output_deviation(reference, result.model, x, relative=True)
    plain_err = output_deviation(reference, plain.model, x, relative=True)
    assert aligned_err <= 1e-4
    assert plain_err > 100 * max(aligned_err, 1e-7) and plain_err > 1e-2
    assert all(d.applied for d in result.alignment.decisions)
    assert result.report["checks"][0]["passed"] and result.alignment.exact


@pytest.mark.parametrize("model_type,head", [("bert", "sequence"), ("vit", "image")])
def test_recovery_with_token_stride(model_type, head):
    """The spine test with the fit moments on every 3rd token only: an exact scramble is still
    recovered (the correlations of matched units stay 1), and fewer tokens were used."""
    a, b = _pair(model_type, head)
    reference = clone(a)
    pre, data = _data(model_type)
    config = RaotConfig().replace(calibration={"moment_stride": 3, "num_samples": 96})
    result = RaotMerger.from_models(a, b, preprocessor=pre, config=config).merge(calibration=data)
    assert output_deviation(reference, result.model, example_inputs(reference), relative=True) <= 1e-4
    assert all(d.applied for d in result.alignment.decisions)
    cal = result.report["calibration"]
    assert cal["config"]["moment_stride"] == 3
    assert 0 < 2.5 * cal["moment_tokens"] < cal["fit_tokens"] < 3.5 * cal["moment_tokens"]


@pytest.mark.parametrize("model_type,head", [("bert", "sequence"), ("vit", "image")])
def test_recovery_with_regmean(model_type, head):
    """The spine test through RegMean (float32 models: float32 Gram sums, transformed — and for
    the ViT unfolded through the LayerNorms — in float64): B′'s Grams equal A's, so RegMean
    returns A."""
    a, b = _pair(model_type, head)
    reference = clone(a)
    pre, data = _data(model_type)
    result = RaotMerger.from_models(a, b, preprocessor=pre, merge_rule="regmean").merge(calibration=data)
    assert output_deviation(reference, result.model, example_inputs(reference), relative=True) <= 1e-4
    assert all(d.applied for d in result.alignment.decisions)


def _train(model, seed, steps=30):
    return fine_tune(model, seed, steps)


@pytest.mark.parametrize("model_type", ["bert", "vit"])
def test_siblings_share_a_basis(model_type):
    head = "image" if model_type == "vit" else "sequence"
    base = tiny_model(model_type, head, dtype=torch.float32, hidden_size=32, num_heads=4, intermediate_size=48)
    a, b = _train(clone(base), 1), _train(clone(base), 2)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    pre, data = _data(model_type, 256)
    result = RaotMerger.from_models(a, b, preprocessor=pre).merge(calibration=data)
    assert result.alignment.decisions and not any(d.applied for d in result.alignment.decisions)
    assert result.alignment.shares_basis and "already shares a basis" in result.report["summary"]


def test_too_few_tokens_lose_to_identity(caplog):
    a, b = _pair("bert", "sequence")
    pre, data = _data("bert", 8)
    result = RaotMerger.from_models(a, b, preprocessor=pre, min_heldout_tokens=10_000).merge(calibration=data)
    assert not any(d.applied for d in result.alignment.decisions)
    assert any("too few held-out tokens" in d.reason for d in result.alignment.decisions)
    assert "too few held-out tokens" in caplog.text


def test_scope_ablation_and_regmean():
    a, b = _pair("vit", "image")
    reference = clone(a)
    pre, data = _data("vit")
    only_heads = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, scope=("heads",)).merge(calibration=data)
    assert {d.transform for d in only_heads.alignment.decisions} == {"heads"}
    regmean = RaotMerger.from_models(a, b, preprocessor=pre, merge_rule="regmean").merge(calibration=data)
    assert output_deviation(reference, regmean.model, example_inputs(reference), relative=True) <= 1e-3


def test_config_round_trip_and_validation():
    cfg = RaotConfig(scope=("mlp", "heads"), alpha=0.3, merge_rule="regmean")
    assert RaotConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(RaotError, match="alpha"):
        RaotConfig(alpha=1.5)
    with pytest.raises(RaotError, match="scope entry"):
        RaotConfig(scope=("attention",))
    with pytest.raises(RaotError, match="unknown option"):
        RaotConfig.from_dict({"alpah": 0.5})


def _save_pair(tmp_path, model_type="bert", head="sequence"):
    a, b = _pair(model_type, head)
    pre, data = _data(model_type)
    for name, m in (("a", a), ("b", b)):
        m.save_pretrained(tmp_path / name)
        pre.save_pretrained(tmp_path / name)
    data.to_csv(tmp_path / "cal.csv") if model_type != "vit" else data.save_to_disk(str(tmp_path / "cal"))
    return tmp_path / "a", tmp_path / "b", (tmp_path / "cal.csv" if model_type != "vit" else tmp_path / "cal")


def test_saved_output_reloads_identically_and_cli_matches_api(tmp_path):
    path_a, path_b, cal = _save_pair(tmp_path)
    result = RaotMerger.from_pretrained(path_a, path_b, calibration={"source": str(cal), "num_samples": 64}).merge()
    out_api = result.save_pretrained(tmp_path / "out_api")
    reloaded, info = transformers.AutoModelForSequenceClassification.from_pretrained(out_api, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    x = example_inputs(reloaded)
    assert output_deviation(result.model, reloaded.eval(), x) == 0.0
    card = (out_api / "README.md").read_text()
    assert "tags:" in card and "raot" in card and "library_name: transformers" in card
    report = json.loads((out_api / "raot_report.json").read_text())
    assert report["decisions"] and report["models"][0]["files"]
    # the applied alignment, bit-exact, next to the report: B′ = load_transform(...) applied to B
    from raot_hf.symmetry import load_transform, transform_model

    assert report["applied_transform"]["file"] == "raot_transform.safetensors"
    stored = load_transform(out_api / "raot_transform.safetensors")
    assert [t.describe() for t in stored.transforms] == report["applied_transform"]["transforms"]
    b_again = transformers.AutoModelForSequenceClassification.from_pretrained(path_b).eval()
    transform_model(b_again, schema_for(b_again), stored)
    assert (
        output_deviation(transformers.AutoModelForSequenceClassification.from_pretrained(path_b).eval(), b_again, x)
        < 1e-4
    )

    runner = CliRunner()
    from raot_hf.cli import main

    res = runner.invoke(
        main,
        [
            "-q",
            "merge",
            str(path_a),
            str(path_b),
            "--calibration",
            str(cal),
            "--num-samples",
            "64",
            "--out",
            str(tmp_path / "out_cli"),
        ],
    )
    assert res.exit_code == 0, res.output
    cli_model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out_cli").eval()
    assert output_deviation(reloaded, cli_model, x) == 0.0
    again = runner.invoke(
        main, ["-q", "merge", str(path_a), str(path_b), "--calibration", str(cal), "--out", str(tmp_path / "out_cli")]
    )
    assert again.exit_code == 2 and "exists" in again.output

    inspect = runner.invoke(main, ["-q", "inspect", str(path_a), str(path_b), "--calibration", str(cal), "--json"])
    assert inspect.exit_code == 0, inspect.output
    assert all(d["applied"] for d in json.loads(inspect.stdout)["decisions"])


def test_incompatible_pairs_fail_before_loading_weights(tmp_path):
    a = tiny_model("bert", "sequence", dtype=torch.float32)
    b = tiny_model("bert", "sequence", dtype=torch.float32, num_heads=2)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    with pytest.raises(RaotError, match="num_attention_heads"):
        RaotMerger.from_pretrained(tmp_path / "a", tmp_path / "b")
    c = tiny_model("vit", "image", dtype=torch.float32)
    c.save_pretrained(tmp_path / "c")
    with pytest.raises(RaotError, match="vit"):
        RaotMerger.from_pretrained(tmp_path / "a", tmp_path / "c")


def test_post_ln_rotation_is_reported_approximate_with_measured_deviation():
    a = tiny_model("bert", "sequence", dtype=torch.float32, seed=0)
    b = tiny_model("bert", "sequence", dtype=torch.float32, seed=7)  # independent: O is a true rotation
    pre, data = _data("bert")
    result = RaotMerger.from_models(a, b, preprocessor=pre, residual="rotation", scope=("residual",), gate=False).merge(
        calibration=data
    )
    check = result.report["checks"][0]
    assert result.alignment.decisions[0].applied
    assert not result.alignment.exact and not check["exact"] and check["passed"]
    assert check["value"] > 1e-4  # the approximation is measured and reported, not hidden
    assert check["norm_value"] > 1e-4  # and in norm, ‖Δ‖ / ‖B‖, beside the max form


def test_broken_exact_transform_raises(monkeypatch):
    """Fault injection: a schema that forgets one writer makes the 'exact' transform inexact —
    the functional check must catch it rather than warn."""
    from raot_hf import EquivalenceError
    from raot_hf.adapters import resolve

    original = resolve.build_schema

    def forgetful(spec, model):
        schema = original(spec, model)
        res = schema.residual
        res.members = [m for m in res.members if not m.name.endswith("layer.0.output.dense.bias")]
        return schema

    monkeypatch.setattr(resolve, "build_schema", forgetful)
    a, b = _pair("bert", "sequence")
    pre, data = _data("bert")
    with pytest.raises(EquivalenceError, match="exact transform changed"):
        RaotMerger.from_models(a, b, preprocessor=pre, scope=("residual",)).merge(calibration=data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scramble_passes_the_check_and_a_broken_transform_still_raises(monkeypatch, dtype):
    """Storing transformed 16-bit weights rounds them: the check tolerates 16 machine epsilons
    (docs/design.md §5.5) — an exact scramble of a bf16 / fp16 Llama deviates by ~1 eps and
    merges back to A within rounding; a transform that breaks the function still raises."""
    from raot_hf import EquivalenceError
    from raot_hf.symmetry import apply as symmetry_apply
    from raot_hf.testing import output_deviation, tiny_text_dataset, tiny_tokenizer

    eps = torch.finfo(dtype).eps
    a = tiny_model("llama", "causal", dtype=dtype, seed=0)
    b = clone(a)
    scramble(b, seed=1)
    pre, data = tiny_tokenizer(100), tiny_text_dataset(96, vocab_size=100)
    result = RaotMerger.from_models(clone(a), b, preprocessor=pre).merge(calibration=data)
    check = result.report["checks"][0]
    assert check["threshold"] == 16 * eps and 0 < check["value"] < 4 * eps
    assert output_deviation(a, result.model, example_inputs(a), relative=True) < 8 * eps

    real = symmetry_apply._contract

    def flips_the_head(t, member, action, *rest):  # fault injection: B′'s LM head comes out negated
        out = real(t, member, action, *rest)
        return -out if member.name == "lm_head.weight" else out

    monkeypatch.setattr(symmetry_apply, "_contract", flips_the_head)
    for sweep in (True, False):  # B′ written by the one sweep after the solve, and by the apply stage
        b = clone(a)
        scramble(b, seed=1)
        with pytest.raises(EquivalenceError, match="exact transform changed"):
            RaotMerger.from_models(clone(a), b, preprocessor=pre, gate={"sweep": sweep}).merge(calibration=data)
