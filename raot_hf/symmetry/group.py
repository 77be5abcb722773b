"""Random and structured group elements: Haar-orthogonal matrices, the mean-axis complement
basis (docs/design.md §4, mean-preserving Procrustes), and :func:`scramble`."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from raot_hf.adapters import schema_for
from raot_hf.adapters.schema import ModelSchema
from raot_hf.errors import RaotError
from raot_hf.symmetry.apply import transform_model
from raot_hf.symmetry.experts import random_expert_alignment
from raot_hf.symmetry.transforms import (
    HeadAlignment,
    HeadRescale,
    MLPPermutation,
    ResidualPermutation,
    ResidualRotation,
    ResidualSignedPermutation,
    Transform,
    TransformSequence,
    partial_rope_blocks,
    rope_blocks,
    turn_blocks,
)

_F64 = torch.float64
SCRAMBLE_KINDS = ("mlp", "experts", "heads", "residual", "rescale")


def random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """A Haar-distributed element of O(n) (reflections included)."""
    a = torch.randn(n, n, generator=generator, dtype=_F64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r))


def mean_axis_basis(d: int) -> torch.Tensor:
    """A fixed orthonormal basis (d × d−1) of the complement of the mean axis 1/√d (Helmert)."""
    b = torch.zeros(d, d - 1, dtype=_F64)
    for k in range(1, d):
        b[:k, k - 1] = 1.0
        b[k, k - 1] = -float(k)
        b[:, k - 1] /= (k * (k + 1)) ** 0.5
    return b


def mean_fixing(rotation: torch.Tensor) -> torch.Tensor:
    """Embed R ∈ O(d−1) as O = u·uᵀ + Bᵤ·R·Bᵤᵀ ∈ O(d) with O·1 = 1."""
    d = rotation.shape[0] + 1
    u = torch.full((d, 1), d**-0.5, dtype=_F64)
    b = mean_axis_basis(d)
    return u @ u.T + b @ rotation.to(_F64) @ b.T


def random_group_element(
    schema: ModelSchema, seed: int = 0, kinds: Iterable[str] = SCRAMBLE_KINDS, residual: str = "auto"
) -> TransformSequence:
    """A random exact symmetry of a model with ``schema``; ``residual``: ``"rotation"`` (exact only
    for pre-LN), ``"permutation"`` or ``"auto"`` (rotation where it is exact)."""
    kinds = tuple(kinds)
    unknown = set(kinds) - set(SCRAMBLE_KINDS)
    if unknown:
        raise RaotError(f"unknown scramble kinds {sorted(unknown)}; choose from {', '.join(SCRAMBLE_KINDS)}")
    g = torch.Generator().manual_seed(int(seed))
    H, h = schema.num_heads, schema.head_size
    parts: list[Transform] = []
    if "residual" in kinds:
        mode = residual
        if mode == "auto":
            mode = "rotation" if schema.residual.exact in ("mean_fixing", "orthogonal") else "permutation"
        if mode == "rotation" and schema.residual.exact == "orthogonal":  # RMSNorm stream: all of O(d)
            parts.append(ResidualRotation(random_orthogonal(schema.hidden_size, g)))
        elif mode == "rotation":
            parts.append(ResidualRotation(mean_fixing(random_orthogonal(schema.hidden_size - 1, g))))
        elif mode == "permutation" and schema.residual.exact == "signed_permutation":
            perm = torch.randperm(schema.hidden_size, generator=g)
            signs = 2.0 * torch.randint(0, 2, (schema.hidden_size,), generator=g, dtype=_F64) - 1
            parts.append(ResidualSignedPermutation(perm, signs))
        elif mode == "permutation":
            parts.append(ResidualPermutation(torch.randperm(schema.hidden_size, generator=g)))
        else:
            raise RaotError(f"residual must be 'auto', 'rotation' or 'permutation', got {residual!r}")
    for layer in range(schema.num_layers):
        if "mlp" in kinds and schema.has_mlp(layer):
            parts.append(MLPPermutation(layer, torch.randperm(schema.mlp_size(layer), generator=g)))
        if "experts" in kinds and schema.layers[layer].experts is not None:
            parts.append(random_expert_alignment(schema, layer, g))
        shares_kv = schema.kv_space(layer, "k") is not None
        if "heads" in kinds and shares_kv:
            parts.append(random_shared_kv_heads(schema, layer, g))
        elif "heads" in kinds:
            if _structured_qk(schema):
                qk = random_qk_blocks(schema, H, g)
            else:
                qk = torch.stack([random_orthogonal(h, g) for _ in range(H)])
            vo = torch.stack([random_orthogonal(h, g) for _ in range(H)])
            perm = torch.randperm(H, generator=g) if schema.head_permutation else torch.arange(H)
            parts.append(HeadAlignment(layer, perm, qk, vo))
        if "rescale" in kinds:
            n = schema.kv_heads if shares_kv else H
            a = random_qk_scales(schema, n, g)
            c = torch.exp(0.5 * torch.randn(n, generator=g, dtype=_F64))
            if shares_kv:  # one scale per KV head, shared by its query heads
                a, c = (x.repeat_interleave(H // n, 0) for x in (a, c))
            parts.append(HeadRescale(layer, a, c))
    return TransformSequence(parts)


def _structured_qk(schema: ModelSchema) -> bool:
    """Whether a schema's Q/K maps are more than per-head orthogonal maps (positions, Q/K norms)."""
    return schema.qk_structure == "rope" or schema.qk_turns is not None


def random_qk_blocks(schema: ModelSchema, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` random Q/K maps (n, h, h) of the group a schema leaves (docs/design.md §8.2, §9): a
    rotation per rotary pair under RoPE (a turn by a multiple of 2π/``qk_turns`` under Q/K norms),
    Haar-orthogonal on the dims that do not rotate."""
    h, r = schema.head_size, schema.rotary_size if schema.qk_structure == "rope" else 0
    if schema.qk_turns is not None:
        if not r:  # no positions: the norm leaves sign flips of single dims
            signs = 2.0 * torch.randint(0, 2, (n, h), generator=g, dtype=_F64) - 1
            return torch.diag_embed(signs)
        rotary = turn_blocks(torch.randint(0, schema.qk_turns, (n, r // 2), generator=g), schema.qk_turns)
    elif schema.rotary_dims is None:
        return rope_blocks(2 * torch.pi * torch.rand(n, h // 2, generator=g, dtype=_F64))
    else:
        rotary = rope_blocks(2 * torch.pi * torch.rand(n, r // 2, generator=g, dtype=_F64))
    if r == h:
        return rotary
    free = torch.stack([random_orthogonal(h - r, g) for _ in range(n)])
    return partial_rope_blocks(rotary, free)


def random_qk_scales(schema: ModelSchema, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` heads' random Q/K scales e^{0.5·N(0,1)}: one per head, one per rotary pair under RoPE
    (s on q, 1/s on k commutes with the rotations), per dim of a partially rotary head (a pair's two
    dims share one, the dims that do not rotate another); all 1 where a Q/K norm absorbs them."""
    h = schema.head_size
    if not schema.qk_scales:
        return torch.ones(n, dtype=_F64)
    if schema.qk_structure != "rope":
        return torch.exp(0.5 * torch.randn(n, generator=g, dtype=_F64))
    if schema.rotary_dims is None:
        return torch.exp(0.5 * torch.randn(n, h // 2, generator=g, dtype=_F64))
    r = schema.rotary_dims
    pairs = torch.exp(0.5 * torch.randn(n, r // 2, generator=g, dtype=_F64))
    free = torch.exp(0.5 * torch.randn(n, 1, generator=g, dtype=_F64)).expand(n, h - r)
    return torch.cat([pairs, pairs, free], -1)


def random_shared_kv_heads(schema: ModelSchema, layer: int, g: torch.Generator) -> HeadAlignment:
    """A random head symmetry of a layer with shared KV heads (grouped-query attention, possibly
    RoPE; docs/design.md §8): KV heads permuted with their query heads, query heads within each,
    one Q/K and one V/O map per KV head (Haar-orthogonal, or random 2×2 rotations per rotary pair under RoPE)."""
    H, kv, h = schema.num_heads, schema.kv_heads, schema.head_size
    queries_per_kv = H // kv
    if schema.head_permutation:
        kv_perm = torch.randperm(kv, generator=g)
        within = torch.stack([torch.randperm(queries_per_kv, generator=g) for _ in range(kv)])
        perm = (kv_perm[:, None] * queries_per_kv + within).reshape(H)
    else:
        perm = torch.arange(H)
    if _structured_qk(schema):
        qk = random_qk_blocks(schema, kv, g)
    else:
        qk = torch.stack([random_orthogonal(h, g) for _ in range(kv)])
    vo = torch.stack([random_orthogonal(h, g) for _ in range(kv)])
    return HeadAlignment(layer, perm, qk.repeat_interleave(queries_per_kv, 0), vo.repeat_interleave(queries_per_kv, 0))


def scramble(
    model: torch.nn.Module,
    seed: int = 0,
    *,
    kinds: Iterable[str] = SCRAMBLE_KINDS,
    residual: str = "auto",
    working_files=None,
) -> TransformSequence:
    """Apply a random exact symmetry to ``model`` in place (same function; pre-LN LayerNorms folded
    first for a residual rotation) and return it: merging a model with its scramble gives it back.
    ``working_files``: the model's when it is offloaded (docs/design.md §7.4)."""
    schema = schema_for(model)
    transform = random_group_element(schema, seed, kinds, residual)
    transform_model(model, schema, transform, working_files=working_files)
    return transform
