"""The symmetry group as a small algebra (docs/design.md §3).

A transform maps space names to :class:`SpaceAction` s — a permutation, or a matrix M — and
:func:`raot_hf.symmetry.apply.apply_transform` contracts every member of each space with M
(covariant) or M⁻ᵀ (contravariant). Transforms compose (:class:`TransformSequence`) and
round-trip through JSON (floats are written with ``repr`` precision, so exactly).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from raot_hf.adapters.schema import ModelSchema
from raot_hf.errors import RaotError

_F64 = torch.float64


@dataclass
class SpaceAction:
    """How a transform acts on one space: ``perm`` (new position j takes old ``perm[j]``,
    ``P[perm[j], j] = 1``), ``diagonal`` (M = diag(diagonal): a head rescale) or ``matrix``
    (``new[..., j] = Σᵢ old[..., i]·M[i, j]``); ``orthogonal`` marks M⁻ᵀ = M; ``contra``
    overrides the contravariant members' matrix (default M⁻ᵀ; a soft transport plan acts with the
    same plan on both sides)."""

    perm: torch.Tensor | None = None
    matrix: torch.Tensor | None = None
    orthogonal: bool = True
    contra: torch.Tensor | None = None
    #: the matrix's head-block structure when it has one (head maps, §3.2): ``(perm, blocks)`` with
    #: block (perm[i], i) = blocks[i] and zeros elsewhere, so a contraction costs H·h³, not (H·h)³
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None
    contra_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
    diagonal: torch.Tensor | None = None
    #: with ``perm``, a sign per new position: ``new[..., j] = signs[j]·old[..., perm[j]]`` (a signed
    #: permutation, docs/design.md §9.2); None: all +1
    signs: torch.Tensor | None = None

    def dense(self, n: int) -> torch.Tensor:
        if self.matrix is not None:
            return self.matrix.to(_F64)
        if self.diagonal is not None:
            return torch.diag(self.diagonal.to(_F64))
        m = torch.zeros(n, n, dtype=_F64)
        m[self.perm, torch.arange(n)] = 1.0 if self.signs is None else self.signs.to(_F64)
        return m

    def inverse_transpose(self) -> SpaceAction:
        if self.contra is not None:
            return SpaceAction(matrix=self.contra.to(_F64), orthogonal=False, blocks=self.contra_blocks)
        if self.diagonal is not None:
            return SpaceAction(diagonal=1 / self.diagonal.to(_F64), orthogonal=False)
        if self.perm is not None or self.orthogonal:
            return self
        return SpaceAction(matrix=torch.linalg.inv(self.matrix.to(_F64)).T, orthogonal=False)

    def then(self, other: SpaceAction, n: int) -> SpaceAction:
        """Apply ``self`` then ``other`` (contractions compose as M₁·M₂)."""
        if self.perm is not None and other.perm is not None:
            if self.signs is None and other.signs is None:
                return SpaceAction(perm=self.perm[other.perm])
            first = torch.ones(len(self.perm), dtype=_F64) if self.signs is None else self.signs.to(_F64)
            second = torch.ones(len(other.perm), dtype=_F64) if other.signs is None else other.signs.to(_F64)
            return SpaceAction(perm=self.perm[other.perm], signs=first[other.perm] * second)
        if self.diagonal is not None and other.diagonal is not None:
            return SpaceAction(diagonal=self.diagonal.to(_F64) * other.diagonal.to(_F64), orthogonal=False)
        contra = contra_blocks = None
        if any(a.contra is not None or a.diagonal is not None for a in (self, other)):
            first, second = self.inverse_transpose(), other.inverse_transpose()
            contra = _product(first, second, n)
            contra_blocks = _blocks_then_diagonal(first, second)
        return SpaceAction(
            matrix=_product(self, other, n),
            orthogonal=self.orthogonal and other.orthogonal,
            contra=contra,
            blocks=_blocks_then_diagonal(self, other),
            contra_blocks=contra_blocks,
        )


def _blocks_then_diagonal(first: SpaceAction, second: SpaceAction) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The head-block structure of first·second when ``first`` has one and ``second`` is diagonal
    (a head rotation, then a head rescale): each block's columns scaled — the entries
    :func:`_product` gives the dense matrix. None otherwise."""
    if first.blocks is None or second.diagonal is None:
        return None
    perm, blocks = first.blocks
    return perm, blocks * second.diagonal.to(_F64).view(blocks.shape[0], 1, blocks.shape[-1])


def is_diagonal_matrix(m: torch.Tensor) -> bool:
    """Whether every non-zero entry of ``m`` is on its diagonal."""
    return bool(torch.count_nonzero(m) == torch.count_nonzero(torch.diagonal(m)))


def _product(first: SpaceAction, second: SpaceAction, n: int) -> torch.Tensor:
    """The dense M₁·M₂, with a diagonal factor (a head rescale) scaling columns or rows instead of
    an n³ product: the same numbers, as every other term of each sum is an exact zero."""
    if second.diagonal is not None:
        return first.dense(n) * second.diagonal.to(_F64)
    if first.diagonal is not None:
        return first.diagonal.to(_F64)[:, None] * second.dense(n)
    m1, m2 = first.dense(n), second.dense(n)
    if is_diagonal_matrix(m2):
        return m1 * torch.diagonal(m2)
    if is_diagonal_matrix(m1):
        return torch.diagonal(m1)[:, None] * m2
    return m1 @ m2


def _tensor(x: Any, dtype=_F64) -> torch.Tensor:
    return x.detach().to(dtype).clone() if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)


def _check_perm(perm: torch.Tensor, n: int, what: str) -> None:
    if perm.shape != (n,) or not torch.equal(torch.sort(perm).values, torch.arange(n)):
        raise RaotError(f"{what}: expected a permutation of {n} items, got shape {tuple(perm.shape)}")


def block_matrix(perm: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The (H·h)² matrix G with block (perm[i], i) = blocks[i]: head i of the result takes head
    perm[i] rotated by blocks[i] (docs/design.md §3.2)."""
    H, h, _ = blocks.shape
    g = torch.zeros(H * h, H * h, dtype=_F64)
    for i in range(H):
        j = int(perm[i])
        g[j * h : (j + 1) * h, i * h : (i + 1) * h] = blocks[i]
    return g


def head_action(perm: torch.Tensor, blocks: torch.Tensor) -> SpaceAction:
    """The action of per-head orthogonal maps after a head permutation, dense and by blocks."""
    return SpaceAction(matrix=block_matrix(perm, blocks), blocks=(perm, blocks))


def rope_blocks(angles: torch.Tensor) -> torch.Tensor:
    """(…, h/2) angles → (…, h, h) maps rotating each rotary pair (p, p + h/2) by its angle:
    x ← x·M multiplies x_p + i·x_{p+h/2} by e^{iφ_p}, which commutes with RoPE (docs/design.md §8)."""
    half = angles.shape[-1]
    c, s = torch.cos(angles.to(_F64)), torch.sin(angles.to(_F64))
    m = torch.zeros(*angles.shape[:-1], 2 * half, 2 * half, dtype=_F64)
    p = torch.arange(half)
    m[..., p, p] = c
    m[..., p + half, p + half] = c
    m[..., p, p + half] = s
    m[..., p + half, p] = -s
    return m


def turn_blocks(turns: torch.Tensor, quarter: int) -> torch.Tensor:
    """(…, r/2) integers → (…, r, r) maps turning each rotary pair by ``turns``·2π/``quarter``,
    with entries exactly 0 and ±1 (signed permutations): the Q/K maps left by per-head Q/K norms
    (docs/design.md §9.1)."""
    angles = turns.to(_F64) * (2 * torch.pi / quarter)
    return torch.round(rope_blocks(angles))


def partial_rope_blocks(rotary: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """The Q/K maps of a partially rotary head (docs/design.md §9.4): the rotary pairs' maps
    ``rotary`` (…, r, r) on the first r dims, any map ``free`` (…, h − r, h − r) on the rest."""
    r, rest = rotary.shape[-1], free.shape[-1]
    m = torch.zeros(*rotary.shape[:-2], r + rest, r + rest, dtype=_F64)
    m[..., :r, :r] = rotary.to(_F64)
    m[..., r:, r:] = free.to(_F64)
    return m


def check_qk_blocks(blocks: torch.Tensor, schema: ModelSchema, layer: int) -> None:
    """Refuse Q/K maps outside the group a schema's positions and per-head norms leave (docs/design.md
    §8.2, §9): under RoPE only 2×2 rotations within rotary pairs (p, p + r/2), any map on the dims that
    do not rotate, nothing across; under Q/K norms only turns by multiples of 2π/``qk_turns``."""
    if schema.qk_structure == "rope" and schema.rotary_dims is None and schema.qk_turns is None:
        _check_rope(blocks, layer)
        return
    h = blocks.shape[-1]
    r = schema.rotary_size if schema.qk_structure == "rope" else 0
    if r:
        half = r // 2
        p = torch.arange(half)
        rot = blocks[..., :r, :r]
        angles = torch.atan2(rot[..., p, p + half], rot[..., p, p])
        expected = rope_blocks(angles)
        if schema.qk_turns is not None:
            step = 2 * torch.pi / schema.qk_turns
            expected = turn_blocks(torch.round(angles / step), schema.qk_turns)
        off = [blocks[..., :r, r:], blocks[..., r:, :r]]
        if not torch.allclose(rot, expected, atol=1e-8) or any(x.abs().max() > 1e-8 for x in off if x.numel()):
            allowed = "rotate" if schema.qk_turns is None else f"turn by multiples of 360°/{schema.qk_turns}"
            raise RaotError(
                f"layer {layer}: a Q/K map of this model must {allowed} each rotary pair (i, i + {half}) and mix "
                "nothing else; this one does not commute with the position rotations or the Q/K norms"
            )
    elif schema.qk_turns is not None and h:
        eye = torch.eye(h, dtype=_F64)
        signs = torch.diagonal(blocks, dim1=-2, dim2=-1)
        flips_only = torch.allclose(blocks, eye * signs[..., None, :], atol=1e-8)
        if not flips_only or not torch.allclose(signs.abs(), torch.ones_like(signs)):
            raise RaotError(f"layer {layer}: a Q/K map of this model may only flip signs of dims (its Q/K norms)")


def _check_rope(blocks: torch.Tensor, layer: int) -> None:
    """Refuse Q/K maps that do not commute with RoPE: only 2×2 rotations within rotary pairs do."""
    h = blocks.shape[-1]
    if h % 2:
        raise RaotError(f"layer {layer}: RoPE needs an even head size, got {h}")
    half = h // 2
    p = torch.arange(half)
    angles = torch.atan2(blocks[..., p, p + half], blocks[..., p, p])
    if not torch.allclose(blocks, rope_blocks(angles), atol=1e-8):
        raise RaotError(
            f"layer {layer}: a Q/K map of a RoPE model must rotate each rotary pair (i, i + h/2) and mix nothing "
            "else; this one does not commute with the position rotations"
        )


def shared_kv_blocks(
    schema: ModelSchema, layer: int, perm: torch.Tensor, qk: torch.Tensor, vo: torch.Tensor, *, rope: bool = True
):
    """For shared KV heads (grouped-query attention, docs/design.md §8): the KV-head permutation and
    per-KV-head Q/K and V/O maps implied by a per-query-head alignment, checked to move each KV head
    with all its query heads and one map per KV head (and with ``rope`` on a RoPE schema, to commute
    with the position rotations)."""
    H, kv = schema.num_heads, schema.kv_heads
    queries_per_kv = H // kv
    kv_perm = (perm // queries_per_kv).view(kv, queries_per_kv)
    if not torch.equal(kv_perm, kv_perm[:, :1].expand_as(kv_perm)):
        raise RaotError(
            f"layer {layer}: a head permutation of a model with shared KV heads must move each KV head with all "
            f"its query heads ({queries_per_kv} per KV head); permute KV heads, and query heads within one KV head only"
        )
    maps = []
    for name, r in (("qk", qk), ("vo", vo)):
        per_kv = r.view(kv, queries_per_kv, *r.shape[1:])
        if not torch.allclose(per_kv, per_kv[:, :1].expand_as(per_kv), atol=1e-12):
            raise RaotError(
                f"layer {layer}: the query heads of one KV head need one {name} map (they share its keys/values)"
            )
        maps.append(per_kv[:, 0])
    if rope and (schema.qk_structure == "rope" or schema.qk_turns is not None):
        check_qk_blocks(maps[0], schema, layer)
    return kv_perm[:, 0], maps[0], maps[1]


class Transform:
    """Base class: a group element acting on some spaces of a schema."""

    kind: ClassVar[str] = ""
    _types: ClassVar[dict[str, type[Transform]]] = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.kind:
            Transform._types[cls.kind] = cls

    exact: ClassVar[bool] = True  # exact on every schema (see :meth:`exact_for`)

    def actions(self, schema: ModelSchema) -> dict[str, SpaceAction]:
        raise NotImplementedError

    def space_actions(self, schema: ModelSchema) -> Iterator[tuple[str, SpaceAction]]:
        """:meth:`actions` one space at a time, in the same order (a sequence composes each space's
        action only when its turn comes)."""
        yield from self.actions(schema).items()

    def space_action(self, schema: ModelSchema, name: str) -> SpaceAction | None:
        """The action on the space ``name`` alone (None: this transform does not touch it)."""
        if not self.may_touch(schema, name):
            return None
        return self.actions(schema).get(name)

    def forget(self) -> None:
        """Drop what this transform made and kept to act again (nothing, unless it says so)."""

    def may_touch(self, schema: ModelSchema, name: str) -> bool:
        """False when this transform surely leaves the space ``name`` alone, known without making
        its actions (a layer's transform and the residual stream); True when it may act on it."""
        return True

    def exact_for(self, schema: ModelSchema) -> bool:
        """Whether this transform leaves the function of a model with ``schema`` unchanged."""
        return self.exact

    def to_dict(self) -> dict[str, Any]:
        """The transform as JSON-ready data: its type and its dataclass fields (tensors as lists)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {"type": self.kind, **{k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in values.items()}}

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> Transform:
        return cls(*(d[f.name] for f in fields(cls)))

    def then(self, other: Transform) -> TransformSequence:
        """This transform followed by ``other``."""
        return TransformSequence([*_flatten(self), *_flatten(other)])

    def describe(self) -> str:
        return self.kind

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Transform:
        """Rebuild any transform from :meth:`to_dict` output."""
        kind = data.get("type")
        if kind not in Transform._types:
            raise RaotError(f"unknown transform type {kind!r}; known: {', '.join(sorted(Transform._types))}")
        return Transform._types[kind]._from_dict(data)


def _flatten(t: Transform) -> list[Transform]:
    return list(t.transforms) if isinstance(t, TransformSequence) else [t]


@dataclass
class MLPPermutation(Transform):
    """Permute the MLP units of one layer (§3.1): ``fc1`` rows and ``fc2`` columns."""

    layer: int
    perm: torch.Tensor
    kind: ClassVar[str] = "mlp_permutation"

    def __post_init__(self):
        self.perm = _tensor(self.perm, torch.long)

    def may_touch(self, schema, name):
        return name.startswith(f"layers.{self.layer}.")

    def actions(self, schema):
        space = schema.mlp_space(self.layer)
        _check_perm(self.perm, space.size, f"MLP permutation of layer {self.layer}")
        return {space.name: SpaceAction(perm=self.perm)}

    def describe(self):
        moved = int((self.perm != torch.arange(len(self.perm))).sum())
        return f"layer {self.layer} MLP: permutation moving {moved}/{len(self.perm)} units"


@dataclass
class HeadAlignment(Transform):
    """One layer's head permutation with per-head Q/K and V/O orthogonal maps (§3.2).

    Head i of B′ is head ``perm[i]`` of B with ``q, k ← R_qkⁱᵀ·(block)``, ``v ← R_voⁱᵀ·(block)``
    and ``o``'s columns ``← (block)·R_voⁱ``. Reflections are allowed: any orthogonal R is exact.
    """

    layer: int
    perm: torch.Tensor
    qk: torch.Tensor  # (H, h, h)
    vo: torch.Tensor  # (H, h, h)
    kind: ClassVar[str] = "head_alignment"

    def __post_init__(self):
        self.perm = _tensor(self.perm, torch.long)
        self.qk = _tensor(self.qk)
        self.vo = _tensor(self.vo)

    def may_touch(self, schema, name):
        return name.startswith(f"layers.{self.layer}.")

    def actions(self, schema):
        # checking the maps (RoPE's commutant, one map per KV head) costs more than acting with them
        # on a small layer, and a merge asks for a layer's actions once per candidate set it scores:
        # made once per schema and state of the tensors
        shape = (schema.num_heads, schema.head_size, schema.kv_heads, schema.qk_structure, schema.rotary_dims,
                 schema.qk_turns, schema.head_permutation)  # fmt: skip
        key = (id(schema), shape, *((t.data_ptr(), t._version) for t in (self.perm, self.qk, self.vo)))
        made = self.__dict__.get("_made")
        if made is None or made[0] != key:
            made = self.__dict__["_made"] = (key, self._actions(schema))
        return dict(made[1])

    def forget(self) -> None:
        """Drop the kept actions (two dense d × d float64 maps a layer); asked for again, they are
        made again."""
        self.__dict__.pop("_made", None)

    def _actions(self, schema):
        H, h = schema.num_heads, schema.head_size
        _check_perm(self.perm, H, f"head permutation of layer {self.layer}")
        for name, r in (("qk", self.qk), ("vo", self.vo)):
            if r.shape != (H, h, h):
                raise RaotError(f"layer {self.layer} {name} maps: expected shape {(H, h, h)}, got {tuple(r.shape)}")
        if not schema.head_permutation and not torch.equal(self.perm, torch.arange(H)):
            raise RaotError(
                f"layer {self.layer}: the heads of a {schema.model_type} model may not be permuted (a score bias "
                "shared by every layer indexes them); keep the heads in place"
            )
        out = {
            schema.qk_space(self.layer).name: head_action(self.perm, self.qk),
            schema.vo_space(self.layer).name: head_action(self.perm, self.vo),
        }
        if (
            schema.kv_space(self.layer, "k") is None
            and self.exact
            and (schema.qk_structure == "rope" or schema.qk_turns is not None)
        ):  # heads without KV spaces of their own (ModernBERT, GPT-NeoX): their Q/K maps checked here
            check_qk_blocks(self.qk, schema, self.layer)
        if schema.kv_space(self.layer, "k") is not None:
            kv_perm, qk_kv, vo_kv = shared_kv_blocks(schema, self.layer, self.perm, self.qk, self.vo, rope=self.exact)
            out[schema.kv_space(self.layer, "k").name] = head_action(kv_perm, qk_kv)
            out[schema.kv_space(self.layer, "v").name] = head_action(kv_perm, vo_kv)
        return out

    def describe(self):
        moved = int((self.perm != torch.arange(len(self.perm))).sum())
        eye = torch.eye(self.qk.shape[-1], dtype=_F64)
        dev = max(float((self.qk - eye).abs().max()), float((self.vo - eye).abs().max()))
        return f"layer {self.layer} heads: {moved}/{len(self.perm)} heads moved, max |R − I| = {dev:.3g}"


@dataclass
class UnrestrictedHeadAlignment(HeadAlignment):
    """A head alignment whose Q/K maps ignore RoPE (an ablation): exact without rotary embeddings;
    on a RoPE model its maps do not commute with the position rotations, so it is labelled inexact
    and the merge reports the measured B′ deviation (docs/design.md §8)."""

    kind: ClassVar[str] = "head_alignment_unrestricted"
    exact: ClassVar[bool] = False

    def exact_for(self, schema):
        return schema.qk_structure != "rope"  # no position rotations to commute with: exact

    def describe(self):
        return super().describe() + " (Q/K maps not restricted to RoPE's commutant: approximate)"


def _spread(scale: torch.Tensor, h: int) -> torch.Tensor:
    """Scales per dimension: a (n,) scale covers its head's h dims, a (n, h/2) one each rotary pair's
    two dims, a (n, h) one each dim (a partially rotary head, docs/design.md §9.4)."""
    if scale.ndim == 1:
        return scale.repeat_interleave(h)
    if scale.shape[-1] == h:
        return scale.reshape(-1)
    return torch.cat([scale, scale], -1).reshape(-1)


@dataclass
class HeadRescale(Transform):
    """Optional per-head rescaling (§3.4): q ← a·q, k ← k/a; v ← c·v, o ← o/c (exact). ``qk_scale``
    may be (H, h/2), one scale per rotary pair (commutes with RoPE, docs/design.md §8); query heads
    sharing a KV head carry its scales."""

    layer: int
    qk_scale: torch.Tensor  # (H,) or (H, h/2)
    vo_scale: torch.Tensor  # (H,)
    kind: ClassVar[str] = "head_rescale"

    def __post_init__(self):
        self.qk_scale = _tensor(self.qk_scale)
        self.vo_scale = _tensor(self.vo_scale)
        if (self.qk_scale <= 0).any() or (self.vo_scale <= 0).any():
            raise RaotError(f"layer {self.layer} head rescale: scales must be positive")

    def per_dim(self, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The Q/K and V/O scales per dimension of the (query-head) spaces."""
        return _spread(self.qk_scale, h), _spread(self.vo_scale, h)

    def may_touch(self, schema, name):
        return name.startswith(f"layers.{self.layer}.")

    def actions(self, schema):
        h = schema.head_size

        def diag(s):
            return SpaceAction(diagonal=_spread(s, h), orthogonal=False)

        if self.qk_scale.ndim == 2 and self.qk_scale.shape[1:] not in ((h // 2,), (h,)):
            raise RaotError(f"layer {self.layer} per-pair Q/K scales: expected (heads, {h // 2}) values")
        scales_qk = schema.qk_scales
        if not scales_qk and not torch.all(self.qk_scale == 1):
            raise RaotError(
                f"layer {self.layer}: a norm of the queries and keys absorbs their scales in a {schema.model_type} "
                "model, so Q/K scales are not a symmetry there; scale values and outputs only"
            )
        out = {schema.vo_space(self.layer).name: diag(self.vo_scale)}
        if scales_qk:
            out = {schema.qk_space(self.layer).name: diag(self.qk_scale), **out}
        if schema.kv_space(self.layer, "k") is not None:  # one scale per KV head, shared by its query heads
            queries_per_kv = schema.num_heads // schema.kv_heads
            kinds = (("k", self.qk_scale), ("v", self.vo_scale)) if scales_qk else (("v", self.vo_scale),)
            for kind, scale in kinds:
                per_kv = scale.view(schema.kv_heads, queries_per_kv, *scale.shape[1:])
                if not torch.equal(per_kv, per_kv[:, :1].expand_as(per_kv)):
                    raise RaotError(
                        f"layer {self.layer} head rescale: query heads sharing a KV head need one scale; "
                        "repeat each KV head's scale over its query heads"
                    )
                out[schema.kv_space(self.layer, kind).name] = diag(per_kv[:, 0])
        return out

    def describe(self):
        qk, vo = self.qk_scale, self.vo_scale
        return (
            f"layer {self.layer} head scales: Q/K {float(qk.min()):.3g}–{float(qk.max()):.3g}, "
            f"V/O {float(vo.min()):.3g}–{float(vo.max()):.3g}"
        )


@dataclass
class ResidualPermutation(Transform):
    """Permute the residual-stream coordinates (exact for pre- and post-LN, §3.3)."""

    perm: torch.Tensor
    kind: ClassVar[str] = "residual_permutation"

    def __post_init__(self):
        self.perm = _tensor(self.perm, torch.long)

    def actions(self, schema):
        _check_perm(self.perm, schema.hidden_size, "residual permutation")
        return {"residual": SpaceAction(perm=self.perm)}

    def describe(self):
        moved = int((self.perm != torch.arange(len(self.perm))).sum())
        return f"residual: permutation moving {moved}/{len(self.perm)} coordinates"


@dataclass
class ResidualSignedPermutation(ResidualPermutation):
    """Permute the residual-stream coordinates and flip some signs: ``new[..., j] = signs[j]·old[..., perm[j]]``.
    Exact on an RMSNorm stream whose norm weights cannot fold (docs/design.md §9.2): the weights
    move with the coordinates, the signs pass through every norm."""

    signs: torch.Tensor = None
    kind: ClassVar[str] = "residual_signed_permutation"

    def __post_init__(self):
        super().__post_init__()
        self.signs = torch.ones(len(self.perm), dtype=_F64) if self.signs is None else _tensor(self.signs)
        if not bool(torch.all(self.signs.abs() == 1)):
            raise RaotError("residual signed permutation: signs must be +1 or −1")

    def exact_for(self, schema):
        return schema.residual.exact in ("signed_permutation", "orthogonal") or bool(torch.all(self.signs == 1))

    def actions(self, schema):
        _check_perm(self.perm, schema.hidden_size, "residual permutation")
        return {"residual": SpaceAction(perm=self.perm, signs=self.signs)}

    def describe(self):
        flipped = int((self.signs < 0).sum())
        return super().describe() + f", {flipped} signs flipped"


@dataclass
class ResidualRotation(Transform):
    """An orthogonal map O of the residual stream with O·1 = 1 (§3.3): exact for pre-LN models
    once LayerNorms are folded; post-LN streams refit γ per coordinate (approximate, :meth:`exact_for`)."""

    matrix: torch.Tensor
    kind: ClassVar[str] = "residual_rotation"

    def __post_init__(self):
        self.matrix = _tensor(self.matrix)

    def exact_for(self, schema):
        return schema.residual.exact in ("mean_fixing", "orthogonal")

    def actions(self, schema):
        d = schema.hidden_size
        o = self.matrix
        if o.shape != (d, d):
            raise RaotError(f"residual rotation: expected a {d}×{d} matrix, got {tuple(o.shape)}")
        # the check is a d³ product (a second at d = 3,072) and a merge asks for the actions of
        # one rotation once per tensor it moves: checked once per matrix and kind of stream
        checked = (o.data_ptr(), o._version, bool(schema.stream_centered))
        if self.__dict__.get("_checked") != checked:
            ones = torch.ones(d, dtype=_F64)
            # RMSNorm streams (§8) admit all of O(d); LayerNorm streams only maps fixing the mean axis
            fixes_mean = not schema.stream_centered or torch.allclose(o @ ones, ones, atol=1e-8)
            if not fixes_mean or not torch.allclose(o.T @ o, torch.eye(d, dtype=_F64), atol=1e-8):
                raise RaotError("residual rotation must be orthogonal and fix the mean axis (O·1 = 1)")
            self.__dict__["_checked"] = checked
        return {"residual": SpaceAction(matrix=o)}

    def describe(self):
        dev = float((self.matrix - torch.eye(len(self.matrix), dtype=_F64)).norm())
        return f"residual: mean-fixing rotation, ‖O − I‖_F = {dev:.3g}"


@dataclass
class SoftTransport(Transform):
    """A soft transport plan on one space (OT fusion's baseline; **not** a symmetry): ``plan`` (n×n)
    contracts covariant and contravariant members alike, unit j of B′ = Σᵢ plan[i, j]·(unit i of B)."""

    space: str
    plan: torch.Tensor
    kind: ClassVar[str] = "soft_transport"
    exact: ClassVar[bool] = False

    def __post_init__(self):
        self.plan = _tensor(self.plan)

    def actions(self, schema):
        size = schema.space(self.space).size
        if self.plan.shape != (size, size):
            raise RaotError(
                f"soft transport on {self.space}: expected a {size}×{size} plan, got {tuple(self.plan.shape)}"
            )
        return {self.space: SpaceAction(matrix=self.plan, orthogonal=False, contra=self.plan)}

    def describe(self):
        return f"{self.space}: soft transport plan (approximate)"


@dataclass
class TransformSequence(Transform):
    """Transforms applied left to right."""

    transforms: list[Transform] = field(default_factory=list)
    kind: ClassVar[str] = "sequence"

    def actions(self, schema):
        out: dict[str, SpaceAction] = {}
        for t in self.transforms:
            for name, act in t.actions(schema).items():
                out[name] = out[name].then(act, schema.space(name).size) if name in out else act
        return out

    def space_actions(self, schema):
        """The composed action of each space as :meth:`actions` gives it, one space at a time (the
        dense head actions of a whole model are never all held at once)."""
        touching: dict[str, list[Transform]] = {}
        for t in self.transforms:
            for name in t.actions(schema):
                touching.setdefault(name, []).append(t)
        made: dict[int, dict[str, SpaceAction]] = {}  # the actions of the transforms touching this space
        for name, parts in touching.items():
            made = {id(t): made.get(id(t)) or t.actions(schema) for t in parts}  # each made once for its spaces
            yield name, self._composed(schema, name, parts, made)

    def space_action(self, schema, name):
        return self._composed(schema, name, self.transforms)

    @staticmethod
    def _composed(schema, name: str, parts: list[Transform], made: dict | None = None) -> SpaceAction | None:
        out = None
        for t in parts:
            act = t.space_action(schema, name) if made is None else made[id(t)].get(name)
            if act is not None:
                out = act if out is None else out.then(act, schema.space(name).size)
        return out

    def to_dict(self):
        return {"type": self.kind, "transforms": [t.to_dict() for t in self.transforms]}

    @classmethod
    def _from_dict(cls, d):
        return cls([Transform.from_dict(t) for t in d["transforms"]])

    def describe(self):
        return "; ".join(t.describe() for t in self.transforms) or "identity"

    def __len__(self):
        return len(self.transforms)


def is_exact(transform: Transform, schema: ModelSchema) -> bool:
    """Whether ``transform`` leaves the function of a model with ``schema`` exactly unchanged."""
    return all(t.exact_for(schema) for t in _flatten(transform))
