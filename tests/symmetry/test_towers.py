"""The symmetries of two-tower models (docs/design.md §11): each tower's group, exact on the tower
with its projection; one orthogonal map of the joint space on both projections (for SigLIP, whose
pooling head keeps a LayerNorm in the joint space, a map fixing its mean axis once it is folded);
and what is not a symmetry: a map on one projection alone, a SigLIP joint rotation that moves the
mean axis."""

import pytest
import torch

from raot_hf import schema_for
from raot_hf.adapters import get_dual_encoder
from raot_hf.dual import joint_schema, tower_models
from raot_hf.errors import RaotError
from raot_hf.symmetry import ResidualRotation, random_group_element, transform_model
from raot_hf.symmetry.group import mean_fixing, random_orthogonal
from raot_hf.testing import (
    architectures,
    clone,
    example_inputs,
    output_deviation,
    tiny_architecture,
    tiny_dual_model,
    tiny_dual_processor,
    tiny_model,
    tiny_paired_dataset,
)

TOWERS = [(t, head) for t in architectures(towers=True) for head in tiny_architecture(t).heads]


@pytest.mark.parametrize("model_type,head", TOWERS)
def test_every_tower_group_is_exact(model_type, head):
    model = tiny_model(model_type, head)
    schema = schema_for(model)
    transform = random_group_element(schema, seed=3)
    moved = transform_model(clone(model), schema, transform)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), moved.parameters(), strict=True))
    stream = transform.space_action(schema, "residual").dense(schema.hidden_size)
    assert output_deviation(model, moved, example_inputs(model), stream_map=stream) <= 1e-9


def _logits(model, processor, n=6):
    data = tiny_paired_dataset(n, seed=5)
    inputs = processor(text=list(data["text"]), images=list(data["image"]), return_tensors="pt", padding=True)
    inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "pixel_values")}
    inputs["pixel_values"] = inputs["pixel_values"].double()
    with torch.no_grad():
        return model(**inputs).logits_per_image


def _joint_map(schema, seed, mean_fixed=True):
    g = torch.Generator().manual_seed(seed)
    p = schema.hidden_size
    return mean_fixing(random_orthogonal(p - 1, g)) if mean_fixed else random_orthogonal(p, g)


@pytest.mark.parametrize("model_type", ["clip", "siglip"])
def test_the_joint_map_and_both_towers_leave_the_logits_unchanged(model_type):
    model, processor = tiny_dual_model(model_type), tiny_dual_processor(model_type)
    moved = clone(model)
    spec = get_dual_encoder(model_type)
    schema = joint_schema(spec, moved)
    mean_fixed = schema.residual.exact == "mean_fixing"
    assert mean_fixed == (model_type == "siglip")
    transform_model(moved, schema, ResidualRotation(_joint_map(schema, 1, mean_fixed)))
    for tower in tower_models(spec, moved).values():
        transform_model(tower, schema_for(tower), random_group_element(schema_for(tower), seed=2))
    reference, logits = _logits(model, processor), _logits(moved, processor)
    assert (reference - logits).abs().max() <= 1e-9 * reference.abs().max()
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), moved.parameters(), strict=True))


@pytest.mark.parametrize("model_type", ["clip", "siglip"])
def test_a_map_on_one_projection_alone_is_no_symmetry(model_type):
    model, processor = tiny_dual_model(model_type), tiny_dual_processor(model_type)
    spec = get_dual_encoder(model_type)
    schema = joint_schema(spec, model)
    text_only = clone(model)
    u = _joint_map(schema, 1)
    with torch.no_grad():
        for name, axis in spec.joint.writers:
            if name.startswith("text_model") or name.startswith("text_projection"):
                p = text_only.get_parameter(name)
                p.copy_((p.movedim(axis, -1) @ u).movedim(-1, axis))
    reference = _logits(model, processor)
    assert (reference - _logits(text_only, processor)).abs().max() > 1e-2 * reference.abs().max()


def test_siglip_joint_rotations_must_fix_the_mean_axis():
    """The pooling head's LayerNorm centres the joint space: a rotation moving its mean axis is refused
    as a symmetry, and applied by hand it changes the logits."""
    model, processor = tiny_dual_model("siglip"), tiny_dual_processor("siglip")
    schema = joint_schema(get_dual_encoder("siglip"), model)
    free = _joint_map(schema, 3, mean_fixed=False)
    with pytest.raises(RaotError, match="fix the mean axis"):
        transform_model(clone(model), schema, ResidualRotation(free))
    moved = clone(model)
    transform_model(moved, schema, ResidualRotation(_joint_map(schema, 3)))  # folds the head's LayerNorm
    with torch.no_grad():  # now a free rotation on top, members moved as the schema lists them
        for m in schema.residual.members:
            if m.role in ("writer", "reader"):
                p = moved.get_parameter(m.name)
                p.copy_((p.movedim(m.axis, -1) @ free).movedim(-1, m.axis))
    reference = _logits(model, processor)
    assert (reference - _logits(moved, processor)).abs().max() > 1e-3 * reference.abs().max()
