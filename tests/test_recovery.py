"""The spine promise at sizes and depths that behave like trained models (docs/design.md §4.4, §8.3):
B = a random exact symmetry of A — the whole group the estimator inverts: unit and head
permutations, per-head rotations, Q/K scales (per rotary pair under RoPE) and V/O scales, the
residual map — and merge(A, B) gives A back, on models with peaked attention
(:func:`raot_hf.testing.trained_like`), a planted pair of near-twin massive MLP units of different
magnitude (correlating at 0.99–0.99999, closer than bf16 products can order), and, for decoders,
massive stream activations. Tiny random models with nearly uniform attention hide wrong Q/K maps:
a wrong map barely changes their logits.

Every recovery runs under **each moment precision** — bf16 products forced as well as float32 —
whatever the host: bf16 products are slow but exact-rounding on CPUs without bf16 instructions,
so the bf16 path is tested on every machine, and ``auto`` (which picks one of the two by the
hardware) is covered by both."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raot_hf import RaotMerger, schema_for, scramble
from raot_hf.gate import Verdict
from raot_hf.symmetry import HeadRescale
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

DECODERS = architectures(decoders=True)
ENCODERS = [(t, tiny_architecture(t).task_head) for t in architectures(decoders=False)]  # images too
PRECISIONS = ["float32", "bfloat16"]
VOCAB = 100
TWINS = 300.0  # the near-twin pair's peak activation, against a median unit RMS of ~0.3


def _decoder(model_type, d, layers, *, massive=None, twins=None, seed=0):
    heads = 4 if d <= 64 else 8
    shape = dict(hidden_size=d, num_layers=layers, intermediate_size=2 * d + 16, num_heads=heads, num_kv_heads=2)
    model = tiny_model(model_type, "causal", seed=seed, vocab_size=VOCAB, **shape)
    return trained_like(model, seed=seed, massive=massive, twins=twins).float()


def _precision(name):
    return {"calibration": {"moment_precision": name}}


def _texts(n, seed=0):
    return tiny_text_dataset(n, vocab_size=VOCAB, seed=seed)


def _check_inputs():
    """Held-out texts of the calibration kind, [CLS] first and [SEP] last (the massive-activation
    triggers), right-padded."""
    batch = tiny_tokenizer(VOCAB)(list(_texts(6, seed=99)["text"]), return_tensors="pt", padding=True)
    return dict(batch)


def _recover(a, pre, data, **options):
    b = clone(a)
    truth = scramble(b, seed=1)
    assert any(isinstance(t, HeadRescale) for t in truth.transforms)  # scales are part of the draw
    reference = clone(a)
    result = RaotMerger.from_models(a, b, preprocessor=pre, **options).merge(calibration=data)
    return reference, result


def _assert_recovered(reference, result, inputs, tolerance=1e-4):
    rejected = [(d.transform, d.layer, d.reason) for d in result.alignment.decisions if not d.applied]
    assert not rejected
    assert result.alignment.exact and result.report["checks"][0]["passed"]
    assert output_deviation(reference, result.model, inputs, relative=True) <= tolerance
    # the gate's per-token view agrees: no token of the merge leaves the parents' path
    assert result.alignment.verdict_code is not Verdict.DIFFERS_NOT_EXACT
    assert max(result.alignment.model_fidelity["worst_token_by_layer"]) <= 1e-2


def _assert_precision(result, name):
    assert result.report["calibration"]["moment_precision"]["used"] == name


def _assert_same_generation(reference, merged, inputs):
    ids = inputs["input_ids"][:2, :5]
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(reference.generate(input_ids=ids, **kw), merged.generate(input_ids=ids, **kw))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("model_type", DECODERS)
def test_decoders_recover_the_whole_group_at_several_widths(model_type, d, precision):
    """With massive stream activations and a near-twin massive MLP pair, under each precision."""
    a = _decoder(model_type, d, 4, massive=1000.0, twins=TWINS)
    reference, result = _recover(a, tiny_tokenizer(VOCAB), _texts(192), **_precision(precision))
    _assert_precision(result, precision)
    inputs = _check_inputs()
    _assert_recovered(reference, result, inputs)
    _assert_same_generation(reference, result.model, inputs)


@pytest.mark.parametrize("model_type", DECODERS)
def test_massive_activations_are_recovered(model_type):
    """Layer 1 writes ~10³ into two stream dimensions on the first and last token of every text,
    against a median entry of ~1 (as pretrained LLMs do): the stream, MLP and head estimates and
    the gate's fidelity must not be dominated by those few tokens."""
    a = _decoder(model_type, 64, 4, massive=1000.0)
    inputs = _check_inputs()
    with torch.no_grad():
        hidden = a(**inputs, output_hidden_states=True).hidden_states[2][inputs["attention_mask"].bool()]
    assert float(hidden.abs().max()) >= 500 * float(hidden.abs().median())  # really massive
    reference, result = _recover(a, tiny_tokenizer(VOCAB), _texts(192))
    _assert_recovered(reference, result, inputs)
    _assert_same_generation(reference, result.model, inputs)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_deep_decoder_with_massive_activations_is_recovered(precision):
    """12 layers, massive stream activations and the near-twin pair in layer 6."""
    a = _decoder("llama", 64, 12, massive=1000.0, twins=TWINS)
    reference, result = _recover(a, tiny_tokenizer(VOCAB), _texts(192), **_precision(precision))
    _assert_precision(result, precision)
    inputs = _check_inputs()
    _assert_recovered(reference, result, inputs)
    _assert_same_generation(reference, result.model, inputs)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("model_type,head", ENCODERS)
def test_encoders_recover_the_whole_group_at_four_layers(model_type, head, d, precision):
    """Peaked attention (the Q/K gain reaches query/key, query_proj/key_proj and in_proj too) and
    a near-twin massive MLP pair, at several widths, under each precision."""
    shape = dict(hidden_size=d, num_heads=4 if d <= 64 else 8, num_layers=4, intermediate_size=2 * d + 16)
    a = trained_like(tiny_model(model_type, head, seed=0, **shape), twins=TWINS).float()
    pre, data = tiny_data(model_type, 128)
    reference, result = _recover(a, pre, data, **_precision(precision))
    _assert_precision(result, precision)
    _assert_recovered(reference, result, example_inputs(reference))


def test_the_planted_twins_are_closer_than_bf16_products_can_order():
    """The mechanism the precision tests rest on: the planted pair is massive against the median
    unit, of different magnitude, and correlates closer to 1 than bf16 products' error bound
    (so an assignment from bf16 correlations alone is decided by rounding there)."""
    from raot_hf import schema_for
    from raot_hf.calibration.precision import correlation_error_bound
    from raot_hf.hooks import Hooks

    for model in (_decoder("llama", 64, 4, massive=1000.0, twins=TWINS), _decoder("gpt2", 64, 4, twins=TWINS)):
        schema = schema_for(model)
        fc2 = model.get_submodule(schema.layers[schema.num_layers // 2].mlp_hidden)
        seen = []
        batch = tiny_tokenizer(VOCAB)(list(_texts(64)["text"]), return_tensors="pt", padding=True)
        with Hooks().on_input(fc2, lambda args, seen=seen: seen.append(args[0])), torch.no_grad():
            model(**batch)
        units = seen[0][batch["attention_mask"].bool()].double()
        rms = units.pow(2).mean(0).sqrt()
        assert rms[1] < 0.5 * rms[0] and rms[1] > 50 * rms.median()  # massive, of different magnitude
        assert 1 - 2 * correlation_error_bound(torch.bfloat16) < torch.corrcoef(units[:, :2].T)[0, 1] < 1 - 1e-9


def test_auto_on_a_machine_with_bf16_units_recovers_as_on_one_without(monkeypatch):
    """``auto`` picks bf16 products where the CPU reports bf16 matrix units: told so, the default
    merge takes that path here (whatever this CPU is) and still gives A back — the same recovery
    as the float32 path that ``auto`` takes on a CPU without them."""
    from raot_hf.calibration import precision

    a = _decoder("llama", 128, 4, massive=1000.0, twins=TWINS)
    for units, used in (("AMX", "bfloat16"), (None, "float32")):
        monkeypatch.setattr(precision, "cpu_bf16_units", lambda units=units: units)
        reference, result = _recover(clone(a), tiny_tokenizer(VOCAB), _texts(192))
        _assert_precision(result, used)
        _assert_recovered(reference, result, _check_inputs())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model_type=st.sampled_from(["llama", "qwen2", "gpt2"]),
    d=st.sampled_from([32, 48, 64]),
    layers=st.integers(2, 4),
    kv_heads=st.sampled_from([1, 2, 4]),
    width=st.sampled_from([40, 72, 136]),
    seed=st.integers(0, 10_000),
)
def test_recovery_property_over_shapes(model_type, d, layers, kv_heads, width, seed):
    """Whatever the shape (widths, depth, grouping, MLP width) and the drawn group element, the
    merge of a trained-like decoder with its scramble gives it back."""
    shape = dict(hidden_size=d, num_layers=layers, intermediate_size=width, num_heads=4, num_kv_heads=kv_heads)
    a = trained_like(tiny_model(model_type, "causal", seed=seed, vocab_size=VOCAB, **shape), seed=seed).float()
    b = clone(a)
    scramble(b, seed=seed + 1)
    reference = clone(a)
    result = RaotMerger.from_models(a, b, preprocessor=tiny_tokenizer(VOCAB)).merge(calibration=_texts(160, seed))
    _assert_recovered(reference, result, _check_inputs())


def test_scales_are_estimated_and_reported():
    """Each layer's head estimate carries its scales; the inverse of the drawn ones."""
    a = _decoder("llama", 32, 2)
    b = clone(a)
    truth = scramble(b, seed=1)
    merger = RaotMerger.from_models(a, b, preprocessor=tiny_tokenizer(VOCAB))
    alignment, _, _ = merger.align(_texts(160))
    drawn = {t.layer: t for t in truth.transforms if isinstance(t, HeadRescale)}
    estimated = {t.layer: t for t in alignment.applied.transforms if isinstance(t, HeadRescale)}
    assert set(estimated) == set(drawn) == {0, 1}
    schema = schema_for(a)
    for layer, t in estimated.items():
        # per rotary pair under RoPE; the product of all of them undoes the drawn ones'
        assert t.qk_scale.shape == (schema.num_heads, schema.head_size // 2)
        drawn_product = drawn[layer].qk_scale.prod() * drawn[layer].vo_scale.prod()
        assert torch.allclose(
            t.qk_scale.prod() * t.vo_scale.prod() * drawn_product, torch.ones((), dtype=torch.float64), rtol=1e-3
        )
