"""Sufficient statistics from one calibration forward pass of A and B (DESIGN.md §4).

Hooks on the schema's modules capture, per batch, the real-token activations of A and then
of B on the same inputs; each pair updates float64 sums — means, diagonal second moments and
the A×B cross moment — kept in two copies, **fit** and **held-out**, split per example by the
fixed rule of :func:`raot_hf.calibration.is_heldout`. No activation outlives its batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from raot_hf.adapters.schema import ModelSchema
from raot_hf.calibration.data import CalibrationBatch

logger = logging.getLogger("raot_hf.calibration")
_F64 = torch.float64


@dataclass
class Moments:
    """Float64 sums over paired samples a (of A) and b (of B): count, Σa, Σb, Σa², Σb², Σaᵀb."""

    n: torch.Tensor
    sum_a: torch.Tensor
    sum_b: torch.Tensor
    sq_a: torch.Tensor
    sq_b: torch.Tensor
    cross: torch.Tensor
    full_a: torch.Tensor | None = None  # Σaᵀa and Σbᵀb, kept only where a rotation is scored
    full_b: torch.Tensor | None = None

    @classmethod
    def zeros(cls, k: int, *, full: bool = False) -> Moments:
        z = torch.zeros
        extra = (z(k, k, dtype=_F64), z(k, k, dtype=_F64)) if full else (None, None)
        return cls(
            z((), dtype=_F64),
            z(k, dtype=_F64),
            z(k, dtype=_F64),
            z(k, dtype=_F64),
            z(k, dtype=_F64),
            z(k, k, dtype=_F64),
            *extra,
        )

    def update(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.shape[0] == 0:
            return
        a, b = a.to(_F64), b.to(_F64)
        self.n += a.shape[0]
        self.sum_a += a.sum(0)
        self.sum_b += b.sum(0)
        self.sq_a += (a * a).sum(0)
        self.sq_b += (b * b).sum(0)
        self.cross.addmm_(a.T, b)
        if self.full_a is not None:
            self.full_a.addmm_(a.T, a)
            self.full_b.addmm_(b.T, b)

    def tensors(self) -> list[torch.Tensor]:
        full = [] if self.full_a is None else [self.full_a, self.full_b]
        return [self.n, self.sum_a, self.sum_b, self.sq_a, self.sq_b, self.cross, *full]

    def correlation(self, eps: float = 1e-12) -> torch.Tensor:
        """Pearson correlation of every (a_i, b_j) pair; constant units correlate 0."""
        n = self.n.clamp_min(1)
        ma, mb = self.sum_a / n, self.sum_b / n
        cov = self.cross / n - torch.outer(ma, mb)
        sa = (self.sq_a / n - ma**2).clamp_min(0).sqrt()
        sb = (self.sq_b / n - mb**2).clamp_min(0).sqrt()
        denom = torch.outer(sa, sb)
        return torch.where(denom > eps, cov / denom.clamp_min(eps), torch.zeros_like(cov))


@dataclass
class Gram:
    """Σ xᵀx of one Linear input, for RegMean (A and B separately)."""

    a: torch.Tensor
    b: torch.Tensor
    n: torch.Tensor
    sum_a: torch.Tensor  # Σx, needed to re-express a Gram after folding a LayerNorm shift
    sum_b: torch.Tensor

    @classmethod
    def zeros(cls, k: int) -> Gram:
        z = torch.zeros
        return cls(z(k, k, dtype=_F64), z(k, k, dtype=_F64), z((), dtype=_F64), z(k, dtype=_F64), z(k, dtype=_F64))

    def tensors(self) -> list[torch.Tensor]:
        return [self.a, self.b, self.n, self.sum_a, self.sum_b]


@dataclass
class SplitStatistics:
    """All moments of one split (fit or held-out)."""

    mlp: list[Moments]
    q: list[Moments]
    k: list[Moments]
    ctx: list[Moments]
    stream: Moments
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=_F64))

    @classmethod
    def zeros(cls, schema: ModelSchema) -> SplitStatistics:
        L, d, f = schema.num_layers, schema.hidden_size, schema.intermediate_size
        return cls(
            mlp=[Moments.zeros(f) for _ in range(L)],
            q=[Moments.zeros(d) for _ in range(L)],
            k=[Moments.zeros(d) for _ in range(L)],
            ctx=[Moments.zeros(d) for _ in range(L)],
            stream=Moments.zeros(d, full=True),
        )

    def tensors(self) -> list[torch.Tensor]:
        out = [self.tokens, *self.stream.tensors()]
        for group in (self.mlp, self.q, self.k, self.ctx):
            for m in group:
                out += m.tensors()
        return out


@dataclass
class CalibrationStatistics:
    """Fit and held-out statistics, plus optional RegMean Grams (over all tokens)."""

    fit: SplitStatistics
    heldout: SplitStatistics
    grams: dict[str, Gram] = field(default_factory=dict)
    gram_keys: dict[str, str] = field(default_factory=dict)  # Linear weight name → gram key
    examples: int = 0

    def tensors(self) -> list[torch.Tensor]:
        out = self.fit.tensors() + self.heldout.tensors()
        for key in sorted(self.grams):
            out += self.grams[key].tensors()
        return out

    def all_reduce(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum every statistic across processes in place (statistics are sums, §7)."""
        for t in self.tensors():
            t.copy_(reduce_sum(t))


def _first_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    raise TypeError(f"cannot read an activation from {type(x).__name__}")


class _Capture:
    """Forward hooks writing one batch's activations of one model into a dict."""

    def __init__(self, model: torch.nn.Module, schema: ModelSchema, gram_modules: Iterable[str] = ()):
        self.acts: dict[str, torch.Tensor] = {}
        self.grams_in: dict[str, torch.Tensor] = {}
        self.handles = []
        modules = dict(model.named_modules())
        params = dict(model.named_parameters())
        H, h = schema.num_heads, schema.head_size

        def out_hook(key, index=None, bias=None):
            def hook(_m, _inp, out):
                if key in self.acts:  # keep the first call: DeBERTa reuses q/k on rel_embeddings
                    return
                x = _first_tensor(out).detach()
                if index is not None:
                    x = x[..., index]
                if bias is not None:
                    x = x + params[bias].detach()
                self.acts[key] = x

            return hook

        def in_hook(key):
            def hook(_m, inp):
                if key not in self.acts:
                    self.acts[key] = _first_tensor(inp).detach()

            return hook

        def gram_hook(key):
            def hook(_m, inp):
                if key not in self.grams_in:
                    self.grams_in[key] = _first_tensor(inp).detach()

            return hook

        def add(name, kind, hook):
            module = modules.get(name)
            if module is None:
                raise KeyError(f"module {name} not found in {type(model).__name__}")
            reg = module.register_forward_hook if kind == "out" else module.register_forward_pre_hook
            self.handles.append(reg(hook))

        for layer in schema.layers:
            r, i = layer.heads, layer.index
            qi = None if r.q_index is None else torch.tensor(r.q_index)
            ki = None if r.k_index is None else torch.tensor(r.k_index)
            if r.q_module == r.k_module:
                fused = modules[r.q_module]

                def fused_hook(_m, _inp, out, i=i, qi=qi, ki=ki, qb=r.q_bias, kb=r.k_bias):
                    if f"q{i}" in self.acts:
                        return
                    x = _first_tensor(out).detach()
                    q, k = x[..., qi], x[..., ki]
                    self.acts[f"q{i}"] = q + params[qb].detach() if qb else q
                    self.acts[f"k{i}"] = k + params[kb].detach() if kb else k

                self.handles.append(fused.register_forward_hook(fused_hook))
            else:
                add(r.q_module, "out", out_hook(f"q{i}", qi, r.q_bias))
                add(r.k_module, "out", out_hook(f"k{i}", ki, r.k_bias))
            add(layer.context, "in", in_hook(f"ctx{i}"))
            add(layer.mlp_hidden, "in", in_hook(f"mlp{i}"))
        for j, name in enumerate(schema.stream_modules):
            add(name, "out", out_hook(f"stream{j}"))
        for name in gram_modules:
            add(name, "in", gram_hook(name))
        del H, h

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class StatisticsCollector:
    """Runs A and B on the same batches and accumulates :class:`CalibrationStatistics`.

    ``grams``: collect RegMean Gram matrices for every Linear of the layers (and the heads'
    stream readers).
    """

    def __init__(self, model_a: torch.nn.Module, model_b: torch.nn.Module, schema: ModelSchema, *, grams=False):
        self.model_a, self.model_b, self.schema = model_a, model_b, schema
        gram_modules: list[str] = []
        gram_keys: dict[str, str] = {}
        if grams:
            for layer in schema.layers:
                for mod in layer.linears:
                    gram_modules.append(mod)
                    gram_keys[f"{mod}.weight"] = mod
        self.stats = CalibrationStatistics(
            SplitStatistics.zeros(schema), SplitStatistics.zeros(schema), gram_keys=gram_keys
        )
        self._gram_modules = gram_modules
        self._cap_a = _Capture(model_a, schema, gram_modules)
        self._cap_b = _Capture(model_b, schema, gram_modules)

    def close(self) -> None:
        self._cap_a.remove()
        self._cap_b.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @torch.no_grad()
    def update(self, batch: CalibrationBatch) -> None:
        """Forward A and B on ``batch`` and fold their activations into the sums."""
        self._cap_a.acts.clear()
        self._cap_b.acts.clear()
        self.model_a(**batch.inputs)
        self.model_b(**batch.inputs)
        acts_a, acts_b = self._cap_a.acts, self._cap_b.acts
        sample = next(iter(acts_a.values()))
        bsz, seq = sample.shape[0], sample.shape[1]
        mask = batch.token_mask
        if mask is None:
            mask = torch.ones(bsz, seq, dtype=torch.bool)
        mask = mask.to(torch.bool)
        heldout_tok = batch.heldout.to(torch.bool)[:, None].expand(bsz, seq)[mask]
        fit_tok = ~heldout_tok
        self.stats.examples += bsz

        def rows(x: torch.Tensor) -> torch.Tensor:
            if x.shape[1] != seq:  # defensive: sequence dims must agree across modules
                raise RuntimeError(f"activation with sequence length {x.shape[1]} != {seq}")
            return x[mask].to(_F64)

        for split, sel in ((self.stats.fit, fit_tok), (self.stats.heldout, heldout_tok)):
            split.tokens += int(sel.sum())
        for i in range(self.schema.num_layers):
            for key, group in ((f"q{i}", "q"), (f"k{i}", "k"), (f"ctx{i}", "ctx"), (f"mlp{i}", "mlp")):
                a, b = rows(acts_a[key]), rows(acts_b[key])
                self.stats.fit.__dict__[group][i].update(a[fit_tok], b[fit_tok])
                self.stats.heldout.__dict__[group][i].update(a[heldout_tok], b[heldout_tok])
        for j in range(len(self.schema.stream_modules)):
            a, b = rows(acts_a[f"stream{j}"]), rows(acts_b[f"stream{j}"])
            a = a - a.mean(-1, keepdim=True)  # project out the mean axis (§4)
            b = b - b.mean(-1, keepdim=True)
            self.stats.fit.stream.update(a[fit_tok], b[fit_tok])
            self.stats.heldout.stream.update(a[heldout_tok], b[heldout_tok])
        for name in self._gram_modules:
            xa = rows(self._cap_a.grams_in[name])
            xb = rows(self._cap_b.grams_in[name])
            g = self.stats.grams.get(name)
            if g is None:
                g = self.stats.grams[name] = Gram.zeros(xa.shape[-1])
            g.a.addmm_(xa.T, xa)
            g.b.addmm_(xb.T, xb)
            g.sum_a += xa.sum(0)
            g.sum_b += xb.sum(0)
            g.n += xa.shape[0]
        self._cap_a.grams_in.clear()
        self._cap_b.grams_in.clear()
        acts_a.clear()
        acts_b.clear()
