"""The soft-OT baseline (Sinkhorn plans from calibration statistics; not a symmetry)."""

import pytest
import torch

from raot_hf import RaotError, RaotMerger, schema_for
from raot_hf.calibration import CalibrationConfig, iter_calibration_batches
from raot_hf.calibration.collector import StatisticsCollector
from raot_hf.estimators.soft_ot import estimate_soft_ot, sinkhorn_plan
from raot_hf.symmetry import (
    HeadAlignment,
    MLPPermutation,
    SoftTransport,
    TransformSequence,
    is_exact,
    scramble,
    transform_model,
)
from raot_hf.testing import (
    clone,
    example_inputs,
    output_deviation,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
)


def _statistics(a, b, schema, n=96):
    config = CalibrationConfig(batch_size=32, max_length=16)
    with StatisticsCollector(a, b, schema) as collector:
        for batch in iter_calibration_batches(tiny_text_dataset(n), tiny_tokenizer(), config):
            collector.update(batch)
    return collector.stats


@pytest.fixture(scope="module")
def scrambled_pair():
    a = tiny_model("bert", "sequence", seed=3, hidden_size=16, num_heads=4, intermediate_size=24)
    b = clone(a)
    g = scramble(b, seed=11, kinds=("mlp",))
    schema = schema_for(a)
    return a, b, schema, g, _statistics(a, b, schema)


def _weights_error(x, y):
    return max(float((p - q).detach().abs().max()) for p, q in zip(x.parameters(), y.parameters(), strict=True))


def test_small_reg_tends_to_the_exact_permutation(scrambled_pair):
    a, b, schema, g, stats = scrambled_pair
    inverse = {t.layer: torch.argsort(t.perm) for t in g.transforms if isinstance(t, MLPPermutation)}
    errors = []
    for reg in (0.2, 0.02, 0.002):
        t, log = estimate_soft_ot(stats, schema, scope=("mlp",), reg=reg, return_log=True)
        assert all(isinstance(x, SoftTransport) for x in t.transforms) and len(t) == schema.num_layers
        worst = 0.0
        for x in t.transforms:
            layer = schema.space(x.space).layer
            exact = torch.zeros_like(x.plan)
            exact[inverse[layer], torch.arange(len(inverse[layer]))] = 1.0  # plan[i_B, j_A]
            assert torch.allclose(x.plan.sum(0), torch.ones(len(x.plan), dtype=torch.float64), atol=1e-9)
            worst = max(worst, float((x.plan - exact).abs().max()))
        errors.append(worst)
        assert all(entry["mlp"]["argmax_agrees_with_assignment"] == 1.0 for entry in log["layers"])
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-3
    assert errors[0] > 0.05  # a large reg really spreads mass
    # The near-permutation plan turns B back into A (weights and function).
    back = transform_model(clone(b), schema, t)
    assert _weights_error(a, back) < 1e-3
    assert output_deviation(a, back, example_inputs(a), relative=True) < 1e-3


def test_moderate_reg_is_approximate_and_labelled(scrambled_pair):
    a, b, schema, g, stats = scrambled_pair
    t, log = estimate_soft_ot(stats, schema, scope=("mlp", "heads"), reg=0.3, return_log=True)
    assert not is_exact(t, schema) and not SoftTransport.exact
    assert {schema.space(x.space).kind for x in t.transforms} == {"mlp", "qk", "vo"}
    assert all(entry["mlp"]["mean_column_max"] < 0.9 for entry in log["layers"])  # plans are soft
    moved = transform_model(clone(b), schema, t)
    undo = TransformSequence([MLPPermutation(x.layer, torch.argsort(x.perm)) for x in g.transforms])
    exact = transform_model(clone(b), schema, undo)  # the exact inverse scramble, for contrast
    assert output_deviation(b, exact, example_inputs(b), relative=True) < 1e-12
    assert output_deviation(b, moved, example_inputs(b), relative=True) > 1e-5  # B′ is not B
    # Through the product: the merger marks the alignment approximate and reports the deviation.
    tokenizer, data = tiny_tokenizer(), tiny_text_dataset(96)
    result = RaotMerger.from_models(
        clone(a), clone(b), preprocessor=tokenizer, alignment="soft_ot", soft_ot_reg=0.3, scope=("mlp",)
    ).merge(calibration=data)
    check = result.report["checks"][0]
    assert result.alignment.exact is False and check["exact"] is False and check["value"] > 1e-5
    assert result.report["estimator_logs"]["soft_ot"]["reg"] == pytest.approx(0.3)


def test_head_plan_is_block_identity_and_recovers_a_head_permutation():
    a = tiny_model("bert", "sequence", seed=5, hidden_size=16, num_heads=4, intermediate_size=24)
    b = clone(a)
    g = scramble(b, seed=2, kinds=("heads",))
    schema = schema_for(a)
    # keep only head permutations (identity rotations): soft OT has no rotations
    eye = torch.eye(schema.head_size, dtype=torch.float64).expand(schema.num_heads, -1, -1)
    b = transform_model(
        clone(a),
        schema,
        TransformSequence([HeadAlignment(x.layer, x.perm, eye, eye) for x in g.transforms]),
    )
    stats = _statistics(a, b, schema)
    t, log = estimate_soft_ot(stats, schema, scope=("heads",), reg=0.002, return_log=True)
    h = schema.head_size
    for x in t.transforms:
        blocks = x.plan.reshape(schema.num_heads, h, schema.num_heads, h)
        off_diagonal = blocks - blocks.diagonal(dim1=1, dim2=3).mean(-1)[:, None, :, None] * torch.eye(h)[
            None, :, None, :
        ].to(torch.float64)
        assert float(off_diagonal.abs().max()) == 0.0  # identity inside every head block
    back = transform_model(clone(b), schema, t)
    assert output_deviation(a, back, example_inputs(a), relative=True) < 1e-3


def test_user_errors():
    with pytest.raises(RaotError, match="reg"):
        sinkhorn_plan(torch.eye(3, dtype=torch.float64), 0.0)
    a = tiny_model("bert", "sequence")
    schema = schema_for(a)
    with pytest.raises(RaotError, match="calibration"):
        estimate_soft_ot(None, schema)
    with pytest.raises(RaotError, match="scope"):
        estimate_soft_ot(_statistics(a, clone(a), schema, n=8), schema, scope=("residual",))
