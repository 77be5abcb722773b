"""RaotMerger: the public façade over the merge stages (docs/architecture.md).

>>> from raot_hf import RaotMerger
>>> result = RaotMerger.from_pretrained("path/to/A", "path/to/B").merge(calibration="data.csv")  # doctest: +SKIP
>>> result.save_pretrained("merged")  # doctest: +SKIP

Data flows one way: load → per model after the reference: calibrate (fit) → solve → calibrate
(held-out) → gate → apply + check; then merge → refit (auto, §6.11) → report, each a function of :mod:`raot_hf.stages`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from raot_hf.adapters import is_dual_encoder, schema_for
from raot_hf.calibration.statistics import CalibrationStatistics
from raot_hf.config import RaotConfig
from raot_hf.distributed import DistributedContext
from raot_hf.errors import RaotError
from raot_hf.io.loading import ModelSource, check_compatible
from raot_hf.io.offload import WorkingFiles
from raot_hf.plan import plan_for
from raot_hf.registry import Registry, registry
from raot_hf.results import Alignment, MergeResult
from raot_hf.stages.align import calibrate_and_solve, calibrate_solve_decide
from raot_hf.stages.calibrate import CalibrationRun, fit_phase, heldout_phase, open_calibration
from raot_hf.stages.combine import merge_weights
from raot_hf.stages.context import PairContext, StageTimer
from raot_hf.stages.load import base_for, load_pair, model_sources
from raot_hf.stages.members import (
    align_all,
    central_index,
    members_folded,
    merged_quality,
    parents_before_merge,
    prepare_config,
)
from raot_hf.stages.provenance import build_report, transform_file
from raot_hf.stages.refit import check_refit, prediction_capture, refit_merged, refit_targets
from raot_hf.symmetry import Transform

__all__ = ["Alignment", "MergeResult", "RaotMerger", "merge_checkpoints"]

logger = logging.getLogger("raot_hf.merger")
_STAGE = {"stage": True}  # a line the CLI shows by default (raot_hf.cli.verbosity)


_MERGED = (
    "this RaotMerger has already merged: model A now holds the merged weights and B was moved into A's "
    "basis; build a new one (RaotMerger.from_pretrained or from_models) for another merge"
)


def _with_options(config: RaotConfig | None, options: dict) -> RaotConfig:
    config = config or RaotConfig()
    return config.replace(**options) if options else config


class RaotMerger:
    """Aligns B to A under the Transformer's symmetries and merges them; options are the fields of
    :class:`RaotConfig`. One merger makes one merge: :meth:`merge` writes into A's module and moves B."""

    def __init__(
        self, model_a, model_b, *more_models, config: RaotConfig | None = None, preprocessor=None,
        source_a: ModelSource | None = None, source_b: ModelSource | None = None,
        more_sources: tuple[ModelSource, ...] = (), base_model=None, source_base: ModelSource | None = None,
        base_missing: list[str] | tuple[str, ...] = (), early_calibration: Any = None,
        working_files: WorkingFiles | None = None,
    ):  # fmt: skip
        models = [m.eval() for m in (model_a, model_b, *more_models)]
        config = prepare_config(config or RaotConfig(), len(models), base_model is not None)
        for other in models[1:]:
            check_compatible(models[0].config, other.config, head_policy=config.head)
        schema = schema_for(models[0])
        if any(schema_for(m).parameter_names() != schema.parameter_names() for m in models[1:]):
            raise RaotError("the models resolve to different parameter sets; load every one with the same class.")
        self._base = (base_model, source_base, base_missing)
        self.working_files = working_files or WorkingFiles()  # offloaded models' (§7.4); empty: in memory
        self.models = models
        given = [source_a, source_b, *more_sources]
        self.sources = [
            (given[i] if i < len(given) else None) or ModelSource(getattr(m, "name_or_path", "") or f"model_{i + 1}")
            for i, m in enumerate(models)
        ]
        self._set_pairs(schema, config, preprocessor, DistributedContext.detect())
        self.early_calibration = early_calibration  # the sample from_pretrained's early check loaded
        self.merged = False
        self.reference_log: dict[str, Any] | None = None

    def _set_pairs(self, schema, config, preprocessor, dist) -> None:
        """One pair context (reference, model i) per model after the reference, sharing one clock."""
        timer = self.pairs[0].timer if getattr(self, "pairs", None) else StageTimer()
        self.pairs = []
        base_model, source_base, base_missing = self._base
        for other in self.models[1:]:
            pair = PairContext(self.models[0], other, schema, config, preprocessor, dist, timer)
            pair.working_files = self.working_files  # one set for every pair: the models are shared
            pair.base = base_for(self.models[0], other, schema, base_model, source_base, base_missing)
            self.pairs.append(pair)

    # -- the pair, as the stages see it --------------------------------------------------------
    pair = property(lambda self: self.pairs[0], doc="The context of the reference and model 2.")
    source_a = property(lambda self: self.sources[0], doc="Where model A (the reference) came from.")
    source_b = property(lambda self: self.sources[1], doc="Where model B came from.")
    model_a = property(lambda self: self.pair.model_a, doc="Model A, the reference (receives the merged weights).")
    model_b = property(lambda self: self.pair.model_b, doc="Model B (moved into A's basis by merge()).")
    schema = property(lambda self: self.pair.schema, doc="The architecture's symmetry schema.")
    config = property(lambda self: self.pair.config, doc="The RaotConfig of this merge.")
    timer = property(lambda self: self.pair.timer, doc="Wall time per stage.")
    dist = property(lambda self: self.pair.dist, doc="The process group (accelerate launch) or a single process.")

    @property
    def preprocessor(self):
        """A's tokenizer or image processor (calibration data is encoded with it)."""
        return self.pair.preprocessor

    @preprocessor.setter
    def preprocessor(self, value) -> None:
        self.pair.preprocessor = value

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, a: str | Path, b: str | Path, *more: str | Path, config: RaotConfig | None = None,
        revision: str | None = None, revision_b: str | None = None, token: str | bool | None = None,
        trust_remote_code: bool = False, allow_pickle: bool = False, base: str | Path | None = None,
        base_revision: str | None = None, offload: str | bool = "auto", offload_dir: str | Path | None = None,
        max_memory: str | int | None = None, **options,
    ) -> RaotMerger:  # fmt: skip
        """Load A and B — and any ``more`` models, aligned to the same reference (docs/design.md
        §6.9) — from Hub ids or local directories. ``revision`` applies to A (and to the others
        unless ``revision_b`` is given); ``options`` override fields of ``config``. ``base``
        (with ``base_revision``) is the checkpoint the models were fine-tuned from, for the
        base-relative rules (``task_arithmetic``, ``ties``, ``dare_ties``). ``offload`` ("auto",
        "always", "never"): run layer by layer with the parameters in disk-backed working files in
        ``offload_dir`` (default: the system's temporary directory) — automatically when an
        in-memory merge would not fit in ``max_memory`` (e.g. ``"8GiB"``; default: the memory
        available); the result is the same (docs/design.md §7.4)."""
        if _dual_encoder_type(a, revision, token):  # two towers and a joint space (docs/design.md §11)
            if more:
                raise RaotError("two-tower models merge two at a time; pass two models")
            config = prepare_config(_with_options(config, options), 2, base is not None)
            return _TWO_TOWERS.get("two towers").from_pretrained(
                a, b, config=config, base=base, allow_pickle=allow_pickle
            )
        config = prepare_config(_with_options(config, options), 2 + len(more), base is not None)
        access = dict(token=token, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
        loaded = load_pair(a, b, config, *more, revision=revision, revision_b=revision_b, base=base,
                           base_revision=base_revision, offload=offload, offload_dir=offload_dir,
                           max_memory=max_memory, **access)  # fmt: skip
        merger = cls(loaded.model_a, loaded.model_b, *loaded.more_models, config=config,
                     preprocessor=loaded.preprocessor, source_a=loaded.sources[0], source_b=loaded.sources[1],
                     more_sources=loaded.sources[2:], base_model=loaded.base_model, source_base=loaded.source_base,
                     base_missing=loaded.base_missing, early_calibration=loaded.early_calibration,
                     working_files=loaded.working_files)  # fmt: skip
        merger.timer.times.update(loaded.times)
        return merger

    @classmethod
    def from_models(
        cls, model_a, model_b, *more_models, preprocessor=None, config: RaotConfig | None = None, base_model=None,
        working_files: WorkingFiles | None = None, **options,
    ) -> RaotMerger:  # fmt: skip
        """Wrap two (or more) loaded models (the merge writes into ``model_a`` and moves ``model_b`` into
        A's basis: pass copies to keep them); ``base_model``, for the
        base-relative rules, may be A's class or the bare model A's head class wraps (loaded with its own class).
        ``working_files``: the models' when they were offloaded (:func:`raot_hf.stages.offload.offload_models`)."""
        config = _with_options(config, options)
        if is_dual_encoder(getattr(getattr(model_a, "config", None), "model_type", "")):  # docs/design.md §11
            if more_models:
                raise RaotError("two-tower models merge two at a time; pass two models")
            return _TWO_TOWERS.get("two towers")(
                model_a, model_b, config=config, processor=preprocessor, base_model=base_model
            )
        models = (model_a, model_b, *more_models)
        return cls(
            *models, config=config, preprocessor=preprocessor, base_model=base_model, working_files=working_files
        )

    # -- stages ---------------------------------------------------------------------------------
    def _refuse_after_merge(self) -> None:
        if self.merged:
            raise RaotError(_MERGED)

    def collect_statistics(self, calibration=None) -> tuple[CalibrationStatistics, CalibrationRun]:
        """The fit phase of the calibration pass: A and B over the fit examples (sharded across
        processes under ``accelerate launch``). Returns the summed fit moments (and Grams) and the
        calibration run (data, settings, fingerprint) that :meth:`collect_heldout` continues."""
        with self.timer.stage("calibration"):
            run = open_calibration(self.pair, calibration, self.early_calibration)
            return fit_phase(self.pair, run), run

    def collect_heldout(self, stats: CalibrationStatistics, run: CalibrationRun, candidates: list[Transform]) -> None:
        """The held-out phase: A and B over the held-out examples, scoring ``candidates`` against
        the identity, added into ``stats`` in place; keeps the B′ ≡ B check's inputs in ``run``."""
        with self.timer.stage("calibration"):
            heldout_phase(self.pair, run, stats, candidates)

    def calibrate_and_solve(self, calibration=None) -> tuple[CalibrationStatistics | None, Any, list, dict]:
        """The fit phase, the candidates (§7), then the held-out phase that scores them: the statistics
        (the fit moments freed), the data's fingerprint, the candidates and the estimators' logs."""
        self._refuse_after_merge()
        stats, run, parts, logs = calibrate_and_solve(self.pair, calibration, self.early_calibration)
        return stats, (run.fingerprint if run is not None else None), parts, logs

    def align(self, calibration=None) -> tuple[Alignment, CalibrationStatistics | None, dict[str, Any] | None]:
        """Estimate every transform in scope, gate each against the identity, and return the
        decisions, the statistics and the data's fingerprint (nothing is applied to the models).
        With more than two models: the reference's alignment with model 2 (``merge`` aligns all)."""
        self._refuse_after_merge()
        alignment, stats, run = calibrate_solve_decide(self.pair, calibration, self.early_calibration)
        return alignment, stats, (run.fingerprint if run is not None else None)

    def merge(self, calibration=None, *, command: str | None = None) -> MergeResult:
        """Estimate, gate, apply to B, check B′ ≡ B, merge into model A's object (no third copy), and
        return a :class:`MergeResult`; with more models each is aligned to the reference (docs/design.md §6.9).
        ``command``: the command line that ran the merge, for the report."""
        self._refuse_after_merge()
        check_refit(self.pairs)
        central = len(self.models) > 2 and self.config.models.reference == "central"
        run = self._reference_to_center(calibration) if central else None
        self.merged = True  # from here on the models change
        members = align_all(self.pairs, calibration, self.early_calibration, run, predict=prediction_capture)
        quality_sets, parents = parents_before_merge(members)  # A before the merge writes into it
        targets = refit_targets(members, calibration, self.early_calibration)  # likewise (None: refit off)
        merge_log = merge_weights(members, members_folded(members))
        refit = refit_merged(members, targets)  # docs/design.md §6.11
        quality = merged_quality(members, quality_sets, parents)
        report = build_report(members, self.sources, merge_log, quality, reference_log=self.reference_log,
                              refit=refit, command=command)  # fmt: skip
        source_a, files = self.source_a.name_or_path, self.working_files
        result = MergeResult(
            self.model_a, report, members[0].alignment, self.preprocessor, source_a, working_files=files
        )
        result.more_transforms = {transform_file(i): m.alignment.applied for i, m in enumerate(members[1:], start=3)}
        return result

    def _reference_to_center(self, calibration) -> CalibrationRun:
        """Make the most central model the reference (``models.reference="central"``); returns the
        calibration run it read, for the alignments to reuse."""
        run = open_calibration(self.pair, calibration, self.early_calibration)
        index, self.reference_log = central_index(self.models, self.pair, run)
        if index:
            order = [index, *(i for i in range(len(self.models)) if i != index)]
            self.models = [self.models[i] for i in order]
            self.sources = [self.sources[i] for i in order]
            self._set_pairs(self.pair.schema, self.config, self.preprocessor, self.dist)
        return run


#: The merger of two-tower models (:class:`raot_hf.dual.DualEncoderMerger`, which registers itself on
#: import with :func:`register_two_tower_merger`): ``RaotMerger`` hands such a pair to it.
_TWO_TOWERS: Registry[type] = registry("two-tower merger")


def register_two_tower_merger(cls: type) -> type:
    """Register the class that merges two-tower models (docs/design.md §11); it replaces the one there."""
    if "two towers" in _TWO_TOWERS:
        _TWO_TOWERS.unregister("two towers")
    return _TWO_TOWERS.register("two towers", cls)


def _dual_encoder_type(source, revision=None, token=None) -> bool:
    """Whether the checkpoint at ``source`` is a two-tower model (its config read alone)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(source), revision=revision, token=token)
    except (OSError, ValueError, KeyError):
        return False  # the loader says what is wrong with it
    return is_dual_encoder(config.model_type)


def merge_checkpoints(
    *models: str | Path, out: str | Path, base: str | Path | None = None, config=None, calibration=None,
    overwrite: bool = False, max_shard_size: str | int = "2GB", max_memory: str | int | None = None,
    stream: bool = True, offload: str | bool = "auto", offload_dir: str | Path | None = None,
    revision: str | None = None, revision_b: str | None = None, base_revision: str | None = None,
    token: str | bool | None = None, trust_remote_code: bool = False, allow_pickle: bool = False,
    command: str | None = None, **options,
) -> tuple[Path | None, dict[str, Any] | None]:  # fmt: skip
    """Merge checkpoints (two or more local directories or Hub ids) into the directory ``out``;
    returns its path and the report — the one entry of the Python API and the command line. The
    execution mode is chosen once (:func:`raot_hf.stages.execution.plan_execution`): a merge that
    reads no data (no alignment, a per-tensor rule) of local safetensors checkpoints is streamed
    from the files a few tensors at a time, whatever their size and whether or not raot_hf has an
    adapter for them (docs/design.md §7.3; ``stream=False`` loads them instead); any other merge
    runs :class:`RaotMerger`, in memory or, when that would not fit (or ``offload="always"``), layer
    by layer with the models offloaded to ``offload_dir``. All give the same bytes. ``max_memory``
    (e.g. ``"8GiB"``) refuses, before any work, a merge that cannot keep under it.

    ``config``: a :class:`RaotConfig`, or a merge file (its path or a
    :class:`~raot_hf.merging.mergefile.MergeFile`, docs/design.md §6.9) — then the file lists the
    models, ``options`` apply to each of its merges, and a merge given no calibration data is
    merged as stored, as mergekit merges it. Under ``accelerate launch`` a process other than the
    main one returns ``(None, None)`` once it has added its share of the statistics."""
    from raot_hf.merging.mergefile import MergeFile, load_merge_file

    run = dict(overwrite=overwrite, max_shard_size=max_shard_size, max_memory=max_memory, stream=stream,
               offload=offload, offload_dir=offload_dir, command=command,
               access=(token, trust_remote_code, allow_pickle))  # fmt: skip
    if isinstance(config, (str, Path)):
        config = load_merge_file(config)
    if isinstance(config, MergeFile):
        if models or base is not None:
            raise RaotError("the merge file lists the models; do not also give them (or --base)")
        if options:
            config = config.configured(lambda cfg: cfg.replace(**options), alignment_given="alignment" in options)
        return _merge_file(config, out, calibration, **run)
    config = prepare_config(_with_options(config, options), len(models), base is not None)
    revisions = (revision, revision_b, base_revision)
    return _merge(models, base, config, calibration, out, revisions=revisions, **run)


def _merge(
    models, base, config: RaotConfig, calibration, out, *, revisions=(None, None, None), overwrite=False,
    max_shard_size="2GB", max_memory=None, stream=True, offload="auto", offload_dir=None, command=None,
    access=(None, False, False),
) -> tuple[Path | None, dict[str, Any] | None]:  # fmt: skip
    """One merge of ``models``: the input checks every mode runs, the execution plan, then the mode."""
    from raot_hf.outputs import check_destination, parse_size
    from raot_hf.stages.execution import plan_execution
    from raot_hf.stages.load import check_before_weights
    from raot_hf.stages.stream import PlainMerge, merge_streamed

    check_destination(out, overwrite)  # refused before any heavy work
    parse_size(max_shard_size)
    sources, base_source = model_sources(models, base, *revisions, access)
    (configs, _), preprocessor, _ = check_before_weights(config, sources, base_source, adapter=False, early=False)
    if is_dual_encoder(configs[0].model_type):  # tower by tower, in memory (docs/design.md §11)
        if DistributedContext.detect().is_distributed:
            raise RaotError("a two-tower merge runs in one process; run it without accelerate launch")
        merger = RaotMerger.from_pretrained(*models, config=config, allow_pickle=access[2],
                                            **({"base": base} if base else {}))  # fmt: skip
        result = merger.merge(calibration)
        return result.save_pretrained(out, overwrite=overwrite, max_shard_size=max_shard_size), result.report
    plan = plan_execution(config, sources, base_source, configs, stream=stream, offload=offload,
                          max_memory=max_memory, max_shard_size=max_shard_size)  # fmt: skip
    if plan_for(config).needs_data and calibration is None and config.calibration.source is None:
        raise RaotError("this merge needs calibration data; pass --calibration (or --alignment none)")
    if plan.mode == "streamed":
        job = PlainMerge.from_config(config, sources, base_source)
        return merge_streamed(job, [*configs, *_base_config(base_source)], out, overwrite=overwrite,
                              max_shard_size=plan.shard_bytes, command=command, preprocessor=preprocessor)  # fmt: skip
    memory = {"offload": "always" if plan.mode == "layer-wise" else "never", "offload_dir": offload_dir,
              "max_memory": max_memory}  # fmt: skip
    token, trust_remote_code, allow_pickle = access
    revision, revision_b, base_revision = revisions
    merger = RaotMerger.from_pretrained(
        *models, config=config, revision=revision, revision_b=revision_b, token=token,
        trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, **memory,
        **({"base": base, "base_revision": base_revision} if base else {}),
    )  # fmt: skip
    if not merger.dist.is_main:  # the main process solves, reports and writes
        from raot_hf.distributed import follow_main

        follow_main(merger)
        merger.dist.close()
        return None, None
    try:
        result = merger.merge(calibration, command=command)
    finally:
        merger.dist.close()
    return result.save_pretrained(out, overwrite=overwrite, max_shard_size=plan.shard_bytes), result.report


def _base_config(source) -> list:
    from raot_hf.io.loading import load_config

    return [load_config(source, "base", adapter=False)] if source is not None else []


def _merge_file(merge_file, out, calibration, *, access, **run) -> tuple[Path | None, dict[str, Any] | None]:
    """Run a merge file's documents in order: the named ones into a temporary directory beside
    ``out``, removed at the end, the last into ``out`` (docs/design.md §6.9)."""
    import contextlib
    import shutil
    import tempfile

    from raot_hf.outputs import check_destination

    destination = check_destination(out, run["overwrite"])
    done: dict[str, Path] = {}
    result: tuple[Path | None, dict[str, Any] | None] = (None, None)
    said: set[str] = set()  # the log lines said once per file
    with contextlib.ExitStack() as stack:
        scratch = None
        if len(merge_file.documents) > 1:
            destination.parent.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f".{destination.name}.stages-", dir=destination.parent))
            stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        for document in merge_file.documents:
            final = document is merge_file.output
            target = destination if final else scratch / document.name
            if not final:
                logger.info("merging %s (an intermediate merge of the merge file)", document.name, extra=_STAGE)
            options = {**run, "overwrite": run["overwrite"] if final else False}
            result = _merge_document(document, target, calibration, done, said, access=access, **options)
            if not final:
                done[document.name] = target
    return result


def _merge_document(document, out, calibration, done: dict, said: set, *, access, **run):
    """One document of a merge file: aligned when it gives calibration data and its shape allows,
    else merged as stored by the streamed engine (docs/design.md §6.9). ``said``: the log lines
    already given for this file."""
    from raot_hf.io.loading import load_preprocessor, local_snapshot
    from raot_hf.merging.mergefile import aligned_models
    from raot_hf.outputs import check_destination, parse_size
    from raot_hf.stages.load import check_before_weights
    from raot_hf.stages.stream import merge_streamed, plain_merge_of

    config = document.config()
    calibrated = calibration is not None or config.calibration.source is not None
    aligns = config.alignment != "none" and bool(config.scope)
    wants = calibrated or document.alignment_given or "alignment" in document.raot
    if aligns and wants and not document.stacks_layers:
        models, base, aligned = aligned_models(document)
        models = [str(done.get(m, m)) for m in models]
        base = str(done.get(base, base)) if base is not None else None
        aligned = prepare_config(aligned, len(models), base is not None)
        return _merge(models, base, aligned, calibration, out, access=access, **run)
    if document.stacks_layers:
        line = f"alignment does not apply to {document.method} over stacked slices: the layers are copied as stored"
    else:
        line = ("the merge file gives no calibration data: the checkpoints are merged as stored, as mergekit merges "
                "them; pass --calibration DATA (or raot: calibration:) to align them first")  # fmt: skip
    if aligns and line not in said:
        logger.info(line, extra=_STAGE)
        said.add(line)
    config = config.replace(alignment="none")
    if DistributedContext.detect().is_distributed:
        raise RaotError("a merge file merged as stored runs in one process; run it without accelerate launch")
    check_destination(out, run["overwrite"])
    parse_size(run["max_shard_size"])
    if plan_for(config).needs_data:
        raise RaotError(f"merge_method: {document.method} reads calibration data; pass --calibration DATA")
    token, trust_remote_code, allow_pickle = access
    sources = {
        ref: local_snapshot(ModelSource(str(done[ref.path]), None, *access) if ref.path in done else
                            ModelSource(ref.path, ref.revision, token, trust_remote_code, allow_pickle))
        for ref in document.models()
    }  # fmt: skip
    job = plain_merge_of(document, config, sources)
    (configs, _), _, _ = check_before_weights(
        config, job.checkpoints, None, adapter=False, early=False, vocabulary=document.tokenizer is None,
        layers=not document.stacks_layers,
    )  # fmt: skip
    preprocessor = load_preprocessor(job.checkpoints[job.donor])
    return merge_streamed(job, configs, out, overwrite=run["overwrite"], max_shard_size=run["max_shard_size"],
                          command=run.get("command"), preprocessor=preprocessor)  # fmt: skip
