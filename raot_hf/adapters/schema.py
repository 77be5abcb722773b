"""The common schema every architecture adapter produces (docs/design.md §2).

A model is described by *spaces* on which a symmetry acts (the residual stream, each layer's MLP
units, query-key and value-output head spaces), each listing its *members*: parameter axes
indexing it. A symmetry (§3) contracts every covariant member (writers, biases, γ/β in the space)
with M and every contravariant one (readers) with M⁻ᵀ; for orthogonal M both are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

NormPlacement = Literal["pre", "post"]


@dataclass(frozen=True)
class Member:
    """One parameter axis (or, by ``index``, the positions of it that belong to the space, in the
    space's order; ``None``: the whole axis) that indexes a space."""

    name: str
    axis: int
    covariant: bool
    role: str
    index: tuple[int, ...] | None = None
    #: the axis of a 3-D expert parameter that indexes the experts (docs/design.md §10): the space's
    #: positions are then (expert, position on ``axis``) pairs, expert-major, and ``index`` selects
    #: among them (None: every pair)
    expert_axis: int | None = None

    def index_tensor(self) -> torch.Tensor | None:
        return None if self.index is None else torch.tensor(self.index, dtype=torch.long)


@dataclass
class Space:
    """A vector space inside the model on which one symmetry factor acts (``kind``: ``"residual"``,
    ``"mlp"``, ``"qk"`` or ``"vo"``). ``exact`` names the largest group that acts exactly:
    ``"orthogonal"`` (heads; a folded RMSNorm stream), ``"permutation"`` (MLP units; a post-LN
    stream), ``"signed_permutation"`` (an RMSNorm stream carrying norm weights, docs/design.md §9.2)
    or ``"mean_fixing"`` (a folded pre-LN LayerNorm stream)."""

    name: str
    kind: str
    size: int
    members: list[Member] = field(default_factory=list)
    exact: str = "orthogonal"
    layer: int | None = None


@dataclass(frozen=True)
class Fold:
    """A pre-LN LayerNorm whose affine part folds into the readers that follow it (§3.3), or a
    per-channel scale that folds into the writers before it (LayerScale, ``writers``: §9.8)."""

    norm_weight: str
    norm_bias: str | None  # None: an RMSNorm (no shift)
    readers: tuple[tuple[str, str | None], ...]  # (weight, bias) of each Linear reading the norm
    transposed: tuple[str, ...] = ()  # weights stored (in, out), as GPT-2's Conv1D
    offset: float = 0.0  # the norm multiplies by offset + weight (Gemma: 1 + w)
    writers: tuple[tuple[str, str | None], ...] = ()  # (weight, bias) of the Linears whose output it scales

    @property
    def identity_weight(self) -> float:
        """The stored weight of a folded norm: the one that multiplies by 1."""
        return 1.0 - self.offset


@dataclass(frozen=True)
class HeadReadout:
    """Where a layer's per-head queries and keys are observed during calibration: modules hooked
    on their output, ``q_index`` / ``k_index`` the heads' (H·h,) feature positions, ``q_bias`` /
    ``k_bias`` parameters added after the module (DeBERTa v1)."""

    module: str
    q_module: str
    k_module: str
    q_index: tuple[int, ...] | None = None
    k_index: tuple[int, ...] | None = None
    q_bias: str | None = None
    k_bias: str | None = None


@dataclass(frozen=True)
class LayerSchema:
    """Module names of one encoder layer, for hooks (calibration) and Gram matrices (RegMean)."""

    index: int
    heads: HeadReadout
    context: str  # module whose *input* is the per-head context entering o
    mlp_hidden: str | None  # module whose *input* is the post-activation MLP units (fc2); None: no dense MLP
    linears: tuple[str, ...]  # every Linear (or GPT-2 Conv1D) module of the layer (RegMean)
    module: str | None = None  # the layer's own module (decoders, §8)
    experts: ExpertLayer | None = None  # the layer's mixture-of-experts block (§10)


@dataclass(frozen=True)
class ExpertLayer:
    """A layer's mixture-of-experts block (docs/design.md §10): the ``router`` module (its weight
    (E, d) scores the experts), the ``experts`` module with its 3-D ``gate_up`` (E, parts·f, d) and
    ``down`` (E, d, f) parameters (full names), ``parts`` 2 for [gate | up] rows; E experts of f
    units, the ``top_k`` chosen per token, their weights renormalised or not; the schema's spaces
    ``layers.ℓ.router`` (E: the router's rows) and ``layers.ℓ.experts`` (E·f: every expert's units,
    expert-major)."""

    layer: int
    router: str
    experts: str
    gate_up: str
    down: str
    num_experts: int
    units: int
    top_k: int
    renormalised: bool
    parts: int = 2

    @property
    def router_space(self) -> str:
        return f"layers.{self.layer}.router"

    @property
    def experts_space(self) -> str:
        return f"layers.{self.layer}.experts"


@dataclass
class ModelSchema:
    """Everything the symmetry algebra, the estimators and the merge need to know."""

    model_type: str
    architecture: str
    norm: NormPlacement
    num_layers: int
    hidden_size: int
    num_heads: int
    head_size: int
    intermediate_size: int
    spaces: dict[str, Space]
    layers: list[LayerSchema]
    stream_modules: list[str]  # modules whose output is the residual stream (§4)
    folds: list[Fold] = field(default_factory=list)
    head_params: list[str] = field(default_factory=list)  # task-head parameters (head policy)
    output_in_stream: bool = False  # the model's primary output is the stream (base models)
    notes: list[str] = field(default_factory=list)
    # Decoders (docs/design.md §8). ``num_kv_heads``: KV heads shared by several query heads
    # (grouped-query attention; None: one KV head per query head); the schema then has per-layer
    # ``layers.i.k`` / ``layers.i.v`` spaces over the KV heads beside ``qk`` (query rows) and ``vo``
    # (output columns). ``qk_structure``:
    # ``"rope"`` restricts Q/K maps to one 2×2 rotation per rotary pair (i, i + h/2).
    # ``stream_centered``: whether stream statistics project out the mean axis (LayerNorm) or
    # not (RMSNorm, where the mean axis is not special).
    num_kv_heads: int | None = None
    qk_structure: str = "free"
    stream_centered: bool = True
    causal: bool = False
    # The dtype the norms compute in whatever the model's dtype (transformers' RMSNorm: float32),
    # or None (the model's own): B′ ≡ B is then checked at that precision (docs/design.md §8).
    norm_dtype: str | None = None
    # What a family's extra nonlinearities leave of the head group (docs/design.md §9).
    # ``rotary_dims``: under RoPE the leading dims of a head that rotate, paired (p, p + r/2); the
    # other h − r dims take any orthogonal Q/K map (None: the whole head rotates). ``qk_turns``: Q/K
    # maps turn each rotary pair by multiples of 2π/qk_turns only (2: sign flips, 4: quarter turns;
    # None: any angle), as per-head Q/K norms require. ``qk_scales``: whether per-head Q/K scales
    # are exact (a norm after the projection absorbs them). ``head_permutation``: whether a layer's
    # heads may be permuted (a score bias shared by every layer ties them in place).
    rotary_dims: int | None = None
    qk_turns: int | None = None
    qk_scales: bool = True
    head_permutation: bool = True

    @property
    def residual(self) -> Space:
        return self.spaces["residual"]

    def space(self, name: str) -> Space:
        if name not in self.spaces:
            raise KeyError(f"no space {name!r} in the {self.model_type} schema")
        return self.spaces[name]

    def mlp_space(self, layer: int) -> Space:
        return self.spaces[f"layers.{layer}.mlp"]

    def has_mlp(self, layer: int) -> bool:
        """Whether layer ``layer`` has a dense MLP (a mixture-of-experts layer may have none, or a
        shared expert in its place: docs/design.md §10)."""
        return f"layers.{layer}.mlp" in self.spaces

    def mlp_size(self, layer: int) -> int:
        """The units of layer ``layer``'s dense MLP (0: none)."""
        return self.spaces[f"layers.{layer}.mlp"].size if self.has_mlp(layer) else 0

    @property
    def expert_layers(self) -> list[ExpertLayer]:
        """The mixture-of-experts blocks, in layer order (docs/design.md §10)."""
        return [layer.experts for layer in self.layers if layer.experts is not None]

    def qk_space(self, layer: int) -> Space:
        return self.spaces[f"layers.{layer}.qk"]

    def vo_space(self, layer: int) -> Space:
        return self.spaces[f"layers.{layer}.vo"]

    def kv_space(self, layer: int, kind: str) -> Space | None:
        """The KV-head space (``kind`` "k" or "v") of a schema with shared KV heads, else None."""
        return self.spaces.get(f"layers.{layer}.{kind}")

    @property
    def attention_size(self) -> int:
        """H·h: the size of the query and attention-context spaces (the hidden size where the heads tile it)."""
        return self.num_heads * self.head_size

    @property
    def rotary_size(self) -> int:
        """The dims of a head that rotate under RoPE (the whole head unless ``rotary_dims`` says less)."""
        return self.head_size if self.rotary_dims is None else self.rotary_dims

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def parameter_names(self) -> set[str]:
        return {m.name for s in self.spaces.values() for m in s.members}


def head_index(num_heads: int, head_size: int, stride: int | None = None, offset: int = 0) -> tuple[int, ...]:
    """Feature positions of every head in head order: head i occupies
    ``[i·stride + offset, i·stride + offset + head_size)`` (``stride`` defaults to head_size)."""
    stride = head_size if stride is None else stride
    return tuple(i * stride + offset + j for i in range(num_heads) for j in range(head_size))
