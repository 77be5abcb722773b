"""The spine promise for mixtures of experts (docs/design.md §10): B = a random exact symmetry of a
trained-like MoE model A — experts permuted with their router rows, each expert's units permuted,
heads, scales and the residual map as for its dense family — and merge(A, B) gives A back to
≤ 1e-4 relative with greedy ``generate()`` unchanged, under each moment precision. The models
carry a layer with two near-twin experts (their units correlate closer than bf16 products can
order) and a layer with two experts that route alike (their router rows nearly equal)."""

import pytest
import torch

from raot_hf import RaotMerger, scramble
from raot_hf.calibration.precision import correlation_error_bound
from raot_hf.estimators.experts import expert_scores
from raot_hf.gate import Verdict
from raot_hf.symmetry import ExpertAlignment
from raot_hf.testing import (
    architectures,
    clone,
    output_deviation,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
    trained_like,
)

MOE = architectures(experts=True)
VOCAB = 100
# d = 64 under both precisions; d = 128 under bf16 products, the path near ties stress
MATRIX = [(t, 64, p) for t in MOE for p in ("float32", "bfloat16")] + [(t, 128, "bfloat16") for t in MOE]


def _moe(model_type, d, layers=4, seed=0):
    shape = dict(hidden_size=d, num_layers=layers, intermediate_size=2 * d + 16, num_heads=4 if d <= 64 else 8)
    model = tiny_model(model_type, "causal", seed=seed, vocab_size=VOCAB, num_kv_heads=2, **shape)
    return trained_like(model, seed=seed, expert_twins=True).float()


def _texts(n, seed=0):
    return tiny_text_dataset(n, vocab_size=VOCAB, seed=seed)


def _check_inputs():
    batch = tiny_tokenizer(VOCAB)(list(_texts(6, seed=99)["text"]), return_tensors="pt", padding=True)
    return dict(batch)


@pytest.mark.parametrize("model_type,d,precision", MATRIX)
def test_moe_models_recover_the_whole_group(model_type, d, precision):
    a = _moe(model_type, d)
    b = clone(a)
    truth = scramble(b, seed=1)
    assert sum(isinstance(t, ExpertAlignment) for t in truth.transforms) == 4  # every layer's experts moved
    reference = clone(a)
    options = {"calibration": {"moment_precision": precision}}
    result = RaotMerger.from_models(a, b, preprocessor=tiny_tokenizer(VOCAB), **options).merge(calibration=_texts(160))
    assert result.report["calibration"]["moment_precision"]["used"] == precision
    decisions = result.alignment.decisions
    assert all(d.applied for d in decisions) and sum(d.transform == "experts" for d in decisions) == 4
    assert result.alignment.exact and result.report["checks"][0]["passed"]
    assert result.alignment.verdict_code is Verdict.DIFFERS_IN_BASIS
    inputs = _check_inputs()
    assert output_deviation(reference, result.model, inputs, relative=True) <= 1e-4
    ids, kw = inputs["input_ids"][:2, :5], dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(reference.generate(input_ids=ids, **kw), result.model.generate(input_ids=ids, **kw))


@pytest.mark.parametrize("model_type", MOE)
def test_the_planted_experts_are_hard_to_tell_apart(model_type):
    """The mechanism the recovery rests on: in the twin layer the two experts' units correspond
    closer to 1 than bf16 products can order, and only their routing tells them apart; in the first
    layer two experts route alike and only their units tell them apart (A against itself)."""
    from raot_hf import schema_for
    from raot_hf.calibration import CalibrationConfig
    from raot_hf.calibration.batches import iter_calibration_batches
    from raot_hf.calibration.collector import StatisticsCollector

    a = _moe(model_type, 64)
    with StatisticsCollector(a, clone(a), schema_for(a)) as collector:
        for batch in iter_calibration_batches(_texts(96), tiny_tokenizer(VOCAB), CalibrationConfig(column="text")):
            collector.update(batch)
    twins = expert_scores(collector.stats.fit.experts[2])
    alike = expert_scores(collector.stats.fit.experts[0])
    assert twins["units"][0, 1] > 1 - 2 * correlation_error_bound(torch.bfloat16)
    assert twins["routing"][0, 1] < 0.5 and twins["score"][0, 1] < 0.6
    assert alike["routing"][2, 3] > 0.999 and alike["units"][2, 3] < 0.6 and alike["score"][2, 3] < 0.8


def _lm_steps(model, seed, steps=20, lr=0.02):
    """A few steps of next-token training on random texts: a fine-tuned sibling."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        ids = torch.randint(5, VOCAB, (8, 12), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("model_type", MOE)
def test_moe_siblings_share_a_basis(model_type):
    base = _moe(model_type, 64, layers=2)
    a, b = _lm_steps(clone(base), 1), _lm_steps(clone(base), 2)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    result = RaotMerger.from_models(a, b, preprocessor=tiny_tokenizer(VOCAB)).merge(calibration=_texts(128))
    assert any(d.transform == "experts" for d in result.alignment.decisions)
    assert not any(d.applied for d in result.alignment.decisions)
    assert result.alignment.shares_basis and "already shares a basis" in result.report["summary"]


@torch.no_grad()
def _experts_permuted_by_hand(model, seed):
    """B from the block's equations, not from raot_hf's transforms: a layer computes
    y = Σ_{e ∈ top-k(router(x))} g_e(x) · down_e(act(gate_e x) ⊙ up_e x), so permuting the experts
    together with the router's rows (e ↦ σ(e)), and inside each expert its units j (rows j and f + j
    of ``gate_up_proj``, column j of ``down_proj``), leaves y as it was."""
    g = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        router, experts = layer.mlp.gate, layer.mlp.experts
        sigma = torch.randperm(router.weight.shape[0], generator=g)
        router.weight.copy_(router.weight[sigma])
        gate_up, down = experts.gate_up_proj, experts.down_proj
        gate_up.copy_(gate_up[sigma])
        down.copy_(down[sigma])
        f = down.shape[2]
        for e in range(down.shape[0]):
            pi = torch.randperm(f, generator=g)
            gate_up[e].copy_(torch.cat([gate_up[e][:f][pi], gate_up[e][f:][pi]]))
            down[e].copy_(down[e][:, pi])
    return model


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "olmoe"])
def test_experts_permuted_by_hand_are_recovered(model_type, precision):
    a = _moe(model_type, 64)
    b = _experts_permuted_by_hand(clone(a), seed=3)
    inputs = _check_inputs()
    assert output_deviation(a, b, inputs, relative=True) <= 1e-5  # the same function
    assert not torch.equal(a.model.layers[0].mlp.gate.weight, b.model.layers[0].mlp.gate.weight)
    reference = clone(a)
    options = {"calibration": {"moment_precision": precision}}
    result = RaotMerger.from_models(a, b, preprocessor=tiny_tokenizer(VOCAB), **options).merge(calibration=_texts(160))
    assert sum(d.transform == "experts" and d.applied for d in result.alignment.decisions) == 4
    assert output_deviation(reference, result.model, inputs, relative=True) <= 1e-4
