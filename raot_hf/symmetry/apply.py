"""Acting with a transform on weights: contraction of every member of a space (docs/design.md §3).
The arithmetic runs in float64 and each tensor is cast back to its own dtype."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import torch

from raot_hf.adapters.schema import Member, ModelSchema
from raot_hf.errors import RaotError
from raot_hf.io.offload import WorkingFiles, drop_file_pages, mapped_file_ranges
from raot_hf.symmetry.transforms import SpaceAction, Transform

logger = logging.getLogger("raot_hf.symmetry")
_F64 = torch.float64


def _contract(t: torch.Tensor, member: Member, action: SpaceAction, precision: torch.dtype = _F64) -> torch.Tensor:
    """``t`` with ``member``'s axis contracted with the action (a new tensor of t's dtype): a
    permutation only moves entries in t's dtype, a matrix is applied in ``precision`` (float64;
    float32 where the result only scores a candidate, docs/design.md §5.7)."""
    if member.expert_axis is not None:
        return _contract_experts(t, member, action, precision)
    idx = member.index_tensor()
    if action.perm is not None:
        x = t.movedim(member.axis, -1)
        src = action.perm if idx is None else idx[action.perm]
        moved = x[..., src]
        if action.signs is not None:  # a signed permutation: ±1, exact in any dtype
            moved = moved * action.signs.to(moved.dtype)
    else:
        x = t.to(precision).movedim(member.axis, -1)
        sub = x if idx is None else x[..., idx]
        moved = _matrix_product(sub, action)
    y = moved if idx is None else x.clone()
    if idx is not None:
        y[..., idx] = moved
    return _contiguous(y.movedim(-1, member.axis), t.dtype)


def _contract_experts(t: torch.Tensor, member: Member, action: SpaceAction, precision: torch.dtype) -> torch.Tensor:
    """A 3-D expert parameter's member (docs/design.md §10): its expert axis and ``member.axis``
    flattened into one axis of (expert, position) pairs, expert-major — the space's order — and
    contracted as one axis."""
    x = t.movedim((member.expert_axis, member.axis), (-2, -1))
    shape = x.shape
    flat = x.reshape(*shape[:-2], shape[-2] * shape[-1])
    one_axis = dataclasses.replace(member, axis=flat.ndim - 1, expert_axis=None)
    out = _contract(flat, one_axis, action, precision).reshape(shape)
    return _contiguous(out.movedim((-2, -1), (member.expert_axis, member.axis)), t.dtype)


def _contiguous(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, contiguous: one copy at most (``to`` returns ``x`` itself when no cast is needed)."""
    return x.to(dtype, memory_format=torch.contiguous_format).contiguous()


def _matrix_product(x: torch.Tensor, action: SpaceAction) -> torch.Tensor:
    """x·M in x's precision by M's structure: per head block (H·h³ instead of (H·h)³), per entry for a
    diagonal M (a head rescale), else dense. The terms dropped are exact zeros of the dense sum."""
    if action.diagonal is not None:
        return x * action.diagonal.to(x.dtype)
    if action.blocks is not None:
        perm, blocks = action.blocks
        heads, h = blocks.shape[0], blocks.shape[-1]
        gathered = x.reshape(-1, heads, h)[:, perm].transpose(0, 1)  # (H, rows, h): head i reads head perm[i]
        return (gathered @ blocks.to(x.dtype)).transpose(0, 1).reshape(x.shape)
    return x @ action.matrix.to(x.dtype)


def _norm_weight(gamma: torch.Tensor, action: SpaceAction, second_moment: torch.Tensor | None) -> torch.Tensor:
    """γ′ for a LayerNorm in a space mapped by O (§3.3): exact for permutations; for a rotation the
    least-squares γ′_j = (S′·A)_jj / S′_jj with A = Oᵀ·diag(γ)·O and S′ the second moment of
    z′ = z·O (S′ = I: Σᵢ O_ij²·γ_i)."""
    if action.perm is not None:  # signs pass through a norm: its weight only moves
        return gamma[action.perm]
    if action.diagonal is not None:  # a scale before the norm is absorbed by it (only 1 is exact there)
        return gamma
    o = action.matrix.to(_F64)
    g = gamma.to(_F64)
    if second_moment is None:
        return ((o**2).T @ g).to(gamma.dtype)
    s = o.T @ second_moment.to(_F64) @ o
    a = o.T @ torch.diag(g) @ o
    return (torch.diagonal(s @ a) / torch.diagonal(s).clamp_min(1e-12)).to(gamma.dtype)


def apply_transform(
    state: dict, schema: ModelSchema, transform: Transform, *, norm_second_moments=None, precision: torch.dtype = _F64
) -> dict:
    """Apply ``transform`` to the parameters in ``state`` (updated in place and returned; absent
    members are skipped). A residual rotation of a pre-LN schema needs folded LayerNorms;
    ``norm_second_moments`` (norm weight → second moment of its input) refines post-LN γ′;
    ``precision``: the matrix products' (float64; float32 only where the result scores a
    candidate and is never written, docs/design.md §5.7)."""
    if needs_folding(schema, stream_actions(transform, schema)):
        _require_folded(state, schema)
    for space_name, action in transform.space_actions(schema):
        inverse_t = action.inverse_transpose()
        for member in schema.space(space_name).members:
            if member.name not in state:
                continue
            if member.role == "norm":
                sm = None if norm_second_moments is None else norm_second_moments.get(member.name)
                state[member.name] = _norm_weight(state[member.name], action, sm)
            else:
                act = action if member.covariant else inverse_t
                state[member.name] = _contract(state[member.name], member, act, precision)
    return state


def output_map(
    schema: ModelSchema, actions: Mapping[str, SpaceAction], weight: str, out_axis: int
) -> list[tuple[Member, SpaceAction]]:
    """How ``actions`` (space → action, e.g. ``dict(transform.space_actions(schema))``) move the
    outputs of the Linear whose weight is ``weight`` (its output axis ``out_axis``: 0, or 1 for
    GPT-2's ``Conv1D``): each space that axis indexes, with the action its output features take
    (M for a covariant axis, M⁻ᵀ for a contravariant one, as the weight's own contraction).
    Every symmetry is exact there (§3): the transformed Linear computes, on the transformed
    input, its old output under this map (:func:`map_output_rows`)."""
    found = []
    for space_name, action in actions.items():
        for member in schema.space(space_name).members:
            if member.name == weight and member.axis == out_axis and member.role != "norm":
                act = action if member.covariant else action.inverse_transpose()
                found.append((Member(member.name, -1, member.covariant, member.role, member.index), act))
    return found


def map_output_rows(rows: torch.Tensor, mapping: list[tuple[Member, SpaceAction]], precision: torch.dtype = _F64):
    """A Linear's output ``rows`` (…, out) under its :func:`output_map`, matrices applied in
    ``precision`` and the result in the rows' dtype (a permutation only moves entries)."""
    for member, action in mapping:
        rows = _contract(rows, member, action, precision)
    return rows


def stream_actions(transform: Transform, schema: ModelSchema) -> dict[str, SpaceAction]:
    """``transform``'s action on the residual stream alone, as a one-entry actions dict (empty if
    it does not move the stream), without composing every head space."""
    action = transform.space_action(schema, "residual")
    return {} if action is None else {"residual": action}


def needs_folding(schema: ModelSchema, actions: Mapping[str, SpaceAction]) -> bool:
    """Whether ``actions`` rotate a pre-LN residual stream, so that its LayerNorms must be folded
    into their readers first (docs/design.md §3.3) — the one place this condition is written."""
    return schema.norm == "pre" and "residual" in actions and actions["residual"].perm is None


def norm_affines(model: torch.nn.Module, schema: ModelSchema) -> dict[str, torch.Tensor]:
    """Copies of the foldable norms' affine parameters (γ, β): what a fold removes, and what
    RegMean needs to re-express Grams recorded before it (docs/design.md §6.2)."""
    params = dict(model.named_parameters())
    names = [n for f in schema.folds for n in (f.norm_weight, f.norm_bias) if n and n in params]
    return {n: params[n].detach().clone() for n in names}


def _require_folded(state: Mapping[str, torch.Tensor], schema: ModelSchema) -> None:
    for fold in schema.folds:
        if fold.norm_weight in state and not _fold_is_identity(state, fold):
            raise RaotError(
                "a residual rotation of a pre-LN model needs its LayerNorms folded first; "
                "call raot_hf.symmetry.fold_layernorms (RaotMerger does this for you)."
            )


def fold_layernorms(state: dict[str, torch.Tensor], schema: ModelSchema) -> dict[str, torch.Tensor]:
    """Fold each pre-LN LayerNorm's γ, β into the readers after it (§3.3): ``W ← W·diag(γ)``,
    ``b ← b + W·β``, then γ = 1, β = 0. Exact; a no-op for post-LN schemas. Every fold is
    checked before any tensor is written."""
    for fold in schema.folds:
        for w_name, b_name in fold.readers:
            if b_name is None and fold.norm_bias is not None and torch.any(state[fold.norm_bias] != 0):
                raise RaotError(
                    f"cannot fold LayerNorm {fold.norm_bias} into {w_name}: the reader has no bias; "
                    "use a residual permutation instead of a rotation."
                )
    for fold in schema.folds:
        g = state[fold.norm_weight].to(_F64, copy=True)
        if fold.offset:  # the norm multiplies by offset + weight (Gemma's 1 + w)
            g = g + fold.offset
        for w_name, b_name in fold.writers:  # a scale of the writers' outputs (LayerScale): rows and bias
            w = state[w_name].to(_F64)
            scaled = w * g if w_name in fold.transposed else w * g[:, None]
            state[w_name] = scaled.to(state[w_name].dtype)
            if b_name is not None:
                state[b_name] = (state[b_name].to(_F64) * g).to(state[b_name].dtype)
        beta = None if fold.norm_bias is None else state[fold.norm_bias].to(_F64, copy=True)
        for w_name, b_name in fold.readers:
            w = state[w_name].to(_F64)
            copies = w.shape[0 if w_name in fold.transposed else -1] // len(g)  # a reader of several tokens' norms
            gr, br = (g, beta) if copies == 1 else (g.repeat(copies), None if beta is None else beta.repeat(copies))
            if w_name in fold.transposed:  # (in, out) storage: W ← diag(γ)·W, b ← b + βᵀ·W
                shift, scaled = (None if br is None else br @ w), w * gr[:, None]
            else:
                shift, scaled = (None if br is None else w @ br), w * gr
            if b_name is not None and shift is not None:
                state[b_name] = (state[b_name].to(_F64) + shift).to(state[b_name].dtype)
            state[w_name] = scaled.to(state[w_name].dtype)
        state[fold.norm_weight] = torch.full_like(state[fold.norm_weight], fold.identity_weight)
        if fold.norm_bias is not None:
            state[fold.norm_bias] = torch.zeros_like(state[fold.norm_bias])
    return state


def _fold_is_identity(state: Mapping[str, torch.Tensor], fold) -> bool:
    """Whether a norm's affine is already γ = 1 (and β = 0 where it has a shift)."""
    unit = bool(torch.all(state[fold.norm_weight] == fold.identity_weight))
    return unit and (fold.norm_bias is None or bool(torch.all(state[fold.norm_bias] == 0)))


def is_folded(state: Mapping[str, torch.Tensor], schema: ModelSchema) -> bool:
    """Whether every foldable LayerNorm in ``state`` already has γ = 1, β = 0."""
    return all(_fold_is_identity(state, f) for f in schema.folds)


def model_state(model: torch.nn.Module, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The model's (deduplicated, tied-once) parameters as detached tensors."""
    return {n: p.detach() for n, p in model.named_parameters() if names is None or n in names}


def storage_of(tensors) -> set[int]:
    """The storages (their data pointers) behind ``tensors``: what :func:`load_state` must copy from,
    not take over."""
    return {t.untyped_storage().data_ptr() for t in tensors}


def _write(param: torch.nn.Parameter, value: torch.Tensor, take: bool, files: list[tuple[int, int]]) -> None:
    """``param`` ← ``value`` (cast to its dtype). ``take``: the parameter takes the value's storage
    instead of copying into its own, when shape and layout allow. A loaded parameter's storage is
    the checkpoint's memory-mapped file, and the first write into each of its pages costs a
    page fault and a copy of the page: taking a freshly computed tensor writes nothing, and the old
    storage's pages, if they are a file's (``files``: :func:`raot_hf.io.offload.mapped_file_ranges`),
    are handed back."""
    if take and value.shape == param.shape and not value.requires_grad:
        old = param.data
        param.data = _contiguous(value, param.dtype)
        drop_file_pages(old, files)
    else:
        param.copy_(value)


@torch.no_grad()
def load_state(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, working_files=None, keep: set[int] | None = None
) -> None:
    """Write ``state`` into the model's parameters (casting to each parameter's dtype). An offloaded
    model (``working_files`` holds it) is written in place, each written parameter's pages going
    back to its file (docs/design.md §7.4); a model in memory takes over the given tensors — except
    any whose storage is in ``keep`` (the merged models' own parameters), which are copied, so that
    no two models ever share a parameter's memory."""
    params = dict(model.named_parameters())
    offloaded = working_files is not None and working_files.of(model) is not None
    files = mapped_file_ranges() if keep is not None and not offloaded else []
    for name, value in state.items():
        if name not in params:
            raise KeyError(f"{name} is not a parameter of {type(model).__name__}")
        take = not offloaded and keep is not None and value.untyped_storage().data_ptr() not in keep
        _write(params[name], value, take, files)
        if offloaded:
            working_files.release_tensor(params[name])


class _WriteThrough(dict):
    """A name → parameter map whose assignments write into the model's parameter (a model is
    transformed one parameter at a time, with no copy of the touched parameters): an offloaded
    parameter in place, one in memory by taking the newly computed tensor (:func:`_write`)."""

    def __init__(self, model: torch.nn.Module, names: set[str], working_files: WorkingFiles | None):
        self.params = {n: p for n, p in model.named_parameters() if n in names}
        super().__init__({n: p.detach() for n, p in self.params.items()})
        self.working_files = working_files
        self.offloaded = working_files is not None and working_files.of(model) is not None
        self.files = [] if self.offloaded else mapped_file_ranges()

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if value is self[name]:
            return
        _write(self.params[name], value, not self.offloaded, self.files)  # a transform's values are new tensors
        super().__setitem__(name, self.params[name].detach())
        if self.offloaded:  # an offloaded parameter's pages go back to its file
            self.working_files.release_tensor(self.params[name])


def _fold_parameters(model, schema: ModelSchema, names: set[str] = frozenset(), working_files=None) -> _WriteThrough:
    """``names`` and every parameter a LayerNorm fold touches, written through to ``model``
    (``working_files``: the model's when it is offloaded, docs/design.md §7.4)."""
    names = set(names) | {n for f in schema.folds for n in (f.norm_weight, f.norm_bias) if n}
    names |= {n for f in schema.folds for r in (*f.readers, *f.writers) for n in r if n}
    return _WriteThrough(model, names, working_files)


@torch.no_grad()
def transform_model(model: torch.nn.Module, schema: ModelSchema, transform: Transform, *, working_files=None, **kw):
    """Apply ``transform`` to ``model`` in place, parameter by parameter; pre-LN LayerNorms are
    folded first if a residual rotation needs it. Returns the model."""
    state = _fold_parameters(model, schema, schema.parameter_names(), working_files)
    if needs_folding(schema, stream_actions(transform, schema)) and not is_folded(state, schema):
        logger.debug("folding pre-LN LayerNorms before a residual rotation")
        fold_layernorms(state, schema)
    apply_transform(state, schema, transform, **kw)
    return model


@torch.no_grad()
def fold_model(model: torch.nn.Module, schema: ModelSchema, *, working_files=None) -> torch.nn.Module:
    """Fold a pre-LN model's LayerNorms into their readers in place (exact)."""
    fold_layernorms(_fold_parameters(model, schema, working_files=working_files), schema)
    return model
