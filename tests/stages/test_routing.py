"""Routing after the merge of mixtures of experts (docs/design.md §10.4): the report's per-layer
fraction of held-out tokens whose top-k experts change between each parent and the merge, and the
router recalibration (``correction="router"``), which competes with the rule's merge on held-out
examples like every post-merge correction."""

import torch

from raot_hf import RaotMerger, scramble
from raot_hf.testing import (
    clone,
    example_inputs,
    output_deviation,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
    trained_like,
)

VOCAB = 100


def _moe(seed=0, layers=2):
    model = tiny_model("mixtral", "causal", seed=seed, vocab_size=VOCAB, hidden_size=32, num_layers=layers)
    return trained_like(model, seed=seed).float()


def _merge(a, b, **options):
    data = tiny_text_dataset(96, vocab_size=VOCAB)
    return RaotMerger.from_models(a, b, preprocessor=tiny_tokenizer(VOCAB), **options).merge(calibration=data)


def test_routing_change_is_reported_per_layer_and_vanishes_for_an_aligned_scramble():
    a = _moe()
    b = clone(a)
    scramble(b, seed=1)
    aligned = _merge(clone(a), clone(b), refit={"mode": "off"})
    routing = aligned.report["quality"]["routing"]
    assert [r["layer"] for r in routing] == [0, 1] and all(r["tokens"] > 0 for r in routing)
    assert all(r["changed_a"] == r["changed_b"] == r["parents_differ"] == 0 for r in routing)
    unmatched = _merge(
        clone(a), clone(b), scope=("heads", "residual"), refit={"mode": "off"}
    )  # B's experts stay in their scrambled order
    routing = unmatched.report["quality"]["routing"]
    assert all(r["parents_differ"] > 0.2 for r in routing) and all(r["changed_a"] > 0.1 for r in routing)


def test_router_recalibration_refits_only_routers_and_competes_on_held_out_examples():
    a, b = _moe(seed=0), _moe(seed=7)
    # the gate decides before either merge (one alignment for both); no refit of the whole model after it
    staged = {"gate": {"sweep": False}, "refit": {"mode": "off"}}
    rule = _merge(clone(a), clone(b), correction="none", **staged)
    routed = _merge(clone(a), clone(b), correction="router", **staged)
    record = routed.report["merge"]["correction"]
    assert record["method"] == "router" and len(record["layers"]) == 2
    written, plain = routed.model.state_dict(), rule.model.state_dict()
    for layer in record["layers"]:
        (site,) = layer["sites"]  # the router alone
        assert site == "mlp.gate"
        fit = layer["sites"][site]
        assert fit["error_after"] <= fit["error_before"]
        router = f"model.layers.{layer['layer']}.mlp.gate.weight"
        assert torch.equal(written[router], plain[router]) != layer["kept"]
    routers = {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
    assert all(torch.equal(written[k], plain[k]) for k in plain if k not in routers)


def test_router_recalibration_leaves_an_exact_recovery_exact():
    a = _moe()
    b = clone(a)
    scramble(b, seed=2)
    result = _merge(clone(a), b, correction="router", refit={"mode": "off"})
    assert not any(layer["kept"] for layer in result.report["merge"]["correction"]["layers"])
    assert output_deviation(a, result.model, example_inputs(a), relative=True) <= 1e-4


def test_two_mixtures_of_experts_merge_with_the_default_correction():
    # the default correction refits every Linear after the sweep; the router and the experts' fused
    # weights are read from a run of the parents, not from the outputs a dense layer's pass keeps
    a, b = _moe(seed=0), _moe(seed=7)
    result = _merge(a, b, refit={"mode": "off"})
    record = result.report["merge"]["correction"]
    assert record["method"] in ("lsq", "repair") and record["layers"]
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
