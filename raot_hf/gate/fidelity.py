"""Merged computations without a third model: the evaluation behind the merge gate (docs/design.md §5).

* the **gate set**'s parent paths: A and B carried layer by layer over a few held-out examples,
  each layer's call (attention masks, relative positions and the like, whatever each architecture
  passes) taken from one forward in which no layer computes, each layer run once as the gate's
  sweep reaches it (:class:`ParentPath`);
* **merged parameters** ``(1−α)·θ_A + α·T(θ_B)`` of one layer (or of the non-layer trunk), with
  pre-LN LayerNorms folded when the residual map is a rotation, as the merge does (§3.3);
* **block-local fidelity**: a merged layer run with ``functional_call`` on A's layer at A's
  captured call and at B′'s (B's, with its stream tensors mapped into A's basis);
* **model fidelity**: A's modules computing with merged parameters (``functional_call``), layer
  by layer over every gate chunk up to its last layer (:class:`MergedModelRun`), in the gate's
  own sweep over the layers — each layer's merged parameters made once for its decisions and the
  check; every layer called as A's model calls it (:func:`raot_hf.correction.carry.layer_calls`,
  with the merged trunk).

Fidelity of an output ``m`` to a parent's ``y`` is ``1 − Σ_t w_t‖m_t − y_t‖² / Σ_t w_t‖y_t − x_t‖²``
over real tokens t, ``x`` the stream entering the block (one layer, or all layers): the part of
the output the block computes — its input passes through the residual connection and would
swamp the score. Each token weighs ``w_t = 1/rms(y_t)²``, as the next norm reads it, so that a
few massive-activation tokens do not decide the score. The score of a merged block is
``(1−α)``·that to A plus ``α``·that to B′.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch.func import functional_call

from raot_hf.adapters.schema import ModelSchema
from raot_hf.correction.carry import layer_calls
from raot_hf.errors import RaotError
from raot_hf.hooks import Call, capture_calls, first_tensor
from raot_hf.io.offload import WorkingFiles
from raot_hf.symmetry import (
    Transform,
    TransformSequence,
    apply_transform,
    fold_layernorms,
    model_state,
    needs_folding,
)


def layer_module_names(model: torch.nn.Module, schema: ModelSchema) -> list[str]:
    """The module of each layer: the schema's own (decoders), else the deepest common parent of its Linears."""
    modules = dict(model.named_modules())
    names = []
    for layer in schema.layers:
        if layer.module is not None:  # decoders name their layer module (GPT-2's Conv1D layers have no Linears)
            names.append(layer.module)
            continue
        parts = [m.split(".") for m in layer.linears]
        common = []
        for comps in zip(*parts, strict=False):
            if len(set(comps)) != 1:
                break
            common.append(comps[0])
        name = ".".join(common)
        if not name or name not in modules:
            raise RaotError(f"cannot find the module of layer {layer.index} (from {layer.linears[:2]}); report this")
        names.append(name)
    if len(set(names)) != len(names):
        raise RaotError("two layers resolve to one module; the merge gate needs one module per layer")
    return names


class ParentPath:
    """One parent over one chunk of gate examples, carried layer by layer: its layer calls
    without their hidden states (:func:`raot_hf.correction.carry.layer_calls`, from one forward in
    which no layer computes) and the states entering the current layer. :meth:`at` runs the
    current layer once and gives its call and output as a :class:`Call`; :meth:`advance` moves on.
    Only one layer's states are held (besides layer 0's input and the last output, which the
    model-level check reads): the gate set is not captured whole up front."""

    def __init__(self, model: torch.nn.Module, layer_names: list[str], inputs: dict, tails: dict, kept=None):
        self.model, self.layer_names = model, layer_names
        self.calls, self.start = layer_calls(model, layer_names, inputs, tails=tails)
        self.layer, self.hidden = 0, self.start
        self.current: Call | None = None
        # layer index → the layer's output, kept from the calibration pass (docs/design.md §5.7):
        # then the parent's layers do not run again
        self.kept = kept

    @torch.no_grad()
    def at(self, index: int) -> Call:
        """Layer ``index``'s call (its hidden states included) and output; it must be the current layer."""
        if index != self.layer:
            raise RaotError(f"the gate's parent path is at layer {self.layer}, not {index}; report this")
        if self.current is None:
            call = self.calls[index]
            if self.kept is not None:
                output = self.kept(index).to(self.hidden.device)
            else:
                output = call(self.model.get_submodule(self.layer_names[index]), self.hidden)
            self.current = Call(*call.bind(self.hidden), output)
        return self.current

    @property
    def final(self) -> torch.Tensor:
        """The last layer's output (once every layer has run)."""
        if self.layer != len(self.layer_names):
            raise RaotError(f"the gate's parent path ran {self.layer} of {len(self.layer_names)} layers; report this")
        return self.hidden

    def advance(self) -> None:
        """Move on to the next layer (after :meth:`at` ran the current one)."""
        self.hidden = self.at(self.layer).output
        self.layer, self.current = self.layer + 1, None


@dataclass
class GateChunk:
    """Gate examples of one calibration batch: inputs, real-token mask and A's and B's paths
    through their layers (:class:`ParentPath`).

    ``side``: the parent whose call a merged *layer* is scored at on these examples ("a" or "b");
    the gate set alternates halves, so each layer runs once per example, not twice."""

    inputs: dict[str, torch.Tensor]
    mask: torch.Tensor  # (rows, seq) bool
    a: ParentPath
    b: ParentPath
    side: str = "a"

    def advance(self) -> None:
        """Both parents move on to the next layer."""
        self.a.advance()
        self.b.advance()


@torch.no_grad()
def capture_layers(model: torch.nn.Module, layer_names: list[str], inputs: dict) -> list[Call]:
    """Run ``model`` on ``inputs`` up to its last layer, keeping every layer's args, kwargs and output."""
    out = capture_calls(model, layer_names, inputs)
    if any(c is None or c.output is None for c in out):
        raise RaotError("a layer did not run during the gate forward; the merge gate cannot score it")
    return out


def relative_squared_error(
    out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, start: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-example squared error of ``out`` to ``ref`` over real tokens, in float64, relative to
    ``‖ref‖²`` — or, for one layer, to ``‖ref − start‖²``, the part of the output the layer
    computes (its input passes through the residual connection and would swamp the score)."""
    return Reference(ref, mask, start).relative_squared_error(out)


def worst_token_deviation(
    out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, start: torch.Tensor | None = None
) -> torch.Tensor:
    """Per example, the largest deviation of one real token: ‖out_t − ref_t‖ over ‖ref_t − start_t‖
    (what the block computes for that token; ``start`` None: over ‖ref_t‖), with that denominator
    raised to the median token's so a token the block barely changes does not divide by ~0.

    Unweighted, unlike the fidelity (docs/design.md §5.3): the fidelity weighs tokens by 1/rms²
    so that massive-activation tokens do not swamp it, and so it hardly sees an error confined to
    them — a swap of two massive MLP units leaves a fidelity of 0.997. This measure sees it."""
    return Reference(ref, mask, start).worst_token_deviation(out)


class Reference:
    """A parent's output ``ref`` on a chunk (real tokens ``mask``, the block's input ``start``)
    as the gate's two measures read it: what depends on the reference alone — float64 copies,
    the per-token weights 1/rms², the scale and the per-token sizes — is made once, for every
    merged output scored against it (a layer's candidate sets)."""

    def __init__(self, ref: torch.Tensor, mask: torch.Tensor, start: torch.Tensor | None = None):
        self.ref = ref.to(torch.float64)
        self.mask = mask
        self.start = None if start is None else start.to(torch.float64)
        self._weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self._scale: torch.Tensor | None = None
        self._sizes: torch.Tensor | None = None

    @property
    def scale(self) -> torch.Tensor:
        """``ref``, or ``ref − start``: what the block computes."""
        if self._scale is None:
            self._scale = self.ref if self.start is None else self.ref - self.start
        return self._scale

    def relative_squared_error(self, out: torch.Tensor, diff: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`relative_squared_error` of ``out`` (``diff``: out − ref in float64, if at hand)."""
        if self._weights is None:
            # each real token weighs by 1/‖ref_t‖²: the next norm reads every token at its own scale, so a
            # handful of massive-activation tokens must not swamp the score (docs/design.md §5.3)
            rms = self.ref.pow(2).mean(-1, keepdim=True).clamp_min(1e-30)
            m = self.mask.to(out.device, torch.float64)[..., None] / rms
            self._weights = m, (self.scale**2 * m).sum(dim=(1, 2)).clamp_min(1e-30)
        m, denominator = self._weights
        diff = out.to(torch.float64) - self.ref if diff is None else diff
        return (diff**2 * m).sum(dim=(1, 2)) / denominator

    def worst_token_deviation(self, out: torch.Tensor, diff: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`worst_token_deviation` of ``out`` (``diff``: out − ref in float64, if at hand)."""
        err = (out.to(torch.float64) - self.ref if diff is None else diff).norm(dim=-1)
        if self._sizes is None:
            self._sizes = self.scale.norm(dim=-1)
        real = self.mask.to(out.device).bool()
        worst = []
        for e, s, m in zip(err, self._sizes, real, strict=True):
            if not m.any():
                worst.append(torch.zeros((), dtype=torch.float64, device=out.device))
                continue
            s_real = s[m]
            worst.append((e[m] / torch.maximum(s_real, s_real.median()).clamp_min(1e-30)).max())
        return torch.stack(worst).cpu()


@dataclass(frozen=True)
class LayerFidelity:
    """A merged layer's per-example fidelity and per-example worst-token deviation
    (:func:`worst_token_deviation`) on the gate examples."""

    scores: torch.Tensor
    worst_token: torch.Tensor


def _hidden_in(call_args: tuple, call_kwargs: dict) -> torch.Tensor:
    return Call(call_args, call_kwargs, None).hidden


class MergedParameters:
    """Merged parameters of one layer (or of the non-layer trunk) under a set of transforms.

    ``aligned=False`` is the identity merge (plain average of A and B as they are); ``aligned=True``
    folds pre-LN LayerNorms when the residual map is a rotation (as the merge does, §3.3) and maps
    B's parameters by the residual candidate and the given per-layer transforms."""

    def __init__(self, model_a, model_b, schema: ModelSchema, layer_names, residual: Transform | None, alpha: float):
        self.schema, self.alpha, self.residual = schema, alpha, residual
        self.layer_names = layer_names
        self.fold = residual is not None and needs_folding(schema, residual.actions(schema))
        head = set(schema.head_params)
        state_a, state_b = model_state(model_a), model_state(model_b)
        prefixes = tuple(n + "." for n in layer_names)
        self.layers_a = [{k: v for k, v in state_a.items() if k.startswith(p)} for p in prefixes]
        self.layers_b = [{k: v for k, v in state_b.items() if k.startswith(p)} for p in prefixes]
        other = {k for k in state_a if k not in head and not k.startswith(prefixes)}
        for f in schema.folds:  # a norm read only by the head (ViT's final LayerNorm) is not needed
            if not all(w in other for w, _ in f.readers):
                other -= {f.norm_weight, f.norm_bias}
        self.other_a = {k: state_a[k] for k in other}
        self.other_b = {k: state_b[k] for k in other}
        # candidates are scored from float32 products (float64 for a float64 model); only what is
        # written — :meth:`written`, :meth:`mapped` — is composed in float64 (docs/design.md §5.7)
        self.scoring = torch.float64 if any(v.dtype == torch.float64 for v in state_b.values()) else torch.float32
        self._cache: tuple[int, dict, dict] | None = None
        self._last: tuple[int | None, list, dict] | None = None
        self._merged: tuple[tuple, tuple, dict] | None = None

    def _reuse(self, index, transforms: list[Transform], base: dict) -> tuple[int, dict]:
        """B's state under the longest prefix of ``transforms`` already computed for this layer
        (a head rotation is a dense float64 contraction of four weights: worth not repeating)."""
        if self._last is not None and self._last[0] == index:
            done = self._last[1]
            if len(done) <= len(transforms) and all(x is y for x, y in zip(done, transforms, strict=False)):
                return len(done), dict(self._last[2])
        return 0, dict(base)

    def _folded(self, state: dict) -> dict:
        state = dict(state)
        if self.fold:
            local = [
                f
                for f in self.schema.folds
                if f.norm_weight in state and all(w in state for w, _ in (*f.readers, *f.writers))
            ]
            fold_layernorms(state, dataclasses.replace(self.schema, folds=local))
        return state

    def _base(self, index: int | None) -> tuple[dict, dict]:
        """A's (folded) and B's (folded, residual-mapped) parameters of one layer (None: the rest)."""
        if self._cache is not None and self._cache[0] == index:
            return self._cache[1], self._cache[2]
        a = self.other_a if index is None else self.layers_a[index]
        b = self.other_b if index is None else self.layers_b[index]
        a, b = self.mapped(a, b, self.scoring)
        self._cache = (index, a, b)
        return a, b

    def mapped(self, a: dict, b: dict, precision: torch.dtype = torch.float64) -> tuple[dict, dict]:
        """A's and B's parameters ``a`` and ``b`` (any part of the models, full names) as the aligned
        merge reads them: pre-LN norms folded where the residual map is a rotation (§3.3), B's
        mapped by the residual candidate, its products in ``precision`` (float64: what is written).
        New dicts; the given ones are not changed."""
        a, b = self._folded(a), self._folded(b)
        if self.residual is not None:
            apply_transform(b, self.schema, self.residual, precision=precision)
        return a, b

    def parents(self, index: int, transforms: list[Transform] = ()) -> tuple[dict, dict]:
        """Layer ``index`` of A (folded) and of B′ (B under the residual candidate and
        ``transforms``), full names: what the aligned merge of that layer combines, as scored (the
        products in :attr:`scoring` precision). Read only."""
        a, b = self._base(index)
        done, b = self._reuse(index, list(transforms), b)
        for t in list(transforms)[done:]:
            apply_transform(b, self.schema, t, precision=self.scoring)
        self._last = (index, list(transforms), b)
        return a, b

    def written(self, index: int, transforms: list[Transform]) -> tuple[dict, dict]:
        """Layer ``index`` of A (folded) and of B′ as the apply writes them: B's own layer (folded)
        under ``transforms`` — the residual candidate and the layer's accepted transforms, in the
        order of the whole sequence — composed into one float64 contraction per tensor, bit for bit
        what transforming the whole model gives (:func:`raot_hf.symmetry.transform_model`). The
        gate's scored B′ (:meth:`parents`: the residual map first, then each candidate, each cast
        back to B's dtype) differs from it by that rounding (docs/design.md §5.7). New dicts."""
        a = self._folded(self.layers_a[index])
        b = self._folded(self.layers_b[index])
        if transforms:
            apply_transform(b, self.schema, TransformSequence(list(transforms)))
        return a, b

    def merged(self, index: int | None, transforms: list[Transform] = (), *, aligned: bool = True) -> dict:
        """Full parameter names → merged values for layer ``index`` (None: the non-layer trunk). The
        last call's result is kept: the gate's model-level check asks again for the set a layer's
        decisions scored last (the callers only read the values)."""
        transforms = tuple(transforms)  # held with the result, so that no id below is reused
        key = (index, aligned, [id(t) for t in transforms])
        if self._merged is not None and self._merged[0] == key:
            return self._merged[2]
        merged = self._merge(index, transforms, aligned)
        self._merged = (key, transforms, merged)
        return merged

    def forget(self) -> None:
        """Drop the parameters kept for the layer just scored (B mapped, B′ under the last set, the
        last merge): the one sweep asks for each layer once, and an offloaded merge's peak is the
        sweep's, where these are three float32 copies of a layer beside the correction (§5.7)."""
        self._cache = self._last = self._merged = None

    def _merge(self, index: int | None, transforms, aligned: bool) -> dict:
        if aligned:
            a, b = self.parents(index, transforms) if index is not None else self._base(index)
        else:
            a = self.other_a if index is None else self.layers_a[index]
            b = self.other_b if index is None else self.layers_b[index]
        return {k: torch.lerp(a[k], b[k].to(a[k].dtype), self.alpha) for k in a}


def _relative(params: dict, prefix: str) -> dict:
    n = len(prefix) + 1
    return {k[n:]: v for k, v in params.items()}


def _map_stream(x: torch.Tensor, stream: torch.Tensor | None) -> torch.Tensor:
    return x if stream is None else x @ stream.to(x.device, x.dtype)


def _b_prime_call(a: Call, b: Call, stream: torch.Tensor | None, hidden: int) -> tuple[tuple, dict]:
    """B′'s layer call: B's tensors that live in the stream (they differ from A's and end in the
    hidden size — the hidden states, DeBERTa's relative embeddings) mapped into A's basis."""

    def convert(xa, xb):
        if not isinstance(xb, torch.Tensor) or stream is None or not xb.is_floating_point():
            return xb
        if xb.shape[-1] != hidden or (isinstance(xa, torch.Tensor) and xa.shape == xb.shape and torch.equal(xa, xb)):
            return xb
        return _map_stream(xb, stream)

    args = tuple(convert(xa, xb) for xa, xb in zip(a.args, b.args, strict=True))
    kwargs = {k: convert(a.kwargs.get(k), v) for k, v in b.kwargs.items()}
    return args, kwargs


@dataclass(frozen=True)
class ScoredCall:
    """One gate chunk's call of a layer as the merged layer is scored at it: A's captured call on an
    "a" chunk, B′'s (B's stream tensors mapped into A's basis) on a "b" chunk; the parent's output
    there as a :class:`Reference`, and the error's weight (2(1−α) or 2α)."""

    args: tuple
    kwargs: dict
    reference: Reference
    weight: float


def scored_calls(chunks: list[GateChunk], index: int, stream: torch.Tensor | None, alpha: float, hidden: int):
    """Layer ``index``'s :class:`ScoredCall` on every chunk: made once per layer, for every candidate
    set :func:`layer_fidelity` scores there."""
    calls = []
    for c in chunks:
        ca, cb = c.a.at(index), c.b.at(index)
        if c.side == "a":
            ref = Reference(ca.output, c.mask, _hidden_in(ca.args, ca.kwargs))
            calls.append(ScoredCall(ca.args, ca.kwargs, ref, 2 * (1 - alpha)))
        else:
            args_b, kwargs_b = _b_prime_call(ca, cb, stream, hidden)
            ref = Reference(_map_stream(cb.output, stream), c.mask, _hidden_in(args_b, kwargs_b))
            calls.append(ScoredCall(args_b, kwargs_b, ref, 2 * alpha))
    return calls


@torch.no_grad()
def layer_fidelity(module: torch.nn.Module, prefix: str, params: dict, calls: list[ScoredCall]) -> LayerFidelity:
    """Per-example fidelity of a merged layer (block-local) at its :func:`scored_calls`: on an "a"
    chunk to A's output at A's call, on a "b" chunk to B′'s at B′'s call, the error weighted 2(1−α)
    and 2α so that the mean over a balanced gate set is the (1−α, α) mix of both; with each
    example's worst-token deviation from the parent it is scored against."""
    rel = _relative(params, prefix)
    scores, worst = [], []
    for call in calls:
        out = first_tensor(functional_call(module, rel, call.args, call.kwargs))
        ref = call.reference
        diff = out.to(torch.float64) - ref.ref
        scores.append(1 - call.weight * ref.relative_squared_error(out, diff))
        worst.append(ref.worst_token_deviation(out, diff))
    return LayerFidelity(torch.cat(scores).cpu(), torch.cat(worst))


class MergedModelRun:
    """One merged model (identity or aligned) carried layer by layer over every gate chunk: A's
    modules computing with merged parameters (``functional_call``), A's own parameters never
    written; each layer called as A's model calls it (:func:`raot_hf.correction.carry.layer_calls`,
    with the merged trunk). :meth:`advance` runs the next layer with its merged parameters, so a
    caller that makes them anyway (the gate's per-layer decisions) runs the model-level check in
    the same sweep over the layers; :meth:`scores` is the fidelity once the last layer has run."""

    @torch.no_grad()
    def __init__(self, model_a, layer_names, merged: MergedParameters, chunks, *, aligned: bool):
        self.model_a, self.layer_names, self.chunks = model_a, layer_names, chunks
        self.stream = stream_matrix(merged.residual, merged.schema) if aligned else None
        trunk = merged.merged(None, aligned=aligned)
        device = next(model_a.parameters()).device
        self.carried, tails = [], {}  # tails: layer 0's output structure, learnt at the first chunk
        for c in chunks:
            inputs = {k: v.to(device) for k, v in c.inputs.items()}
            calls, hidden = layer_calls(model_a, layer_names, inputs, trunk, tails)
            self.carried.append([calls, hidden])
        self.next_layer = 0
        self.alpha = merged.alpha
        self.worst_token: list[float] = []  # per layer run: the worst token's deviation from the parents' mix

    def fork(self) -> MergedModelRun:
        """A run that goes on from this one's carried states: another merged model that has
        computed the same so far (the layers' outputs are new tensors, so the two never share
        a write)."""
        twin = copy.copy(self)
        twin.carried = [list(item) for item in self.carried]
        twin.worst_token = list(self.worst_token)
        return twin

    @torch.no_grad()
    def advance(self, params: dict) -> None:
        """Run layer ``next_layer`` (full parameter names → merged values) on every chunk."""
        i = self.next_layer
        name = self.layer_names[i]
        rel, module = _relative(params, name), self.model_a.get_submodule(name)
        worst = 0.0
        for c, item in zip(self.chunks, self.carried, strict=True):
            item[1] = item[0][i](module, item[1], rel)
            # where the merged model leaves the parents' path: its state against their mix at this layer
            ref_b = _map_stream(c.b.at(i).output, self.stream).double()
            ref = torch.lerp(c.a.at(i).output.to(torch.float64), ref_b, self.alpha)
            worst = max(worst, float(worst_token_deviation(item[1], ref, c.mask).max()))
        self.worst_token.append(worst)
        self.next_layer += 1

    @torch.no_grad()
    def scores(self, alpha: float) -> torch.Tensor:
        """Per-example fidelity of the last layer's output to A's and B′'s (weights 1−α, α)."""
        if self.next_layer != len(self.layer_names):
            raise RaotError(f"the merged model ran {self.next_layer} of {len(self.layer_names)} layers")
        scores = []
        for c, (_, out) in zip(self.chunks, self.carried, strict=True):
            ref_b = _map_stream(c.b.final, self.stream)
            start_a, start_b = c.a.start, _map_stream(c.b.start, self.stream)
            err_a = relative_squared_error(out, c.a.final, c.mask, start_a)
            err = (1 - alpha) * err_a + alpha * relative_squared_error(out, ref_b, c.mask, start_b)
            scores.append(1 - err)
        return torch.cat(scores).cpu()


def model_fidelity(
    model_a,
    layer_names,
    merged: MergedParameters,
    chunks,
    layer_transforms: dict[int, list[Transform]] | None,
    alpha,
    working_files: WorkingFiles | None = None,
) -> torch.Tensor:
    """Per-example fidelity of the merged model's last-layer output to A's and B′'s, in one sweep
    of its own (:class:`MergedModelRun`). ``layer_transforms=None``: the identity merge; otherwise
    the aligned merge with the residual candidate of ``merged`` and these per-layer transforms.
    ``working_files``: the models' when they are offloaded (each layer's pages are released)."""
    working_files = working_files or WorkingFiles()  # in memory: nothing to release
    aligned = layer_transforms is not None
    run = MergedModelRun(model_a, layer_names, merged, chunks, aligned=aligned)
    for i in range(len(layer_names)):
        run.advance(merged.merged(i, (layer_transforms or {}).get(i, []), aligned=aligned))
        for c in chunks:
            c.advance()
        working_files.release_all()  # offloaded models: the layer's pages, read to merge it (docs/design.md §7.4)
    return run.scores(alpha)


def stream_matrix(residual: Transform | None, schema: ModelSchema) -> torch.Tensor | None:
    """The matrix M with B′'s stream = B's stream · M (None: no residual map)."""
    if residual is None:
        return None
    action = residual.actions(schema).get("residual")
    if action is None:
        raise RaotError(f"the merge gate cannot map the stream by a {type(residual).__name__}")
    return action.dense(schema.hidden_size)


def gate_chunks(model_a, model_b, layer_names, batches, examples: int, kept=None) -> list[GateChunk]:
    """The gate set — the first ``examples`` held-out examples of ``batches`` (the held-out split,
    in id order: the same every run) — with A's and B's paths at layer 0 (:class:`ParentPath`: each
    layer's call from one forward in which no layer computes), in chunks whose ``side`` alternates
    between halves of each batch's rows. A chunk's parents run their layers as the gate reaches them,
    or, given ``kept`` (the parents' outputs kept from the calibration pass,
    :class:`raot_hf.calibration.kept.KeptOutputs`), read them from there."""
    chunks, taken = [], 0
    tails: dict = {}  # layer 0's output structure, learnt once (raot_hf.correction.carry.layer_calls)
    for number, batch in enumerate(batches):
        picked = batch.heldout.to(torch.bool).nonzero().squeeze(1)[: examples - taken]
        half = (picked.numel() + 1) // 2
        for side, rows, span in (("a", picked[:half], (0, half)), ("b", picked[half:], (half, picked.numel()))):
            if rows.numel():
                stored = None if kept is None else (number, span)
                chunks.append(_chunk(model_a, model_b, layer_names, batch, rows, side, tails, kept, stored))
        taken += picked.numel()
        if taken >= examples:
            break
    return chunks


def _chunk(model_a, model_b, layer_names, batch, rows: torch.Tensor, side: str, tails: dict, kept=None,
           stored=None) -> GateChunk:  # fmt: skip
    """Rows ``rows`` of ``batch``, with A's and B's paths through their layers (``stored``: the held-out
    batch's number and the rows' span in what ``kept`` holds of it)."""
    inputs = {k: v.index_select(0, rows) for k, v in batch.inputs.items()}
    paths = []
    for parent, model in (("a", model_a), ("b", model_b)):
        device = next(model.parameters()).device
        outputs = None
        if stored is not None:
            number, (lo, hi) = stored
            outputs = lambda i, p=parent, n=number, lo=lo, hi=hi: kept.rows(("gate", p, i, n), lo, hi)  # noqa: E731
        paths.append(ParentPath(model, layer_names, {k: v.to(device) for k, v in inputs.items()}, tails, outputs))
    if batch.token_mask is None:  # images: every position the model produces is real
        mask = torch.ones(paths[0].start.shape[:2], dtype=torch.bool)
    else:
        mask = batch.token_mask.index_select(0, rows).to(torch.bool)
    return GateChunk(inputs, mask, paths[0], paths[1], side)
