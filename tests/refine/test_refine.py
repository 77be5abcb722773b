"""The learned alignment (docs/design.md §5.6): every step an exact symmetry of B′, label-free,
early-stopped on held-out examples and competing with the estimated alignment."""

import pytest
import torch

from raot_hf import RaotConfig, RaotError, RaotMerger, schema_for, scramble
from raot_hf.refine.parameters import RefineParameters, as_transforms, dense_actions, transformed
from raot_hf.symmetry import TransformSequence, apply_transform, fold_model, model_state, transform_model
from raot_hf.testing import (
    clone,
    exact_rmsnorm,
    example_inputs,
    output_deviation,
    tiny_image_dataset,
    tiny_image_processor,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
    trained_like,
)

CASES = [("llama", "causal"), ("qwen2", "causal"), ("vit", "image"), ("bert", "sequence"), ("gpt2", "causal")]


def _random_parameters(schema, seed):
    stream = schema.residual.exact in ("mean_fixing", "orthogonal")
    p = RefineParameters.zeros(schema, list(range(schema.num_layers)), stream)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in p.tensors():
            t.copy_(0.3 * torch.randn(t.shape, generator=g, dtype=torch.float64))
    return p, stream


@pytest.mark.parametrize("model_type,head", CASES)
def test_every_parameter_value_is_an_exact_symmetry_and_the_optimised_map_is_the_applied_one(model_type, head):
    """At any parameter value Δ is an exact group element (B″ computes B′'s function, float64
    ≤ 1e-9), and the differentiable contraction the optimiser sees equals the transforms applied."""
    model = tiny_model(model_type, head)
    schema = schema_for(model)
    p, stream = _random_parameters(schema, seed=3)
    if stream and schema.norm == "pre":
        fold_model(model, schema)
    delta = TransformSequence(as_transforms(p))
    moved = transform_model(clone(model), schema, delta)
    actions = delta.actions(schema)
    stream_map = actions["residual"].dense(schema.hidden_size) if "residual" in actions else None
    with exact_rmsnorm():
        assert output_deviation(model, moved, example_inputs(model), stream_map) <= 1e-9
    state = model_state(model)
    differentiable = transformed(state, schema, dense_actions(p))
    applied = apply_transform({k: v.clone() for k, v in state.items()}, schema, delta)
    assert differentiable and all(
        torch.allclose(differentiable[k], applied[k].double(), atol=1e-12) for k in differentiable
    )


def _pair(model_type, head, seed_b=1, scrambled=False):
    shape = dict(hidden_size=32, num_heads=4, num_layers=2, intermediate_size=64)
    if model_type in ("llama", "qwen2", "gpt2"):
        shape["vocab_size"] = 100
    a = trained_like(tiny_model(model_type, head, **shape)).float()
    if scrambled:
        b = clone(a)
        scramble(b, seed=seed_b)
    else:
        b = trained_like(tiny_model(model_type, head, seed=seed_b, **shape), seed=seed_b).float()
    if model_type == "vit":
        return a, b, tiny_image_processor(), tiny_image_dataset(96)
    vocab = 100 if "vocab_size" in shape else 40
    return a, b, tiny_tokenizer(vocab), tiny_text_dataset(96, vocab_size=vocab)


def test_b_stays_b_at_every_step(monkeypatch):
    """After every optimiser step the current Δ, applied to B′, leaves its function unchanged."""
    import raot_hf.refine as refine

    a, b, pre, data = _pair("llama", "causal")
    merger = RaotMerger.from_models(a, b, preprocessor=pre, refine={"steps": 6, "eval_every": 2}, refit={"mode": "off"})
    deviations = []
    original_step = torch.optim.Adam.step

    def checked_step(self, *args, **kw):
        out = original_step(self, *args, **kw)
        p = self.refine_parameters
        moved = transform_model(clone(merger.model_b), merger.schema, TransformSequence(as_transforms(p)))
        inputs = example_inputs(merger.model_b)
        deviations.append(output_deviation(merger.model_b, moved, inputs, relative=True))
        return out

    original_init = refine.RefineParameters.zeros.__func__

    def zeros(cls, *args, **kw):
        p = original_init(cls, *args, **kw)
        torch.optim.Adam.refine_parameters = p
        return p

    monkeypatch.setattr(torch.optim.Adam, "step", checked_step)
    monkeypatch.setattr(refine.RefineParameters, "zeros", classmethod(zeros))
    merger.merge(calibration=data)
    assert len(deviations) == 6 and max(deviations) <= 1e-5


def test_refinement_lowers_the_held_out_error_of_independent_parents_and_is_applied():
    a, b, pre, data = _pair("vit", "image")
    result = RaotMerger.from_models(a, b, preprocessor=pre, refine={"steps": 60}).merge(calibration=data)
    log = result.alignment.logs["refine"]
    assert log["applied"] and log["error_refined"] < log["error_estimated"]
    assert [c["passed"] for c in result.report["checks"]] == [True, True]
    assert result.report["estimator_logs"]["refine"]["curve"]


def test_an_exact_estimate_is_not_refined_and_the_merge_stays_a():
    a, b, pre, data = _pair("llama", "causal", scrambled=True)
    reference = clone(a)
    result = RaotMerger.from_models(a, b, preprocessor=pre, refine={"steps": 30}).merge(calibration=data)
    assert not result.alignment.logs["refine"]["applied"]
    assert output_deviation(reference, result.model, example_inputs(reference), relative=True) <= 1e-5


@pytest.mark.parametrize(
    "options,match",
    [
        ({"refine": {"steps": -1}}, "refine_steps"),
        ({"refine": {"lr": 0}}, "refine_lr"),
        ({"refine_examples": 0}, "refine_examples"),
        ({"refine": {"eval_every": 0}}, "refine_eval_every"),
    ],
)
def test_bad_refine_options_are_refused_in_one_line(options, match):
    with pytest.raises(RaotError, match=match) as err:
        RaotConfig.from_dict(options)
    assert "\n" not in str(err.value)
