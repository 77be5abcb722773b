"""Near ties in the MLP assignment (docs/design.md §4.3–4.4): the error bound of a correlation
read from co-moments of a given product precision, and the rule that resolves the ties that bound
cannot order from exact per-unit statistics."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raot_hf.calibration import statistics
from raot_hf.calibration.precision import correlation_error_bound
from raot_hf.calibration.statistics import Moments
from raot_hf.estimators import estimate_mlp_permutation
from raot_hf.estimators.head_fit import assign
from raot_hf.estimators.ties import match_margins, resolve_near_ties


def _massive_units(n=2048, k=48, seed=0):
    """Heavy-tailed units as a trained model's MLP has them: most near 0.2, two near-twins of
    different magnitude that reach 10³ on a few tokens, correlating at ~0.9999."""
    g = torch.Generator().manual_seed(seed)
    x = 0.2 * torch.randn(n, k, generator=g, dtype=torch.float64)
    spikes = torch.zeros(n, dtype=torch.float64)
    spikes[::97] = 1000.0 * (1 + 0.1 * torch.rand(len(spikes[::97]), generator=g, dtype=torch.float64))
    x[:, 0] += spikes
    x[:, 1] = 0.35 * x[:, 0] + 0.02 * torch.randn(n, generator=g, dtype=torch.float64)
    return x


@pytest.mark.parametrize("blocks", ["whole", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_correlations_stay_within_the_error_bound_of_their_products(dtype, blocks, monkeypatch):
    """Measured: the largest move of any correlation from its float64 value stays within the
    bound for the products' precision — on units whose sums a few massive tokens carry, where
    rounding errors do not average out. ``split``: each 512-row batch is centered in float64
    blocks of 37 rows and multiplied in products of 150 rows (16-bit) — spans that cut blocks."""
    if blocks == "split":
        monkeypatch.setattr(statistics, "_BLOCK_ENTRIES", 37 * 48)
        monkeypatch.setattr(statistics, "_CENTERED_ENTRIES", 37 * 48)
        monkeypatch.setattr(statistics, "_PRODUCT_ENTRIES", 150 * 48)
    a = _massive_units()
    perm = torch.randperm(a.shape[1], generator=torch.Generator().manual_seed(1))
    b = a[:, perm]
    exact, rounded = Moments.zeros(a.shape[1]), Moments.zeros(a.shape[1], quad_dtype=torch.float32, product_dtype=dtype)
    for rows in torch.arange(a.shape[0]).split(512):
        exact.update(a[rows], b[rows])
        rounded.update(a[rows].float(), b[rows].float())
    moved = (rounded.correlation() - exact.correlation()).abs().max()
    assert moved <= correlation_error_bound(dtype)
    if dtype == torch.bfloat16:  # the bound is not vacuous here: bf16 moves more than the twins' margin
        twins_margin = 1 - exact.correlation()[0, (perm == 1).nonzero().item()]
        assert moved > 0.1 * twins_margin


def test_the_bf16_bound_covers_the_rounding_of_the_products_sum():
    """A bf16 matrix product returns its sum in bf16: with inputs that bf16 holds exactly, Σx² =
    1 + 2⁻⁸ comes back as 1 — an error of nearly u relative to ‖x‖², on top of what rounding
    the inputs may cost (2u + u²). The bound must hold both."""
    x = torch.tensor([[1.0], [2.0**-4]], dtype=torch.bfloat16)
    exact = 1 + 2.0**-8
    moved = abs(float((x.T @ x).float()) - exact) / exact  # ‖x‖·‖y‖ = Σx² here (x = y)
    u = 2.0**-8
    assert moved > 0.9 * u  # the sum's rounding is there, and near its worst case
    assert correlation_error_bound(torch.bfloat16) >= 2 * u + u * u + moved


def test_bf16_moments_of_near_twins_recover_the_exact_permutation():
    """The estimator on bf16 moments of a permuted copy returns the permutation that float64
    moments give, the twins included."""
    a = _massive_units(seed=3)
    perm = torch.randperm(a.shape[1], generator=torch.Generator().manual_seed(4))
    b = a[:, perm]
    exact, rounded = (
        Moments.zeros(a.shape[1]),
        Moments.zeros(a.shape[1], quad_dtype=torch.float32, product_dtype=torch.bfloat16),
    )
    for rows in torch.arange(a.shape[0]).split(256):
        exact.update(a[rows], b[rows])
        rounded.update(a[rows].float(), b[rows].float())
    truth = estimate_mlp_permutation(exact, 0).perm
    found, log = estimate_mlp_permutation(rounded, 0, return_log=True)
    assert torch.equal(b[:, found.perm], a) and torch.equal(found.perm, truth)
    assert log["near_ties"]["near_tied"] >= 2  # the twins were seen as a near tie, and resolved


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 12),
    seed=st.integers(0, 10_000),
    gap=st.floats(0.0, 1.0),
    tolerance=st.sampled_from([correlation_error_bound(torch.bfloat16), 1e-3, 1e-5]),
)
def test_an_exact_permutation_survives_any_perturbation_within_the_bound(n, seed, gap, tolerance):
    """Exact scores: 1 on the true pairs, rivals (twins) up to 1 − gap·2ε; observed scores off by
    up to ε each, adversarially. Where rivals differ in exact statistics (mismatch 1), the rule
    returns the true permutation whatever the perturbation."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randperm(n, generator=g)
    exact = torch.rand(n, n, generator=g, dtype=torch.float64) * (1 - gap * 2 * tolerance)
    exact[torch.arange(n), truth] = 1.0
    noise = (2 * torch.rand(n, n, generator=g, dtype=torch.float64) - 1) * tolerance
    noise[torch.arange(n), truth] = -tolerance  # the worst case: true pairs read low, rivals high
    noise[noise > 0] = tolerance
    observed = exact + noise
    is_true = torch.zeros(n, n, dtype=torch.bool)
    is_true[torch.arange(n), truth] = True

    def mismatch(rows, cols):
        return (~is_true[rows, cols]).double()

    resolved, info = resolve_near_ties(observed, assign(observed), tolerance, mismatch)
    assert torch.equal(resolved, truth)
    assert info.tolerance == tolerance


def test_a_match_with_no_rival_within_the_band_never_moves():
    """Pairs outside the band keep their scores: a clear assignment is the plain one, whatever the
    mismatch says."""
    score = torch.tensor([[0.9, 0.1, 0.2], [0.3, 0.8, 0.1], [0.0, 0.2, 0.7]], dtype=torch.float64)
    perm = assign(score)
    resolved, info = resolve_near_ties(score, perm, 1e-2, lambda r, c: torch.ones(len(r), dtype=torch.float64))
    assert torch.equal(resolved, perm) and info.near_tied == 0 and info.changed == 0
    assert match_margins(score, perm).min() == pytest.approx(0.5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 60), levels=st.integers(2, 50))
def test_the_assignment_is_the_solvers_maximum_and_leaves_the_scores_as_they_were(seed, n, levels):
    """``assign`` negates the scores in place for the solver and back: the solver's own maximising
    assignment (ties included: scores from a few levels), and the scores bit for bit as before."""
    import numpy
    from scipy.optimize import linear_sum_assignment

    g = torch.Generator().manual_seed(seed)
    score = torch.randint(0, levels, (n, n), generator=g).to(torch.float64) / levels - 0.5
    before = score.clone()
    rows, cols = linear_sum_assignment(numpy.array(score.numpy()), maximize=True)
    perm = assign(score)
    assert torch.equal(score, before)
    assert perm[torch.as_tensor(rows)].tolist() == cols.tolist()


def _copied_margins(score, perm):
    """The margins from a copy of the scores with the matches masked (the definition)."""
    ar = torch.arange(score.shape[0])
    rivals = score.clone()
    rivals[ar, perm] = -torch.inf
    return score[ar, perm] - torch.maximum(rivals.max(1).values, rivals.max(0).values[perm])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 40), levels=st.integers(2, 30))
def test_margins_and_the_penalised_solve_leave_the_scores_as_they_were(seed, n, levels):
    """The margins mask the matches and the penalised solve lowers the band in the scores
    themselves, each put back: the definition's margins and a solve of a penalised copy, bit for
    bit, and the scores unchanged (near ties from a few levels, so the band is rarely empty)."""
    g = torch.Generator().manual_seed(seed)
    score = torch.randint(0, levels, (n, n), generator=g).to(torch.float64) / levels
    before = score.clone()
    perm = assign(score)
    assert torch.equal(match_margins(score, perm), _copied_margins(before, perm))
    assert torch.equal(score, before)
    weights = torch.rand(n, n, generator=g, dtype=torch.float64)

    def mismatch(rows, cols):
        return weights[rows, cols]

    tolerance = 0.5 / levels
    resolved, _ = resolve_near_ties(score, perm, tolerance, mismatch)
    assert torch.equal(score, before)
    ar = torch.arange(n)
    matched = before[ar, perm]
    inverse = torch.empty_like(perm)
    inverse[perm] = ar
    band = (before >= (matched - 2 * tolerance)[:, None]) | (before >= (matched[inverse] - 2 * tolerance)[None, :])
    band &= (band.sum(1) > 1)[:, None] | (band.sum(0) > 1)[None, :]
    penalised = before.clone()
    rows, cols = band.nonzero(as_tuple=True)
    penalised[rows, cols] -= 4 * tolerance * mismatch(rows, cols)
    assert torch.equal(resolved, assign(penalised) if band.any() else perm)
