"""Merge rules against independent computations (numpy, loops, autograd)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raot_hf.errors import RaotError
from raot_hf.merging import (
    available_merge_rules,
    get_merge_rule,
    merge_fisher,
    merge_heads,
    merge_linear,
    merge_regmean,
    merge_task_arithmetic,
    merge_ties,
    register_merge_rule,
    shrink_gram,
)


def make_state(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {
        "embeddings.word.weight": torch.randn(11, 6, generator=g).to(dtype),
        "layer.0.query.weight": torch.randn(6, 6, generator=g).to(dtype),
        "layer.0.query.bias": torch.randn(6, generator=g).to(dtype),
        "layer.0.key.weight": torch.randn(6, 6, generator=g).to(dtype),
        "layer.0.out.weight": torch.randn(4, 6, generator=g).to(dtype),
        "layer.0.norm.weight": torch.rand(6, generator=g).to(dtype) + 0.5,
        "embeddings.position_ids": torch.arange(8).unsqueeze(0),
    }


# ----------------------------------------------------------------------------- linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_linear_endpoints_are_bit_exact(dtype):
    a, b = make_state(0, dtype), make_state(1, dtype)
    a["layer.0.query.bias"][0] = -0.0  # a negative zero must survive α=0 (−0 + 0·1 would be +0)
    b["layer.0.query.bias"][0] = 1.0
    at_zero = merge_linear([a, b], [1.0, 0.0])
    at_one = merge_linear([a, b], [0.0, 1.0])
    for key in a:
        assert at_zero[key].dtype == a[key].dtype
        assert torch.equal(at_zero[key].view(torch.uint8), a[key].view(torch.uint8)), key
        assert torch.equal(at_one[key], b[key] if b[key].is_floating_point() else a[key]), key
    assert math.copysign(1.0, float(at_zero["layer.0.query.bias"][0])) == -1.0


def test_linear_matches_numpy_and_keeps_int_buffers():
    a, b = make_state(0), make_state(1)
    b["embeddings.position_ids"] = b["embeddings.position_ids"] + 1
    merged, log = merge_linear([a, b], [0.7, 0.3], return_log=True)
    for key in a:
        if key == "embeddings.position_ids":
            assert torch.equal(merged[key], a[key])
            continue
        expected = 0.7 * a[key].numpy().astype(np.float64) + 0.3 * b[key].numpy().astype(np.float64)
        np.testing.assert_array_equal(merged[key].numpy(), expected.astype(np.float32))
    assert log.rule == "linear" and log.settings["weights"] == (0.7, 0.3)
    assert log.params["embeddings.position_ids"]["identical"] is False
    assert log.counts["linear"] == len(a) - 1


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(0, 9),
    seed=st.integers(0, 2**16),
    weights=st.lists(st.floats(0.0, 2.0, allow_nan=False), min_size=3, max_size=3).filter(lambda w: sum(w) > 1e-3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    transposed=st.booleans(),
)
def test_linear_in_blocks_is_the_whole_tensor_sum_bit_for_bit(rows, seed, weights, dtype, transposed):
    # blocks of 7 elements cut rows of 5 apart and leave a short last block; a transposed (non-contiguous)
    # tensor must be read in its logical order
    g = torch.Generator().manual_seed(seed)
    states = [{"w": (torch.randn(5, rows, generator=g) * 10).to(dtype)} for _ in weights]
    if transposed:
        states = [{"w": s["w"].T} for s in states]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("raot_hf.merging.rules.SUM_BLOCK", 7)
        merged = merge_linear(states, weights)["w"]
    total = sum(weights)
    expected = np.zeros(tuple(states[0]["w"].shape))
    for s, w in zip(states, weights, strict=True):
        if w / total != 0.0:
            expected = expected + (w / total) * s["w"].to(torch.float64).numpy()
    assert merged.dtype == dtype
    assert torch.equal(merged, torch.from_numpy(expected).to(dtype))


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
    alpha=st.floats(0.0, 1.0, allow_nan=False),
)
def test_linear_lies_between_the_models(shape, seed, alpha):
    g = torch.Generator().manual_seed(seed)
    a = {"w": torch.randn(*shape, generator=g) * 10}
    b = {"w": torch.randn(*shape, generator=g) * 10}
    merged = merge_linear([a, b], [1 - alpha, alpha])["w"]
    assert bool((merged >= torch.minimum(a["w"], b["w"])).all())
    assert bool((merged <= torch.maximum(a["w"], b["w"])).all())


def test_mismatched_states_name_the_key():
    a, b = make_state(0), make_state(1)
    del b["layer.0.key.weight"]
    with pytest.raises(RaotError, match=r"'layer\.0\.key\.weight'.*differ in architecture"):
        merge_linear([a, b], [0.5, 0.5])
    b = make_state(1)
    b["layer.0.out.weight"] = torch.zeros(5, 6)
    with pytest.raises(RaotError, match=r"'layer\.0\.out\.weight' has shape \(4, 6\) in A but \(5, 6\)"):
        merge_linear([a, b], [0.5, 0.5])
    with pytest.raises(RaotError, match="weights"):
        merge_linear([a, make_state(1)], [-0.5, 1.5])


# ----------------------------------------------------------------------------- RegMean

LINEAR = {"layer.0.query.weight": "l0.in", "layer.0.key.weight": "l0.in", "layer.0.out.weight": "l0.out_in"}


def grams_from(seed, tokens=40):
    g = torch.Generator().manual_seed(seed)
    x_in = torch.randn(tokens, 6, generator=g, dtype=torch.float64) * torch.linspace(0.5, 2.0, 6, dtype=torch.float64)
    x_out = torch.randn(tokens, 6, generator=g, dtype=torch.float64) + 0.3
    return {"l0.in": x_in.T @ x_in, "l0.out_in": x_out.T @ x_out}, {"l0.in": x_in, "l0.out_in": x_out}


@pytest.mark.parametrize("alpha", [0.5, 0.3])
@pytest.mark.parametrize("shrink", [1.0, 0.6])
def test_regmean_with_equal_grams_is_linear(alpha, shrink):
    a, b = make_state(0, torch.float64), make_state(1, torch.float64)
    grams, _ = grams_from(2)
    merged = merge_regmean([a, b], [1 - alpha, alpha], grams=[grams, grams], linear_weights=LINEAR, shrink=shrink)
    linear = merge_linear([a, b], [1 - alpha, alpha])
    for key in a:
        torch.testing.assert_close(merged[key], linear[key], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("alpha", [0.5, 0.25])
def test_regmean_minimises_the_output_loss(alpha):
    a, b = make_state(0, torch.float64), make_state(1, torch.float64)
    grams_a, xs_a = grams_from(3)
    grams_b, xs_b = grams_from(4)
    merged = merge_regmean([a, b], [1 - alpha, alpha], grams=[grams_a, grams_b], linear_weights=LINEAR, shrink=1.0)
    for name, gram_key in LINEAR.items():
        w = merged[name].clone().requires_grad_(True)
        x_a, x_b = xs_a[gram_key], xs_b[gram_key]
        loss = (1 - alpha) * ((x_a @ w.T - x_a @ a[name].T) ** 2).sum() + alpha * (
            (x_b @ w.T - x_b @ b[name].T) ** 2
        ).sum()
        loss.backward()
        assert float(w.grad.norm()) < 1e-8 * float(loss.detach()), name
        # and it beats the linear merge on that loss
        lin = (1 - alpha) * a[name] + alpha * b[name]
        lin_loss = (1 - alpha) * ((x_a @ lin.T - x_a @ a[name].T) ** 2).sum() + alpha * (
            (x_b @ lin.T - x_b @ b[name].T) ** 2
        ).sum()
        assert float(loss.detach()) < float(lin_loss)


def test_regmean_matches_numpy_with_shrinking_and_shared_grams():
    a, b = make_state(0), make_state(1)
    grams_a, _ = grams_from(5)
    grams_b, _ = grams_from(6)
    merged, log = merge_regmean(
        [a, b], [0.6, 0.4], grams=[grams_a, grams_b], linear_weights=LINEAR, shrink=0.7, return_log=True
    )
    for name, gram_key in LINEAR.items():
        ga, gb = grams_a[gram_key].numpy(), grams_b[gram_key].numpy()
        ga = 0.7 * ga + 0.3 * np.diag(np.diag(ga))
        gb = 0.7 * gb + 0.3 * np.diag(np.diag(gb))
        wa, wb = a[name].numpy().astype(np.float64), b[name].numpy().astype(np.float64)
        expected = np.linalg.solve(0.6 * ga + 0.4 * gb, 0.6 * ga @ wa.T + 0.4 * gb @ wb.T).T
        np.testing.assert_allclose(merged[name].numpy(), expected, rtol=1e-5, atol=1e-6)
        assert merged[name].dtype == torch.float32
        assert log.params[name]["solver"] == "cholesky"
        assert log.params[name]["gram"] == gram_key
    assert log.params["layer.0.query.weight"]["shared_with"] == ["layer.0.key.weight"]
    # a shared key solves the same as separate keys
    split = {"layer.0.query.weight": "q", "layer.0.key.weight": "k", "layer.0.out.weight": "layer.0.out_in"}
    alias = lambda grams: {"q": grams["l0.in"], "k": grams["l0.in"], "layer.0.out_in": grams["l0.out_in"]}  # noqa: E731
    separate = merge_regmean(
        [a, b], [0.6, 0.4], grams=[alias(grams_a), alias(grams_b)], linear_weights=split, shrink=0.7
    )
    for key in a:
        torch.testing.assert_close(separate[key], merged[key], rtol=0, atol=0)
    # non-Linear tensors merge linearly
    linear = merge_linear([a, b], [0.6, 0.4])
    for key in ("layer.0.query.bias", "layer.0.norm.weight", "embeddings.word.weight"):
        assert torch.equal(merged[key], linear[key])
        assert log.params[key]["method"] == "linear"


def test_regmean_endpoints_are_exact():
    a, b = make_state(0), make_state(1)
    grams_a, _ = grams_from(5)
    grams_b, _ = grams_from(6)
    kwargs = dict(grams=[grams_a, grams_b], linear_weights=LINEAR)
    at_zero = merge_regmean([a, b], [1.0, 0.0], **kwargs)
    at_one = merge_regmean([a, b], [0.0, 1.0], **kwargs)
    for key in a:
        assert torch.equal(at_zero[key], a[key])
        assert torch.equal(at_one[key], b[key] if key != "embeddings.position_ids" else a[key])


def test_regmean_singular_gram_falls_back_to_linear_on_dead_inputs():
    a, b = make_state(0, torch.float64), make_state(1, torch.float64)
    grams_a, xs_a = grams_from(7)
    grams_b, xs_b = grams_from(8)
    for grams, xs in ((grams_a, xs_a), (grams_b, xs_b)):
        xs["l0.in"][:, 2] = 0.0  # input feature 2 is never active
        grams["l0.in"] = xs["l0.in"].T @ xs["l0.in"]
    merged, log = merge_regmean(
        [a, b], [0.5, 0.5], grams=[grams_a, grams_b], linear_weights=LINEAR, shrink=0.9, return_log=True
    )
    name = "layer.0.query.weight"
    assert log.params[name]["solver"] == "ridge"
    assert log.params["layer.0.out.weight"]["solver"] == "cholesky"
    assert bool(torch.isfinite(merged[name]).all())
    torch.testing.assert_close(merged[name][:, 2], 0.5 * (a[name][:, 2] + b[name][:, 2]), rtol=1e-6, atol=1e-6)


def test_regmean_rejects_bad_grams():
    a, b = make_state(0), make_state(1)
    grams, _ = grams_from(5)
    with pytest.raises(RaotError, match="no Gram matrix 'l0.in' for B′"):
        merge_regmean([a, b], [0.5, 0.5], grams=[grams, {"l0.out_in": grams["l0.out_in"]}], linear_weights=LINEAR)
    wrong = {**grams, "l0.in": torch.eye(4, dtype=torch.float64)}
    with pytest.raises(RaotError, match=r"needs \(6, 6\)"):
        merge_regmean([a, b], [0.5, 0.5], grams=[wrong, grams], linear_weights=LINEAR)
    with pytest.raises(RaotError, match="not a parameter"):
        merge_regmean([a, b], [0.5, 0.5], grams=[grams, grams], linear_weights={"nope.weight": "l0.in"})


# ----------------------------------------------------------------------------- Fisher


def fishers(seed, state):
    g = torch.Generator().manual_seed(seed)
    keys = ["layer.0.query.weight", "layer.0.out.weight", "layer.0.norm.weight"]
    return {k: torch.rand(state[k].shape, generator=g) ** 3 for k in keys}


def test_fisher_with_equal_fishers_is_linear():
    a, b = make_state(0, torch.float64), make_state(1, torch.float64)
    f = fishers(3, a)
    for alpha in (0.5, 0.2):
        merged = merge_fisher([a, b], [1 - alpha, alpha], fishers=[f, f])
        linear = merge_linear([a, b], [1 - alpha, alpha])
        for key in a:
            torch.testing.assert_close(merged[key], linear[key], rtol=1e-13, atol=1e-13)


def test_fisher_matches_numpy_and_ignores_overall_scale():
    a, b = make_state(0), make_state(1)
    fa, fb = fishers(3, a), fishers(4, b)
    fa["layer.0.norm.weight"][:2] = 0.0
    fb["layer.0.norm.weight"][:2] = 0.0  # no Fisher mass in either model: linear there
    merged, log = merge_fisher([a, b], [0.7, 0.3], fishers=[fa, fb], eps=1e-8, return_log=True)
    mean_a = sum(float(v.double().sum()) for v in fa.values()) / sum(v.numel() for v in fa.values())
    mean_b = sum(float(v.double().sum()) for v in fb.values()) / sum(v.numel() for v in fb.values())
    for key in a:
        if key not in fa:
            continue
        na = 0.7 * (fa[key].numpy().astype(np.float64) / mean_a + 1e-8)
        nb = 0.3 * (fb[key].numpy().astype(np.float64) / mean_b + 1e-8)
        wa, wb = a[key].numpy().astype(np.float64), b[key].numpy().astype(np.float64)
        np.testing.assert_allclose(merged[key].numpy(), (na * wa + nb * wb) / (na + nb), rtol=1e-6, atol=1e-7)
        assert log.params[key]["method"] == "fisher"
    norm = "layer.0.norm.weight"
    torch.testing.assert_close(merged[norm][:2], 0.7 * a[norm][:2] + 0.3 * b[norm][:2])
    assert log.params["layer.0.key.weight"]["method"] == "linear"
    scaled = merge_fisher([a, b], [0.7, 0.3], fishers=[{k: v * 1e6 for k, v in fa.items()}, fb])
    for key in a:
        torch.testing.assert_close(scaled[key], merged[key], rtol=1e-5, atol=1e-6)


def test_fisher_errors():
    a, b = make_state(0), make_state(1)
    fa = fishers(3, a)
    with pytest.raises(RaotError, match="different parameters"):
        merge_fisher([a, b], [0.5, 0.5], fishers=[fa, {k: v for k, v in fa.items() if "norm" not in k}])
    bad = {**fa, "layer.0.norm.weight": -fa["layer.0.norm.weight"]}
    with pytest.raises(RaotError, match="negative"):
        merge_fisher([a, b], [0.5, 0.5], fishers=[bad, fa])


# ----------------------------------------------------------------------------- siblings


def test_task_arithmetic_matches_loops():
    base, a, b = make_state(10), make_state(11), make_state(12)
    merged = merge_task_arithmetic([a, b], [0.75, 0.25], base=base, scale=0.7)
    for key in a:
        if not a[key].is_floating_point():
            assert torch.equal(merged[key], a[key])
            continue
        flat_base, flat_a, flat_b = (s[key].double().flatten().tolist() for s in (base, a, b))
        expected = [x0 + 0.7 * (0.75 * (xa - x0) + 0.25 * (xb - x0)) for x0, xa, xb in zip(flat_base, flat_a, flat_b)]
        np.testing.assert_allclose(merged[key].flatten().numpy(), np.float32(expected), rtol=1e-6, atol=1e-6)
    key = next(k for k in base if base[k].dim() == 2)
    with pytest.raises(RaotError, match="in the base but"):
        merge_task_arithmetic([a, b], [0.5, 0.5], base={**base, key: base[key][:, :1]})


def ties_reference(base, a, b, density, scale, weights=(0.5, 0.5)):
    """mergekit's TIES for one tensor, with plain Python loops over a flat list: keep the
    int(density·n) largest magnitudes (the larger index first among equal ones does not matter
    for random data), elect the sign of the weighted sum (+ at 0), weighted mean of the agreeing."""
    n = len(base)
    keep = int(density * n)

    def trim(task):
        order = sorted(range(n), key=lambda i: abs(task[i]), reverse=True)[:keep]
        return [t if i in order else 0.0 for i, t in enumerate(task)]

    tasks = [trim([x - y for x, y in zip(m, base)]) for m in (a, b)]
    out = []
    for i in range(n):
        total = sum(w * t[i] for w, t in zip(weights, tasks))
        sign = 1 if total >= 0 else -1
        agreeing = [(w, t[i]) for w, t in zip(weights, tasks) if t[i] != 0 and (t[i] > 0) - (t[i] < 0) == sign]
        mass = sum(w for w, _ in agreeing)
        out.append(base[i] + scale * (sum(w * t for w, t in agreeing) / mass if agreeing else 0.0))
    return out


def test_ties_hand_made():
    base = {"w": torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)}
    a = {"w": torch.tensor([3.0, -1.0, 0.5, 2.0, 1.0], dtype=torch.float64)}
    b = {"w": torch.tensor([1.0, 4.0, -0.2, -3.0, 1.0], dtype=torch.float64)}
    # density 0.6 keeps 3 of 5: A keeps 3, 2, -1; B keeps 4, -3, 1 (ties none)
    merged = merge_ties([a, b], [0.5, 0.5], base=base, density=0.6, scale=1.0)["w"]
    # entry 0: 3 & 1 agree → 2; entry 1: -1 vs 4 → sign +, only 4; entry 2: trimmed both → 0;
    # entry 3: 2 vs -3 → sign −, only -3; entry 4: no task → base
    torch.testing.assert_close(merged, torch.tensor([2.0, 4.0, 0.0, -3.0, 1.0], dtype=torch.float64))


@pytest.mark.parametrize("density", [0.2, 0.5, 1.0])
def test_ties_matches_loops(density):
    base, a, b = make_state(20), make_state(21), make_state(22)
    merged, log = merge_ties([a, b], [0.5, 0.5], base=base, density=density, scale=0.8, return_log=True)
    for key in a:
        if not a[key].is_floating_point():
            continue
        expected = ties_reference(*(s[key].double().flatten().tolist() for s in (base, a, b)), density, 0.8)
        np.testing.assert_allclose(merged[key].flatten().numpy(), np.float32(expected), rtol=1e-6, atol=1e-6)
        kept = int(density * a[key].numel()) / a[key].numel()
        assert log.params[key]["kept_1"] <= kept and log.params[key]["kept_2"] <= kept
    with pytest.raises(RaotError, match="density"):
        merge_ties([a, b], [0.5, 0.5], base=base, density=0.0)


# ----------------------------------------------------------------------------- two models: the formulas, bit for bit


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_two_models_with_weights_one_minus_alpha_alpha_are_the_two_model_formulas(dtype, alpha):
    """N = 2 with weights (1 − α, α) is the two-model formula written out in float64 and cast
    once, bit for bit (negative zeros included); RegMean's solve to float64 accuracy."""
    base, a, b = make_state(30, dtype), make_state(31, dtype), make_state(32, dtype)
    for state in (a, b):
        state["layer.0.query.bias"][0] = -0.0  # (1 − α)·(−0) + α·(−0) is −0: no zero start may turn it to +0
    del base["layer.0.norm.weight"]  # not in the base: linear
    w = [1 - alpha, alpha]
    f64 = {k: [s[k].double() for s in (a, b)] for k in a}

    def linear(k):
        return ((1 - alpha) * f64[k][0] + alpha * f64[k][1]).to(dtype)

    merged = merge_linear([a, b], w)
    assert all(torch.equal(_bits(merged[k]), _bits(linear(k) if a[k].is_floating_point() else a[k])) for k in a)
    assert math.copysign(1.0, float(merged["layer.0.query.bias"][0])) == -1.0

    merged = merge_task_arithmetic([a, b], w, base, scale=1.3)
    for k in (k for k in a if a[k].is_floating_point()):
        if k not in base:
            assert torch.equal(_bits(merged[k]), _bits(linear(k))), k
            continue
        origin = base[k].double()
        want = origin + 1.3 * ((1 - alpha) * (f64[k][0] - origin) + alpha * (f64[k][1] - origin))
        assert torch.equal(_bits(merged[k]), _bits(want.to(dtype))), k

    fishers = [{k: s[k].double().abs() + 0.1 for k in s if s[k].is_floating_point()} for s in (a, b)]
    means = [sum(float(v.sum()) for v in f.values()) / sum(v.numel() for v in f.values()) for f in fishers]
    merged = merge_fisher([a, b], w, fishers=fishers, eps=1e-8)
    for k in fishers[0]:
        weight_a = (1 - alpha) * (fishers[0][k] / means[0] + 1e-8)
        weight_b = alpha * (fishers[1][k] / means[1] + 1e-8)
        want = (weight_a * f64[k][0] + weight_b * f64[k][1]) / (weight_a + weight_b)
        assert torch.equal(_bits(merged[k]), _bits(want.to(dtype))), k

    grams = [grams_from(33)[0], grams_from(34)[0]]
    merged = merge_regmean([a, b], w, grams=grams, linear_weights=LINEAR, shrink=0.9)
    for k, key in LINEAR.items():
        g = [shrink_gram(gr[key], 0.9) for gr in grams]
        system = (1 - alpha) * g[0] + alpha * g[1]
        rhs = (1 - alpha) * g[0] @ f64[k][0].T + alpha * g[1] @ f64[k][1].T
        want = torch.linalg.solve(system, rhs).T
        torch.testing.assert_close(
            merged[k].double(), want.to(dtype).double(), rtol=0, atol=2 * want.abs().max() * 2**-8
        )


# ----------------------------------------------------------------------------- registry and heads


def test_registry():
    assert {"linear", "regmean", "fisher", "task_arithmetic", "ties"} <= set(available_merge_rules())
    assert get_merge_rule("linear") is merge_linear
    with pytest.raises(RaotError, match=r"unknown merge rule 'karcher'; valid: .*linear.*regmean.*ties"):
        get_merge_rule("karcher")
    with pytest.raises(RaotError, match="already registered.*linear"):
        register_merge_rule("linear", merge_ties)
    with pytest.raises(TypeError, match="callable"):
        register_merge_rule("not_a_function", 3)


HEAD = ["classifier.weight", "classifier.bias"]


def head_state(seed, labels=3):
    g = torch.Generator().manual_seed(seed)
    return {
        "classifier.weight": torch.randn(labels, 6, generator=g),
        "classifier.bias": torch.randn(labels, generator=g),
    }


def test_head_policies():
    a, b = head_state(0), head_state(1)
    labels = {0: "neg", 1: "neu", 2: "pos"}
    from_a = merge_heads([a, b], HEAD, [0.5, 0.5], "a")
    from_b = merge_heads([a, b], HEAD, [0.5, 0.5], "b")
    for name in HEAD:
        assert torch.equal(from_a[name], a[name]) and torch.equal(from_b[name], b[name])
    spaces = [(3, labels), (3, {str(k): v for k, v in labels.items()})]
    averaged, log = merge_heads([a, b], HEAD, [0.5, 0.5], "average", spaces, return_log=True)
    for name in HEAD:
        torch.testing.assert_close(averaged[name], 0.5 * (a[name] + b[name]))
    assert log.rule == "heads" and log.counts == {"linear": 2} and log.settings["weights"] == [0.5, 0.5]
    other = head_state(2, labels=2)
    assert merge_heads([a, other], HEAD, [0.5, 0.5], "b")["classifier.weight"].shape == (2, 6)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.3, 1 / 3, 0.7, 1.0])
def test_two_model_head_average_is_the_alpha_formula_bit_for_bit(alpha):
    """Weights (1 − α, α) sum to exactly 1: the average is (1 − α)·x_A + α·x_B′ in float64, as written."""
    a, b = head_state(0), head_state(1)
    averaged = merge_heads([a, b], HEAD, [1.0 - alpha, alpha], "average", [(3, None), (3, None)])
    for name in HEAD:
        if alpha in (0.0, 1.0):
            expected = (a if alpha == 0.0 else b)[name]
        else:
            expected = ((1.0 - alpha) * a[name].double() + alpha * b[name].double()).float()
        assert torch.equal(averaged[name], expected)


def test_head_average_of_n_models_is_the_normalised_weighted_mean():
    states = [head_state(seed) for seed in range(4)]
    weights = [0.5, 0.0, 1.0, 0.5]
    averaged, log = merge_heads(states, HEAD, weights, "average", [(3, None)] * 4, return_log=True)
    for name in HEAD:
        expected = sum(w / 2.0 * s[name].double() for w, s in zip(weights, states) if w)
        torch.testing.assert_close(averaged[name], expected.float(), rtol=0, atol=1e-7)
    assert log.settings == {"policy": "average", "weights": [0.25, 0.0, 0.5, 0.25]}
    from_reference = merge_heads(states, HEAD, weights, "a")
    assert all(torch.equal(from_reference[name], states[0][name]) for name in HEAD)


def test_head_policy_errors():
    a, b = head_state(0), head_state(1)
    expected = r"--head average needs the same label space; A has 3 labels.*B has 3 labels.*use --head a or --head b"
    swapped = [(3, {0: "a", 1: "b", 2: "c"}), (3, {0: "a", 1: "c", 2: "b"})]
    with pytest.raises(RaotError, match=expected):
        merge_heads([a, b], HEAD, [0.5, 0.5], "average", swapped)
    with pytest.raises(RaotError, match="A has 3 labels.*B has 2 labels"):
        merge_heads([a, head_state(1, 2)], HEAD, [0.5, 0.5], "average", [(3, None), (2, None)])
    with pytest.raises(RaotError, match="unknown head policy 'mean'"):
        merge_heads([a, b], HEAD, [0.5, 0.5], "mean")
    with pytest.raises(RaotError, match="not in B′"):
        merge_heads([a, {}], HEAD, [0.5, 0.5], "b")
    with pytest.raises(RaotError, match="needs every model's label space"):
        merge_heads([a, b], HEAD, [0.5, 0.5], "average")
    c = head_state(2)
    with pytest.raises(RaotError, match="model 1 has 3 labels.*model 3 has 2 labels.*use --head a$"):
        merge_heads([a, b, c], HEAD, [1, 1, 1], "average", [(3, None), (3, None), (2, None)])
    with pytest.raises(RaotError, match="--head b names one of two models"):
        merge_heads([a, b, c], HEAD, [1, 1, 1], "b")
    with pytest.raises(RaotError, match="not in model 3"):
        merge_heads([a, b, {}], HEAD, [1, 1, 1], "average", [(3, None)] * 3)
