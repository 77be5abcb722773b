"""Sibling detection: identity affinity of the estimates (docs/design.md §5.4)."""

import pytest
import torch

from raot_hf import RaotMerger
from raot_hf.adapters import schema_for
from raot_hf.gate import Verdict
from raot_hf.gate.lineage import CHANCE_MULTIPLE, SIBLING_AFFINITY, detect_siblings, identity_affinity
from raot_hf.symmetry import HeadAlignment, MLPPermutation, ResidualPermutation, ResidualRotation
from raot_hf.symmetry.apply import transform_model
from raot_hf.symmetry.group import mean_fixing, random_orthogonal
from raot_hf.testing import clone, tiny_image_dataset, tiny_image_processor, tiny_model


def _perm_with_fixed(n: int, fixed: int, seed: int = 0) -> torch.Tensor:
    """A permutation of n with exactly ``fixed`` fixed points (a cycle on the rest)."""
    g = torch.Generator().manual_seed(seed)
    moved = torch.randperm(n, generator=g)[: n - fixed]
    perm = torch.arange(n)
    perm[moved] = moved.roll(1)
    return perm


def test_affinity_of_permutations_counts_fixed_points():
    assert identity_affinity(MLPPermutation(0, torch.arange(256)))[2] == 1.0
    assert identity_affinity(MLPPermutation(0, _perm_with_fixed(256, 64)))[2] == pytest.approx(0.25)
    kind, layer, affinity, size = identity_affinity(ResidualPermutation(_perm_with_fixed(64, 0)))
    assert (kind, layer, affinity, size) == ("residual", None, 0.0, 64)


def test_affinity_of_rotations_is_the_normalised_trace():
    g = torch.Generator().manual_seed(0)
    assert identity_affinity(ResidualRotation(torch.eye(64, dtype=torch.float64)))[2] == pytest.approx(1.0)
    haar = [identity_affinity(ResidualRotation(random_orthogonal(64, g)))[2] for _ in range(20)]
    assert max(abs(a) for a in haar) < SIBLING_AFFINITY  # E tr = 0, sd 1: |tr/d| ~ 1/64
    eye = torch.eye(8, dtype=torch.float64).expand(4, 8, 8)
    heads = HeadAlignment(0, torch.arange(4), eye.clone(), -eye.clone())  # R_vo = −I: a reflection
    assert identity_affinity(heads)[2] == pytest.approx(0.0)
    heads = HeadAlignment(0, torch.tensor([1, 0, 2, 3]), eye.clone(), eye.clone())
    assert identity_affinity(heads)[2] == pytest.approx(0.5)


def test_siblings_need_identity_dominated_estimates_and_none_at_chance():
    near = [MLPPermutation(i, _perm_with_fixed(256, 40, seed=i)) for i in range(3)]
    assert detect_siblings(near).siblings
    # One random map (1 fixed point of 64, chance level) among them: B shares A's basis only in part.
    assert not detect_siblings(near + [ResidualPermutation(_perm_with_fixed(64, 1))]).siblings
    assert not detect_siblings([]).siblings  # no estimate, no evidence
    # A drifted layer above chance but below the threshold (6 of 128 fixed points, as measured on
    # the ViT siblings' last MLP) does not outvote the others; a majority of such layers does.
    drifted = MLPPermutation(3, _perm_with_fixed(128, 6, seed=7))
    assert detect_siblings(near + [drifted]).siblings
    assert not detect_siblings(near[:1] + [drifted] * 2).siblings
    # A small map cannot pass by chance: 1 fixed point of 8 is 0.125 ≥ 0.1 but below 4/8.
    small = detect_siblings([MLPPermutation(0, _perm_with_fixed(8, 1))])
    assert not small.siblings and small.affinities[0]["chance"] == CHANCE_MULTIPLE / 8
    assert small.median == pytest.approx(0.125) and small.to_dict()["median_affinity"] == small.median


def _near_identity_rotation(d: int, angle: float, seed: int = 0) -> torch.Tensor:
    """exp(angle·K) for a random unit skew-symmetric K, embedded mean-fixing."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(d - 1, d - 1, generator=g, dtype=torch.float64)
    k = (k - k.T) / (k - k.T).norm() * (d - 1) ** 0.5
    return mean_fixing(torch.linalg.matrix_exp(angle * k))


def test_a_near_identity_basis_change_is_detected_and_left_alone():
    """B = A in a slightly rotated residual basis: the merge gate would repair it (the aligned
    merge is A itself), the sibling check keeps the identity and the merge is the plain average."""
    a = tiny_model("vit", "image", dtype=torch.float32, hidden_size=32, num_heads=4, intermediate_size=48)
    b = clone(a)
    rotation = _near_identity_rotation(32, 0.5)
    assert 0.5 < torch.trace(rotation) / 32 < 0.95
    transform_model(b, schema_for(b), ResidualRotation(rotation))
    pre, data = tiny_image_processor(), tiny_image_dataset(96)
    repaired, _, _ = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, sibling_check=False).align(data)
    assert any(d.applied and d.transform == "residual" for d in repaired.decisions)
    assert repaired.verdict_code is Verdict.DIFFERS_IN_BASIS
    merged = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre).merge(calibration=data)
    kept = merged.alignment
    assert kept.shares_basis and kept.verdict_code is Verdict.SIBLINGS
    # the merge-fidelity comparison is kept as evidence
    assert kept.basis_verdict.check is not None and kept.model_fidelity["siblings"]["siblings"]
    median, smallest = kept.basis_verdict.affinity
    assert median >= SIBLING_AFFINITY and smallest == kept.model_fidelity["siblings"]["smallest_affinity"]
    residual = next(d for d in kept.decisions if d.transform == "residual")
    assert not residual.applied and residual.reason.startswith("siblings:")
    plain = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, alignment="none").merge(calibration=data)
    got, want = merged.model.state_dict(), plain.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
