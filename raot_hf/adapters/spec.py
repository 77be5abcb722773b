"""A family of architectures described as data (docs/design.md §2): module paths, norms, positions
and heads, read from one JSON file per family (``raot_hf/adapters/families/*.json``) and resolved
on a loaded model into its :class:`~raot_hf.adapters.schema.ModelSchema` by
:func:`raot_hf.adapters.resolve.build_schema`.

A spec names *where* the parts of a block are and *how* they are wired; the group that acts on
them follows from that (docs/design.md §3, §8–§9): which norms sit in the stream, whether each
norm folds into the Linears reading it, which maps commute with the positions and the per-head
norms. Code is written only where the mathematics differs from what the fields express.

Every field round-trips JSON (:meth:`FamilySpec.to_dict` / :meth:`FamilySpec.from_dict`); a file
may start from another family's with ``"extends": "<name>"`` and override some fields (nested
objects are merged key by key, lists replaced; a head set to null is removed).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.errors import RaotError

KINDS = ("encoder", "decoder")
MODALITIES = ("text", "image")
NORM_KINDS = ("layer", "rms")
PLACEMENTS = ("pre", "post")
POSITIONS = ("absolute", "rope", "relative", "none")


# ------------------------------------------------------------------------------- config values
def config_value(config, expression: str) -> int | None:
    """An integer read from ``config`` by ``expression``: an attribute name or an integer, products
    and floor quotients of them (``mlp_ratio * hidden_size``, ``hidden_size // num_attention_heads``),
    and fallbacks joined by ``or`` (the first that every attribute of it has a value for). None when
    no alternative has one."""
    for alternative in expression.split(" or "):
        tokens = alternative.split()
        value = _operand(config, tokens[0])
        for op, name in zip(tokens[1::2], tokens[2::2], strict=True):
            operand = _operand(config, name)
            if value is None or operand is None:
                value = None
                break
            value = value * operand if op == "*" else value // operand
        if value is not None:
            return int(value)
    return None


def _operand(config, token: str):
    if token.isdigit():
        return int(token)
    value = getattr(config, token, None)
    return None if value is None or isinstance(value, bool) else value


# ----------------------------------------------------------------------------------- the parts
@dataclass(frozen=True)
class ConfigKeys:
    """Where the shape of the trunk is read in the config (expressions of :func:`config_value`).
    ``kv_heads`` set: the family groups query heads over shared KV heads (the schema then has KV-head
    spaces, docs/design.md §8.1); ``head_dim`` may differ from hidden_size / heads only where
    ``heads_tile_hidden`` is false (the heads then span a space of their own size)."""

    hidden_size: str = "hidden_size"
    num_heads: str = "num_attention_heads"
    num_layers: str = "num_hidden_layers"
    intermediate_size: str = "intermediate_size"
    head_dim: str = ""
    kv_heads: str = ""
    heads_tile_hidden: bool = True


@dataclass(frozen=True)
class EmbeddingSpec:
    """The stream's writers before the first layer. ``module``: the module whose output is the
    stream's start (pre-norm models); ``writers``: (parameter, axis of the stream); ``norms``: norms
    in the stream there (post-norm models observe the stream at them); ``relative_writers`` /
    ``relative_norms``: relative-position embeddings in the stream basis (DeBERTa); ``projection``:
    a Linear from a smaller embedding space to the stream, when the checkpoint has it (ELECTRA):
    it is then the stream's only writer there, and the tables before it are left as they are."""

    module: str = "embeddings"
    writers: tuple[tuple[str, int], ...] = ()
    norms: tuple[str, ...] = ()
    relative_writers: tuple[tuple[str, int], ...] = ()
    relative_norms: tuple[str, ...] = ()
    projection: str | None = None


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, relative to the layer. ``q``/``k``/``v`` separate Linears, or one
    ``fused`` module with ``fused_layout`` ``"blocks"`` ([q | k | v]: H·h query rows, then K·h key
    and K·h value rows) or ``"per_head"`` (per head [q_i | k_i | v_i], h rows each); ``added_biases``:
    (role, parameter) biases added after a fused projection (DeBERTa v1); ``position_key`` /
    ``position_query``: relative-position projections paired with keys / queries (DeBERTa);
    ``q_norm`` / ``k_norm``: RMSNorms of the queries and keys over each head (``qk_norm_span``
    ``"head"``, one weight of h shared by all heads) or over the whole projection (``"projection"``);
    ``relative_bias``: a per-head score bias shared by every layer (MPNet), which ties every layer's
    head order to its columns."""

    o: str
    q: str | None = None
    k: str | None = None
    v: str | None = None
    fused: str | None = None
    fused_layout: str = "blocks"
    added_biases: tuple[tuple[str, str], ...] = ()
    position_key: tuple[str, ...] = ()
    position_query: tuple[str, ...] = ()
    q_norm: str | None = None
    k_norm: str | None = None
    qk_norm_span: str = "head"
    relative_bias: str | None = None

    def input_modules(self) -> tuple[str, ...]:
        return (self.fused,) if self.fused else tuple(m for m in (self.q, self.k, self.v) if m)


@dataclass(frozen=True)
class MLPSpec:
    """One layer's MLP, relative to the layer: the modules reading the stream (``inputs``: fc1, or a
    gated unit's gate and up, in that order) and the one writing it (``output``). ``fused_parts`` > 1:
    the one input module stacks that many blocks of the units (Phi-3's [gate | up], ModernBERT's
    [input | gate]); a unit permutation moves its rows in every block."""

    inputs: tuple[str, ...]
    output: str
    fused_parts: int = 1


@dataclass(frozen=True)
class NormSpec:
    """The layer norms. ``placement`` ``"post"``: each sits after a residual sum (in the stream,
    BERT); ``"pre"``: each reads the stream before a branch (``attention``, ``mlp``; a missing one
    is an identity, ModernBERT's first layer) and folds into the Linears that follow. ``attention_out``
    / ``mlp_out``: norms on a branch's output before it joins the stream (Gemma's sandwich, OLMo 2):
    their weights are the stream's per-channel weights. ``final``: the norm after the last layer.
    ``offset``: the norm multiplies by offset + weight (Gemma: 1 + w). ``dtype``: the dtype the norm
    computes in whatever the model's (transformers' RMSNorms: float32). ``parallel``: both branches
    read the same stream (GPT-NeoX); the residual group is unchanged."""

    kind: str
    placement: str
    attention: str | None = None
    mlp: str | None = None
    attention_out: str | None = None
    mlp_out: str | None = None
    final: str | None = None
    offset: float = 0.0
    dtype: str | None = None
    parallel: bool = False


@dataclass(frozen=True)
class PositionSpec:
    """``kind``: ``"absolute"`` (learned tables in the stream), ``"rope"`` (rotary, transformers'
    rotate-half pairing of dims p and p + r/2 of the rotary part), ``"relative"`` (DeBERTa, MPNet)
    or ``"none"``. ``partial_rotary``: the rotary part may be a fraction of the head
    (``partial_rotary_factor``); otherwise such a checkpoint is refused."""

    kind: str = "absolute"
    partial_rotary: bool = False


@dataclass(frozen=True)
class HeadSpec:
    """A task head (by the suffix of its class name): the Linears reading the final stream
    (``readers``, full names); ``tied``: the (dense, norm, decoder) of a masked-LM transform tied to
    the stream through the word embeddings; ``reads_final_norm``: whether the final norm folds into
    the readers (a base model returns the norm's output: it cannot); ``trunk``: the head shares the
    trunk's vocabulary and is merged with it (a causal LM's ``lm_head``); ``stream``: other parameter
    axes in the final stream's basis."""

    readers: tuple[str, ...] = ()
    tied: tuple[str, str, str] | None = None
    reads_final_norm: bool = True
    trunk: bool = False
    #: (parameter, axis, covariant) in the final stream's basis beyond the readers' Linears: SigLIP's
    #: attention-pooling probe (a query written in the stream's basis) and the columns of its fused
    #: in-projection (docs/design.md §11.1)
    stream: tuple[tuple[str, int, bool], ...] = ()


@dataclass(frozen=True)
class ConfigCheck:
    """A checkpoint refused from its config, before weights load: ``key``'s value (None when the
    config has no such field) must be in ``allowed``, or equal the value of ``equals``. ``message``
    may name the value as ``{value}`` and the config's fields as ``{config.<field>}``."""

    key: str
    message: str
    allowed: tuple[Any, ...] | None = None
    equals: str | None = None

    def check(self, config) -> None:
        value = getattr(config, self.key, None)
        if self.allowed is not None and value not in self.allowed:
            raise RaotError(self.message.format(value=value, config=config))
        if self.equals is not None and value is not None and value != getattr(config, self.equals, None):
            raise RaotError(self.message.format(value=value, config=config))


@dataclass(frozen=True)
class ExpertsSpec:
    """A mixture-of-experts block in place of a layer's MLP (docs/design.md §10), relative to the
    layer: the ``router`` (a module whose ``weight`` (E, d) — and ``bias`` if any — reads the stream
    and scores each expert) and the ``experts`` module holding every expert's weights as 3-D
    parameters, as transformers ≥ 5 stores them: ``mlp.inputs`` names the (E, parts·f, d) input
    parameter (``fused_parts`` 2: [gate | up] rows per expert), ``mlp.output`` the (E, d, f) output
    one. A permutation of the experts moves the router's rows with them; each expert's units permute
    on their own. ``num_experts``, ``top_k`` and ``intermediate_size`` are config expressions;
    ``normalize``: the chosen experts' weights renormalised to sum 1 — ``"always"``, ``"never"``, or
    a config field (``norm_topk_prob``). ``shared``: an MLP every token passes through beside the
    routed experts (Qwen2-MoE), with ``shared_gate`` its sigmoid gate reading the stream. A layer
    whose experts parameter is missing is a dense layer (Qwen-MoE's ``mlp_only_layers``)."""

    router: str
    experts: str
    mlp: MLPSpec
    num_experts: str = "num_local_experts or num_experts"
    top_k: str = "num_experts_per_tok"
    intermediate_size: str = "moe_intermediate_size or intermediate_size"
    normalize: str = "always"
    shared: MLPSpec | None = None
    shared_gate: str | None = None

    def renormalised(self, config) -> bool:
        """Whether the top-k weights are renormalised to sum 1 (``normalize`` read on ``config``)."""
        if self.normalize in ("always", "never"):
            return self.normalize == "always"
        return bool(getattr(config, self.normalize, False))


@dataclass(frozen=True)
class TowerSpec:
    """One tower of a two-tower model (docs/design.md §11): its family (by name), the attribute of
    the two-tower model holding it (``prefix``) and its projection into the joint space
    (``projection``: a module of the two-tower model beside the tower; None where the tower's own
    head projects); ``wrapper``: the transformers class holding the tower and its projection, which
    the tower's merge runs on (None: the tower itself)."""

    family: str
    prefix: str
    projection: str | None = None
    wrapper: str | None = None


@dataclass(frozen=True)
class JointSpec:
    """The joint space of a two-tower model (full parameter names): ``writers`` (parameter, axis)
    write it — the projections' rows and biases, a pooling head's output rows; ``readers``
    (parameter, axis) read it inside a tower's head; ``norm``: a LayerNorm in it (SigLIP's pooling
    head), folded into the ``norm_readers`` (Linear modules with a bias) before a rotation."""

    writers: tuple[tuple[str, int], ...]
    readers: tuple[tuple[str, int], ...] = ()
    norm: str | None = None
    norm_readers: tuple[str, ...] = ()


@dataclass(frozen=True)
class DualEncoderSpec:
    """A two-tower model (CLIP, SigLIP; docs/design.md §11): its ``towers`` (each a family of its
    own), the ``joint`` space their projections write, where one orthogonal map acts on both, and
    the ``scalars`` outside both (the logit scale and bias), merged by the rule. JSON round trip as
    :class:`FamilySpec`'s (``raot_hf/adapters/dual/*.json``)."""

    name: str
    model_types: tuple[str, ...]
    towers: tuple[TowerSpec, ...]
    joint: JointSpec
    scalars: tuple[str, ...] = ()
    description: str = ""

    def validate(self) -> DualEncoderSpec:
        if not self.name or not self.model_types:
            raise ValueError(f"dual encoder {self.name!r}: needs a name and at least one model type")
        if len(self.towers) != 2 or len({t.prefix for t in self.towers}) != 2:
            raise ValueError(f"dual encoder {self.name!r}: needs two towers under two prefixes")
        if not self.joint.writers:
            raise ValueError(f"dual encoder {self.name!r}: the joint space needs its writers")
        if self.joint.norm is not None and not self.joint.norm_readers:
            raise ValueError(f"dual encoder {self.name!r}: a norm in the joint space folds into its readers")
        return self

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DualEncoderSpec:
        data = dict(data)
        where = f"dual encoder {data.get('name')!r}"
        towers = tuple(_build(TowerSpec, t, f"{where}.towers") for t in data.pop("towers", ()))
        joint = _build(JointSpec, data.pop("joint", None), f"{where}.joint")
        return _build(cls, {**data, "towers": towers, "joint": joint}, where).validate()


# --------------------------------------------------------------------- layouts, from the config
def model_dims(spec: FamilySpec, config) -> tuple[int, int, int, int]:
    """(hidden size, heads, head size, KV heads) as the config gives them."""
    keys = spec.config
    d, H = config_value(config, keys.hidden_size), config_value(config, keys.num_heads)
    h = config_value(config, keys.head_dim) if keys.head_dim else None
    kv = config_value(config, keys.kv_heads) if keys.kv_heads else None
    return d, H, h or (d // H if H else 0), kv or H


def rotary_factor(config) -> float:
    """The fraction of each head that rotates (``partial_rotary_factor``, 1 when absent)."""
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) if rope else 1.0
    return 1.0 if factor is None else float(factor)


def check_layout(spec: FamilySpec, config) -> None:
    """Refuse a layout the schema cannot describe: heads that do not tile the hidden size (where the
    family needs them to), a query-head count not a multiple of the KV heads, an odd rotary part,
    a partial rotary part where the family rotates whole heads, sliced projections."""
    keys = spec.config
    d, H = config_value(config, keys.hidden_size), config_value(config, keys.num_heads)
    if spec.positions.kind != "rope" and not keys.kv_heads:
        if d % H:
            raise RaotError(f"hidden_size {d} is not divisible by num_attention_heads {H}; not a supported layout.")
        return
    kv = config_value(config, keys.kv_heads) if keys.kv_heads else None
    kv = kv or H
    h = (config_value(config, keys.head_dim) if keys.head_dim else None) or d // H
    if H % kv:
        raise RaotError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {kv}; not a GQA layout.")
    if keys.heads_tile_hidden and H * h != d:
        raise RaotError(
            f"{config.model_type} with num_attention_heads·head_dim = {H * h} != hidden_size {d} is not supported; "
            "use a checkpoint whose heads tile the hidden size."
        )
    factor = rotary_factor(config)
    if spec.positions.kind == "rope":
        if h % 2:
            raise RaotError(f"head_dim {h} is odd; RoPE pairs dims i and i + head_dim/2, so it must be even.")
        if factor not in (1, 1.0) and not spec.positions.partial_rotary:
            raise RaotError(
                f"partial_rotary_factor={factor} is not supported; use a checkpoint with full rotary heads."
            )
        if int(h * factor) % 2:
            raise RaotError(f"the rotary part of a head ({int(h * factor)} dims) is odd; RoPE rotates pairs of dims.")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        raise RaotError("pretraining_tp > 1 (sliced projections) is not supported; set config.pretraining_tp = 1.")


# ---------------------------------------------------------------------------------- the family
@dataclass(frozen=True)
class FamilySpec:
    """One architecture family: what :func:`~raot_hf.adapters.resolve.build_schema` resolves on a
    loaded model (docs/design.md §2). ``base_prefix``: the task model's attribute holding the base
    model; ``layers``: the layer list relative to it; ``transposed``: Linear weights stored
    (in, out) (GPT-2's Conv1D); ``layer_scale``: per-channel scales on the attention and MLP outputs
    (LayerScale, DINOv2); ``compatible_keys``: config fields two parents must share beyond the
    shape keys every pair is checked for."""

    name: str
    model_types: tuple[str, ...]
    kind: str
    base_prefix: str
    layers: str
    attention: AttentionSpec
    mlp: MLPSpec
    norms: NormSpec
    heads: dict[str, HeadSpec]
    modality: str = "text"
    config: ConfigKeys = field(default_factory=ConfigKeys)
    embeddings: EmbeddingSpec = field(default_factory=EmbeddingSpec)
    positions: PositionSpec = field(default_factory=PositionSpec)
    layer_scale: tuple[str, str] | None = None
    transposed: bool = False
    checks: tuple[ConfigCheck, ...] = ()
    compatible_keys: tuple[str, ...] = ()
    experts: ExpertsSpec | None = None
    towers: tuple[TowerSpec, ...] = ()
    description: str = ""

    # -- what the rest of the package asks of a family -----------------------------------------
    @property
    def decoder(self) -> bool:
        """A causal decoder (right-padded calibration, generation)."""
        return self.kind == "decoder"

    @property
    def norm(self) -> str:
        return self.norms.placement

    def check_config(self, config) -> None:
        """Refuse, from the config alone, a checkpoint the schema cannot describe (docs/design.md §2, §8.4)."""
        for check in self.checks:
            check.check(config)
        check_layout(self, config)

    def head_for(self, model: torch.nn.Module) -> tuple[str, HeadSpec]:
        """The head of ``model``'s class (the longest matching suffix)."""
        cls = type(model).__name__
        for suffix in sorted(self.heads, key=len, reverse=True):
            if cls.endswith(suffix):
                return suffix, self.heads[suffix]
        raise RaotError(
            f"{cls} is not supported by the {self.name} adapter; supported heads: "
            f"{', '.join(sorted(self.heads))}. Load the checkpoint with one of those classes."
        )

    def validate(self) -> FamilySpec:
        """Refuse a spec whose fields contradict each other (a one-line error naming the family)."""

        def bad(msg: str) -> None:
            raise ValueError(f"family {self.name!r}: {msg}")

        if not self.name or not self.model_types:
            bad("needs a name and at least one model type")
        for value, allowed, what in (
            (self.kind, KINDS, "kind"),
            (self.modality, MODALITIES, "modality"),
            (self.norms.kind, NORM_KINDS, "norms.kind"),
            (self.norms.placement, PLACEMENTS, "norms.placement"),
            (self.positions.kind, POSITIONS, "positions.kind"),
            (self.attention.fused_layout, ("blocks", "per_head"), "attention.fused_layout"),
            (self.attention.qk_norm_span, ("head", "projection"), "attention.qk_norm_span"),
        ):
            if value not in allowed:
                bad(f"{what} must be one of {', '.join(allowed)}, got {value!r}")
        att = self.attention
        if not att.fused and not (att.q and att.k and att.v):
            bad("attention needs q, k and v modules, or one fused module")
        if self.norms.placement == "pre" and not self.norms.final:
            bad("a pre-norm family needs norms.final")
        if self.mlp.fused_parts > 1 and len(self.mlp.inputs) != 1:
            bad("a fused MLP input is one module")
        if self.towers:
            bad("towers belong to a two-tower spec (DualEncoderSpec, adapters/dual/), not to a family")
        if self.experts is not None and (
            len(self.experts.mlp.inputs) != 1 or self.experts.mlp.fused_parts not in (1, 2)
        ):
            bad("experts.mlp names one 3-D input parameter holding one or two parts ([gate | up]) per expert")
        if not self.heads:
            bad("needs at least one head")
        return self

    # -- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FamilySpec:
        return _build(cls, data, "family").validate()


def _plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _nested(cls) -> dict[str, type]:
    """The fields of ``cls`` that hold another part of the spec, by name."""
    if cls is FamilySpec:
        return {
            "config": ConfigKeys,
            "embeddings": EmbeddingSpec,
            "attention": AttentionSpec,
            "mlp": MLPSpec,
            "norms": NormSpec,
            "positions": PositionSpec,
            "experts": ExpertsSpec,
        }
    return {"mlp": MLPSpec, "shared": MLPSpec} if cls is ExpertsSpec else {}


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _build(cls, data: dict[str, Any], where: str):
    """``cls`` from JSON data: lists become tuples, nested objects their dataclasses; an unknown
    key is a one-line error naming where it is."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    nested = _nested(cls)
    kwargs = {}
    for key, value in data.items():
        if key in nested and value is not None:
            kwargs[key] = _build(nested[key], value, f"{where}.{key}")
        elif cls is FamilySpec and key == "heads":
            # null removes a head the extended family has
            kwargs[key] = {s: _build(HeadSpec, h, f"{where}.heads.{s}") for s, h in value.items() if h is not None}
        elif cls is FamilySpec and key == "checks":
            kwargs[key] = tuple(_build(ConfigCheck, c, f"{where}.checks") for c in value)
        elif cls is FamilySpec and key == "towers":
            kwargs[key] = tuple(_build(TowerSpec, t, f"{where}.towers") for t in value)
        else:
            kwargs[key] = _tupled(value)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``: nested objects merged key by key, anything else replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out
