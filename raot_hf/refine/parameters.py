"""The continuous symmetries a refinement moves, parametrised on their groups (docs/design.md §5.6).

Unconstrained tensors map onto the group, so every step of B″ = Δ(B′) is exact: the stream
O = exp(S), S skew (LayerNorm streams: u·uᵀ + Bᵤ·exp(S)·Bᵤᵀ, §3.3); per layer and KV head the Q/K
map (per rotary pair an angle and a log-scale under RoPE, §8.2, else exp(S)·e^σ) and the V/O map
exp(S)·e^γ. Unit permutations stay as estimated; :func:`as_transforms` gives ordinary transforms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raot_hf.adapters.schema import ModelSchema
from raot_hf.symmetry.group import mean_axis_basis
from raot_hf.symmetry.transforms import HeadAlignment, HeadRescale, ResidualRotation, Transform, rope_blocks

_F64 = torch.float64


def _skew(a: torch.Tensor) -> torch.Tensor:
    return a - a.transpose(-1, -2)


@dataclass
class RefineParameters:
    """Δ's free parameters (zeros: the identity). ``stream`` is None where the applied alignment
    maps the stream by a permutation (or not at all): only a rotation is refined."""

    schema: ModelSchema
    stream: torch.Tensor | None  # (n, n) → skew, n = d or d − 1 (mean-fixing)
    qk: dict[int, torch.Tensor]  # layer → (K, h/2) angles under RoPE, else (K, h, h) → skew
    qk_scale: dict[int, torch.Tensor]  # layer → (K, h/2) under RoPE, else (K,): log-scales
    vo: dict[int, torch.Tensor]  # layer → (K, h, h) → skew
    vo_scale: dict[int, torch.Tensor]  # layer → (K,) log-scales

    @classmethod
    def zeros(cls, schema: ModelSchema, layers: list[int], stream: bool) -> RefineParameters:
        d, K, h = schema.hidden_size, schema.kv_heads, schema.head_size
        rope = schema.qk_structure == "rope"
        n = d - 1 if schema.stream_centered else d
        # a partially rotary head or Q/K norms leave no continuous Q/K map of this form (docs/design.md
        # §9): the Q/K maps (and, under Q/K norms, their scales) stay the identity
        qk_free = schema.rotary_dims is None and schema.qk_turns is None

        def z(*shape, free=True):
            return torch.zeros(*shape, dtype=_F64, requires_grad=free)

        return cls(
            schema,
            z(n, n) if stream else None,
            {i: z(K, h // 2, free=qk_free) if rope else z(K, h, h, free=qk_free) for i in layers},
            {i: z(K, h // 2, free=qk_free and schema.qk_scales) if rope else z(K, free=qk_free) for i in layers},
            {i: z(K, h, h) for i in layers},
            {i: z(K) for i in layers},
        )

    def tensors(self) -> list[torch.Tensor]:
        out = [] if self.stream is None else [self.stream]
        for per_layer in (self.qk, self.qk_scale, self.vo, self.vo_scale):
            out += [t for t in per_layer.values() if t.requires_grad]
        return out

    # -- the group elements ----------------------------------------------------------------------
    def stream_matrix(self) -> torch.Tensor | None:
        if self.stream is None:
            return None
        rotation = torch.matrix_exp(_skew(self.stream))
        if not self.schema.stream_centered:
            return rotation
        d = self.schema.hidden_size
        b = mean_axis_basis(d)
        u = torch.full((d, 1), d**-0.5, dtype=_F64)
        return u @ u.T + b @ rotation @ b.T

    def qk_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per KV head the Q/K block M (h×h) and its inverse transpose."""
        if self.schema.qk_structure == "rope":
            rotation = rope_blocks(self.qk[layer])
            scale = torch.cat([self.qk_scale[layer]] * 2, -1).exp()  # per rotary pair (p, p + h/2)
        else:
            rotation = torch.matrix_exp(_skew(self.qk[layer]))
            scale = self.qk_scale[layer].exp()[:, None].expand(-1, self.schema.head_size)
        return rotation * scale[:, None, :], rotation / scale[:, None, :]

    def vo_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        rotation = torch.matrix_exp(_skew(self.vo[layer]))
        scale = self.vo_scale[layer].exp()[:, None, None]
        return rotation * scale, rotation / scale


def _block_diagonal(blocks: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    if repeat > 1:
        blocks = blocks.repeat_interleave(repeat, 0)
    return torch.block_diag(*blocks.unbind(0))


def dense_actions(p: RefineParameters) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Space name → (M, M⁻ᵀ) of Δ, differentiable in the parameters (docs/design.md §3: covariant
    members contract with M, contravariant ones with M⁻ᵀ)."""
    schema = p.schema
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    stream = p.stream_matrix()
    if stream is not None:
        out["residual"] = (stream, stream)
    queries_per_kv = schema.num_heads // schema.kv_heads
    for layer in p.qk:
        (qk, qk_inv_t), (vo, vo_inv_t) = p.qk_blocks(layer), p.vo_blocks(layer)
        out[schema.qk_space(layer).name] = (
            _block_diagonal(qk, queries_per_kv),
            _block_diagonal(qk_inv_t, queries_per_kv),
        )
        out[schema.vo_space(layer).name] = (
            _block_diagonal(vo, queries_per_kv),
            _block_diagonal(vo_inv_t, queries_per_kv),
        )
        if schema.kv_space(layer, "k") is not None:
            out[schema.kv_space(layer, "k").name] = (_block_diagonal(qk), _block_diagonal(qk_inv_t))
            out[schema.kv_space(layer, "v").name] = (_block_diagonal(vo), _block_diagonal(vo_inv_t))
    return out


def _contract(t: torch.Tensor, axis: int, index: torch.Tensor | None, m: torch.Tensor) -> torch.Tensor:
    x = t.to(_F64).movedim(axis, -1)
    if index is None:
        return (x @ m).movedim(-1, axis)
    moved = x.index_select(-1, index) @ m
    return x.index_copy(x.ndim - 1, index, moved).movedim(-1, axis)


def transformed(state: dict[str, torch.Tensor], schema: ModelSchema, actions: dict) -> dict[str, torch.Tensor]:
    """The parameters in ``state`` that Δ moves, as float64 functions of its parameters (norm
    weights are left: a refinement acts only where the stream's norms are folded, γ = 1)."""
    out: dict[str, torch.Tensor] = {}
    for space_name, (m, m_inv_t) in actions.items():
        for member in schema.space(space_name).members:
            if member.name not in state or member.role in ("norm", "norm_bias"):
                continue
            current = out.get(member.name, state[member.name])
            out[member.name] = _contract(
                current, member.axis, member.index_tensor(), m if member.covariant else m_inv_t
            )
    return out


def as_transforms(p: RefineParameters) -> list[Transform]:
    """Δ at the parameters' current values, as ordinary (exact) transforms."""
    schema = p.schema
    parts: list[Transform] = []
    with torch.no_grad():
        stream = p.stream_matrix()
        if stream is not None:
            parts.append(ResidualRotation(stream.detach().clone()))
        H, queries_per_kv = schema.num_heads, schema.num_heads // schema.kv_heads
        for layer in p.qk:
            if schema.qk_structure == "rope":
                qk = rope_blocks(p.qk[layer])
                qk_scale = p.qk_scale[layer].exp()
            else:
                qk = torch.matrix_exp(_skew(p.qk[layer]))
                qk_scale = p.qk_scale[layer].exp()
            vo = torch.matrix_exp(_skew(p.vo[layer]))
            perm = torch.arange(H)
            parts.append(
                HeadAlignment(
                    layer, perm, qk.repeat_interleave(queries_per_kv, 0), vo.repeat_interleave(queries_per_kv, 0)
                )
            )
            parts.append(
                HeadRescale(
                    layer,
                    qk_scale.repeat_interleave(queries_per_kv, 0),
                    p.vo_scale[layer].exp().repeat_interleave(queries_per_kv, 0),
                )
            )
    return parts
