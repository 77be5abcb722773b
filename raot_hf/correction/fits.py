"""The two post-merge corrections of one layer (docs/design.md §6.7), plain functions of a
:class:`~raot_hf.correction.layer.LayerPass` and the layer's merged parameters returning the
corrected parameters and a log: :func:`least_squares_layer` and :func:`repair_layer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raot_hf.calibration.statistics import row_blocks
from raot_hf.correction.layer import LayerPass, SharedInputs

_F64 = torch.float64


@dataclass(frozen=True)
class Site:
    """A module of the layer whose output a correction changes: its weight and bias (full names),
    whether the weight is stored (in, out) (GPT-2's ``Conv1D``) and the output channels it owns
    (``index``, None for all)."""

    module: str  # relative to the layer
    weight: str
    bias: str | None
    transposed: bool
    index: torch.Tensor | None = None
    kind: str = "linear"


def _as_in_out(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A weight as (in, out), float64."""
    w = w.to(_F64)
    return w if transposed else w.T


# ------------------------------------------------------------------------------ least squares


@dataclass
class _Normal:
    """Σ x̃ᵀx̃, Σ x̃ᵀȳ and Σ_p w_p‖y_p‖² of one Linear, x̃ = [x, 1] where it has a bias, ȳ the
    α-mix of the parents' outputs; ``residual``: the rule's own error Σ_p w_p‖y_M − y_p‖², from
    M's outputs at the site (None: not taken from the rows, see :func:`_rule_error`).

    Each chunk's products are computed in the rows' precision (float32 for a float32 or bf16
    model) and summed in float64: their rounding is far below the sampling noise of a few
    thousand rows. The rule's error, which decides whether a Linear is kept (an exact merge has
    none), is taken from the rows in float64, not from these products (docs/design.md §6.7)."""

    gram: torch.Tensor | None = None
    cross: torch.Tensor | None = None
    target: float = 0.0
    residual: float | None = None
    tokens: int = 0

    def add(self, x: torch.Tensor, y_mix: torch.Tensor, target: float, y_merged: torch.Tensor) -> None:
        """Add one chunk: M's inputs ``x`` (x̃), the mix ``y_mix``, Σ_p w_p‖y_p‖² and M's outputs."""
        self.add_products(x, y_mix)
        self.target += target
        self.tokens += x.shape[0]
        self.add_residual(y_merged, y_mix, target)

    def add_products(self, x: torch.Tensor, y_mix: torch.Tensor, gram: torch.Tensor | None = None) -> None:
        """Add one chunk's x̃ᵀx̃ and x̃ᵀȳ; ``gram``: x̃ᵀx̃ (float64) already made for all the
        Linears that read one input."""
        x = x.to(_product_dtype(x))
        g = _gram(x) if gram is None else gram
        self.gram = g if self.gram is None else self.gram + g  # not in place: the readers of one input share its Gram
        self.add_cross(x, y_mix)

    def add_cross(self, x: torch.Tensor, y_mix: torch.Tensor) -> None:
        """Add one chunk's x̃ᵀȳ (its x̃ᵀx̃ summed by the caller, once for the readers of one input)."""
        dt = _product_dtype(x)
        c = x.to(dt).T @ y_mix.to(dt)
        # promoted exactly as it is added: the same sums as a float64 copy of the product would give
        self.cross = c.to(_F64) if self.cross is None else self.cross.add_(c)

    @property
    def kept(self) -> bool:
        """Whether the rule's error, measured from the rows, is small enough to keep the Linear."""
        return self.residual is not None and self.residual / max(self.target, 1e-300) <= KEEP_BELOW

    def add_residual(self, y_merged: torch.Tensor, y_mix: torch.Tensor, target: float) -> None:
        """Add one chunk's Σ_p w_p‖y_M − y_p‖² = ‖y_M − ȳ‖² + Σ_p w_p‖y_p‖² − ‖ȳ‖² (Σ_p w_p = 1),
        in float64 blocks of rows."""
        total = target
        for block in row_blocks(y_mix.shape[0], y_mix.shape[1]):
            mix = y_mix[block].to(_F64)
            total += _sum_squares(torch.sub(y_merged[block], mix)) - _sum_squares(mix)
        self.residual = total if self.residual is None else self.residual + total


def _product_dtype(x: torch.Tensor) -> torch.dtype:
    """The precision of a chunk's products: float64 rows stay float64, others are float32."""
    return _F64 if x.dtype == _F64 else torch.float32


def _gram(x: torch.Tensor) -> torch.Tensor:
    """x̃ᵀx̃ in x's precision (float32 or float64), returned in float64."""
    return (x.T @ x).to(_F64)


def _sum_squares(x: torch.Tensor) -> float:
    """Σ x² of a contiguous float64 tensor: one dot product, one pass over its memory (x·x written
    out and then summed are two, and a temporary as large as x)."""
    flat = x.reshape(-1)
    return float(torch.dot(flat, flat))


def _squared_norm(y: torch.Tensor) -> float:
    """Σ y² in float64, a block of rows at a time."""
    return sum(_sum_squares(y[block].to(_F64)) for block in row_blocks(y.shape[0], y.shape[1]))


def _augment(x: torch.Tensor, bias: bool) -> torch.Tensor:
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], 1) if bias else x


def _with_gram(x: torch.Tensor, bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x̃ in the products' precision and x̃ᵀx̃: made once for all the Linears reading one input."""
    augmented = _augment(x, bias).to(_product_dtype(x))
    return augmented, _gram(augmented)


def _objective(w: torch.Tensor, n: _Normal) -> float:
    """Σ_p w_p‖x̃·W − y_p‖² relative to Σ_p w_p‖y_p‖² (the fit's error, 0 when it reproduces
    both), from the summed products."""
    value = (w * (n.gram @ w)).sum() - 2 * (w * n.cross).sum() + n.target
    return max(float(value / max(n.target, 1e-300)), 0.0)


def _solved_objective(w: torch.Tensor, n: _Normal, prior: torch.Tensor, shrink: float) -> float:
    """:func:`_objective` at :func:`_solve`'s solution, from its normal equations: (s·G + (1 − s)·D)·W
    = s·C + (1 − s)·D·W_prior gives G·W = C + ((1 − s)/s)·D·(W_prior − W), so Wᵀ·G·W takes no
    k × k product — O(k·out), not O(k²·out) (at the down projection of a 0.49 B model a 34 GFLOP
    float64 product, for a logged figure)."""
    d = _shrink_diagonal(n)
    wc = (w * n.cross).sum()
    wgw = wc + (1 - shrink) / shrink * (w * (d[:, None] * (prior - w))).sum()
    value = wgw - 2 * wc + n.target
    return max(float(value / max(n.target, 1e-300)), 0.0)


def _shrink_diagonal(n: _Normal) -> torch.Tensor:
    """D = diag(X̃ᵀX̃), its zeros (dead inputs) raised to 10⁻¹² of its largest entry."""
    return n.gram.diagonal().clamp_min(1e-12 * float(n.gram.diagonal().max().clamp_min(1e-300)))


def _solve(n: _Normal, prior: torch.Tensor, shrink: float) -> tuple[torch.Tensor, bool]:
    """argmin over W of shrink·‖X̃W − Ȳ‖² + (1 − shrink)·‖D^½(W − W_prior)‖², D = diag(X̃ᵀX̃):
    RegMean's shrinkage towards the rule's merged weight; and whether it solved those normal
    equations as they are (False: a singular system took a ridge and least squares)."""
    d = _shrink_diagonal(n)
    # shrink·G + (1 − shrink)·diag(d) in one k × k buffer, its diagonal added in place (the same
    # roundings as adding the two matrices): at the down projection of a 0.49 B model each k × k
    # float64 matrix is 128 MiB, and the sum of full matrices held four of them at once
    lhs = n.gram.mul(shrink)
    lhs.diagonal().add_(d.mul(1 - shrink))
    rhs = shrink * n.cross + (1 - shrink) * d[:, None] * prior
    # factored in place (the same bits as into a new matrix): two k × k float64 matrices at the
    # peak, not three (the down projection of a 0.49 B model: 128 MiB each)
    info = torch.empty((), dtype=torch.int32)
    factor, info = torch.linalg.cholesky_ex(lhs, out=(lhs, info))
    if int(info) != 0:  # singular (dead inputs): a tiny ridge, then least squares
        lhs = n.gram.mul(shrink)  # the factorisation overwrote it
        lhs.diagonal().add_(d.mul(1 - shrink))
        lhs.diagonal().add_(1e-8 * float(d.mean()))
        return torch.linalg.lstsq(lhs, rhs).solution, False
    return torch.cholesky_solve(rhs, factor), True


def _write(params: dict, site: Site, w: torch.Tensor) -> None:
    """Put the solution W̃ (in [+1], out) back as the module's weight (and bias)."""
    weight = params[site.weight]
    core = w[:-1] if site.bias is not None else w
    params[site.weight] = (core if site.transposed else core.T).to(weight.dtype).contiguous()
    if site.bias is not None:
        params[site.bias] = w[-1].to(params[site.bias].dtype)


#: A merged Linear that already reproduces its parents' outputs to this relative error (their own
#: float rounding: a merge of a model with an exact scramble of itself) is kept as it is — a refit
#: would only fit that rounding (docs/design.md §6.7).
KEEP_BELOW = 1e-6


def _refit(params: dict, site: Site, n: _Normal, prior: torch.Tensor, shrink: float) -> dict:
    """Solve one Linear and write it, unless the rule's weight is already as good as the data can
    tell; returns the Linear's log."""
    before = max(n.residual / max(n.target, 1e-300), 0.0) if n.residual is not None else _objective(prior, n)
    if before <= KEEP_BELOW:
        return {"error_before": before, "error_after": before, "tokens": n.tokens, "kept": True}
    w, exact = _solve(n, prior, shrink)
    _write(params, site, w)
    after = _solved_objective(w, n, prior, shrink) if exact and shrink > 0 else _objective(w, n)
    return {"error_before": before, "error_after": after, "tokens": n.tokens}


#: Rows of M's inputs on which :func:`_rule_error` first measures the rule's error.
SCREEN_ROWS = 512
#: Above this relative error on the screened rows the rule's weight is refitted; its error is then
#: read from the summed products, which are exact enough at this level.
SCREEN_ABOVE = 1e-3


def _rule_error(x: torch.Tensor, site: Site, weights: tuple, y_mix: torch.Tensor, target: float, n: _Normal) -> bool:
    """The rule's error at a site whose outputs M's forward has not computed yet (the readers of
    one input refitted as the forward reaches them), taken from the rows in float64 wherever it may
    be small enough to keep the Linear. It is screened first on :data:`SCREEN_ROWS` evenly spaced
    rows: when M's outputs there miss the parents' mix by more than :data:`SCREEN_ABOVE` (relative),
    the rule's error — which is at least that (docs/design.md §6.7) — is left to the summed
    products. When they do not, the error over every row is left to M's own outputs, once its
    forward has computed them with the rule's weight (``check`` in :func:`least_squares_layer`):
    they are never computed twice. With no more rows than the screen takes, every row is measured here. Returns
    whether the decision waits for M's outputs."""
    stride = max(1, x.shape[0] // SCREEN_ROWS)
    if stride == 1:
        n.add_residual(linear_out(x, site, weights), y_mix, target)
        return False
    rows_mix = y_mix[::stride].to(_F64)
    miss = float((linear_out(x[::stride], site, weights).to(_F64) - rows_mix).pow(2).sum())
    return miss <= SCREEN_ABOVE * float(rows_mix.pow(2).sum())


class _Targets:
    """The parents' mixed outputs ȳ = Σ_p w_p·y_p (float32) at each (chunk, site), by ``[key]``, and
    their Σ_p w_p‖y_p‖² (:meth:`energy`): made all at once from a run of the parents'
    layer, or — from the outputs the calibration pass kept (docs/design.md §5.7) — each when it is
    first read, so that only one input's readers' targets are held at a time. ``pop`` lets one go."""

    def __init__(self, layer: LayerPass, sites: list[str], mix: dict[str, float]):
        self.mixed: dict[tuple[int, str], torch.Tensor] = {}
        self.sums: dict[tuple[int, str], float] = {}
        self.layer, self.mix = layer, mix
        self.lazy = layer.kept is not None
        if self.lazy:
            layer.parents([], lambda *_: None)  # only the states something reads move on
        else:
            layer.parents(sites, self.add)

    def energy(self, key: tuple[int, str]) -> float:
        """Σ_p w_p‖y_p‖² at a (chunk, site), made with its mix."""
        self._load(key)
        return self.sums[key]

    def add(self, side: str, i: int, name: str, y: torch.Tensor, fresh: bool = False) -> None:
        """Add parent ``side``'s output rows ``y`` at (chunk ``i``, site ``name``); ``fresh``: ``y`` is
        a tensor of its own, scaled in place."""
        w, key = self.mix[side], (i, name)
        self.sums[key] = self.sums.get(key, 0.0) + w * _squared_norm(y)
        if key in self.mixed:  # in place: a site's rows are as large as the layer's activations
            self.mixed[key].add_(y.to(torch.float32), alpha=w)
        else:
            own = fresh and y.dtype == torch.float32
            self.mixed[key] = (y if own else y.to(torch.float32, copy=True)).mul_(w)

    def _load(self, key: tuple[int, str]) -> None:
        if self.lazy and key not in self.mixed:
            i, name = key
            self.sums.pop(key, None)  # made again: its energy with it, not added twice
            for side in self.mix:
                y = self.layer.kept.rows(side, i, name)
                if y is not None:
                    self.add(side, i, name, y, fresh=True)
                    del y

    def __getitem__(self, key: tuple[int, str]) -> torch.Tensor:
        self._load(key)
        return self.mixed[key]

    def __contains__(self, key) -> bool:
        return key in self.mixed

    def __delitem__(self, key) -> None:
        del self.mixed[key]

    def pop(self, key, default=None):
        return self.mixed.pop(key, default)


def least_squares_layer(
    layer: LayerPass, params: dict, sites: list[Site], *, mix: dict[str, float], shrink: float, shared: SharedInputs
) -> tuple[dict, list[torch.Tensor], dict]:
    """Refit every Linear of the layer to the parents' mix ``Σ w_p·Y_p`` (``mix``: side → weight,
    summing to 1; two models: ``(1−α)·Y_A + α·Y_B′``) on M's inputs, input by input in call order
    (docs/design.md §6.7). ``shared``: the layer's :func:`shared_input_sites` (one per layer class).
    Returns the parameters, M's layer outputs, and the log."""
    by_module = {s.module: s for s in sites}
    targets = _Targets(layer, list(by_module), mix)
    mixed, energy = targets, targets.energy
    params = dict(params)
    log = {}

    def refit(readers: list[str], normals: dict[str, _Normal]) -> None:
        for name in readers:
            log[name] = _refit(params, by_module[name], normals[name], _prior(params, by_module[name]), shrink)

    if len(layer.chunks) == 1 and shared.once:  # one forward of M: each input's readers refitted as it is reached
        waiting: dict[str, tuple[_Normal, dict]] = {}  # decided from M's outputs once they are computed

        def add_products(name: str, n: _Normal, x: torch.Tensor, inputs: dict) -> None:
            biased = by_module[name].bias is not None
            if biased not in inputs:  # q, k and v (gate and up) read one input: x̃ and its Gram made once
                inputs[biased] = _with_gram(x, biased)
            augmented, gram = inputs[biased]
            n.add_products(augmented, mixed[(0, name)], gram=gram)

        def written(names: list[str]) -> dict[str, torch.Tensor]:
            for name in names:  # the mixed outputs are not read again
                del mixed[(0, name)]
            return {k: params[k] for name in names for k in (by_module[name].weight, by_module[name].bias) if k}

        def fit(readers: list[str], x: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[str]]:
            normals, inputs, now = {}, {}, []
            for name in readers:
                site, key = by_module[name], (0, name)
                n = normals[name] = _Normal(target=energy(key), tokens=x.shape[0])
                if _rule_error(x, site, _weights(params, site), mixed[key], energy(key), n):
                    waiting[name] = n, inputs
                    continue
                now.append(name)
                if not n.kept:  # an exact merge: nothing to fit, no products made
                    add_products(name, n, x, inputs)
            refit(now, normals)
            return written(now), list(waiting)

        def check(name: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            """A waiting reader, from M's outputs ``y`` with the rule's weight: kept, or refitted
            (then M's forward computes it again with the new weight)."""
            n, inputs = waiting.pop(name)
            n.add_residual(y, mixed[(0, name)], energy((0, name)))
            if not n.kept:
                add_products(name, n, x, inputs)
            refit([name], {name: n})
            new = written([name])
            return {} if n.kept else new

        outputs = layer.merged_fitting(params, shared.readers, fit, check)
        return params, outputs, {name: log[name] for name in by_module if name in log}  # in call order
    # Several chunks: an input's readers are refitted once M's forward has run over every chunk.
    # Whether a reader's products are made in a forward is decided on the first chunk from the
    # rule's error there (from the rows), as the one-chunk path decides before making any — an
    # exact merge, whose error stays at float rounding, makes none. The first forward reads every
    # input's readers while their error on the first chunk stays at the keep level, and stops after
    # the first input with a reader above it, which a refit will likely change: where none is (an
    # exact merge), that one forward serves every input and gives M's outputs; each input after a
    # refitted one takes a forward of its own, as its rows then change (docs/design.md §6.7).
    readers_by_input = shared.readers
    input_of = {name: g for g, readers in enumerate(readers_by_input) for name in readers}
    normals = {name: _Normal() for name in input_of}
    now: dict[str, bool] = {}
    above_keep: dict[str, bool] = {}  # on the first chunk
    grams: dict[int, dict[bool, torch.Tensor]] = {}  # input → bias → the summed x̃ᵀx̃
    inputs: dict[tuple[int, bool], torch.Tensor] = {}  # (chunk, bias) → x̃, this chunk's only

    def products(i, name, x, readers_grams):
        """Add chunk ``i``'s x̃ᵀȳ to ``name``'s sums and, once per chunk for the readers of one
        input, x̃ᵀx̃ (the same additions, in the same order, as one sum per reader)."""
        key, biased = (i, name), by_module[name].bias is not None
        if (i, biased) not in inputs:
            if any(c != i for c, _ in inputs):  # a new chunk: the last one's inputs are not read again
                inputs.clear()
            augmented = _augment(x, biased).to(_product_dtype(x))
            inputs[(i, biased)] = augmented
            if biased in readers_grams:  # the chunk's x̃ᵀx̃ added as computed: promoted exactly, no float64 copy
                readers_grams[biased].add_(augmented.T @ augmented)
            else:
                readers_grams[biased] = _gram(augmented)
        normals[name].add_cross(inputs[(i, biased)], mixed[key])

    def merged(i, name, x, y):
        key, biased = (i, name), by_module[name].bias is not None
        if not shared.once:  # a site called more than once per chunk: each call's own inputs
            normals[name].add(_augment(x, biased), mixed[key], energy(key), y)
            return
        n = normals[name]
        n.target += energy(key)
        n.tokens += x.shape[0]
        n.add_residual(y, mixed[key], energy(key))
        if name not in now:
            now[name] = n.residual > SCREEN_ABOVE * n.target
            above_keep[name] = n.residual > KEEP_BELOW * n.target
        if now[name]:
            products(i, name, x, grams.setdefault(input_of[name], {}))
        if mixed.lazy:  # read once per pass; made again (from the kept outputs) where asked for again
            mixed.pop(key)

    def refitting(g: int) -> bool:  # likely: an error above the keep level on the first chunk
        return any(above_keep.get(name, False) for name in readers_by_input[g])

    read = -1  # the inputs whose readers the first forward read on every chunk
    first_outputs = None
    if shared.once:

        def past(name: str) -> bool:  # after an input's last reader: stop where a refit is likely
            g = input_of[name]
            return name == readers_by_input[g][-1] and refitting(g)

        first_outputs = layer.merged(params, list(input_of), merged, stop_after=past)
        read = next((g for g in range(len(readers_by_input)) if refitting(g)), len(readers_by_input) - 1)
    changed = False  # whether a refit wrote a reader's weight: the inputs after it change
    for g, readers in enumerate(readers_by_input):
        if changed or g > read:  # this input's rows are not those the first forward read
            for name in readers:
                normals[name] = _Normal()
                now.pop(name, None)
            grams.pop(g, None)
            inputs.clear()
            layer.merged(params, readers, merged, stop=shared.once)
        late = [name for name in readers if not now.get(name, True) and not normals[name].kept]  # now: once only
        late_grams: dict[bool, torch.Tensor] = {}
        inputs.clear()
        if late:  # a small error on the first chunk, not on all: their products, from one more forward

            def again(i, name, x, _y, late_grams=late_grams):
                products(i, name, x, late_grams)
                if mixed.lazy:
                    mixed.pop((i, name))

            layer.merged(params, late, again, stop=True)
        for name in readers:
            for i in range(len(layer.chunks)):  # the mixed outputs are not read again
                mixed.pop((i, name), None)
            biased = by_module[name].bias is not None
            made = late_grams if name in late else grams.get(g, {})
            if biased in made:
                normals[name].gram = made[biased]
        before = [params[by_module[name].weight] for name in readers]
        refit(readers, normals)
        changed |= any(params[by_module[name].weight] is not w for name, w in zip(readers, before, strict=True))
        grams.pop(g, None)
    if changed or first_outputs is None or any(out is None for out in first_outputs):
        first_outputs = layer.merged(params, [], lambda *_: None)
    return params, first_outputs, log


def least_squares_readers(
    chunks, norms: tuple, params: dict, sites: list[tuple[Site, dict]], *, mix: dict[str, float], shrink: float
) -> tuple[dict, dict]:
    """The Linears that read the final stream through the final norm (an untied LM head), refitted
    like a layer's: on M's final states through M's norm, to the parents' mix of outputs.
    ``norms``: the final norm module of every parent (side → module) and its merged parameters
    (relative names); ``sites``: each reader with every parent's (weight, bias) by side."""
    from torch.func import functional_call

    from raot_hf.correction.carry import rows

    modules, norm_params = norms
    params = dict(params)
    log = {}
    for site, weights in sites:
        n = _Normal()
        for c in chunks:
            mixed, target = 0.0, 0.0
            for side, w in mix.items():
                with torch.no_grad():
                    x = rows(modules[side](c.hidden[side]), c.mask).to(_F64)
                y = linear_out(x, site, weights[side])
                mixed, target = mixed + w * y, target + w * float(y.pow(2).sum())
            with torch.no_grad():
                xm = rows(functional_call(modules["a"], norm_params, (c.hidden["m"],)), c.mask).to(_F64)
            ym = linear_out(xm, site, _weights(params, site))
            n.add(_augment(xm, site.bias is not None), mixed, target, ym)
        log[site.module] = _refit(params, site, n, _prior(params, site), shrink)
    return params, log


def linear_out(x: torch.Tensor, site: Site, weights: tuple) -> torch.Tensor:
    """A Linear's output rows, in x's precision, from its (weight, bias) as stored."""
    w, b = (None if t is None else t.to(x.dtype) for t in weights)
    y = x @ (w if site.transposed else w.T)
    return y if b is None else y + b


def _weights(params: dict, site: Site) -> tuple:
    """The site's (weight, bias) in ``params`` (full names)."""
    return params[site.weight], params[site.bias] if site.bias else None


def _prior(params: dict, site: Site) -> torch.Tensor:
    """The site's current parameters as the (in [+1], out) float64 matrix the fit solves for."""
    prior = _as_in_out(params[site.weight], site.transposed)
    return prior if site.bias is None else torch.cat([prior, params[site.bias].to(_F64)[None]], 0)


# ---------------------------------------------------------------------------------- REPAIR


@dataclass
class _Moments:
    n: int = 0
    total: torch.Tensor | None = None
    squares: torch.Tensor | None = None

    def add(self, y: torch.Tensor) -> None:
        s, q = y.sum(0), y.pow(2).sum(0)
        self.total = s if self.total is None else self.total + s
        self.squares = q if self.squares is None else self.squares + q
        self.n += y.shape[0]

    def mean(self) -> torch.Tensor:
        return self.total / max(self.n, 1)

    def std(self) -> torch.Tensor:
        return (self.squares / max(self.n, 1) - self.mean() ** 2).clamp_min(0).sqrt()

    def rms(self) -> torch.Tensor:
        return (self.squares / max(self.n, 1)).sqrt()


def _channels(y: torch.Tensor, site: Site) -> torch.Tensor:
    return y if site.index is None else y.index_select(1, site.index.to(y.device))


def _affine(site: Site, target: tuple, merged: _Moments) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per channel: the scale t and (with a bias) the new shift that give M's channel the target
    statistics — mean and spread with a bias; the RMS without one (nothing to shift with)."""
    if site.bias is None:
        t = target[0] / merged.rms().clamp_min(1e-30)
        shift = None
    else:
        mean, std = target
        t = std / merged.std().clamp_min(1e-30)
        shift = mean - t * merged.mean()
    usable = torch.isfinite(t) & (t > 0)
    t = torch.where(usable, t, torch.ones_like(t))
    if shift is not None:
        shift = torch.where(usable, shift, torch.zeros_like(shift))
    return t, shift


def _fold(params: dict, site: Site, t: torch.Tensor, shift: torch.Tensor | None) -> None:
    """z ← t·z + shift on the site's channels, folded into its weight and bias."""
    w = params[site.weight].to(_F64).clone()
    idx = site.index if site.index is not None else torch.arange(t.numel())
    if site.transposed:
        w[:, idx] *= t[None, :]
    else:
        w[idx] *= t[:, None]
    params[site.weight] = w.to(params[site.weight].dtype)
    if site.bias is not None:
        b = params[site.bias].to(_F64).clone()
        b[idx] = t * b[idx] + shift  # the new pre-activation: t·(W x + b − μ_M) + μ*
        params[site.bias] = b.to(params[site.bias].dtype)


def repair_layer(
    layer: LayerPass, params: dict, sites: list[Site], *, mix: dict[str, float]
) -> tuple[dict, list, dict]:
    """REPAIR (Jordan et al. 2023) inside one Transformer layer: the value channels first, then
    the MLP's pre-activations given them, each reset to the parents' weighted statistics (``mix``:
    side → weight; two models: the α-interpolation of A's and B′'s) (docs/design.md §6.7).
    Returns the parameters, M's layer outputs and the log."""
    by_module = {s.module: s for s in sites}
    parents = {(side, s.module): _Moments() for side in mix for s in sites}

    def parent(side, _i, name, y):
        parents[(side, name)].add(_channels(y.to(_F64), by_module[name]))

    layer.parents(list(by_module), parent)
    params = dict(params)
    log = {}
    for kind in ("v", "mlp"):
        of_kind = [s.module for s in sites if s.kind == kind]
        if not of_kind:
            continue
        merged = {name: _Moments() for name in of_kind}
        layer.merged(
            params, of_kind, lambda _i, name, _x, y, m=merged: m[name].add(_channels(y.to(_F64), by_module[name]))
        )
        for name in of_kind:
            site, stats = by_module[name], {side: parents[(side, name)] for side in mix}
            if site.bias is None:
                target = (sum(w * stats[side].rms() for side, w in mix.items()),)
            else:
                target = tuple(sum(w * getattr(stats[side], f)() for side, w in mix.items()) for f in ("mean", "std"))
            t, shift = _affine(site, target, merged[name])
            _fold(params, site, t, shift)
            log[name] = {"channels": int(t.numel()), "scale_min": float(t.min()), "scale_max": float(t.max())}
    outputs = layer.merged(params, [], lambda *_: None)
    return params, outputs, log


__all__ = ["Site", "least_squares_layer", "least_squares_readers", "repair_layer"]
