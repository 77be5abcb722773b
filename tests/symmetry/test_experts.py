"""The symmetry of a mixture-of-experts block (docs/design.md §10): experts permuted with their
router rows and each expert's units permuted on their own leave the function unchanged; any part
alone does not. transformers' routers take the softmax in float32, so a float64 model is exact to
float32's rounding through them (as through its float32 RMSNorms, §8.2)."""

import pytest
import torch

from raot_hf import schema_for
from raot_hf.errors import RaotError
from raot_hf.symmetry import ExpertAlignment, Transform, TransformSequence, random_group_element, transform_model
from raot_hf.testing import (
    architectures,
    clone,
    exact_rmsnorm,
    example_inputs,
    output_deviation,
    tiny_architecture,
    tiny_model,
    trained_like,
)

MOE = architectures(experts=True)
CASES = [(t, head) for t in MOE for head in tiny_architecture(t).heads]


def _model(model_type, head="causal", dtype=torch.float64, **shape):
    shape = {"hidden_size": 32, "num_layers": 2, **shape}
    return trained_like(tiny_model(model_type, head, **shape), expert_twins=True).to(dtype)


def _moved(model, seed):
    """A copy of ``model`` under a random element of the whole group, and the stream map (a base
    model's output lives in the stream)."""
    schema = schema_for(model)
    transform = random_group_element(schema, seed=seed)
    moved = transform_model(clone(model), schema, transform)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), moved.parameters(), strict=True))
    return moved, transform.space_action(schema, "residual").dense(schema.hidden_size)


@pytest.mark.parametrize("model_type,head", CASES)
def test_the_whole_group_is_exact_in_float64(model_type, head):
    a = _model(model_type, head)
    b, stream = _moved(a, 3)
    with exact_rmsnorm():
        assert output_deviation(a, b, example_inputs(a), stream_map=stream, relative=True) <= 1e-6


@pytest.mark.parametrize("model_type", MOE)
def test_the_whole_group_is_exact_in_float32_with_the_default_experts_kernel(model_type):
    a = tiny_model(model_type, "causal", dtype=torch.float32, hidden_size=32, num_layers=2)
    a = trained_like(a.double(), expert_twins=True).float()
    a.set_experts_implementation("grouped_mm")
    b, _ = _moved(a, 4)
    assert output_deviation(a, b, example_inputs(a), relative=True) <= 1e-4


@pytest.mark.parametrize("model_type", MOE)
def test_no_part_of_the_expert_symmetry_is_one_alone(model_type):
    """Experts permuted without their router rows, router rows without their experts, and one unit
    exchanged between two experts each change the function."""
    a = _model(model_type)
    inputs = example_inputs(a)
    block = schema_for(a).layers[0].experts
    params = dict(a.named_parameters())
    perm = torch.tensor([1, 0, 3, 2])
    cases = {
        "experts alone": {block.gate_up: lambda w: w[perm], block.down: lambda w: w[perm]},
        "router alone": {f"{block.router}.weight": lambda w: w[perm]},
    }

    f = block.units
    cases["a unit exchanged between experts"] = {  # expert 0's unit 0 and expert 1's: gate and up rows, down column
        block.gate_up: lambda w: _exchanged(w, (0, f), 1),
        block.down: lambda w: _exchanged(w, (0,), 2),
    }
    for what, edits in cases.items():
        b = clone(a)
        with torch.no_grad():
            for name, edit in edits.items():
                dict(b.named_parameters())[name].copy_(edit(params[name].detach()))
        with exact_rmsnorm():
            assert output_deviation(a, b, inputs, relative=True) > 1e-2, what


def _exchanged(w, positions, axis):
    """``w`` with the ``positions`` of ``axis`` exchanged between experts 0 and 1."""
    w = w.clone()
    for r in positions:
        first, second = w[0].select(axis - 1, r).clone(), w[1].select(axis - 1, r).clone()
        w[0].select(axis - 1, r).copy_(second)
        w[1].select(axis - 1, r).copy_(first)
    return w


@pytest.mark.parametrize("model_type", MOE)
def test_composition_json_round_trip_and_inverse(model_type):
    """Two expert alignments compose (the flattened unit space is one permutation), round-trip through
    JSON and are undone by their inverse, bit for bit on the permuted weights."""
    a = _model(model_type)
    schema = schema_for(a)
    first = random_group_element(schema, seed=1, kinds=("experts",))
    second = random_group_element(schema, seed=2, kinds=("experts",))
    one_by_one = clone(a)
    transform_model(one_by_one, schema, first)
    transform_model(one_by_one, schema, second)
    composed = clone(a)
    transform_model(composed, schema, Transform.from_dict(first.then(second).to_dict()))
    for (n, p), q in zip(one_by_one.named_parameters(), composed.parameters(), strict=True):
        assert torch.equal(p, q), n
    t = first.transforms[0]
    assert isinstance(t, ExpertAlignment) and not t.is_identity()
    inverse_perm = torch.argsort(t.perm)
    inverse_units = torch.stack([torch.argsort(t.units[int(inverse_perm[j])]) for j in range(len(t.perm))])
    undone = clone(a)
    transform_model(undone, schema, TransformSequence([t, ExpertAlignment(t.layer, inverse_perm, inverse_units)]))
    assert all(torch.equal(p, q) for p, q in zip(undone.parameters(), a.parameters(), strict=True))


@pytest.mark.parametrize("model_type", MOE)
def test_invalid_expert_alignments_are_refused(model_type):
    schema = schema_for(_model(model_type))
    block = schema.layers[0].experts
    good_units = torch.arange(block.units).expand(block.num_experts, -1)
    bad = [
        ExpertAlignment(0, torch.tensor([0, 0, 1, 2]), good_units),
        ExpertAlignment(0, torch.arange(block.num_experts), good_units[:, :-1]),
        ExpertAlignment(0, torch.arange(block.num_experts), good_units.flip(0).clone().fill_(0)),
    ]
    for t in bad:
        with pytest.raises(RaotError):
            t.actions(schema)
    dense = schema_for(tiny_model("llama", "causal", hidden_size=32, num_heads=8, num_kv_heads=2))
    with pytest.raises(RaotError, match="no mixture-of-experts block"):
        ExpertAlignment(0, torch.arange(4), good_units).actions(dense)
