"""Sufficient statistics from one calibration forward pass of A and B (DESIGN.md §4).

Hooks on the schema's modules observe the real-token activations of A and B on the same
inputs; each pair updates float64 sums — means, diagonal second moments and the A×B cross
moment — kept in two copies, **fit** and **held-out**, split per example by the fixed rule of
:func:`raot_hf.calibration.is_heldout`. No activation outlives its batch.

Two choices keep the pass close to the cost of two plain forward passes:

* **Lockstep.** A runs in a helper thread and B in the caller's thread, strictly alternating
  at every hooked module: A stops at an activation until B has produced the same one and the
  pair has been folded into the sums. Only one activation of A waits at a time (not a whole
  batch of every layer), and the two forwards never compete for cores.
* **Per-batch products in the activations' precision.** Each batch's products (``aᵀb``,
  ``Σa``, ``Σa²``) are computed in the activations' own dtype (float32 for float32, float16 and
  bfloat16 models — upcast; float64 for float64 models) and added into float64 sums. The
  activations carry no more precision than that, and float32 GEMMs are about twice as fast as
  float64 ones; the sums across batches and processes stay float64.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

import torch

from raot_hf.adapters.schema import ModelSchema
from raot_hf.calibration.data import CalibrationBatch

logger = logging.getLogger("raot_hf.calibration")
_F64 = torch.float64


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype a batch's products are computed in: float64 if any input is float64, else float32."""
    return _F64 if any(t.dtype == _F64 for t in tensors) else torch.float32


def _accumulate_product(total: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """``total += xᵀ·y`` with the product in x's dtype and the sum in total's (float64)."""
    if x.dtype == total.dtype:
        total.addmm_(x.T, y)
    else:
        total += x.T @ y


def _moved(obj, device):
    """A copy of a statistics dataclass with every tensor field on ``device``."""
    values = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            v = v.to(device)
        elif isinstance(v, list):
            v = [_moved(x, device) for x in v]
        elif isinstance(v, dict):
            v = {k: _moved(x, device) if hasattr(x, "__dataclass_fields__") else x for k, x in v.items()}
        elif hasattr(v, "__dataclass_fields__"):
            v = _moved(v, device)
        values[f.name] = v
    return type(obj)(**values)


@dataclass
class Moments:
    """Float64 sums over paired samples a (of A) and b (of B): count, Σa, Σb, Σa², Σb², Σaᵀb.

    ``full_a`` / ``full_b`` (Σaᵀa, Σbᵀb) are kept only where a rotation is scored: the
    residual stream keeps Σbᵀb, which the gate needs to score B·O (Σaᵀa is never read)."""

    n: torch.Tensor
    sum_a: torch.Tensor
    sum_b: torch.Tensor
    sq_a: torch.Tensor
    sq_b: torch.Tensor
    cross: torch.Tensor
    full_a: torch.Tensor | None = None
    full_b: torch.Tensor | None = None

    @classmethod
    def zeros(cls, k: int, *, full: bool = False, full_a: bool | None = None, device=None) -> Moments:
        """Zero sums for k-dimensional samples; ``full`` keeps Σbᵀb (and Σaᵀa unless ``full_a=False``)."""
        full_a = full if full_a is None else full_a

        def z(*shape):
            return torch.zeros(*shape, dtype=_F64, device=device)

        return cls(
            z(()), z(k), z(k), z(k), z(k), z(k, k), z(k, k) if full and full_a else None, z(k, k) if full else None
        )

    def update(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add paired rows ``a``, ``b`` (n × k each) to the sums."""
        if a.shape[0] == 0:
            return
        dt = compute_dtype(a, b)
        a, b = a.to(dt), b.to(dt)
        self.n += a.shape[0]
        self.sum_a += a.sum(0)
        self.sum_b += b.sum(0)
        self.sq_a += (a * a).sum(0)
        self.sq_b += (b * b).sum(0)
        _accumulate_product(self.cross, a, b)
        if self.full_a is not None:
            _accumulate_product(self.full_a, a, a)
        if self.full_b is not None:
            _accumulate_product(self.full_b, b, b)

    def tensors(self) -> list[torch.Tensor]:
        full = [t for t in (self.full_a, self.full_b) if t is not None]
        return [self.n, self.sum_a, self.sum_b, self.sq_a, self.sq_b, self.cross, *full]

    def correlation(self, eps: float = 1e-12) -> torch.Tensor:
        """Pearson correlation of every (a_i, b_j) pair; constant units correlate 0."""
        n = self.n.clamp_min(1)
        ma, mb = self.sum_a / n, self.sum_b / n
        sa = (self.sq_a / n - ma**2).clamp_min(0).sqrt()
        sb = (self.sq_b / n - mb**2).clamp_min(0).sqrt()
        corr = self.cross / n  # k×k work in place: three k×k buffers, not seven
        corr.sub_(torch.outer(ma, mb))
        denom = torch.outer(sa, sb)
        constant = denom <= eps
        corr.div_(denom.clamp_min_(eps))
        return corr.masked_fill_(constant, 0.0)


@dataclass
class Gram:
    """Σ xᵀx of one Linear input, for RegMean (A and B separately)."""

    a: torch.Tensor
    b: torch.Tensor
    n: torch.Tensor
    sum_a: torch.Tensor  # Σx, needed to re-express a Gram after folding a LayerNorm shift
    sum_b: torch.Tensor

    @classmethod
    def zeros(cls, k: int, *, device=None) -> Gram:
        def z(*shape):
            return torch.zeros(*shape, dtype=_F64, device=device)

        return cls(z(k, k), z(k, k), z(()), z(k), z(k))

    def update(self, xa: torch.Tensor, xb: torch.Tensor) -> None:
        """Add the rows ``xa`` (inputs in A) and ``xb`` (in B) to the sums."""
        dt = compute_dtype(xa, xb)
        xa, xb = xa.to(dt), xb.to(dt)
        _accumulate_product(self.a, xa, xa)
        _accumulate_product(self.b, xb, xb)
        self.sum_a += xa.sum(0)
        self.sum_b += xb.sum(0)
        self.n += xa.shape[0]

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
    def zeros(cls, schema: ModelSchema, *, device=None, stream_full: bool = True) -> SplitStatistics:
        """Zero sums for ``schema``; ``stream_full=False`` drops the stream's Σbᵀb (needed only to
        score a residual rotation)."""
        L, d, f = schema.num_layers, schema.hidden_size, schema.intermediate_size
        return cls(
            mlp=[Moments.zeros(f, device=device) for _ in range(L)],
            q=[Moments.zeros(d, device=device) for _ in range(L)],
            k=[Moments.zeros(d, device=device) for _ in range(L)],
            ctx=[Moments.zeros(d, device=device) for _ in range(L)],
            stream=Moments.zeros(d, full=stream_full, full_a=False, device=device),
            tokens=torch.zeros((), dtype=_F64, device=device),
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

    def to(self, device) -> CalibrationStatistics:
        """These statistics with every tensor on ``device`` (self if already there)."""
        device = torch.device(device)
        if all(t.device == device for t in self.tensors()):
            return self
        return _moved(self, device)

    def nbytes(self) -> int:
        """Bytes held by the sums."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


# ------------------------------------------------------------------------------ observation


def _first_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    raise TypeError(f"cannot read an activation from {type(x).__name__}")


class _Observer:
    """Forward hooks on one model that hand each observed activation to ``emit(key, tensor)``.

    A key is reported once per forward (the first call: DeBERTa reuses q/k on
    ``rel_embeddings``), and only when the forward runs in the observer's own thread, so two
    observers on one model object do not see each other's passes.
    """

    def __init__(self, model: torch.nn.Module, schema: ModelSchema, gram_modules: Iterable[str] = ()):
        self.emit: Callable[[tuple, torch.Tensor], None] | None = None
        self.thread: int | None = None
        self.seen: set[tuple] = set()
        self.handles = []
        modules = dict(model.named_modules())
        params = dict(model.named_parameters())

        def report(key, x: torch.Tensor) -> None:
            if self.emit is None or threading.get_ident() != self.thread or key in self.seen:
                return
            self.seen.add(key)
            self.emit(key, x.detach())

        def add_bias(x, bias):
            return x if bias is None else x + params[bias].detach()

        def out_hook(key, index=None, bias=None):
            def hook(_m, _inp, out):
                x = _first_tensor(out)
                report(key, add_bias(x if index is None else x[..., index.to(x.device)], bias))

            return hook

        def in_hook(key):
            def hook(_m, inp):
                report(key, _first_tensor(inp))

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

                def fused_hook(_m, _inp, out, i=i, qi=qi, ki=ki, qb=r.q_bias, kb=r.k_bias):
                    x = _first_tensor(out)
                    report(("q", i), add_bias(x[..., qi.to(x.device)], qb))
                    report(("k", i), add_bias(x[..., ki.to(x.device)], kb))

                self.handles.append(modules[r.q_module].register_forward_hook(fused_hook))
            else:
                add(r.q_module, "out", out_hook(("q", i), qi, r.q_bias))
                add(r.k_module, "out", out_hook(("k", i), ki, r.k_bias))
            add(layer.context, "in", in_hook(("ctx", i)))
            add(layer.mlp_hidden, "in", in_hook(("mlp", i)))
        for j, name in enumerate(schema.stream_modules):
            add(name, "out", out_hook(("stream", j)))
        for name in gram_modules:
            add(name, "in", in_hook(("gram", name)))

    def start(self, emit: Callable[[tuple, torch.Tensor], None]) -> None:
        """Report this thread's next forward pass to ``emit``."""
        self.emit, self.thread, self.seen = emit, threading.get_ident(), set()

    def stop(self) -> None:
        self.emit = self.thread = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class _Aborted(Exception):
    """Raised inside A's forward when B's side has failed and A must stop."""


_DONE, _ERROR = object(), object()


class _Lockstep:
    """Runs A's forward in a helper thread and B's in the caller's, strictly alternating.

    A stops at each observed activation (:meth:`offer`) until B reaches the same key
    (:meth:`take`), which pairs the two, hands them to ``consume`` and lets A run on to its
    next activation while B waits. Errors on either side end both forwards and are re-raised
    in the caller."""

    def __init__(self, consume: Callable[[tuple, torch.Tensor, torch.Tensor], None]):
        self.consume = consume
        self._a_turn = threading.Semaphore(0)
        self._b_turn = threading.Semaphore(0)
        self._slot: tuple = (None, None)
        self._abort = False

    def offer(self, key: tuple, x: torch.Tensor) -> None:
        """A's side: publish an activation and wait until B has consumed it."""
        self._slot = (key, x)
        self._b_turn.release()
        self._a_turn.acquire()
        if self._abort:
            raise _Aborted()

    def take(self, key: tuple, y: torch.Tensor) -> None:
        """B's side: pair ``y`` with A's waiting activation, consume both, let A go on."""
        got, x = self._slot
        if got is _ERROR:
            raise x
        if got is not key and got != key:
            raise RuntimeError(
                f"A and B produced different activations ({got if got is not _DONE else 'end of A'} vs {key}); "
                "load both models with the same class and config"
            )
        self._slot = (None, None)
        self.consume(key, x, y)
        self._a_turn.release()
        self._b_turn.acquire()

    def run(self, forward_a: Callable[[], None], forward_b: Callable[[], None]) -> None:
        """Run both forwards to completion in lockstep."""

        def side_a():
            try:
                with torch.no_grad():
                    forward_a()
                self._slot = (_DONE, None)
            except _Aborted:
                return
            except BaseException as exc:  # handed to B's side, which re-raises it
                self._slot = (_ERROR, exc)
            self._b_turn.release()

        thread = threading.Thread(target=side_a, name="raot-calibration-A", daemon=True)
        thread.start()
        try:
            self._b_turn.acquire()
            if self._slot[0] is _ERROR:
                raise self._slot[1]
            forward_b()
            if self._slot[0] is _ERROR:
                raise self._slot[1]
            if self._slot[0] is not _DONE:
                raise RuntimeError(f"model A produced an activation ({self._slot[0]}) that model B did not")
        finally:
            if thread.is_alive():
                self._abort = True
                self._a_turn.release()
            thread.join()


class StatisticsCollector:
    """Runs A and B on the same batches and accumulates :class:`CalibrationStatistics`.

    ``grams``: collect RegMean Gram matrices for every Linear of the layers (and the heads'
    stream readers). ``device``: where the sums live (default: model A's device); batches are
    moved to each model's device. ``stream_full``: keep the stream's Σbᵀb (set it when a
    residual rotation will be scored).
    """

    def __init__(
        self,
        model_a: torch.nn.Module,
        model_b: torch.nn.Module,
        schema: ModelSchema,
        *,
        grams: bool = False,
        device=None,
        stream_full: bool = True,
    ):
        self.model_a, self.model_b, self.schema = model_a, model_b, schema
        gram_modules: list[str] = []
        gram_keys: dict[str, str] = {}
        if grams:
            for layer in schema.layers:
                for mod in layer.linears:
                    gram_modules.append(mod)
                    gram_keys[f"{mod}.weight"] = mod
        if device is None:
            device = next(model_a.parameters()).device
        self.device = torch.device(device)
        self.stats = CalibrationStatistics(
            SplitStatistics.zeros(schema, device=self.device, stream_full=stream_full),
            SplitStatistics.zeros(schema, device=self.device, stream_full=stream_full),
            gram_keys=gram_keys,
        )
        self._obs_a = _Observer(model_a, schema, gram_modules)
        self._obs_b = _Observer(model_b, schema, gram_modules)
        self._rows_index: torch.Tensor | None = None
        self._n_fit = 0
        self._shape: tuple[int, int] | None = None

    def close(self) -> None:
        self._obs_a.remove()
        self._obs_b.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @torch.no_grad()
    def update(self, batch: CalibrationBatch) -> None:
        """Forward A and B on ``batch`` and fold their activations into the sums."""
        self._batch = batch
        self._shape = None
        dev_a = next(self.model_a.parameters()).device
        dev_b = next(self.model_b.parameters()).device
        inputs_a = {k: v.to(dev_a) for k, v in batch.inputs.items()}
        inputs_b = {k: v.to(dev_b) for k, v in batch.inputs.items()}
        lockstep = _Lockstep(self._consume)

        def forward_a():  # runs in the helper thread, whose current CUDA device is not inherited
            if dev_a.type == "cuda":
                torch.cuda.set_device(dev_a)
            self._obs_a.start(lockstep.offer)
            try:
                self.model_a(**inputs_a)
            finally:
                self._obs_a.stop()

        def forward_b():
            self._obs_b.start(lockstep.take)
            try:
                self.model_b(**inputs_b)
            finally:
                self._obs_b.stop()

        lockstep.run(forward_a, forward_b)
        if self._shape is None:
            raise RuntimeError("no activation was observed: the schema's modules did not run")
        bsz = self._shape[0]
        self.stats.examples += bsz
        n_ho = int(self._rows_index.numel()) - self._n_fit
        self.stats.fit.tokens += self._n_fit
        self.stats.heldout.tokens += n_ho
        self._rows_index = None

    def _index_rows(self, x: torch.Tensor) -> None:
        """Per batch: the flat positions of real tokens, fit rows first, then held-out rows."""
        bsz, seq = x.shape[0], x.shape[1]
        mask = self._batch.token_mask
        if mask is None:
            mask = torch.ones(bsz, seq, dtype=torch.bool)
        mask = mask.to(torch.bool)
        if tuple(mask.shape) != (bsz, seq):
            raise RuntimeError(f"activation of shape {tuple(x.shape)} does not match the mask {tuple(mask.shape)}")
        heldout = self._batch.heldout.to(torch.bool)[:, None].expand(bsz, seq)
        fit_pos = (mask & ~heldout).reshape(-1).nonzero().squeeze(1)
        ho_pos = (mask & heldout).reshape(-1).nonzero().squeeze(1)
        self._n_fit = int(fit_pos.numel())
        self._rows_index = torch.cat([fit_pos, ho_pos]).to(x.device)
        self._shape = (bsz, seq)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if self._shape is None:
            self._index_rows(x)
        if tuple(x.shape[:2]) != self._shape:  # sequence dims must agree across modules
            raise RuntimeError(f"activation with leading shape {tuple(x.shape[:2])} != {self._shape}")
        flat = x.reshape(-1, x.shape[-1])
        return flat.index_select(0, self._rows_index).to(compute_dtype(x))

    def _consume(self, key: tuple, x_a: torch.Tensor, x_b: torch.Tensor) -> None:
        kind, which = key
        a, b = self._rows(x_a), self._rows(x_b)
        if kind == "gram":
            g = self.stats.grams.get(which)
            if g is None:
                g = self.stats.grams[which] = Gram.zeros(a.shape[-1], device=self.device)
            g.update(a, b)
            return
        if kind == "stream":
            a = a - a.mean(-1, keepdim=True)  # project out the mean axis (§4)
            b = b - b.mean(-1, keepdim=True)
            fit, ho = self.stats.fit.stream, self.stats.heldout.stream
        else:
            fit, ho = getattr(self.stats.fit, kind)[which], getattr(self.stats.heldout, kind)[which]
        n = self._n_fit
        fit.update(a[:n], b[:n])
        ho.update(a[n:], b[n:])
