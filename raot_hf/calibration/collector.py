"""Observing A and B: hooks, the lockstep of the two forwards, and the collector that folds
each phase's activations into the sums of :mod:`raot_hf.calibration.statistics` (docs/design.md §4–5).

A whole-model forward runs A in a helper thread and B in the caller's, strictly alternating at
every hooked module (:meth:`StatisticsCollector.observe`), so only one activation of A waits at a
time and the forwards never compete for cores. One layer's forward (a layer-by-layer pass) runs A
and then B in the caller's thread, A's activations of the layer held until B's reach them
(:meth:`StatisticsCollector.observe_in_turn`): no second thread, whose own C-heap arena would
fragment with each layer's transient activations (docs/design.md §7.4). An optional
token stride s (``moment_stride``) divides the fit moments' k×k cost by s (1/√s more noise).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable

import torch

from raot_hf.adapters.schema import ModelSchema
from raot_hf.calibration.batches import CalibrationBatch
from raot_hf.calibration.experts import observe_experts, router_probabilities
from raot_hf.calibration.statistics import (
    CalibrationStatistics,
    Gram,
    HeldoutStatistics,
    Moments,
    SplitStatistics,
    compute_dtype,
    quadratic_dtype,
)
from raot_hf.hooks import Hooks, first_tensor


class _Observer:
    """Forward hooks on one model that hand each observed activation to ``emit(key, tensor)``: once
    per forward (DeBERTa reuses q/k on ``rel_embeddings``), and only from the observer's own thread."""

    def __init__(self, model: torch.nn.Module, schema: ModelSchema, gram_modules: Iterable[str] = ()):
        self.emit: Callable[[tuple, torch.Tensor], None] | None = None
        self.thread: int | None = None
        self.seen: set[tuple] = set()
        self.hooks = Hooks()
        modules = dict(model.named_modules())
        params = dict(model.named_parameters())

        def report(key, x) -> None:
            if self.emit is None or threading.get_ident() != self.thread or key in self.seen:
                return
            self.seen.add(key)
            self.emit(key, x.detach() if isinstance(x, torch.Tensor) else x)

        def add_bias(x, bias):
            return x if bias is None else x + params[bias].detach()

        def out_hook(key, index=None, bias=None):
            def hook(_inp, out):
                x = first_tensor(out)
                report(key, add_bias(x if index is None else x[..., index.to(x.device)], bias))

            return hook

        def in_hook(key):
            def hook(inp):
                report(key, first_tensor(inp))

            return hook

        def add(name, kind, hook):
            module = modules.get(name)
            if module is None:
                raise KeyError(f"module {name} not found in {type(model).__name__}")
            (self.hooks.on_output if kind == "out" else self.hooks.on_input)(module, hook)

        for layer in schema.layers:
            r, i = layer.heads, layer.index
            qi = None if r.q_index is None else torch.tensor(r.q_index)
            ki = None if r.k_index is None else torch.tensor(r.k_index)
            if r.q_module == r.k_module:

                def fused_hook(_inp, out, i=i, qi=qi, ki=ki, qb=r.q_bias, kb=r.k_bias):
                    x = first_tensor(out)
                    report(("q", i), add_bias(x[..., qi.to(x.device)], qb))
                    report(("k", i), add_bias(x[..., ki.to(x.device)], kb))

                self.hooks.on_output(modules[r.q_module], fused_hook)
            else:
                add(r.q_module, "out", out_hook(("q", i), qi, r.q_bias))
                add(r.k_module, "out", out_hook(("k", i), ki, r.k_bias))
            add(layer.context, "in", in_hook(("ctx", i)))
            if layer.mlp_hidden is not None:
                add(layer.mlp_hidden, "in", in_hook(("mlp", i)))
            if layer.experts is not None:  # the router's scores, then each expert's units (docs/design.md §10)
                block = layer.experts
                add(block.router, "out", out_hook(("router", i)))

                def experts_hook(args, i=i, block=block, module=modules[block.experts]):
                    report(("experts", i), observe_experts(module, block, args[0], args[1]))

                add(block.experts, "in", experts_hook)
        for j, name in enumerate(schema.stream_modules):
            add(name, "out", out_hook(("stream", j)))
        for name in gram_modules:
            add(name, "in", in_hook(("gram", name)))

    def observing(self, emit: Callable[[tuple, torch.Tensor], None], run: Callable[[], None]) -> None:
        """Run ``run`` in this thread, reporting its observed activations to ``emit``."""
        self.emit, self.thread, self.seen = emit, threading.get_ident(), set()
        try:
            run()
        finally:
            self.emit = self.thread = None

    def remove(self) -> None:
        self.hooks.remove()


def stream_samples(x: torch.Tensor, centered: bool) -> torch.Tensor:
    """Stream rows as the next norm reads them (docs/design.md §4.2): the mean axis projected out
    for LayerNorm streams (RMSNorm streams keep it, §8), then each token scaled to unit RMS so that
    massive-activation tokens do not dominate. Both steps commute with the stream's exact maps."""
    if centered:
        x = x - x.mean(-1, keepdim=True)
    scale = x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(torch.finfo(x.dtype).tiny)
    return x.div_(scale) if centered else x / scale  # centred rows are a tensor of their own


class _Aborted(Exception):
    """Raised inside A's forward when B's side has failed and A must stop."""


_DONE, _ERROR = object(), object()
_SAME_CLASS = "load both models with the same class and config"


class _Lockstep:
    """Runs A's forward in a helper thread and B's in the caller's, strictly alternating: A waits at
    each activation (:meth:`offer`) until B reaches the same key (:meth:`take`) and ``consume`` has
    the pair. An error on either side ends both forwards and is re-raised in the caller."""

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
                + _SAME_CLASS
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


def _version(x) -> int | None:
    """``x``'s version counter (bumped by every in-place write), or None: not a tensor, or an
    inference tensor (which keeps none)."""
    if not isinstance(x, torch.Tensor) or x.is_inference():
        return None
    return x._version


class _InTurn:
    """Runs A's computation to its end, holding each activation it observes, then B's, pairing each
    of B's activations with A's held one in order, in the caller's thread. A held activation that A's
    computation wrote in place after it was observed (its version counter moved) is refused: the
    lockstep would have read it before the write."""

    def __init__(self, consume: Callable[[tuple, torch.Tensor, torch.Tensor], None]):
        self.consume = consume
        self.held: collections.deque = collections.deque()

    def hold(self, key: tuple, x: torch.Tensor) -> None:
        self.held.append((key, x, _version(x)))

    def take(self, key: tuple, y: torch.Tensor) -> None:
        if not self.held:
            raise RuntimeError(f"model B produced an activation ({key}) that model A did not; {_SAME_CLASS}")
        got, x, version = self.held.popleft()
        if got != key:
            raise RuntimeError(f"A and B produced different activations ({got} vs {key}); {_SAME_CLASS}")
        if version != _version(x):
            raise RuntimeError(
                f"model A's layer wrote its observed activation {key} in place after the hook read it; "
                "calibrate batch by batch (offload='never') for this architecture"
            )
        self.consume(key, x, y)

    def run(self, forward_a: Callable[[], None], forward_b: Callable[[], None]) -> None:
        forward_a()
        forward_b()
        if self.held:
            raise RuntimeError(f"model A produced an activation ({self.held[0][0]}) that model B did not")


class _TokenBudget:
    """Which fit rows enter a kind of cross moment (the MLP's; the d × d ones) under a budget of
    ``total`` tokens (docs/design.md §4.3): each row is kept with p = remaining budget / expected
    remaining rows (from the rows per example so far and the ``planned`` examples), drawn from a
    generator seeded by ``seed`` and the batch's first example id. ``total`` 0: every row (inactive)."""

    def __init__(self, total: int, planned: int | None, seed: int):
        self.total, self.planned, self.seed = int(total), planned, int(seed)
        self.kept = self.rows_seen = self.examples_seen = 0

    @property
    def active(self) -> bool:
        return self.total > 0 and bool(self.planned)

    def draw(self, rows: int, examples: int, first_id: int) -> torch.Tensor | None:
        """Indices (into this batch's ``rows`` moment rows) that enter the cross moments;
        ``None`` where the budget keeps every row (no gather: the sums are those of no budget)."""
        self.rows_seen += rows
        self.examples_seen += examples
        later = max(self.planned - self.examples_seen, 0) * self.rows_seen / max(self.examples_seen, 1)
        p = min(1.0, max(self.total - self.kept, 0) / max(rows + later, 1))
        if p >= 1.0:
            self.kept += rows
            return None
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + first_id)
        keep = (torch.rand(rows, generator=g) < p).nonzero().squeeze(1)
        self.kept += int(keep.numel())
        return keep


class StatisticsCollector:
    """Runs A and B on the same batches and accumulates one phase's :class:`CalibrationStatistics`.

    ``phase="fit"``: every ``moment_stride``-th real token (positions p with (p + example id) mod
    stride = 0) feeds :class:`SplitStatistics`; ``phase="heldout"``: :class:`HeldoutStatistics`, B's
    rows also mapped by ``candidates`` (site key → map, :func:`raot_hf.estimators.activation.candidate_maps`;
    missing: the identity). ``grams``: RegMean Grams; ``device``: where the sums live (default A's);
    ``moments=False``: Grams only; ``mlp_token_budget``: fit tokens per MLP cross moment,
    ``hidden_token_budget``: per query, key, context and stream cross moment (:class:`_TokenBudget`,
    0: every token); ``defer_mlp``: co-moments allocated per layer (:meth:`start_layer`).
    """

    def __init__(
        self,
        model_a: torch.nn.Module,
        model_b: torch.nn.Module,
        schema: ModelSchema,
        *,
        phase: str = "fit",
        candidates: dict[tuple, Callable[[torch.Tensor], torch.Tensor]] | None = None,
        grams: bool = False,
        device=None,
        moment_stride: int = 1,
        moments: bool = True,
        mlp_product_dtype: torch.dtype | None = None,
        mlp_token_budget: int = 0,
        hidden_token_budget: int = 0,
        planned_examples: int | None = None,
        seed: int = 0,
        defer_mlp: bool = False,
    ):
        if phase not in ("fit", "heldout"):
            raise ValueError(f"phase must be 'fit' or 'heldout', got {phase!r}")
        if isinstance(moment_stride, bool) or not isinstance(moment_stride, int) or moment_stride < 1:
            raise ValueError(f"moment_stride must be an integer >= 1, got {moment_stride!r}")
        self.model_a, self.model_b, self.schema = model_a, model_b, schema
        self.phase, self.candidates = phase, dict(candidates or {})
        self.moment_stride = moment_stride if phase == "fit" else 1
        self.moments = moments
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
        quad = self._quad = quadratic_dtype(next(model_a.parameters()).dtype)
        self.stats = CalibrationStatistics(gram_keys=gram_keys)
        if phase == "fit" and not moments:
            self.stats.fit = SplitStatistics([], [], [], [], Moments.zeros(0, device=self.device))
        elif phase == "fit":
            self.stats.fit = SplitStatistics.zeros(
                schema,
                device=self.device,
                quad_dtype=quad,
                mlp_product_dtype=mlp_product_dtype,
                defer_mlp=defer_mlp,
            )
        else:
            self.stats.heldout = HeldoutStatistics.zeros(schema, device=self.device)
        self._obs_a = _Observer(model_a, schema, gram_modules)
        self._obs_b = _Observer(model_b, schema, gram_modules)
        self._rows_index: torch.Tensor | None = None
        self._moment_index: torch.Tensor | None = None
        self._mlp_rows: torch.Tensor | None = None
        self._hidden_rows: torch.Tensor | None = None
        self._shape: tuple[int, int] | None = None
        fit = phase == "fit"
        self._budget = _TokenBudget(mlp_token_budget, planned_examples, seed) if fit else None
        # the d × d moments draw from their own generator stream: not the MLP's rows by construction
        self._hidden_budget = _TokenBudget(hidden_token_budget, planned_examples, seed + 1) if fit else None

    def close(self) -> None:
        self._obs_a.remove()
        self._obs_b.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _in_phase(self, batch: CalibrationBatch) -> torch.Tensor:
        return batch.heldout.to(torch.bool) == (self.phase == "heldout")

    @torch.no_grad()
    def update(self, batch: CalibrationBatch, *, both: bool = False):
        """Forward A and B on ``batch`` and fold this phase's rows into the sums; B's output (``both``:
        A's and B's), or None (no forward) when the batch has no row of this phase."""
        if not self.begin(batch):
            return None
        dev_a = next(self.model_a.parameters()).device
        dev_b = next(self.model_b.parameters()).device
        inputs_a = {k: v.to(dev_a) for k, v in batch.inputs.items()}
        inputs_b = {k: v.to(dev_b) for k, v in batch.inputs.items()}
        output_a, output_b = [], []
        run_a = (lambda: output_a.append(self.model_a(**inputs_a))) if both else (lambda: self.model_a(**inputs_a))
        self.observe(run_a, lambda: output_b.append(self.model_b(**inputs_b)))
        self.finish(batch)
        return (output_a[0], output_b[0]) if both else output_b[0]

    def begin(self, batch: CalibrationBatch, rows: tuple | None = None) -> bool:
        """Start folding ``batch`` (``rows``: from :meth:`rows_state`); False if it has no row of this phase."""
        if not bool(self._in_phase(batch).any()):
            return False
        self._batch = batch
        self._shape, self._rows_index, self._moment_index, self._mlp_rows, self._hidden_rows = rows or (None,) * 5
        return True

    def start_layer(self, i: int) -> None:
        """Layer ``i`` is next in a layer-by-layer pass: its deferred co-moments are allocated."""
        if self.phase == "fit" and self.moments:
            fit = self.stats.fit
            for moments in (fit.mlp[i], fit.q[i], fit.k[i], fit.ctx[i]):
                moments.allocate_comoment()

    def rows_state(self) -> tuple:
        """The current batch's row selection (shape, positions, moment rows, the budgets' rows)."""
        return self._shape, self._rows_index, self._moment_index, self._mlp_rows, self._hidden_rows

    def observe(self, run_a: Callable[[], None], run_b: Callable[[], None]) -> None:
        """Run ``run_a`` (A's computation) and ``run_b`` (B's) in lockstep, folding what they observe."""
        dev_a = next(self.model_a.parameters()).device
        lockstep = _Lockstep(self._consume)

        def forward_a():  # runs in the helper thread, whose current CUDA device is not inherited
            if dev_a.type == "cuda":
                torch.cuda.set_device(dev_a)
            self._obs_a.observing(lockstep.offer, run_a)

        lockstep.run(forward_a, lambda: self._obs_b.observing(lockstep.take, run_b))

    def observe_in_turn(self, run_a: Callable[[], None], run_b: Callable[[], None]) -> None:
        """Run ``run_a`` (A's computation of one layer) and then ``run_b`` (B's) in the caller's
        thread, folding what they observe: the pairs and their order are :meth:`observe`'s, with
        A's observed activations of the computation held until B's reach them."""
        in_turn = _InTurn(self._consume)
        in_turn.run(
            lambda: self._obs_a.observing(in_turn.hold, run_a), lambda: self._obs_b.observing(in_turn.take, run_b)
        )

    def finish(self, batch: CalibrationBatch) -> None:
        """Count ``batch``'s examples and tokens once its whole forward has been observed."""
        if self._shape is None:
            raise RuntimeError("no activation was observed: the schema's modules did not run")
        self.stats.examples += int(self._in_phase(batch).sum())
        if self.phase == "fit":
            self.stats.fit.moment_tokens += int(self._moment_index.numel())
        split = self.stats.fit if self.phase == "fit" else self.stats.heldout
        split.tokens += int(self._rows_index.numel())
        self._rows_index = self._moment_index = None

    def _index_rows(self, x: torch.Tensor) -> None:
        """Per batch: the flat positions of this phase's real tokens, and the subset the moments use."""
        bsz, seq = x.shape[0], x.shape[1]
        mask = self._batch.token_mask
        if mask is None:
            mask = torch.ones(bsz, seq, dtype=torch.bool)
        mask = mask.to(torch.bool)
        if tuple(mask.shape) != (bsz, seq):
            raise RuntimeError(f"activation of shape {tuple(x.shape)} does not match the mask {tuple(mask.shape)}")
        rows = mask & self._in_phase(self._batch)[:, None]
        self._rows_index = rows.reshape(-1).nonzero().squeeze(1).to(x.device)
        if self.moment_stride > 1:
            position = torch.arange(seq)[None, :] + self._batch.example_ids.to(torch.long)[:, None]
            sub = rows & (position % self.moment_stride == 0)
            self._moment_index = sub.reshape(-1).nonzero().squeeze(1).to(x.device)
        else:
            self._moment_index = self._rows_index
        self._mlp_rows = self._draw(self._budget, x.device)
        self._hidden_rows = self._draw(self._hidden_budget, x.device)
        self._shape = (bsz, seq)

    def _draw(self, budget: _TokenBudget | None, device) -> torch.Tensor | None:
        """This batch's rows of the moments under ``budget`` (None: every moment row)."""
        if budget is None or not budget.active:
            return None
        examples, first = int(self._in_phase(self._batch).sum()), int(self._batch.example_ids.min())
        keep = budget.draw(self._moment_index.numel(), examples, first)
        return None if keep is None else keep.to(device)

    def _rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if x.ndim == 2 and x.shape[0] == self._shape[0] * self._shape[1]:  # a router reads the tokens flattened
            x = x.reshape(*self._shape, x.shape[-1])
        if tuple(x.shape[:2]) != self._shape:  # sequence dims must agree across modules
            raise RuntimeError(f"activation with leading shape {tuple(x.shape[:2])} != {self._shape}")
        flat = x.reshape(-1, x.shape[-1])
        if index.numel() != flat.shape[0]:  # every position is a row of this phase: no gather
            flat = flat.index_select(0, index)
        return flat.to(compute_dtype(x))

    def _consume(self, key: tuple, x_a: torch.Tensor, x_b: torch.Tensor) -> None:
        kind, which = key
        if kind in ("router", "experts"):
            self._consume_experts(kind, which, x_a, x_b)
            return
        if self._shape is None:
            self._index_rows(x_a)
        if kind == "gram":
            a, b = self._rows(x_a, self._rows_index), self._rows(x_b, self._rows_index)
            g = self.stats.grams.get(which)
            if g is None:
                g = self.stats.grams[which] = Gram.zeros(a.shape[-1], device=self.device, quad_dtype=self._quad)
            g.update(a, b)
            return
        if not self.moments:
            return
        a, b = self._rows(x_a, self._moment_index), self._rows(x_b, self._moment_index)
        if kind == "stream":
            a, b = stream_samples(a, self.schema.stream_centered), stream_samples(b, self.schema.stream_centered)
            which = None
        if self.phase == "fit":
            target = self.stats.fit.stream if kind == "stream" else getattr(self.stats.fit, kind)[which]
            target.update(a, b, self._mlp_rows if kind == "mlp" else self._hidden_rows)
            return
        target = self.stats.heldout.stream if kind == "stream" else getattr(self.stats.heldout, kind)[which]
        fmap = self.candidates.get((kind, which))
        target.update(a, b, b if fmap is None else fmap(b))

    def _consume_experts(self, kind: str, layer: int, x_a, x_b) -> None:
        """A mixture-of-experts block's router scores or experts' units (docs/design.md §10), over
        the flattened (batch·sequence) tokens the block reads, this phase's moment rows kept."""
        if not self.moments or self._shape is None:
            return
        if kind == "experts":
            if self.phase == "fit":
                self.stats.fit.experts[layer].update(x_a, x_b, self._moment_index)
            return
        a = router_probabilities(self._rows(x_a, self._moment_index))
        b = router_probabilities(self._rows(x_b, self._moment_index))
        if self.phase == "fit":
            self.stats.fit.experts[layer].router.update(a, b)
            return
        fmap = self.candidates.get(("router", layer))
        self.stats.heldout.experts[layer].update(a, b, b if fmap is None else fmap(b))
