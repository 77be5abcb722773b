"""The data-free, weight-based estimator (the rotation-symmetry paper's matching, docs/design.md §4)."""

import pytest
import torch
from scipy.optimize import minimize_scalar

from raot_hf import RaotError, schema_for
from raot_hf.estimators.weight_based import (
    SpaceFeatures,
    estimate_weight_alignment,
    optimal_head_scale,
    procrustes,
)
from raot_hf.symmetry import (
    HeadAlignment,
    TransformSequence,
    model_state,
    random_group_element,
    random_orthogonal,
    transform_model,
)
from raot_hf.testing import clone, example_inputs, output_deviation, tiny_model

MODELS = [
    ("bert", "sequence"),
    ("roberta", "token"),
    ("deberta", "sequence"),
    ("deberta-v2", "sequence"),
    ("deberta-v2", "base"),
    ("vit", "image"),
]
IDS = ["/".join(m) for m in MODELS]


def _without_head_permutation(transform: TransformSequence) -> TransformSequence:
    """The same group element with every head permutation replaced by the identity."""
    parts = [
        HeadAlignment(t.layer, torch.arange(len(t.perm)), t.qk, t.vo) if isinstance(t, HeadAlignment) else t
        for t in transform.transforms
    ]
    return TransformSequence(parts)


def _aligned_names(schema):
    return sorted({m.name for name, s in schema.spaces.items() if s.kind in ("mlp", "qk", "vo") for m in s.members})


def _max_weight_error(a, b):
    return max(
        float((p - q).abs().max()) for p, q in zip(model_state(a).values(), model_state(b).values(), strict=True)
    )


def _weight_distance(state_a, state_b, names):
    return float(sum((state_a[n].double() - state_b[n].double()).pow(2).sum() for n in names).sqrt())


def _scrambled_pair(model_type, head, seed, kinds, head_perm):
    a = tiny_model(model_type, head, seed=seed)
    schema = schema_for(a)
    g = random_group_element(schema, seed=seed + 17, kinds=kinds)
    if not head_perm:
        g = _without_head_permutation(g)
    b = transform_model(clone(a), schema, g)
    return a, b, schema, g


@pytest.mark.parametrize("model_type,head", MODELS, ids=IDS)
@pytest.mark.parametrize("match_heads", [False, True], ids=["by_position", "matched"])
def test_recovers_scrambled_weights(model_type, head, match_heads):
    """(a) B = g·A with g of kinds mlp+heads: the estimate applied to B gives A's weights back."""
    a, b, schema, g = _scrambled_pair(model_type, head, 1, ("mlp", "heads"), head_perm=match_heads)
    assert _max_weight_error(a, b) > 1e-2  # the scramble really moved the weights
    t, log = estimate_weight_alignment(model_state(a), model_state(b), schema, match_heads=match_heads, return_log=True)
    back = transform_model(clone(b), schema, t)
    assert _max_weight_error(a, back) <= 1e-8
    for layer in log["layers"]:
        assert layer["mlp"]["distance_after"] <= 1e-8 < layer["mlp"]["distance_before"]
        assert layer["heads"]["qk_distance_after"] <= 1e-8 and layer["heads"]["vo_distance_after"] <= 1e-8
    if match_heads:  # the scramble's head permutations were undone
        scramble_perms = [x.perm for x in g.transforms if isinstance(x, HeadAlignment)]
        found = [torch.tensor(layer["heads"]["perm"]) for layer in log["layers"]]
        assert all(torch.equal(torch.argsort(p), q) for p, q in zip(scramble_perms, found, strict=True))
        assert any(layer["heads"]["heads_moved"] > 0 for layer in log["layers"])


@pytest.mark.parametrize("model_type,head", MODELS, ids=IDS)
@pytest.mark.parametrize("match_heads", [False, True], ids=["by_position", "matched"])
def test_recovers_rescaled_scramble(model_type, head, match_heads):
    """(b) With per-head q/k and v/o scales in the scramble, rescale=True brings A back; without
    it the rotation alone cannot."""
    a, b, schema, _ = _scrambled_pair(model_type, head, 2, ("mlp", "heads", "rescale"), head_perm=match_heads)
    sa, sb = model_state(a), model_state(b)
    t = estimate_weight_alignment(sa, sb, schema, rescale=True, match_heads=match_heads)
    assert _max_weight_error(a, transform_model(clone(b), schema, t)) <= 1e-8
    rotation_only = estimate_weight_alignment(sa, sb, schema, match_heads=match_heads)
    assert _max_weight_error(a, transform_model(clone(b), schema, rotation_only)) > 1e-3


@pytest.mark.usefixtures("float64_deberta_layernorm")
@pytest.mark.parametrize("model_type,head", MODELS, ids=IDS)
def test_estimate_is_exact_symmetry_and_reduces_distance(model_type, head):
    """(c) On two independently initialised models the applied estimate is an exact symmetry
    of B, and (d) it reduces the weight distance to A, by the amounts the log reports."""
    a = tiny_model(model_type, head, seed=0)
    b = tiny_model(model_type, head, seed=1)
    schema = schema_for(a)
    sa, sb = model_state(a), model_state(b)
    names = _aligned_names(schema)
    before = _weight_distance(sa, sb, names)
    previous = before
    for options in (
        {"scope": ("mlp",)},
        {},
        {"match_heads": True},
        {"match_heads": True, "rescale": True},
    ):
        t, log = estimate_weight_alignment(sa, sb, schema, return_log=True, **options)
        moved = transform_model(clone(b), schema, t)
        x = example_inputs(b)
        assert output_deviation(b, moved, x) <= 1e-9, options
        after = _weight_distance(sa, model_state(moved), names)
        assert after < before, options
        assert after <= previous + 1e-9, options  # a larger search space never does worse
        previous = after
        # The log's per-space distances add up to the measured distance.
        if set(log["scope"]) == {"mlp", "heads"}:
            logged_sq = sum(
                layer["mlp"]["distance_after"] ** 2
                + layer["heads"]["qk_distance_after"] ** 2
                + layer["heads"]["vo_distance_after"] ** 2
                for layer in log["layers"]
            )
            assert logged_sq**0.5 == pytest.approx(after, rel=1e-9)


def test_procrustes_orientation():
    """R = U·Vᵀ of M = Bᵀ·A minimises ‖A − B·R‖; the transpose V·Uᵀ does not."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(30, 5, generator=g, dtype=torch.float64)
    r0 = random_orthogonal(5, g)
    b = a @ r0.T  # so that B·r0 = A
    r = procrustes(b.T @ a)
    assert torch.allclose(r, r0, atol=1e-10)
    assert (a - b @ r).abs().max() < 1e-10
    assert (a - b @ r.T).abs().max() > 1e-2


def test_optimal_head_scale_minimises_objective():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        target = SpaceFeatures(*(torch.randn(7, 4, generator=g, dtype=torch.float64) for _ in range(2)))
        source = SpaceFeatures(*(torch.randn(7, 4, generator=g, dtype=torch.float64) for _ in range(2)))

        def objective(a, target=target, source=source):
            return float(
                (target.covariant - a * source.covariant).pow(2).sum()
                + (target.contravariant - source.contravariant / a).pow(2).sum()
            )

        found = optimal_head_scale(target, source)
        reference = min(
            (
                minimize_scalar(objective, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
                for lo, hi in ((1e-3, 1.0), (1.0, 1e3))
            ),
            key=lambda res: res.fun,
        )
        assert found > 0
        assert objective(found) <= reference.fun + 1e-9
        assert objective(found) <= objective(1.0) + 1e-12


def test_user_errors_are_clear():
    a = tiny_model("bert", "sequence")
    schema = schema_for(a)
    state = model_state(a)
    with pytest.raises(RaotError, match="unknown weight-alignment scope"):
        estimate_weight_alignment(state, state, schema, scope=("residual",))
    partial = {k: v for k, v in state.items() if "intermediate" not in k}
    with pytest.raises(RaotError, match="missing"):
        estimate_weight_alignment(state, partial, schema)
    other = model_state(tiny_model("bert", "sequence", intermediate_size=12))
    with pytest.raises(RaotError, match="same architecture"):
        estimate_weight_alignment(state, other, schema)


@pytest.mark.parametrize("model_type,head", [("bert", "sequence"), ("vit", "image")])
def test_permutation_only_scramble_is_recovered_without_rotations(model_type, head):
    """rotations=False: a scramble of MLP units and whole heads (identity rotations) is undone
    by weight matching with heads matched by permutation only; the estimate keeps R = I."""
    a = tiny_model(model_type, head, seed=4)
    schema = schema_for(a)
    g = random_group_element(schema, seed=23, kinds=("mlp", "heads"))
    eye = torch.eye(schema.head_size, dtype=torch.float64).expand(schema.num_heads, -1, -1)
    g = TransformSequence(
        [HeadAlignment(t.layer, t.perm, eye, eye) if isinstance(t, HeadAlignment) else t for t in g.transforms]
    )
    assert any(
        not torch.equal(t.perm, torch.arange(schema.num_heads)) for t in g.transforms if isinstance(t, HeadAlignment)
    )
    b = transform_model(clone(a), schema, g)
    assert _max_weight_error(a, b) > 1e-2
    t, log = estimate_weight_alignment(
        model_state(a), model_state(b), schema, match_heads=True, rotations=False, return_log=True
    )
    heads = [x for x in t.transforms if isinstance(x, HeadAlignment)]
    assert heads and all(torch.equal(x.qk, eye) and torch.equal(x.vo, eye) for x in heads)
    assert _max_weight_error(a, transform_model(clone(b), schema, t)) <= 1e-8
    assert log["rotations"] is False
    # Without head matching and without rotations nothing can undo the head permutation.
    fixed = estimate_weight_alignment(model_state(a), model_state(b), schema, match_heads=False, rotations=False)
    assert _max_weight_error(a, transform_model(clone(b), schema, fixed)) > 1e-3
