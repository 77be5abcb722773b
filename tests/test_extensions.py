"""Each extension point tried end to end from outside the package, as docs/architecture.md
("Extending raot_hf") shows it: a toy architecture, merge rule, estimator and correction are
registered here, in the test module, through public names only, and a merge runs them. Every
registration is undone after its test (:func:`raot_hf.testing.registries_restored`)."""

import dataclasses

import pytest
import torch
import transformers

from raot_hf import RaotError, RaotMerger, get_adapter, register_adapter, scramble, supported_model_types
from raot_hf.adapters import schema_for
from raot_hf.correction import available_corrections, get_correction, register_correction, unregister_correction
from raot_hf.estimators import available_estimators, register_estimator
from raot_hf.merging import available_merge_rules, register_merge_rule
from raot_hf.symmetry import MLPPermutation, model_state
from raot_hf.testing import (
    TinyArchitecture,
    architectures,
    clone,
    example_inputs,
    output_deviation,
    register_tiny_architecture,
    registries_restored,
    tiny_data,
    tiny_model,
)


@pytest.fixture(autouse=True)
def restored_registries():
    """Whatever a test registers is gone after it; the check below fails if it were not."""
    before = (available_merge_rules(), available_estimators(), available_corrections(), supported_model_types())
    with registries_restored():
        yield
    assert (available_merge_rules(), available_estimators(), available_corrections(), supported_model_types()) == before


def _pair(seed_b=1):
    """Two different tiny BERT classifiers (B is not a symmetry of A)."""
    return tiny_model("bert", "sequence", seed=0), tiny_model("bert", "sequence", seed=seed_b)


def _trunk(model) -> dict[str, torch.Tensor]:
    head = set(schema_for(model).head_params)
    return {k: v.clone() for k, v in model_state(model).items() if k not in head}


# ----------------------------------------------------------------------------- an architecture


class ToyBertConfig(transformers.BertConfig):
    """A BERT under a model type no adapter knows (an outside architecture computing like BERT)."""

    model_type = "toy-bert"


def toy_config(model_type, *, hidden_size=16, num_heads=4, num_layers=2, intermediate_size=24, **overrides):
    kw = dict(vocab_size=40, max_position_embeddings=32, num_labels=3)
    kw.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides)
    return ToyBertConfig(
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_hidden_layers=num_layers,
        intermediate_size=intermediate_size,
        **kw,
    )


def test_a_toy_architecture_is_aligned_and_merged_and_joins_the_per_architecture_tests():
    """The adapter of a new model type and its tiny model, registered beside it: the merge of A
    with an exact scramble of itself gives A back, and the tests' one list now holds it."""
    assert "toy-bert" not in supported_model_types()
    with pytest.raises(RaotError, match="has no raot_hf adapter"):
        schema_for(transformers.BertModel(toy_config("toy-bert")))
    register_adapter(dataclasses.replace(get_adapter("bert"), name="toy-bert", model_types=("toy-bert",)))
    register_tiny_architecture(
        TinyArchitecture(
            "toy-bert",
            toy_config,
            lambda model_type, head: transformers.BertForSequenceClassification,
            heads=("sequence",),
            task_head="sequence",
        )
    )
    assert "toy-bert" in architectures(decoders=False)
    a = tiny_model("toy-bert", "sequence", dtype=torch.float32)
    assert a.config.model_type == "toy-bert"
    b = clone(a)
    scramble(b, seed=1)
    reference = clone(a)
    assert output_deviation(reference, b, example_inputs(reference), relative=True) < 1e-5  # same function
    assert any(not torch.equal(p, q) for p, q in zip(reference.parameters(), b.parameters(), strict=True))
    pre, data = tiny_data("toy-bert", 96)
    result = RaotMerger.from_models(a, b, preprocessor=pre).merge(calibration=data)
    assert all(d.applied for d in result.alignment.decisions)
    got, want = model_state(result.model), model_state(reference)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-4  # A back, weight by weight


# ----------------------------------------------------------------------------- a merge rule


def take_reference(states, weights, base=None, *, return_log=False, **options):
    """A toy rule: the merge is the reference's tensors."""
    merged = {k: v.clone() for k, v in states[0].items()}
    log = {"rule": "toy_take_reference", "settings": {}, "counts": {"taken from the reference": len(merged)}}
    return (merged, log) if return_log else merged


def test_a_toy_merge_rule_is_what_the_merge_writes():
    register_merge_rule("toy_take_reference", take_reference, per_tensor=True)
    assert "toy_take_reference" in available_merge_rules()
    a, b = _pair()
    want = _trunk(a)
    result = RaotMerger.from_models(a, b, alignment="none", merge_rule="toy_take_reference").merge()
    got = _trunk(result.model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert result.report["merge"]["counts"] == {"taken from the reference": len(want)}


# ----------------------------------------------------------------------------- an estimator


def test_a_toy_estimator_runs_and_its_candidates_are_applied():
    """An estimator proposing the identity of every MLP space: B′ = B, so the linear merge is
    the plain average of A and B, and its log reaches the alignment."""
    seen = []

    def identity_mlp(request):
        seen.append(request.scope("mlp"))
        units = request.schema.intermediate_size
        return [MLPPermutation(i, torch.arange(units)) for i in range(request.schema.num_layers)], {"toy": "identity"}

    register_estimator("toy_identity", identity_mlp, needs_statistics=False, gated=False)
    with pytest.raises(RaotError, match="already registered"):
        register_estimator("toy_identity", identity_mlp, needs_statistics=False)
    a, b = _pair()
    trunk_a, trunk_b = _trunk(a), _trunk(b)
    result = RaotMerger.from_models(a, b, alignment="toy_identity", scope=("mlp",), correction="none").merge()
    assert seen == [("mlp",)] and result.alignment.logs == {"toy": "identity"}
    assert len(result.alignment.decisions) == schema_for(a).num_layers
    got = _trunk(result.model)
    assert all(torch.allclose(got[k], 0.5 * (trunk_a[k] + trunk_b[k]), atol=1e-12) for k in trunk_a)


# ----------------------------------------------------------------------------- a correction


def keep_the_rule(request):
    """A toy correction that leaves each layer as the rule merged it, and logs which layer it saw."""
    request.layer.parents([], lambda *_: None)  # every parent's layer runs: their states move on
    outputs = request.layer.merged(request.rule, [], lambda *_: None)
    return dict(request.rule), outputs, [{"toy": request.index}]


def test_a_toy_correction_runs_layer_by_layer_and_is_reported():
    register_correction("toy_keep", keep_the_rule, description="the rule's merge, kept")
    with pytest.raises(RaotError, match="already registered.*valid: auto, none, lsq, repair, .*toy_keep"):
        register_correction("toy_keep", keep_the_rule)
    with pytest.raises(TypeError, match="other than 'auto' and 'none'"):
        register_correction("none", keep_the_rule)
    assert get_correction("toy_keep").description == "the rule's merge, kept"
    a, b = _pair()
    plain = RaotMerger.from_models(clone(a), clone(b), alignment="none", correction="none").merge()
    pre, data = tiny_data("bert", 64)
    corrected = RaotMerger.from_models(
        a, b, alignment="none", preprocessor=pre, correction={"method": "toy_keep", "compete": False}
    ).merge(calibration=data)
    log = corrected.report["merge"]["correction"]
    layers = schema_for(a).num_layers
    assert log["method"] == "toy_keep" and [e["sites"] for e in log["layers"]] == [[{"toy": i}] for i in range(layers)]
    assert log["examples"] > 0 and log["skipped"] == []
    got, want = model_state(corrected.model), model_state(plain.model)
    assert all(torch.equal(got[k], want[k]) for k in want)  # the rule's merge, as written without a correction


def test_an_unregistered_correction_is_refused_by_name():
    register_correction("toy_keep", keep_the_rule)
    unregister_correction("toy_keep")
    assert "toy_keep" not in available_corrections()
    a, b = _pair()
    with pytest.raises(RaotError, match="correction_method='toy_keep' is not valid; choose one of: auto, none, lsq"):
        RaotMerger.from_models(a, b, correction="toy_keep")
