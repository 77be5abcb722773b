"""The merger dispatches through its registries only, and one merger makes one merge (docs/architecture.md)."""

import pytest
import torch

from raot_hf import RaotError, RaotMerger, scramble
from raot_hf.adapters import schema_for
from raot_hf.estimators import estimator_spec, register_estimator
from raot_hf.merging import merge_rule_spec, register_merge_rule
from raot_hf.symmetry import MLPPermutation, model_state
from raot_hf.testing import clone, example_inputs, output_deviation, registries_restored, tiny_model


@pytest.fixture(autouse=True)
def restored_registries():
    """Every registration a test makes is undone after it."""
    with registries_restored():
        yield


@pytest.fixture
def scrambled_mlp():
    a = tiny_model("bert", "sequence", seed=0)
    b = clone(a)
    transform = scramble(b, seed=3, kinds=("mlp",))
    return a, b, transform


def test_a_registered_estimator_is_what_the_merger_runs(scrambled_mlp, monkeypatch):
    """An oracle estimator that knows the scramble: registered, selected by name, and the merge is A."""
    a, b, transform = scrambled_mlp
    calls = []

    def oracle(request):
        calls.append(request.config.alignment)
        return [MLPPermutation(t.layer, torch.argsort(t.perm)) for t in transform.transforms], {"oracle": True}

    register_estimator("oracle", oracle, needs_statistics=False)
    assert not estimator_spec("oracle").needs_statistics
    result = RaotMerger.from_models(clone(a), b, alignment="oracle", gate=False).merge()
    assert calls == ["oracle"] and result.alignment.logs == {"oracle": True}
    assert output_deviation(a, result.model, example_inputs(a), relative=True) < 1e-9
    with pytest.raises(
        RaotError, match="alignment='nope' is not valid; choose one of: activation, weight, soft_ot, oracle, none"
    ):
        RaotMerger.from_models(clone(a), clone(a), alignment="nope")


def test_a_registered_merge_rule_gets_what_it_declares(scrambled_mlp, monkeypatch):
    a, b, _ = scrambled_mlp
    seen = {}

    def take_b(states, weights, base=None, *, shrink, return_log=False):
        seen.update(weights=list(weights), shrink=shrink)
        log = {"rule": "take_b", "settings": {}, "counts": {"copied from B": len(states[1])}}
        return {k: v.clone() for k, v in states[1].items()}, log

    register_merge_rule("take_b", take_b, options={"shrink": "regmean.shrink"})
    assert merge_rule_spec("take_b").options == {"shrink": "regmean.shrink"}
    result = RaotMerger.from_models(a, clone(b), alignment="none", merge_rule="take_b", regmean_shrink=0.25).merge()
    assert seen == {"weights": [0.5, 0.5], "shrink": 0.25}
    got, want = model_state(result.model), model_state(b)
    head = set(schema_for(a).head_params)
    assert head
    assert all(torch.equal(got[k], want[k]) for k in want if k not in head)
    assert result.report["merge"]["counts"] == {"copied from B": len(want) - len(head)}


def test_a_second_merge_is_refused(scrambled_mlp):
    a, b, _ = scrambled_mlp
    merger = RaotMerger.from_models(a, b, alignment="weight")
    merger.merge()
    for again in (merger.merge, merger.align):
        with pytest.raises(RaotError, match="already merged.*build a new one"):
            again()


def test_a_rule_registered_from_outside_brings_its_own_option_and_flag(tmp_path, monkeypatch):
    """One options section and one registration line: the config holds the section, its JSON
    round-trips, the CLI offers ``--<section>-<field>``, and the rule receives the value."""
    from dataclasses import dataclass, field

    from click.testing import CliRunner

    from raot_hf import RaotConfig
    from raot_hf.cli import main
    from raot_hf.config.options import meta
    from raot_hf.config.sections import OptionSection
    from raot_hf.testing import tiny_tokenizer

    @dataclass
    class ScaleOptions(OptionSection):
        section = "scale_b"
        factor: float = field(default=1.0, metadata=meta("scale_b: the factor on B′'s tensors (default 1)."))

    def scale_b(states, weights, base=None, *, factor, return_log=False):
        merged = {k: v * factor if v.is_floating_point() else v.clone() for k, v in states[1].items()}
        return merged, {"rule": "scale_b", "settings": {"factor": factor}, "counts": {"scaled": len(merged)}}

    register_merge_rule("scale_b", scale_b, per_tensor=True, config=ScaleOptions)  # the one registration line
    config = RaotConfig.from_dict({"merge_rule": "scale_b", "scale_b": {"factor": 3.0}})
    assert config.scale_b.factor == 3.0 and RaotConfig.from_json(config.to_json()) == config
    a = tiny_model("bert", "sequence", seed=0)
    b = tiny_model("bert", "sequence", seed=1)
    for name, model in (("a", a), ("b", b)):
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    args = ["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--alignment", "none", "--merge-rule", "scale_b"]
    out = CliRunner().invoke(main, [*args, "--scale-b-factor", "2", "--out", str(tmp_path / "m")])
    assert out.exit_code == 0, out.output
    merged = type(a).from_pretrained(tmp_path / "m")
    key = "bert.encoder.layer.0.output.dense.weight"
    assert torch.allclose(model_state(merged)[key].double(), 2 * model_state(b)[key].double(), rtol=1e-6)
    import json

    report = json.loads((tmp_path / "m" / "raot_report.json").read_text())
    assert report["settings"]["scale_b"] == {"factor": 2.0}
