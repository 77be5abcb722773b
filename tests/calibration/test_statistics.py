"""The two-phase statistics pass (docs/design.md §4–5): fit moments, held-out sums under candidates."""

import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raot_hf.adapters import schema_for
from raot_hf.calibration import CalibrationConfig, iter_calibration_batches
from raot_hf.calibration.collector import StatisticsCollector
from raot_hf.calibration.statistics import quadratic_dtype
from raot_hf.estimators.activation import (
    candidate_maps,
    head_gains,
    mlp_gains,
    residual_gains,
)
from raot_hf.symmetry import HeadAlignment, MLPPermutation, random_group_element
from raot_hf.testing import tiny_image_dataset, tiny_image_processor, tiny_model, tiny_text_dataset, tiny_tokenizer


def _as_split(batches, heldout: bool):
    for batch in batches:
        yield dataclasses.replace(batch, heldout=torch.full_like(batch.heldout, heldout))


def _collect(a, b, schema, batches, **options):
    with StatisticsCollector(a, b, schema, **options) as collector:
        for batch in batches:
            collector.update(batch)
    return collector.stats


def _old_head_gains(q, k, ctx, t: HeadAlignment, H, h):
    """The gate's score from full k×k moments: tr(N_iπ(i)·R)/z minus the same-index identity."""

    def blocks(m):
        return m.reshape(H, h, H, h).permute(0, 2, 1, 3)

    def energy(sq):
        return sq.reshape(H, h).sum(-1)

    n_qk, n_vo = blocks(q.raw_cross() + k.raw_cross()), blocks(ctx.raw_cross())
    z_qk = torch.outer(energy(q.sq_a + k.sq_a), energy(q.sq_b + k.sq_b)).sqrt()
    z_vo = torch.outer(energy(ctx.sq_a), energy(ctx.sq_b)).sqrt()
    ar = torch.arange(H)
    eye = torch.eye(h, dtype=torch.float64).expand(H, h, h)

    def cos(n, z, idx, r):
        return torch.einsum("hab,hba->h", n[ar, idx], r) / z[ar, idx]

    est = 0.5 * (cos(n_qk, z_qk, t.perm, t.qk) + cos(n_vo, z_vo, t.perm, t.vo))
    ident = 0.5 * (cos(n_qk, z_qk, ar, eye) + cos(n_vo, z_vo, ar, eye))
    return est - ident


def _old_residual_gains(stream, stream_bb, t):
    """The stream score from full d×d moments: (M·O)_jj / √(S_A,jj · (Oᵀ·S_B·O)_jj) minus the
    identity's (M = Σaᵀb, S_B = Σbᵀb)."""
    cross, o = stream.raw_cross(), t.matrix
    ea, sq_b = stream.sq_a.clamp_min(1e-300), stream.sq_b.clamp_min(1e-300)
    mapped = torch.einsum("ji,ij->j", cross, o)
    eb = torch.einsum("ij,ik,kj->j", o, stream_bb, o)
    return mapped / (ea * eb).sqrt() - cross.diagonal() / (ea * sq_b).sqrt()


@pytest.mark.parametrize("model_type,head", [("bert", "sequence"), ("vit", "image")])
def test_heldout_sums_score_candidates_like_full_moments(model_type, head):
    """The held-out phase's per-coordinate sums give the same gains as the full cross moments
    the gate used to read (same examples, same candidates): the objective did not change."""
    a = tiny_model(model_type, head, seed=0)
    b = tiny_model(model_type, head, seed=7)  # independent: the candidates below are not the answer
    schema = schema_for(a)
    pre, data = (
        (tiny_image_processor(), tiny_image_dataset(24))
        if model_type == "vit"
        else (tiny_tokenizer(), tiny_text_dataset(24))
    )
    batches = list(iter_calibration_batches(data, pre, CalibrationConfig(batch_size=8)))
    kinds = ("mlp", "heads", "residual")  # orthogonal head maps: the full-moment formula below has no scales
    candidates = list(random_group_element(schema, seed=5, kinds=kinds, residual="rotation").transforms)
    full = _collect(a, b, schema, _as_split(batches, False)).fit
    stream_bb = _collect(b, b, schema, _as_split(batches, False)).fit.stream.raw_cross()  # Σbᵀb
    maps = candidate_maps(candidates, schema.num_heads, schema.head_size)
    sums = _collect(a, b, schema, _as_split(batches, True), phase="heldout", candidates=maps).heldout
    assert int(sums.tokens) == int(full.tokens) > 0
    H, h = schema.num_heads, schema.head_size
    checked = set()
    for t in candidates:
        if isinstance(t, MLPPermutation):
            corr = full.mlp[t.layer].correlation()
            want = corr[torch.arange(len(t.perm)), t.perm] - corr.diagonal()
            got, _ = mlp_gains(sums.mlp[t.layer])
        elif isinstance(t, HeadAlignment):
            i = t.layer
            want = _old_head_gains(full.q[i], full.k[i], full.ctx[i], t, H, h)
            got, _ = head_gains(sums.q[i], sums.k[i], sums.ctx[i], H, h)
        else:
            want = _old_residual_gains(full.stream, stream_bb, t)
            got, _ = residual_gains(sums.stream)
        checked.add(type(t).__name__)
        assert got.abs().max() > 1e-3  # a random candidate really changes the score
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert {"MLPPermutation", "HeadAlignment", "ResidualRotation"} <= checked


def test_moment_stride_keeps_every_sth_token_of_each_example():
    a, b = tiny_model("bert", "sequence", seed=0), tiny_model("bert", "sequence", seed=1)
    schema = schema_for(a)
    batches = list(iter_calibration_batches(tiny_text_dataset(20), tiny_tokenizer(), CalibrationConfig(batch_size=8)))
    for stride in (1, 3):
        stats = _collect(a, b, schema, batches, moment_stride=stride).fit
        want = 0
        for batch in batches:
            fit = ~batch.heldout.to(torch.bool)
            pos = torch.arange(batch.token_mask.shape[1])[None, :] + batch.example_ids[:, None]
            want += int((batch.token_mask.bool() & fit[:, None] & (pos % stride == 0)).sum())
        assert int(stats.moment_tokens) == int(stats.mlp[0].n) == int(stats.stream.n) // len(schema.stream_modules)
        assert int(stats.moment_tokens) == want
        assert int(stats.tokens) >= want * stride
    with pytest.raises(ValueError, match="moment_stride"):
        StatisticsCollector(a, b, schema, moment_stride=0)


def test_quadratic_sums_in_activation_precision():
    for dtype in (torch.float32, torch.float64):
        a, b = tiny_model("bert", "sequence", dtype=dtype, seed=0), tiny_model("bert", "sequence", dtype=dtype, seed=1)
        batches = iter_calibration_batches(tiny_text_dataset(8), tiny_tokenizer(), CalibrationConfig(batch_size=8))
        stats = _collect(a, b, schema_for(a), batches).fit
        assert stats.mlp[0].comoment.dtype == quadratic_dtype(dtype) == dtype
        assert stats.q[0].comoment.dtype == quadratic_dtype(dtype) and stats.stream.comoment.dtype == torch.float64
        assert stats.mlp[0].sum_a.dtype == stats.mlp[0].sq_a.dtype == torch.float64


@settings(max_examples=60, deadline=None)
@given(
    rows=st.sampled_from([1, 2, 4, 8, 16]),
    cols=st.integers(1, 24),
    block_rows=st.integers(1, 5),
    quad=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_moment_sums_are_exact_where_the_arithmetic_is(rows, cols, block_rows, quad, seed):
    """Two batches of small integers, a power of two rows each: every mean, centred row, product and
    Chan term is exact in float32, so Moments must equal integer arithmetic, whatever the blocks
    (cut here to a few rows, the last one shorter) through which the float64 sums and the centred
    rows are made."""
    from raot_hf.calibration import statistics
    from raot_hf.calibration.statistics import Moments

    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randint(-4, 5, (2 * rows, cols), generator=g, dtype=torch.int64) for _ in range(2))
    dtype = quad  # float32 rows sum into a float32 co-moment; float64 rows into a float64 one
    cut = {"_BLOCK_ENTRIES": block_rows * cols, "_CENTERED_ENTRIES": block_rows * cols}
    with mock.patch.multiple(statistics, **cut):
        moments = Moments.zeros(cols, quad_dtype=quad)
        for half in (slice(0, rows), slice(rows, 2 * rows)):
            moments.update(a[half].to(dtype), b[half].to(dtype))
    ca, cb = a * 2 * rows - a.sum(0), b * 2 * rows - b.sum(0)  # (2·rows)·(x − x̄), in integers
    expected = (ca.T @ cb).double() / (2 * rows) ** 2
    assert int(moments.n) == int(moments.n_cross) == 2 * rows
    assert torch.equal(moments.sum_a, a.sum(0).double()) and torch.equal(moments.sum_b, b.sum(0).double())
    assert torch.equal(moments.sq_a, (a * a).sum(0).double()) and torch.equal(moments.sq_b, (b * b).sum(0).double())
    assert torch.equal(moments.comoment.double(), expected)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), dead=st.integers(0, 3))
def test_the_correlation_block_by_block_is_the_whole_matrix_formula(seed, dead):
    """The correlation divides C by the outer product of the spreads a block of rows at a time:
    the same value in every entry as the formula over the whole k × k matrix, constant units 0."""
    from raot_hf.calibration.statistics import Moments, row_blocks

    g = torch.Generator().manual_seed(seed)
    k = 1500  # several blocks of rows
    a, b = torch.randn(64, k, generator=g), torch.randn(64, k, generator=g)
    a[:, :dead] = 1.0  # constant units
    moments = Moments.zeros(k)
    moments.update(a, b)
    assert len(row_blocks(k, k)) > 1
    _, sa, _, sb = moments.unit_statistics()
    corr = moments.comoment.to(torch.float64) / moments.n_cross.clamp_min(1)
    denom = torch.outer(sa, sb)
    expected = (corr / denom.clamp_min(1e-12)).masked_fill(denom <= 1e-12, 0.0)
    got = moments.correlation()
    assert torch.equal(got, expected)
    assert bool((got[:dead] == 0).all())
