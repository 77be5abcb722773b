"""Sufficient statistics from one calibration forward pass of A and B (docs/design.md §4–5).

Real-token activations are folded into sums; no activation outlives its batch. Examples split by
:func:`raot_hf.calibration.is_heldout` go through two phases, each through each model once:
**fit** (means, diagonal and A×B cross moments, :class:`Moments`, for the estimators) and, once the
candidates are solved, **held-out** (per-coordinate sums of A, B and B under the candidate,
:class:`PairedDiagonal`: all the gate reads).

Per-batch products take the activations' dtype (float32 for float32/float16/bfloat16 models,
float64 for float64). Counts, sums and diagonal moments are float64; the k×k sums float32 unless
the model is float64 (:func:`quadratic_dtype`). Hooks and passes: :mod:`raot_hf.calibration.collector`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from raot_hf.adapters.schema import ExpertLayer, ModelSchema

_F64 = torch.float64


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype a batch's products are computed in: float64 if any input is float64, else float32."""
    return _F64 if any(t.dtype == _F64 for t in tensors) else torch.float32


def quadratic_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the k×k sums for models with parameters in ``param_dtype``: float64 for float64
    models, else float32 (half the largest statistic; n per-batch products add a relative error of
    about √n·6e-8, far below a correlation's 1/√tokens sampling noise: docs/design.md §4.3)."""
    return _F64 if param_dtype == _F64 else torch.float32


#: Rows × columns of one float64 block in the moment updates: 2¹⁹ entries, 4 MiB — small enough
#: to stay in cache while it is summed, squared and summed again (docs/design.md §4.3).
_BLOCK_ENTRIES = 1 << 19
#: Rows × columns of the centred rows one float32 or float64 co-moment product takes: 2²¹ entries
#: (8 MiB per side in float32). Each product adds into every entry of the k × k sum, so fewer, larger
#: products pass over it fewer times.
_CENTERED_ENTRIES = 1 << 21
#: Rows × columns of the rows one 16-bit co-moment product takes: 2²⁴ entries, 32 MiB per side.
_PRODUCT_ENTRIES = 1 << 24


def row_blocks(rows: int, cols: int, entries: int | None = None) -> list[slice]:
    """Slices that cut ``rows`` rows of ``cols`` columns into blocks of about ``entries`` entries
    (default 2¹⁹): the float64 copies of a batch's activations are made one block at a time (peak memory)."""
    step = max(1, (_BLOCK_ENTRIES if entries is None else entries) // max(cols, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _column_sums(x: torch.Tensor, squares: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float64 Σx and Σx² (``squares``; else None) over the rows, one block of rows at a time,
    through one float64 block: the block is summed, then squared in place and summed (a float32
    value's square is exact in float64)."""
    total = torch.zeros(x.shape[1], dtype=_F64, device=x.device)
    square_sums = torch.zeros_like(total) if squares else None
    blocks = row_blocks(x.shape[0], x.shape[1])
    if not blocks:
        return total, square_sums
    buffer = torch.empty(blocks[0].stop, x.shape[1], dtype=_F64, device=x.device)
    for block in blocks:
        x64 = buffer[: block.stop - block.start].copy_(x[block])
        total += x64.sum(0)
        if squares:
            square_sums += x64.square_().sum(0)
    return total, square_sums


def _block_sums(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float64 Σa, Σb, Σa², Σb² over the rows, one block of rows at a time: a's, then b's, so that
    one float64 block is alive at a time (docs/design.md §4.3: the calibration pass sets the peak)."""
    sum_a, sq_a = _column_sums(a)
    sum_b, sq_b = _column_sums(b)
    return sum_a, sum_b, sq_a, sq_b


def _accumulate_product(total: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """``total += xᵀ·y`` with the product in x's dtype and the sum in total's (a bf16 product is
    summed in float32 across batches: docs/design.md §4.3)."""
    if x.dtype == total.dtype:
        total.addmm_(x.T, y)
    else:  # the add promotes the product exactly: no float32 copy of it
        total.add_(x.T @ y)


def _centered(x: torch.Tensor, mean: torch.Tensor, span: slice, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``span`` of ``x`` minus the float64 ``mean``, in ``dtype``: each difference computed in
    float64 and rounded as it is stored, as torch converts float64 to a 16-bit format (through
    float32: the bits a float32 copy then ``dtype`` would give), one block of about 2¹⁹ entries at
    a time and no float64 block made."""
    out = torch.empty(span.stop - span.start, x.shape[1], dtype=dtype, device=x.device)
    for block in row_blocks(out.shape[0], out.shape[1]):
        rows = slice(span.start + block.start, span.start + block.stop)
        torch.sub(x[rows], mean, out=out[block])
    return out


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
    """Sums over paired samples a (of A) and b (of B): count, Σa, Σb, Σa², Σb² (float64, per
    coordinate) and the k×k **co-moment** C = Σ(a − ā)ᵀ(b − b̄).

    C is accumulated stably (docs/design.md §4.3): each batch is centered at its own float64 means
    and combined by Chan's update C += C_batch + (n₀·m/(n₀ + m))·δaᵀδb (δ: batch minus running
    means), so the error stays relative to the spread, not the mean. ``n_cross`` / ``xsum_a`` / ``xsum_b``
    count and sum the rows in C (fewer than ``n`` under a token budget); ``product_dtype``: C's
    per-batch products (None: the rows' own; :mod:`raot_hf.calibration.precision`)."""

    n: torch.Tensor
    sum_a: torch.Tensor
    sum_b: torch.Tensor
    sq_a: torch.Tensor
    sq_b: torch.Tensor
    comoment: torch.Tensor
    n_cross: torch.Tensor | None = None
    xsum_a: torch.Tensor | None = None
    xsum_b: torch.Tensor | None = None
    product_dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.n_cross is None:
            self.n_cross = self.n.clone()
        if self.xsum_a is None:
            self.xsum_a, self.xsum_b = self.sum_a.clone(), self.sum_b.clone()

    @classmethod
    def zeros(
        cls,
        k: int,
        *,
        device=None,
        quad_dtype=_F64,
        product_dtype: torch.dtype | None = None,
        defer: bool = False,
    ) -> Moments:
        """Zero sums; the k×k sum in ``quad_dtype``, the rest float64; ``defer``: C is created empty
        (:meth:`allocate_comoment`)."""

        def z(*shape):
            return torch.zeros(*shape, dtype=_F64, device=device)

        def zq(size=k):
            return torch.zeros(size, size, dtype=quad_dtype, device=device)

        comoment = zq(0 if defer else k)
        return cls(z(()), z(k), z(k), z(k), z(k), comoment, z(()), z(k), z(k), product_dtype)

    def allocate_comoment(self) -> None:
        """Give a co-moment created empty (:meth:`SplitStatistics.zeros`) its zero k × k sum."""
        if self.comoment.numel() == 0 and self.sum_a.numel():
            k = self.sum_a.numel()
            self.comoment = torch.zeros(k, k, dtype=self.comoment.dtype, device=self.comoment.device)

    def update(self, a: torch.Tensor, b: torch.Tensor, cross_rows: torch.Tensor | None = None) -> None:
        """Add paired rows ``a``, ``b`` (n × k each); with ``cross_rows`` only those enter the
        co-moment (a token budget). Float64 copies are made a block at a time (:func:`row_blocks`)."""
        if a.shape[0] == 0:
            return
        dt = _F64 if self.product_dtype == _F64 else compute_dtype(a, b)
        self.n += a.shape[0]
        sums = _block_sums(a, b)
        for total, value in zip((self.sum_a, self.sum_b, self.sq_a, self.sq_b), sums):
            total += value
        if cross_rows is None:
            self._add_comoment(a, b, dt, sums[0], sums[1])
        else:
            ca, cb = a.index_select(0, cross_rows), b.index_select(0, cross_rows)
            self._add_comoment(ca, cb, dt, _column_sums(ca, squares=False)[0], _column_sums(cb, squares=False)[0])

    def _add_comoment(self, a, b, dt: torch.dtype, sum_a: torch.Tensor, sum_b: torch.Tensor) -> None:
        """Chan's update of the co-moment with one batch (``sum_a``, ``sum_b``: its float64 column sums)."""
        m = a.shape[0]
        if m == 0:
            return
        ma, mb = sum_a / m, sum_b / m
        n0 = float(self.n_cross)
        if n0 > 0:
            da, db = ma - self.xsum_a / n0, mb - self.xsum_b / n0
            cd = self.comoment.dtype
            self.comoment.addr_(da.to(cd), db.to(cd), alpha=n0 * m / (n0 + m))
        pd = self.product_dtype
        if pd is None or pd == dt or dt == _F64:
            blocks = row_blocks(m, a.shape[1], _CENTERED_ENTRIES)
            buffers = [torch.empty(blocks[0].stop, x.shape[1], dtype=dt, device=x.device) for x in (a, b)]
            for block in blocks:
                # the subtraction promotes the rows to float64 exactly, as a float64 copy of them would,
                # and rounds each difference once into dt as it is written: no float64 block is made
                rows = block.stop - block.start
                xa = torch.sub(a[block], ma, out=buffers[0][:rows])
                xb = torch.sub(b[block], mb, out=buffers[1][:rows])
                _accumulate_product(self.comoment, xa, xb)
        else:
            # 16-bit products (docs/design.md §4.3): the centered rows are rounded once into buffers
            # of up to 2²⁴ entries and multiplied in one product per buffer, not per float64
            # block — each product's bf16 sum is added to C by a pass over all k² entries
            for span in row_blocks(m, a.shape[1], _PRODUCT_ENTRIES):
                xa = _centered(a, ma, span, pd)
                xb = _centered(b, mb, span, pd)
                _accumulate_product(self.comoment, xa, xb)
        self.n_cross += m
        self.xsum_a += sum_a
        self.xsum_b += sum_b

    def tensors(self) -> list[torch.Tensor]:
        return [
            self.n, self.sum_a, self.sum_b, self.sq_a, self.sq_b, self.comoment,
            self.n_cross, self.xsum_a, self.xsum_b,
        ]  # fmt: skip

    def raw_cross(self) -> torch.Tensor:
        """Σaᵀb over every row, in float64: (Σa)(Σb)ᵀ / n + C. Under a token budget C holds only
        the cross rows and is scaled by n / n_cross (docs/design.md §4.3), so that the cross sum
        stays on the scale of the squares and means, which take every row; without one (n_cross = n)
        nothing is scaled: the bits of a sum over every row."""
        n, n_cross = float(self.n), float(self.n_cross)
        outer = torch.outer(self.sum_a, self.sum_b).div_(max(n, 1.0))
        comoment = self.comoment.to(_F64)
        if n_cross != n:
            comoment = comoment * (n / max(n_cross, 1.0))
        return outer.add_(comoment)

    def unit_statistics(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each coordinate's mean and standard deviation over every row, of A and of B (float64)."""
        n = self.n.clamp_min(1)
        ma, mb = self.sum_a / n, self.sum_b / n
        sa = (self.sq_a / n - ma**2).clamp_min(0).sqrt()
        sb = (self.sq_b / n - mb**2).clamp_min(0).sqrt()
        return ma, sa, mb, sb

    def correlation(self, eps: float = 1e-12) -> torch.Tensor:
        """Pearson correlation of every (a_i, b_j) pair; constant units correlate 0."""
        _, sa, _, sb = self.unit_statistics()
        # k×k work in place, C's float64 copy the only k×k buffer (the denominator and the mask a
        # block of rows at a time: the same values entry by entry); C may hold fewer rows (a budget)
        corr = self.comoment.to(_F64, copy=True).div_(self.n_cross.clamp_min(1))
        for rows in row_blocks(corr.shape[0], corr.shape[1]):
            denom = torch.outer(sa[rows], sb)
            constant = denom <= eps
            corr[rows].div_(denom.clamp_min_(eps)).masked_fill_(constant, 0.0)
        return corr


@dataclass
class Gram:
    """Σ xᵀx of one Linear input, for RegMean (A and B separately)."""

    a: torch.Tensor
    b: torch.Tensor
    n: torch.Tensor
    sum_a: torch.Tensor  # Σx, needed to re-express a Gram after folding a LayerNorm shift
    sum_b: torch.Tensor

    @classmethod
    def zeros(cls, k: int, *, device=None, quad_dtype=_F64) -> Gram:
        """Zero sums; the k×k Grams in ``quad_dtype`` (see :func:`quadratic_dtype`)."""

        def z(*shape):
            return torch.zeros(*shape, dtype=_F64, device=device)

        def zq():
            return torch.zeros(k, k, dtype=quad_dtype, device=device)

        return cls(zq(), zq(), z(()), z(k), z(k))

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
class PairedDiagonal:
    """Held-out sums for the gate (docs/design.md §5), per coordinate, of a (A), b (B) and t (b under
    the candidate transform): count, Σa, Σa², Σb, Σb², Σa·b, Σt, Σt², Σa·t."""

    n: torch.Tensor
    sum_a: torch.Tensor
    sq_a: torch.Tensor
    sum_b: torch.Tensor
    sq_b: torch.Tensor
    dot: torch.Tensor
    sum_t: torch.Tensor
    sq_t: torch.Tensor
    dot_t: torch.Tensor

    @classmethod
    def zeros(cls, k: int, *, device=None) -> PairedDiagonal:
        """Zero sums for k-dimensional samples."""
        return cls(
            torch.zeros((), dtype=_F64, device=device), *(torch.zeros(k, dtype=_F64, device=device) for _ in range(8))
        )

    def update(self, a: torch.Tensor, b: torch.Tensor, t: torch.Tensor) -> None:
        """Add paired rows ``a`` (A), ``b`` (B) and ``t`` (B under the candidate), n × k each."""
        if a.shape[0] == 0:
            return
        self.n += a.shape[0]
        same = t is b  # no candidate at this site: t's sums are b's, summed once
        blocks = row_blocks(a.shape[0], a.shape[1])
        # four float64 blocks made once per call, not per block; the squares and products written
        # into one of them, not into a temporary each (the same bits)
        buffers = [torch.empty(blocks[0].stop, a.shape[1], dtype=_F64, device=a.device) for _ in range(4)]
        for block in blocks:
            # O(n·k) sums whose differences the gains take: float64, a block of rows at a time
            rows = block.stop - block.start
            a64, b64, t64, product = (buffer[:rows] for buffer in buffers)
            a64.copy_(a[block])
            b64.copy_(b[block])

            def dot(x, y, product=product):
                return torch.mul(x, y, out=product).sum(0)

            sums = [a64.sum(0), dot(a64, a64), b64.sum(0), dot(b64, b64), dot(a64, b64)]
            if same:
                sums += sums[2:]
            else:
                t64.copy_(t[block])
                sums += [t64.sum(0), dot(t64, t64), dot(a64, t64)]
            for total, value in zip(
                (self.sum_a, self.sq_a, self.sum_b, self.sq_b, self.dot, self.sum_t, self.sq_t, self.dot_t), sums
            ):
                total += value

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def correlation(self, *, transformed: bool, eps: float = 1e-12) -> torch.Tensor:
        """Per-coordinate Pearson correlation of (a, t) (``transformed``) or of (a, b)."""
        n = self.n.clamp_min(1)
        s, sq, dot = (self.sum_t, self.sq_t, self.dot_t) if transformed else (self.sum_b, self.sq_b, self.dot)
        ma, mb = self.sum_a / n, s / n
        cov = dot / n - ma * mb
        denom = ((self.sq_a / n - ma**2).clamp_min(0) * (sq / n - mb**2).clamp_min(0)).sqrt()
        return torch.where(denom > eps, cov / denom.clamp_min(eps), torch.zeros_like(cov))


@dataclass
class ExpertMoments:
    """The fit statistics of one mixture-of-experts layer (see the module docstring): ``router``
    (E), the routed counts ``routed_a``, ``routed_b`` (E) and ``both`` (E × E), and ``units``, the
    E × E pairs' unit moments, row-major (pair (a, b) at a·E + b)."""

    router: Moments
    routed_a: torch.Tensor
    routed_b: torch.Tensor
    both: torch.Tensor
    units: list[Moments]

    @classmethod
    def zeros(cls, block: ExpertLayer, *, device=None, quad_dtype=_F64, product_dtype=None) -> ExpertMoments:
        e, f = block.num_experts, block.units
        router = Moments.zeros(e, device=device, quad_dtype=_F64, product_dtype=_F64)
        units = [
            Moments.zeros(f, device=device, quad_dtype=quad_dtype, product_dtype=product_dtype) for _ in range(e * e)
        ]
        z = torch.zeros(e, dtype=_F64, device=device)
        return cls(router, z, z.clone(), torch.zeros(e, e, dtype=_F64, device=device), units)

    @property
    def num_experts(self) -> int:
        return self.routed_a.numel()

    def pair(self, a: int, b: int) -> Moments:
        """The unit moments of expert ``a`` of A and expert ``b`` of B."""
        return self.units[a * self.num_experts + b]

    def update(self, a, b, rows: torch.Tensor | None) -> None:
        """Add one batch of two :class:`~raot_hf.calibration.experts.ExpertObservation` s: their
        ``rows`` (the moment rows among the T tokens; None: all)."""
        e = self.num_experts
        routed_a, routed_b = a.routed(e), b.routed(e)
        keep = torch.zeros(routed_a.shape[0], dtype=torch.bool, device=routed_a.device)
        keep[slice(None) if rows is None else rows.to(keep.device)] = True
        routed_a &= keep[:, None]
        routed_b &= keep[:, None]
        self.routed_a += routed_a.sum(0).to(_F64).to(self.routed_a.device)
        self.routed_b += routed_b.sum(0).to(_F64).to(self.routed_b.device)
        self.both += (routed_a.T.to(_F64) @ routed_b.to(_F64)).to(self.both.device)
        # position of each token within each expert's routed rows (before the moment rows are kept)
        place_a = a.routed(e).long().cumsum(0) - 1
        place_b = b.routed(e).long().cumsum(0) - 1
        for i in range(e):
            for j in range(e):
                common = (routed_a[:, i] & routed_b[:, j]).nonzero().squeeze(1)
                if common.numel():
                    self.pair(i, j).update(a.units[i][place_a[common, i]], b.units[j][place_b[common, j]])

    def tensors(self) -> list[torch.Tensor]:
        out = [*self.router.tensors(), self.routed_a, self.routed_b, self.both]
        for m in self.units:
            out += m.tensors()
        return out

    def moments(self) -> list[Moments]:
        return [self.router, *self.units]


def _site_tensors(split, *counts: torch.Tensor) -> list[torch.Tensor]:
    """Every sum of a split, in a fixed order: its counts, the stream's, then each layer's
    MLP, q, k and context sums (the order the all-reduce and the tests rely on)."""
    out = [*counts, *split.stream.tensors()]
    for of_site in (split.mlp, split.q, split.k, split.ctx):
        for m in of_site:
            out += m.tensors()
    for layer in sorted(split.experts):  # mixture-of-experts layers (docs/design.md §10)
        out += split.experts[layer].tensors()
    return out


@dataclass
class SplitStatistics:
    """The fit split's moments (the estimators' input)."""

    mlp: list[Moments]
    q: list[Moments]
    k: list[Moments]
    ctx: list[Moments]
    stream: Moments
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=_F64))  # real fit tokens
    moment_tokens: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=_F64))  # of them, in moments
    experts: dict = field(default_factory=dict)  # layer → ExpertMoments (docs/design.md §10)

    @classmethod
    def zeros(
        cls,
        schema: ModelSchema,
        *,
        device=None,
        quad_dtype=_F64,
        mlp_product_dtype=None,
        defer_mlp: bool = False,
    ) -> SplitStatistics:
        """Zero sums for ``schema``; co-moments in
        ``quad_dtype`` (the MLP's products in ``mlp_product_dtype``; None: the activations').
        ``defer_mlp``: every layer's co-moments are created empty, allocated when a layer-by-layer
        pass reaches it. The stream's d×d sums and rows are float64 whatever the model's dtype
        (massive-activation tokens meet every other there: docs/design.md §4.3)."""
        L, d = schema.num_layers, schema.hidden_size
        a = schema.attention_size  # H·h: the hidden size where the heads tile it
        kw = dict(device=device, quad_dtype=quad_dtype)
        experts = {b.layer: ExpertMoments.zeros(b, product_dtype=mlp_product_dtype, **kw) for b in schema.expert_layers}
        return cls(
            mlp=[
                Moments.zeros(schema.mlp_size(i), product_dtype=mlp_product_dtype, defer=defer_mlp, **kw)
                for i in range(L)
            ],
            q=[Moments.zeros(a, defer=defer_mlp, **kw) for _ in range(L)],
            k=[Moments.zeros(a, defer=defer_mlp, **kw) for _ in range(L)],
            ctx=[Moments.zeros(a, defer=defer_mlp, **kw) for _ in range(L)],
            stream=Moments.zeros(d, device=device, quad_dtype=_F64, product_dtype=_F64),
            tokens=torch.zeros((), dtype=_F64, device=device),
            moment_tokens=torch.zeros((), dtype=_F64, device=device),
            experts=experts,
        )

    def tensors(self) -> list[torch.Tensor]:
        return _site_tensors(self, self.tokens, self.moment_tokens)


@dataclass
class HeldoutStatistics:
    """The held-out split's sums, taken with the candidate transforms known (docs/design.md §5)."""

    mlp: list[PairedDiagonal]
    q: list[PairedDiagonal]
    k: list[PairedDiagonal]
    ctx: list[PairedDiagonal]
    stream: PairedDiagonal
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=_F64))
    experts: dict = field(default_factory=dict)  # layer → PairedDiagonal of the router probabilities (§10)

    @classmethod
    def zeros(cls, schema: ModelSchema, *, device=None) -> HeldoutStatistics:
        L, d, a = schema.num_layers, schema.hidden_size, schema.attention_size
        experts = {b.layer: PairedDiagonal.zeros(b.num_experts, device=device) for b in schema.expert_layers}
        return cls(
            experts=experts,
            mlp=[PairedDiagonal.zeros(schema.mlp_size(i), device=device) for i in range(L)],
            q=[PairedDiagonal.zeros(a, device=device) for _ in range(L)],
            k=[PairedDiagonal.zeros(a, device=device) for _ in range(L)],
            ctx=[PairedDiagonal.zeros(a, device=device) for _ in range(L)],
            stream=PairedDiagonal.zeros(d, device=device),
            tokens=torch.zeros((), dtype=_F64, device=device),
        )

    def tensors(self) -> list[torch.Tensor]:
        return _site_tensors(self, self.tokens)


@dataclass
class CalibrationStatistics:
    """Statistics of one calibration pass: the fit moments (estimators), the held-out sums
    (gate), and optional RegMean Grams (over the tokens of both splits)."""

    fit: SplitStatistics | None = None
    heldout: HeldoutStatistics | None = None
    grams: dict[str, Gram] = field(default_factory=dict)
    gram_keys: dict[str, str] = field(default_factory=dict)  # Linear weight name → gram key
    examples: int = 0

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for split in (self.fit, self.heldout):
            if split is not None:
                out += split.tensors()
        for key in sorted(self.grams):
            out += self.grams[key].tensors()
        return out

    def moments(self) -> list[Moments]:
        """Every :class:`Moments` of the fit split (the co-moments a distributed sum re-centers)."""
        if self.fit is None:
            return []
        fit = self.fit
        experts = [m for layer in sorted(fit.experts) for m in fit.experts[layer].moments()]
        return [fit.stream, *fit.mlp, *fit.q, *fit.k, *fit.ctx, *experts]

    def absorb(self, other: CalibrationStatistics) -> None:
        """Add the other phase's statistics: its held-out sums (or fit moments), Grams and examples."""
        for name in ("fit", "heldout"):
            if getattr(other, name) is not None:
                if getattr(self, name) is not None:
                    raise ValueError(f"both phases hold {name} statistics")
                setattr(self, name, getattr(other, name))
        for key, gram in other.grams.items():
            mine = self.grams.get(key)
            if mine is None:
                self.grams[key] = gram
            else:
                for total, value in zip(mine.tensors(), gram.tensors(), strict=True):
                    total += value
        self.gram_keys.update(other.gram_keys)
        self.examples += other.examples

    def to(self, device) -> CalibrationStatistics:
        """These statistics with every tensor on ``device`` (self if already there)."""
        device = torch.device(device)
        if all(t.device == device for t in self.tensors()):
            return self
        return _moved(self, device)

    def nbytes(self) -> int:
        """Bytes held by the sums."""
        return sum(t.numel() * t.element_size() for t in self.tensors())
