"""The fit moments' product precision and the MLP token budget (docs/design.md §4.3)."""

import pytest
import torch

from raot_hf import RaotConfig, RaotError, RaotMerger
from raot_hf.calibration import precision
from raot_hf.calibration.precision import resolve_moment_precision
from raot_hf.calibration.statistics import Moments
from raot_hf.testing import clone, example_inputs, output_deviation, tiny_model, tiny_text_dataset, tiny_tokenizer


def test_resolution_rules(monkeypatch):
    """float64 models keep float64 whatever is asked; explicit requests are honoured; auto on a
    CPU follows its bf16 matrix instructions — a property of the hardware, not a timing, so two
    runs on one machine choose alike."""
    assert resolve_moment_precision("bfloat16", torch.float64, "cpu")[0] == torch.float64
    assert resolve_moment_precision("float32", torch.float32, "cpu")[0] == torch.float32
    assert resolve_moment_precision("bfloat16", torch.float32, "cpu")[0] == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: "AMX")
    dtype, why = resolve_moment_precision("auto", torch.float32, "cpu")
    assert dtype == torch.bfloat16 and "AMX" in why
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: None)
    dtype, why = resolve_moment_precision("auto", torch.float32, "cpu")
    assert dtype == torch.float32 and "no bf16" in why
    monkeypatch.undo()
    first = resolve_moment_precision("auto", torch.float32, "cpu")
    assert all(resolve_moment_precision("auto", torch.float32, "cpu") == first for _ in range(3))


def test_bf16_products_stay_close_and_sum_in_float32():
    """The MLP cross moment from bf16 products, summed in float32 over batches, is within bf16
    rounding of the float32 one (relative error of a correlation ≤ 1e-2, far below the 1/√n ≈
    0.03 sampling noise of n = 1024 rows), and the sums stay float32."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 48, generator=g)
    b = 0.7 * a[:, torch.randperm(48, generator=g)] + 0.3 * torch.randn(1024, 48, generator=g)
    exact = Moments.zeros(48, quad_dtype=torch.float32)
    half = Moments.zeros(48, quad_dtype=torch.float32, product_dtype=torch.bfloat16)
    for rows in torch.arange(1024).split(128):
        exact.update(a[rows], b[rows])
        half.update(a[rows], b[rows])
    assert half.comoment.dtype == torch.float32
    difference = (half.correlation() - exact.correlation()).abs().max()
    assert 0 < difference <= 1e-2
    assert torch.equal(half.correlation().argmax(1), exact.correlation().argmax(1))


@pytest.mark.parametrize("product", [torch.float32, torch.bfloat16], ids=str)
def test_comoments_are_stable_when_means_dwarf_the_spread(product):
    """Units whose mean is 10³ times their spread (a raw Σab − n·ā·b̄ in float32 cancels every
    digit; in bf16 it returned correlations far above 1): the co-moment, accumulated from
    batch-centered products and Chan's update, gives the float64 correlations to the product's
    precision, and the true matches of a permutation still correlate ≈ 1."""
    g = torch.Generator().manual_seed(2)
    n, k = 2048, 24
    a = 1e3 + torch.randn(n, k, generator=g, dtype=torch.float64)
    perm = torch.randperm(k, generator=g)
    b = a[:, perm]
    exact = Moments.zeros(k, quad_dtype=torch.float64)
    low = Moments.zeros(k, quad_dtype=torch.float32, product_dtype=product)
    for rows in torch.arange(n).split(100):  # uneven last batch: Chan's update carries the means
        exact.update(a[rows], b[rows])
        low.update(a[rows].float(), b[rows].float())
    tol = 2e-2 if product == torch.bfloat16 else 1e-4
    assert (low.correlation() - exact.correlation()).abs().max() <= tol
    matched = low.correlation()[perm, torch.arange(k)]
    assert matched.min() >= 1 - tol and low.correlation().max() <= 1 + tol
    assert torch.allclose(low.raw_cross(), a.T @ b, rtol=1e-6)


def test_cross_rows_budget_keeps_means_from_every_row():
    """With ``cross_rows`` only those rows enter the co-moment (counted in n_cross); the means
    and variances take every row, and the correlation stays unbiased for the subset."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(400, 8, generator=g, dtype=torch.float64), torch.randn(400, 8, generator=g, dtype=torch.float64)
    m = Moments.zeros(8)
    keep = torch.arange(0, 400, 3)
    m.update(a, b, cross_rows=keep)
    assert int(m.n) == 400 and int(m.n_cross) == len(keep)
    ak, bk = a[keep], b[keep]
    assert torch.allclose(m.comoment + torch.outer(m.xsum_a, m.xsum_b) / len(keep), ak.T @ bk)
    # the cross sum for every row: the kept rows' co-moment scaled up, the means from every row
    spread = (ak - ak.mean(0)).T @ (bk - bk.mean(0))
    assert torch.allclose(m.raw_cross(), torch.outer(a.sum(0), b.sum(0)) / 400 + spread * 400 / len(keep))
    assert torch.allclose(m.sum_a, a.sum(0))


def _llama_pair():
    a = tiny_model("llama", "causal", seed=0, num_key_value_heads=2, vocab_size=40, dtype=torch.float32)
    b = clone(a)
    from raot_hf import scramble

    scramble(b, seed=3)
    return a, b


@pytest.mark.parametrize("moment_precision", ["float32", "bfloat16"])
def test_scramble_recovered_with_either_precision(moment_precision):
    """merge(A, scramble(A)) of a float32 decoder gives A back with bf16 MLP products too, with
    the same decisions as float32; the report and the card say which precision was used."""
    a, b = _llama_pair()
    data, pre = tiny_text_dataset(96), tiny_tokenizer()
    cal = {"moment_precision": moment_precision}
    result = RaotMerger.from_models(clone(a), b, preprocessor=pre, calibration=cal).merge(calibration=data)
    assert output_deviation(a, result.model, example_inputs(a), relative=True) <= 1e-4
    assert all(d.applied for d in result.alignment.decisions)
    used = result.report["calibration"]["moment_precision"]
    assert used["requested"] == moment_precision and used["used"] == moment_precision


def test_token_budget_caps_the_mlp_moment_tokens():
    """``mlp_tokens_per_unit`` caps the tokens of each MLP cross moment near units × N (random
    positions), leaves the other sums on every token, and the scramble is still recovered."""
    a, b = _llama_pair()
    data, pre = tiny_text_dataset(256, min_len=8, max_len=16), tiny_tokenizer()
    f = a.config.intermediate_size
    cal = {"mlp_tokens_per_unit": 20, "batch_size": 16}
    result = RaotMerger.from_models(clone(a), b, preprocessor=pre, calibration=cal).merge(calibration=data)
    fingerprint = result.report["calibration"]
    kept = fingerprint["mlp_moment_tokens"]
    assert fingerprint["moment_tokens"] > 2 * 20 * f  # the budget binds
    assert all(0.6 * 20 * f <= k <= 1.4 * 20 * f for k in kept), kept
    assert output_deviation(a, result.model, example_inputs(a), relative=True) <= 1e-4


@pytest.mark.parametrize(
    ("option", "field", "other"),
    [
        ("mlp_cross_tokens", "mlp_moment_tokens", "hidden_moment_tokens"),
        ("hidden_cross_tokens", "hidden_moment_tokens", "mlp_moment_tokens"),
    ],
    ids=["mlp", "hidden"],
)
def test_a_token_cap_binds_only_where_the_fit_tokens_exceed_it(option, field, other):
    """``mlp_cross_tokens`` caps every MLP cross moment near that many tokens, ``hidden_cross_tokens``
    every query, key, context and stream cross moment, each leaving the other's moments whole, and
    the scramble is still recovered (an exact symmetry scores its true pairs on any subset); a cap
    above the fit tokens keeps every one of them and gives the merge of no cap, bit for bit."""
    a, b = _llama_pair()
    data, pre = tiny_text_dataset(256, min_len=8, max_len=16), tiny_tokenizer()
    merged = {}
    for cap in (600, 10**6, 0):
        cal = {option: cap, "batch_size": 16}
        result = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, calibration=cal).merge(calibration=data)
        fingerprint, merged[cap] = result.report["calibration"], result.model.state_dict()
        kept, every = fingerprint[field], [fingerprint["moment_tokens"]] * len(fingerprint[field])
        if cap == 600:
            assert fingerprint["moment_tokens"] > 2 * cap  # the cap binds
            assert all(0.6 * cap <= k <= 1.4 * cap for k in kept), kept
            assert fingerprint[other] == every  # the other moments' cap is not this one
        else:
            assert kept == every
        assert output_deviation(a, result.model, example_inputs(a), relative=True) <= 1e-4
    assert all(torch.equal(merged[10**6][k], merged[0][k]) for k in merged[0])


def test_a_capped_cross_sum_is_scaled_to_every_row():
    """Under a token budget the cross sum Σaᵀb is estimated for every row: the co-moment of the
    cross rows scaled by n / n_cross, the means from every row. Rows that repeat one block twice,
    with the first copy as the cross rows, give the full sum itself; without a budget nothing is
    scaled."""
    from raot_hf.calibration.statistics import Moments

    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, 6, generator=g, dtype=torch.float64) + 3.0
    b = a @ torch.randn(6, 6, generator=g, dtype=torch.float64) + 0.5 * torch.randn(
        300, 6, generator=g, dtype=torch.float64
    )
    full = (a.T @ b) * 2
    capped, every = Moments.zeros(6, quad_dtype=torch.float64), Moments.zeros(6, quad_dtype=torch.float64)
    capped.update(torch.cat([a, a]), torch.cat([b, b]), cross_rows=torch.arange(300))
    every.update(torch.cat([a, a]), torch.cat([b, b]))
    assert int(capped.n_cross) == 300 and int(capped.n) == 600
    assert torch.allclose(capped.raw_cross(), full, rtol=1e-12, atol=1e-9)
    assert torch.allclose(every.raw_cross(), full, rtol=1e-12, atol=1e-9)
    # the cross rows' own sum is half of it: unscaled, the cross sum would be off the squares' scale
    own = capped.comoment + torch.outer(capped.xsum_a, capped.xsum_b) / 300
    assert torch.allclose(own, full / 2, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize(
    ("cross", "per_unit", "world", "expected"),
    [
        (16384, 0, 1, 16384),
        (16384, 4, 1, 4 * 3072),
        (16384, 16, 1, 16384),
        (0, 16, 1, 16 * 3072),
        (0, 0, 1, 0),
        (16384, 0, 2, 8192),
    ],
)
def test_the_smaller_token_cap_binds_and_ranks_share_it(cross, per_unit, world, expected):
    from raot_hf.calibration import CalibrationConfig
    from raot_hf.stages.calibrate import mlp_token_budget

    cal = CalibrationConfig(mlp_cross_tokens=cross, mlp_tokens_per_unit=per_unit)
    assert mlp_token_budget(cal, 3072, world) == expected


def test_bad_settings_are_refused():
    with pytest.raises(RaotError, match="mlp_cross_tokens must be an integer >= 0"):
        RaotConfig.from_dict({"calibration": {"mlp_cross_tokens": -1}})
    with pytest.raises(RaotError, match="moment_precision must be one of auto, float32, bfloat16"):
        RaotConfig.from_dict({"calibration": {"moment_precision": "fp8"}})
    with pytest.raises(RaotError, match="mlp_tokens_per_unit must be an integer >= 0"):
        RaotConfig.from_dict({"calibration": {"mlp_tokens_per_unit": -1}})
    with pytest.raises(RaotError, match="hidden_cross_tokens must be an integer >= 0"):
        RaotConfig.from_dict({"calibration": {"hidden_cross_tokens": -1}})
