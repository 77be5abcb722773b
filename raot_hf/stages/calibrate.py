"""Stage: the calibration pass — fit phase, then held-out phase (docs/design.md §4.1, §7.1).

The fit examples feed the estimators' moments (and RegMean's Grams); the held-out examples score
the candidates and keep the B′ ≡ B check's inputs. Under ``accelerate launch`` each process runs
its shard and the sums are all-reduced (shards never pad or repeat examples).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.utils import tqdm

from raot_hf.calibration import (
    CalibrationConfig,
    check_column,
    count_calibration_batches,
    dataset_fingerprint,
    detect_modality,
    iter_calibration_batches,
    load_calibration_dataset,
)
from raot_hf.calibration.batches import check_tokenizer_reads_text, count_calibration_examples
from raot_hf.calibration.collector import StatisticsCollector
from raot_hf.calibration.kept import KeptOutputs, KeptPlan, OutputCapture, site_bytes
from raot_hf.calibration.precision import resolve_moment_precision
from raot_hf.calibration.statistics import CalibrationStatistics
from raot_hf.errors import RaotError
from raot_hf.estimators.activation import candidate_maps
from raot_hf.io.offload import trim_heap
from raot_hf.stages.context import PairContext
from raot_hf.symmetry.equivalence import select_primary

logger = logging.getLogger("raot_hf.stages.calibrate")


@dataclass
class CalibrationRun:
    """The calibration sample as used: dataset, resolved settings, fingerprint for the report, and the
    held-out inputs and B's outputs kept for the B′ ≡ B check."""

    dataset: Any
    config: CalibrationConfig
    fingerprint: dict[str, Any]
    check_inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    check_reference: list[dict[str, torch.Tensor]] = field(default_factory=list)
    # A's outputs on the check's inputs, from the same forwards (the quality figures read them, §6.8)
    check_reference_a: list[dict[str, torch.Tensor]] = field(default_factory=list)
    moment_precision: dict[str, str] | None = None  # requested, used and why (the fit phase sets it)
    encodings: dict = field(default_factory=dict)  # example id → its tokens: every pass tokenizes once
    # the parents' outputs the one sweep reads, kept while the pass runs them (docs/design.md §5.7)
    kept: OutputCapture | None = None
    # the refit's targets, made from the pass's own forwards of A and B (§6.11): an object with
    # ``add(phase, batch, output_a, output_b)`` (raot_hf.stages.refit.PredictionCapture)
    predictions: Any = None

    def batches(self, preprocessor, batch_size: int | None = None, **shard):
        """This sample's calibration batches (``split``, ``rank``, ``world_size``; ``batch_size``
        instead of the calibration's), tokens reused."""
        config = self.config if batch_size is None else replace(self.config, batch_size=batch_size)
        return iter_calibration_batches(self.dataset, preprocessor, config, encodings=self.encodings, **shard)


@dataclass(frozen=True)
class CheckedSample:
    """A calibration sample loaded and checked before any weights are read (the pass reuses it)."""

    request: dict[str, Any]
    dataset: Any
    column: str


def check_calibration_early(cal: CalibrationConfig, preprocessor) -> CheckedSample:
    """Load the sample and resolve its column before any weights are read: a wrong one fails in seconds."""
    dataset = load_calibration_dataset(cal)
    column = check_column(dataset, cal.column, detect_modality(preprocessor), model_label="model A")
    check_tokenizer_reads_text(dataset, column, preprocessor)
    return CheckedSample(cal.to_dict(), dataset, column)


def resolve_calibration(ctx: PairContext, calibration) -> tuple[CalibrationConfig, Any]:
    """(settings, in-memory dataset or None) from ``calibration``: a CalibrationConfig, a path or
    Hub id, a ``datasets.Dataset``, or None for the config's own source."""
    cal = ctx.config.calibration
    if isinstance(calibration, CalibrationConfig):
        return calibration, None
    if isinstance(calibration, (str, Path)):
        return cal.__class__.from_dict({**cal.to_dict(), "source": str(calibration)}), None
    if calibration is None:
        if cal.source is None:
            hint = " — or alignment='none' to skip the gate's shared-basis check" if ctx.base is not None else ""
            raise RaotError(f"this merge needs calibration data; pass calibration=... (or --calibration){hint}")
        return cal, None
    return cal, calibration  # an in-memory datasets.Dataset


def open_calibration(
    ctx: PairContext, calibration, early: CheckedSample | None = None, like: CalibrationRun | None = None
) -> CalibrationRun:
    """Load (or reuse the early check's) calibration sample and resolve its column. ``like``: another
    pair's run on the same sample, whose dataset and tokens are reused."""
    if like is not None:
        fingerprint = dataset_fingerprint(like.dataset, like.config.column)
        return CalibrationRun(like.dataset, like.config, fingerprint, encodings=like.encodings)
    if ctx.preprocessor is None:
        raise RaotError("no tokenizer or image processor for model A; pass preprocessor= to from_models")
    cal_cfg, data = resolve_calibration(ctx, calibration)
    if data is None and early is not None and early.request == cal_cfg.to_dict():
        dataset, column = early.dataset, early.column  # from_pretrained's early check loaded this very sample
    else:
        dataset = load_calibration_dataset(data if data is not None else cal_cfg, config=cal_cfg)
        column = cal_cfg.column
    column = check_column(dataset, column, detect_modality(ctx.preprocessor), model_label="model A")
    check_tokenizer_reads_text(dataset, column, ctx.preprocessor)
    cal_cfg = CalibrationConfig.from_dict({**cal_cfg.to_dict(), "column": column})
    return CalibrationRun(dataset, cal_cfg, dataset_fingerprint(dataset, column))


def mlp_token_budget(cal: CalibrationConfig, units: int, world_size: int = 1) -> int:
    """The fit tokens each MLP cross moment takes on this rank (0: every token): the smaller of
    ``mlp_cross_tokens`` and ``mlp_tokens_per_unit`` × ``units`` where set, split over the ranks."""
    return _per_rank((cal.mlp_cross_tokens, cal.mlp_tokens_per_unit * units), world_size)


def hidden_token_budget(cal: CalibrationConfig, world_size: int = 1) -> int:
    """The fit tokens each d × d cross moment (queries, keys, attention contexts, the residual
    stream) takes on this rank (0: every token): ``hidden_cross_tokens`` split over the ranks."""
    return _per_rank((cal.hidden_cross_tokens,), world_size)


def _per_rank(caps: tuple[int, ...], world_size: int) -> int:
    """The smallest of the set caps (0: unset) split over the ranks; 0 where none is set."""
    caps = [c for c in caps if c > 0]
    return min(caps) // max(world_size, 1) if caps else 0


def moment_options(ctx: PairContext, run: CalibrationRun) -> dict:
    """The MLP cross moments' product dtype and the cross moments' token budgets for the fit phase
    (docs/design.md §4.3); the resolved precision is recorded on ``run`` for the report."""
    cal = run.config
    dtype, why = resolve_moment_precision(cal.moment_precision, next(ctx.model_a.parameters()).dtype, ctx.stats_device)
    run.moment_precision = {"requested": cal.moment_precision, "used": str(dtype).replace("torch.", ""), "why": why}
    shard = {"rank": ctx.dist.rank, "world_size": ctx.dist.world_size, "split": "fit"}
    budget = mlp_token_budget(cal, ctx.schema.intermediate_size, ctx.dist.world_size)
    hidden = hidden_token_budget(cal, ctx.dist.world_size)
    return {
        "mlp_product_dtype": dtype,
        "mlp_token_budget": budget,
        "hidden_token_budget": hidden,
        "planned_examples": count_calibration_examples(run.dataset, cal, **shard) if budget or hidden else None,
        "seed": cal.seed,
    }


def fit_phase(ctx: PairContext, run: CalibrationRun, solved: dict | None = None) -> CalibrationStatistics:
    """A and B over the fit examples: the summed fit moments (and Grams). ``solved``: the solve
    stage's record of layers solved as soon as their moments are complete (layer by layer, §7.4)."""
    plan = ctx.plan
    stats = run_phase(ctx, run, "fit", forward=plan.fit_forward(), moments=plan.fit_moments,
                      moment_stride=run.config.moment_stride, solved=solved, **moment_options(ctx, run))  # fmt: skip
    run.fingerprint.update(
        fit_examples=stats.examples, fit_tokens=int(stats.fit.tokens), moment_tokens=int(stats.fit.moment_tokens),
        mlp_moment_tokens=[int(m.n_cross) for m in stats.fit.mlp], moment_precision=run.moment_precision,
        hidden_moment_tokens=[int(m.n_cross) for m in stats.fit.q],
        config=run.config.to_dict(),
    )  # fmt: skip
    if not all(torch.isfinite(t).all() for t in stats.fit.tensors()):
        logger.warning("NaN/Inf in fit activations: affected estimates will lose to the identity")
    return stats


def heldout_phase(ctx: PairContext, run: CalibrationRun, stats: CalibrationStatistics, candidates: list) -> None:
    """A and B over the held-out examples, scoring ``candidates`` against the identity
    (per-coordinate sums, docs/design.md §5), added into ``stats`` in place."""
    schema = ctx.schema
    maps = candidate_maps(candidates, schema.num_heads, schema.head_size, device=ctx.stats_device)
    # nothing to score and no Grams to finish: the held-out examples need no forward
    wanted = bool(maps) or ctx.plan.grams
    heldout = run_phase(ctx, run, "heldout", candidates=maps, forward=wanted)
    stats.absorb(heldout)
    if not all(torch.isfinite(t).all() for t in stats.heldout.tensors()):
        logger.warning("NaN/Inf in held-out activations: affected estimates will lose to the identity")


def _keep_check_rows(ctx: PairContext, run: CalibrationRun, batch, output_b, output_a=None) -> None:
    """Keep the first held-out rows (as many as a mixed batch holds) and B's outputs on them (when
    given) for the B′ ≡ B check, and A's (when given) for the quality figures."""
    if len(run.check_inputs) >= ctx.config.check_batches:
        return
    rows = max(1, run.config.batch_size // run.config.heldout_every)
    run.check_inputs.append({k: v[:rows] for k, v in batch.inputs.items()})
    for output, kept in ((output_b, run.check_reference), (output_a, run.check_reference_a)):
        if output is not None:
            kept.append({k: v.detach().to("cpu", copy=True) for k, v in select_primary(output, rows).items()})


def layer_by_layer(ctx: PairContext) -> bool:
    """Whether the pass runs layer by layer: models offloaded to working files (docs/design.md §7.4),
    one process on the models' own device."""
    home = next(ctx.model_a.parameters()).device
    return ctx.working_files.of(ctx.model_a) is not None and not ctx.dist.is_distributed and ctx.stats_device == home


def keep_outputs(ctx: PairContext, run: CalibrationRun) -> OutputCapture | None:
    """The capture of the parents' outputs that the one sweep reads (docs/design.md §5.7), into a
    temporary file beside the offloaded models' (else the system's temporary directory), or None
    where they would not fit in :data:`raot_hf.calibration.kept.DISK_SHARE` of its free space
    (the sweep then runs the parents' layers again)."""
    from raot_hf.gate.fidelity import layer_module_names

    cfg, schema = ctx.config, ctx.schema
    names = layer_module_names(ctx.model_a, schema)
    params = dict(ctx.model_a.named_parameters())
    sites = [
        [m[len(name) + 1 :] for m in layer.linears if m.startswith(name + ".") and f"{m}.weight" in params]
        for name, layer in zip(names, schema.layers, strict=True)
    ]
    plan = KeptPlan(names, sites, cfg.correction.examples, cfg.gate.examples)
    store = KeptOutputs(ctx.working_files.directory)
    per_token = 2 * site_bytes(ctx.model_a, plan)
    if detect_modality(ctx.preprocessor) == "text":  # images: the store's own budget stops it
        planned = per_token * plan.fit_examples * run.config.max_length
        if planned > store.budget:
            gib = (planned / 2**30, store.budget / 2**30)
            store.drop("{:.1f} GiB would exceed {:.1f} GiB of the temporary directory".format(*gib))
            return None
    return OutputCapture({"a": ctx.model_a, "b": ctx.model_b}, plan, store)


def _solves_early(ctx: PairContext) -> bool:
    """Whether a layer-by-layer fit phase solves each layer once it is complete (activation estimator)."""
    from raot_hf.estimators import estimator_spec
    from raot_hf.estimators.builtin import activation_candidates

    cfg = ctx.config
    if not layer_by_layer(ctx) or cfg.alignment == "none" or not ({"mlp", "heads"} & set(cfg.scope)):
        return False
    return estimator_spec(cfg.alignment).fn is activation_candidates


def _early_solver(ctx: PairContext, stats: CalibrationStatistics, solved: dict | None):
    """Solves a layer into ``solved`` (and frees its MLP co-moment) after its last batch, when
    :func:`_solves_early` and the caller keeps a record."""
    from raot_hf.estimators.builtin import solve_layer_early
    from raot_hf.stages.context import one_thread

    cfg = ctx.config
    if solved is None or not _solves_early(ctx):
        return None

    def solve(i: int) -> None:
        # the layer's activations, freed into the C heap, go back to the OS first: the solve's k × k
        # matrices lie above glibc's mmap threshold and cannot reuse free heap chunks (§7.4)
        trim_heap()
        with ctx.timer.stage("solve"), one_thread():
            solve_layer_early(stats, ctx.schema, cfg, i, solved)

    return solve


def _fold_batches(
    ctx: PairContext, run: CalibrationRun, collector, phase: str, shard: dict, total: int, solved: dict | None = None
) -> None:
    """This process's batches of ``phase`` into ``collector``, batch by batch or :func:`layer_by_layer`
    (then the held-out phase keeps only the check's inputs)."""
    batches = run.batches(ctx.preprocessor, **shard)
    progress = {"desc": f"calibration ({phase})", "disable": not ctx.dist.is_main}
    capture = run.kept

    def entering(batch):  # what of this batch the sweep reads later (docs/design.md §5.7)
        return None if capture is None else capture.enter(phase, len(batch), batch.token_mask)

    if layer_by_layer(ctx):
        from raot_hf.calibration.sequential import observe_layer_by_layer
        from raot_hf.gate.fidelity import layer_module_names

        held = list(batches)
        solver = _early_solver(ctx, collector.stats, solved) if phase == "fit" else None
        names = layer_module_names(ctx.model_a, ctx.schema)
        observe_layer_by_layer(collector, held, names, on_layer=solver, progress=not progress["disable"],
                               desc=progress["desc"], capture=capture, entering=entering)  # fmt: skip
        if phase == "heldout":
            for batch in held:
                if bool(batch.heldout.any()):
                    _keep_check_rows(ctx, run, batch, None)
        return
    try:
        for batch in tqdm(batches, total=total, **progress):
            if capture is not None:
                capture.observing(entering(batch))
            checking = phase == "heldout" and len(run.check_inputs) < ctx.config.check_batches
            output_a = output_b = None
            if run.predictions is not None or checking:  # A's output is read too
                outputs = collector.update(batch, both=True)
                if outputs is not None:
                    output_a, output_b = outputs
                    if run.predictions is not None:
                        run.predictions.add(phase, batch, output_a, output_b)
            else:
                output_b = collector.update(batch)
            if phase == "heldout" and output_b is not None:
                _keep_check_rows(ctx, run, batch, output_b, output_a)
            del output_a, output_b
            trim_heap()  # the batch's activations, freed into the C heap: back to the OS (§7.2)
    finally:
        if capture is not None:
            capture.observing(None)


def run_phase(
    ctx: PairContext,
    run: CalibrationRun,
    phase: str,
    *,
    forward: bool = True,
    solved: dict | None = None,
    **collector_options,
) -> CalibrationStatistics:
    """Forward this process's shard of one split through A and B, then sum across processes
    (``forward=False``: the sums stay zero; ``solved``: see :func:`fit_phase`)."""
    home, device = next(ctx.model_a.parameters()).device, ctx.stats_device
    if device != home:  # forward passes on this process's accelerator (accelerate --multi_gpu), then back
        ctx.model_a.to(device)
        ctx.model_b.to(device)
    world = ctx.dist.world_size
    shard = {"rank": ctx.dist.rank, "world_size": world, "split": phase}
    total = count_calibration_batches(run.dataset, run.config, **shard) if forward else 0
    if phase == "heldout":
        run.check_inputs, run.check_reference, run.check_reference_a = [], [], []
    if phase == "fit" and forward and solved is not None and _solves_early(ctx):
        collector_options["defer_mlp"] = True  # each layer's f × f sum lives only while its layer runs
    try:
        options = dict(phase=phase, grams=ctx.plan.grams, **collector_options)
        with StatisticsCollector(ctx.model_a, ctx.model_b, ctx.schema, **options) as collector:
            if forward:
                _fold_batches(ctx, run, collector, phase, shard, total, solved)
        stats = collector.stats
        if world > 1 and forward:  # shards never pad or repeat examples, so the sums are exact (§7)
            ctx.dist.all_reduce_statistics(stats)
    finally:
        if device != home:
            ctx.model_a.to(home)
            ctx.model_b.to(home)
    return stats.to("cpu")
