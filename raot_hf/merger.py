"""RaotMerger: estimate, gate, apply, check and merge (DESIGN.md §4–6).

>>> from raot_hf import RaotMerger
>>> result = RaotMerger.from_pretrained("path/to/A", "path/to/B").merge(calibration="data.csv")  # doctest: +SKIP
>>> result.save_pretrained("merged")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.utils import tqdm

from raot_hf.adapters import schema_for
from raot_hf.adapters.schema import ModelSchema
from raot_hf.calibration.collector import StatisticsCollector
from raot_hf.calibration.data import (
    CalibrationConfig,
    check_column,
    count_calibration_batches,
    dataset_fingerprint,
    detect_modality,
    iter_calibration_batches,
    load_calibration_dataset,
)
from raot_hf.calibration.statistics import CalibrationStatistics
from raot_hf.config import RaotConfig
from raot_hf.distributed import DistributedContext, statistics_pass_needed
from raot_hf.equivalence import primary_outputs, select_primary
from raot_hf.errors import EquivalenceError, RaotError
from raot_hf.estimators.activation import (
    candidate_maps,
    estimate_head_alignment,
    estimate_mlp_permutation,
    estimate_residual_map,
    head_gains,
    mlp_gains,
    residual_gains,
)
from raot_hf.gate import GateDecision, decide
from raot_hf.grams import aligned_grams
from raot_hf.loading import (
    ModelSource,
    check_compatible,
    check_tokenizers,
    load_config,
    load_model,
    load_preprocessor,
)
from raot_hf.merging import get_merge_rule, merge_heads
from raot_hf.symmetry import (
    HeadAlignment,
    HeadRescale,
    MLPPermutation,
    ResidualPermutation,
    ResidualRotation,
    SoftTransport,
    Transform,
    TransformSequence,
    fold_model,
    is_exact,
    model_state,
    transform_model,
)
from raot_hf.symmetry.io import TRANSFORM_NAME
from raot_hf.version import __version__

logger = logging.getLogger("raot_hf.merger")


@dataclass
class Alignment:
    """What the estimators proposed, what the gate decided and what was applied to B."""

    decisions: list[GateDecision]
    applied: TransformSequence
    exact: bool
    logs: dict[str, Any] = field(default_factory=dict)

    @property
    def shares_basis(self) -> bool:
        """True when the gate rejected every transform: the pair already shares a basis."""
        return bool(self.decisions) and not any(d.applied for d in self.decisions)

    def table(self) -> str:
        """The gate table as aligned plain text."""
        head = f"{'transform':<10} {'layer':>5} {'identity':>10} {'estimate':>10} {'gain':>10} {'margin':>10}  applied"
        lines = [head, "-" * len(head)]
        for d in self.decisions:
            layer = "-" if d.layer is None else str(d.layer)
            lines.append(
                f"{d.transform:<10} {layer:>5} {d.identity:>10.4f} {d.estimate:>10.4f} {d.gain:>10.4f} "
                f"{d.margin:>10.4f}  {'yes' if d.applied else 'no'} ({d.reason})"
            )
        return "\n".join(lines)


@dataclass
class MergeResult:
    """The merged model, the alignment behind it and the provenance report."""

    model: torch.nn.Module
    report: dict[str, Any]
    alignment: Alignment
    preprocessor: Any = None
    source_a: str | None = None

    def save_pretrained(self, out_dir: str | Path, *, overwrite: bool = False, max_shard_size: str = "2GB") -> Path:
        """Write a directory ``from_pretrained`` loads, with model card and ``raot_report.json``."""
        from raot_hf.output import write_merged_repo
        from raot_hf.report import model_card_context

        start = time.perf_counter()
        report = dict(self.report)
        path = write_merged_repo(
            out_dir,
            self.model,
            preprocessor_source=self.preprocessor if self.preprocessor is not None else self.source_a,
            report=report,
            card=model_card_context(report),
            overwrite=overwrite,
            max_shard_size=max_shard_size,
            transform=self.alignment.applied,
        )
        self.report.setdefault("timings", {})["write"] = time.perf_counter() - start
        return path

    def push_to_hub(self, repo_id: str, *, folder: str | Path | None = None, **kwargs) -> str:
        """Save (to ``folder`` or a temporary directory) and upload with :func:`raot_hf.hub.push_to_hub`."""
        import tempfile

        from raot_hf.hub import push_to_hub

        if folder is not None:
            path = self.save_pretrained(folder, overwrite=kwargs.pop("overwrite", False))
            return push_to_hub(path, repo_id, **kwargs)
        with tempfile.TemporaryDirectory() as tmp:
            path = self.save_pretrained(Path(tmp) / "merged")
            return push_to_hub(path, repo_id, **kwargs)


class _Timer:
    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start


def _on_device_of(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    device = next(model.parameters()).device
    return {k: v.to(device) for k, v in inputs.items()}


@contextmanager
def _one_thread():
    """Run the solve on one intra-op thread: its work is many small operations (k×k
    correlations, batched h×h SVDs, assignments in scipy), where a parallel region mostly
    waits for its slowest thread — measured 5.6–8 s with one thread vs 26–78 s with two for
    BERT-base on a loaded 2-core machine (1.5 s either way when it is quiet)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _is_identity(t: Transform) -> bool:
    if isinstance(t, (MLPPermutation, ResidualPermutation)):
        return bool(torch.equal(t.perm, torch.arange(len(t.perm))))
    if isinstance(t, HeadAlignment):
        eye = torch.eye(t.qk.shape[-1], dtype=torch.float64)
        return (
            bool(torch.equal(t.perm, torch.arange(len(t.perm))))
            and torch.allclose(t.qk, eye, atol=1e-12)
            and torch.allclose(t.vo, eye, atol=1e-12)
        )
    if isinstance(t, ResidualRotation):
        return torch.allclose(t.matrix, torch.eye(len(t.matrix), dtype=torch.float64), atol=1e-12)
    return False


_SKIPPED = {"skipped": "NaN/Inf in the fit statistics: the identity stands in for the estimate"}


def _finite(*moments) -> bool:
    """True when every sum in these statistics is finite (NaN/Inf activations poison them)."""
    return all(bool(torch.isfinite(t).all()) for m in moments for t in m.tensors())


def _check_calibration_early(cal: CalibrationConfig, preprocessor) -> None:
    """Load the calibration sample and resolve its column before any weights are read, so a
    wrong path, split, column or modality fails in seconds (``datasets`` caches the load)."""
    dataset = load_calibration_dataset(cal)
    check_column(dataset, cal.column, detect_modality(preprocessor), model_label="model A")


def residual_mode(schema: ModelSchema, requested: str) -> str:
    """``auto`` → the mean-fixing rotation where it is exact, the permutation otherwise."""
    if requested == "auto":
        return "rotation" if schema.residual.exact == "mean_fixing" else "permutation"
    return requested


class RaotMerger:
    """Aligns B to A under the Transformer's symmetries and merges them.

    Build it with :meth:`from_pretrained` (Hub ids or local directories) or
    :meth:`from_models` (loaded models); options are the fields of :class:`RaotConfig`.
    """

    def __init__(
        self,
        model_a,
        model_b,
        *,
        config: RaotConfig | None = None,
        preprocessor=None,
        source_a: ModelSource | None = None,
        source_b: ModelSource | None = None,
    ):
        self.config = config or RaotConfig()
        self.model_a, self.model_b = model_a.eval(), model_b.eval()
        check_compatible(model_a.config, model_b.config, head_policy=self.config.head)
        self.schema = schema_for(model_a)
        schema_b = schema_for(model_b)
        if schema_b.parameter_names() != self.schema.parameter_names():
            raise RaotError("A and B resolve to different parameter sets; load both with the same class.")
        self.preprocessor = preprocessor
        self.source_a = source_a or ModelSource(getattr(model_a, "name_or_path", "") or "model_a")
        self.source_b = source_b or ModelSource(getattr(model_b, "name_or_path", "") or "model_b")
        self.timer = _Timer()
        self.dist = DistributedContext.detect()

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        a: str | Path,
        b: str | Path,
        *,
        config: RaotConfig | None = None,
        revision: str | None = None,
        revision_b: str | None = None,
        token: str | bool | None = None,
        trust_remote_code: bool = False,
        allow_pickle: bool = False,
        **options,
    ) -> RaotMerger:
        """Load A and B (Hub ids or local directories). ``revision`` applies to A (and to B
        unless ``revision_b`` is given); ``options`` override fields of ``config``."""
        config = (config or RaotConfig()).replace(**options) if options else (config or RaotConfig())
        src_a = ModelSource(str(a), revision, token, trust_remote_code, allow_pickle)
        src_b = ModelSource(str(b), revision_b or revision, token, trust_remote_code, allow_pickle)
        timer = _Timer()
        with timer.stage("load"):
            cfg_a, cfg_b = load_config(src_a, "A"), load_config(src_b, "B")
            check_compatible(cfg_a, cfg_b, head_policy=config.head)
            pre_a, pre_b = load_preprocessor(src_a), load_preprocessor(src_b)
            check_tokenizers(pre_a, pre_b)
            if config.needs_calibration and config.calibration.source is not None and pre_a is not None:
                _check_calibration_early(config.calibration, pre_a)
            model_a = load_model(src_a, "A", dtype=config.dtype, config=cfg_a)
            model_b = load_model(src_b, "B", dtype=config.dtype, config=cfg_b)
        merger = cls(model_a, model_b, config=config, preprocessor=pre_a, source_a=src_a, source_b=src_b)
        merger.timer.times.update(timer.times)
        return merger

    @classmethod
    def from_models(
        cls, model_a, model_b, *, preprocessor=None, config: RaotConfig | None = None, **options
    ) -> RaotMerger:
        """Wrap two loaded models (the merge writes into ``model_a``)."""
        config = (config or RaotConfig()).replace(**options) if options else (config or RaotConfig())
        return cls(model_a, model_b, config=config, preprocessor=preprocessor)

    # -- calibration ----------------------------------------------------------------------------
    def _calibration_config(self, calibration) -> tuple[CalibrationConfig, Any]:
        cal = self.config.calibration
        if isinstance(calibration, CalibrationConfig):
            return calibration, None
        if isinstance(calibration, (str, Path)):
            return cal.__class__.from_dict({**cal.to_dict(), "source": str(calibration)}), None
        if calibration is None:
            if cal.source is None:
                raise RaotError("this merge needs calibration data; pass calibration=... (or --calibration)")
            return cal, None
        return cal, calibration  # an in-memory datasets.Dataset

    def collect_statistics(self, calibration=None) -> tuple[CalibrationStatistics, dict[str, Any]]:
        """The fit phase of the calibration pass: A and B over the fit examples (sharded across
        processes under ``accelerate launch``), returning the summed fit moments (and Grams) and
        the data's fingerprint. The held-out examples run later, once the candidates are known
        (:meth:`collect_heldout`); each example goes through each model once."""
        if self.preprocessor is None:
            raise RaotError("no tokenizer or image processor for model A; pass preprocessor= to from_models")
        cal_cfg, data = self._calibration_config(calibration)
        with self.timer.stage("calibration"):
            dataset = load_calibration_dataset(data if data is not None else cal_cfg, config=cal_cfg)
            modality = detect_modality(self.preprocessor)
            column = check_column(dataset, cal_cfg.column, modality, model_label="model A")
            cal_cfg = CalibrationConfig.from_dict({**cal_cfg.to_dict(), "column": column})
            fingerprint = dataset_fingerprint(dataset, column)
            self._calibration = (dataset, cal_cfg)
            # Σbᵀb of the stream is read only when a residual rotation is estimated
            rotation = (
                "residual" in self.config.scope and residual_mode(self.schema, self.config.residual) == "rotation"
            )
            moments = self.config.alignment in ("activation", "soft_ot")
            stats = self._run_phase(
                "fit",
                # weight-based alignment and a linear or Fisher merge read nothing from the fit examples
                forward=moments or self.config.merge_rule == "regmean",
                stream_full=rotation,
                moment_stride=cal_cfg.moment_stride,
                moments=moments,
            )
        fingerprint.update(
            {
                "fit_examples": stats.examples,
                "fit_tokens": int(stats.fit.tokens),
                "moment_tokens": int(stats.fit.moment_tokens),
                "config": cal_cfg.to_dict(),
            }
        )
        if not all(torch.isfinite(t).all() for t in stats.fit.tensors()):
            logger.warning("NaN/Inf in fit activations: affected estimates will lose to the identity")
        return stats, fingerprint

    def collect_heldout(self, stats: CalibrationStatistics, candidates: list[Transform]) -> None:
        """The held-out phase: A and B over the held-out examples, scoring ``candidates`` against
        the identity (per-coordinate sums, DESIGN.md §5), added into ``stats`` in place. Also
        keeps the first ``check_batches`` held-out batches' inputs for the B′ ≡ B check."""
        schema = self.schema
        with self.timer.stage("calibration"):
            maps = candidate_maps(candidates, schema.num_heads, schema.head_size, device=self._stats_device())
            # nothing to score and no Grams to finish: the held-out examples need no forward
            wanted = bool(maps) or self.config.merge_rule == "regmean"
            heldout = self._run_phase("heldout", candidates=maps, forward=wanted)
        stats.absorb(heldout)
        if not all(torch.isfinite(t).all() for t in stats.heldout.tensors()):
            logger.warning("NaN/Inf in held-out activations: affected estimates will lose to the identity")

    def _stats_device(self) -> torch.device:
        return self.dist.device if self.dist.is_distributed else next(self.model_a.parameters()).device

    def _run_phase(self, phase: str, *, forward: bool = True, **collector_options) -> CalibrationStatistics:
        """Forward this process's shard of one split through A and B, then sum across processes
        (``forward=False``: the phase has nothing to collect — its sums stay zero)."""
        dataset, cal_cfg = self._calibration
        # forward passes on this process's accelerator (accelerate --multi_gpu), then back
        home = next(self.model_a.parameters()).device
        device = self._stats_device()
        if device != home:
            self.model_a.to(device)
            self.model_b.to(device)
        rank, world = self.dist.rank, self.dist.world_size
        total = count_calibration_batches(dataset, cal_cfg, rank=rank, world_size=world, split=phase) if forward else 0
        if phase == "heldout":
            self._check_inputs, self._check_reference = [], []
        try:
            with StatisticsCollector(
                self.model_a,
                self.model_b,
                self.schema,
                phase=phase,
                grams=self.config.merge_rule == "regmean",
                **collector_options,
            ) as collector:
                batches = (
                    iter_calibration_batches(
                        dataset, self.preprocessor, cal_cfg, rank=rank, world_size=world, split=phase
                    )
                    if forward
                    else iter(())
                )
                for batch in tqdm(batches, total=total, desc=f"calibration ({phase})", disable=not self.dist.is_main):
                    output_b = collector.update(batch)
                    if phase == "heldout" and len(self._check_inputs) < self.config.check_batches:
                        # B's outputs on the first held-out rows are the B′ ≡ B check's reference
                        # (as many rows as a mixed batch holds held-out rows: the check is one forward)
                        rows = max(1, cal_cfg.batch_size // cal_cfg.heldout_every)
                        self._check_inputs.append({k: v[:rows] for k, v in batch.inputs.items()})
                        ref = select_primary(output_b, rows)
                        self._check_reference.append({k: v.detach().to("cpu", copy=True) for k, v in ref.items()})
            stats = collector.stats
            if world > 1 and forward:  # shards never pad or repeat examples, so the sums are exact (§7)
                self.dist.all_reduce_statistics(stats)
        finally:
            if device != home:
                self.model_a.to(home)
                self.model_b.to(home)
        return stats.to("cpu")

    # -- estimation and gate --------------------------------------------------------------------
    def _candidates(self, stats: CalibrationStatistics | None) -> tuple[list[Transform], dict[str, Any]]:
        cfg, schema = self.config, self.schema
        logs: dict[str, Any] = {}
        parts: list[Transform] = []
        if cfg.alignment == "weight":
            from raot_hf.estimators.weight_based import estimate_weight_alignment

            scope = tuple(s for s in cfg.scope if s in ("mlp", "heads"))
            t, log = estimate_weight_alignment(
                model_state(self.model_a),
                model_state(self.model_b),
                schema,
                scope=scope,
                rescale=cfg.weight_rescale,
                match_heads=cfg.weight_match_heads,
                return_log=True,
                **({} if cfg.rotations else {"rotations": False}),
            )
            logs["weight"] = log
            return list(t.transforms), logs
        if cfg.alignment == "soft_ot":
            from raot_hf.estimators.soft_ot import estimate_soft_ot

            scope = tuple(x for x in cfg.scope if x in ("mlp", "heads"))
            t, log = estimate_soft_ot(stats, schema, scope=scope, reg=cfg.soft_ot_reg, return_log=True)
            logs["soft_ot"] = log
            return list(t.transforms), logs
        H, h = schema.num_heads, schema.head_size
        fit = stats.fit
        if "residual" in cfg.scope:
            if _finite(fit.stream):
                t, log = estimate_residual_map(fit.stream, mode=residual_mode(schema, cfg.residual), return_log=True)
            else:
                t, log = ResidualPermutation(torch.arange(schema.hidden_size)), _SKIPPED
            parts.append(t)
            logs["residual"] = log
        for i in tqdm(range(schema.num_layers), desc="solving", disable=not self.dist.is_main):
            if "mlp" in cfg.scope:
                if _finite(fit.mlp[i]):
                    t, log = estimate_mlp_permutation(fit.mlp[i], i, return_log=True)
                else:
                    t, log = MLPPermutation(i, torch.arange(schema.mlp_space(i).size)), _SKIPPED
                parts.append(t)
                logs[f"layers.{i}.mlp"] = log
            if "heads" in cfg.scope:
                if _finite(fit.q[i], fit.k[i], fit.ctx[i]):
                    t, log = estimate_head_alignment(
                        fit.q[i], fit.k[i], fit.ctx[i], i, H, h, rotations=cfg.rotations, return_log=True
                    )
                else:
                    eye = torch.eye(h, dtype=torch.float64).expand(H, h, h)
                    t, log = HeadAlignment(i, torch.arange(H), eye, eye), _SKIPPED
                parts.append(t)
                logs[f"layers.{i}.heads"] = log
        return parts, logs

    def _gate(self, parts: list[Transform], stats: CalibrationStatistics | None) -> list[GateDecision]:
        cfg, schema = self.config, self.schema
        H, h = schema.num_heads, schema.head_size
        decisions = []
        for t in parts:
            if isinstance(t, HeadRescale):
                continue  # follows its layer's head decision
            if isinstance(t, SoftTransport):
                space = schema.space(t.space)
                kind = {"mlp": "mlp", "qk": "heads", "vo": "heads", "residual": "residual"}[space.kind]
                decisions.append(
                    GateDecision(
                        kind,
                        space.layer,
                        float("nan"),
                        float("nan"),
                        float("nan"),
                        float("nan"),
                        float("nan"),
                        True,
                        "soft transport baseline: not a symmetry, not gated",
                        t.describe(),
                    )
                )
                continue
            if stats is None:
                kind = (
                    "mlp" if isinstance(t, MLPPermutation) else "heads" if isinstance(t, HeadAlignment) else "residual"
                )
                layer = getattr(t, "layer", None)
                decisions.append(
                    GateDecision(
                        kind,
                        layer,
                        float("nan"),
                        float("nan"),
                        float("nan"),
                        float("nan"),
                        float("nan"),
                        not _is_identity(t),
                        "no calibration: gate skipped",
                        t.describe(),
                    )
                )
                continue
            ho = stats.heldout
            if isinstance(t, MLPPermutation):
                kind, layer = "mlp", t.layer
                gains, ident = mlp_gains(ho.mlp[t.layer])
            elif isinstance(t, HeadAlignment):
                kind, layer = "heads", t.layer
                gains, ident = head_gains(ho.q[t.layer], ho.k[t.layer], ho.ctx[t.layer], H, h)
            else:
                kind, layer = "residual", None
                gains, ident = residual_gains(ho.stream)
            decisions.append(
                decide(
                    kind,
                    layer,
                    gains,
                    ident,
                    z=cfg.gate_z,
                    min_gain=cfg.gate_min_gain,
                    heldout_tokens=int(ho.tokens),
                    min_tokens=cfg.min_heldout_tokens,
                    is_identity=_is_identity(t),
                    enabled=cfg.gate,
                    description=t.describe(),
                )
            )
        return decisions

    def calibrate_and_solve(self, calibration=None) -> tuple[CalibrationStatistics | None, Any, list, dict]:
        """The statistics pass and the solve, in the order every process runs them: the fit
        phase, the candidates (solved by the main process and broadcast when the statistics
        are sharded, §7), then the held-out phase that scores them. Returns the statistics
        (held-out sums and Grams; the fit moments are freed), the data's fingerprint, the
        candidates and the estimators' logs."""
        stats = fingerprint = None
        if statistics_pass_needed(self.config, calibration):
            stats, fingerprint = self.collect_statistics(calibration)
        parts, logs = [], {}
        if self.config.alignment != "none" and self.config.scope:
            with self.timer.stage("solve"):
                shared = stats is not None and self.dist.is_distributed
                if self.dist.is_main or not shared:
                    with _one_thread():
                        parts, logs = self._candidates(stats)
                if shared:
                    parts, logs = self.dist.broadcast_object((parts, logs) if self.dist.is_main else None)
        if stats is not None:
            stats.fit = None  # the estimators are done with the fit moments: free them before the held-out phase
            self.collect_heldout(stats, parts)
            fingerprint.update({"examples": stats.examples, "heldout_tokens": int(stats.heldout.tokens)})
        return stats, fingerprint, parts, logs

    def align(self, calibration=None) -> tuple[Alignment, CalibrationStatistics | None, dict[str, Any] | None]:
        """Estimate every transform in scope, gate each against the identity, and return the
        decisions (nothing is applied to the models)."""
        stats, fingerprint, parts, logs = self.calibrate_and_solve(calibration)
        if self.config.alignment == "none" or not self.config.scope:
            return Alignment([], TransformSequence([]), True), stats, fingerprint
        with self.timer.stage("gate"):
            decisions = self._gate(parts, stats)
        applied_layers = {(d.transform, d.layer) for d in decisions if d.applied}
        chosen = []
        for t in parts:
            if isinstance(t, SoftTransport):
                keep = True
            elif isinstance(t, HeadRescale):
                keep = ("heads", t.layer) in applied_layers
            elif isinstance(t, MLPPermutation):
                keep = ("mlp", t.layer) in applied_layers
            elif isinstance(t, HeadAlignment):
                keep = ("heads", t.layer) in applied_layers
            else:
                keep = ("residual", None) in applied_layers
            if keep:
                chosen.append(t)
        applied = TransformSequence(chosen)
        return Alignment(decisions, applied, is_exact(applied, self.schema), logs), stats, fingerprint

    # -- the whole job --------------------------------------------------------------------------
    def merge(self, calibration=None) -> MergeResult:
        """Estimate, gate, apply to B, check B′ ≡ B, merge, and return a :class:`MergeResult`.

        Model A's object receives the merged weights (no third copy of the model is made).
        """
        cfg = self.config
        alignment, stats, fingerprint = self.align(calibration)
        if cfg.merge_rule != "regmean":
            stats = None  # only RegMean reads statistics after the gate: free them before apply/merge
        checks = []
        with self.timer.stage("apply"):
            inputs = getattr(self, "_check_inputs", None) or []
            reference = getattr(self, "_check_reference", None) or []
            if not inputs:
                from raot_hf.testing import example_inputs

                inputs = [example_inputs(self.model_b, batch=2, seq=8, seed=cfg.seed)]
            if len(reference) != len(inputs):
                reference = [primary_outputs(self.model_b, _on_device_of(self.model_b, x)) for x in inputs]
            actions = alignment.applied.actions(self.schema) if len(alignment.applied) else {}
            if len(alignment.applied):
                transform_model(self.model_b, self.schema, alignment.applied)
                if "residual" in actions and actions["residual"].perm is None and self.schema.norm == "pre":
                    fold_model(self.model_a, self.schema)
            deviation = self._deviation(reference, inputs, actions)
            threshold = 1e-9 if next(self.model_b.parameters()).dtype == torch.float64 else 1e-4
            checks.append(
                {
                    "name": "B′ ≡ B on held-out inputs (max relative deviation)",
                    "value": deviation,
                    "threshold": threshold,
                    "exact": alignment.exact,
                    "passed": deviation <= threshold or not alignment.exact,
                }
            )
            if alignment.exact and deviation > threshold:
                raise EquivalenceError(
                    f"an exact transform changed B's function (relative deviation {deviation:.3g} > {threshold}); "
                    "this is a bug in raot_hf — please report it with raot_report.json"
                )
            if not alignment.exact:
                logger.warning(
                    "approximate alignment (post-LN rotation or soft transport): B′ deviates from B by %.3g",
                    deviation,
                )
        with self.timer.stage("merge"):
            merged_state = self._merge_weights(alignment, stats)
            from raot_hf.symmetry import load_state

            load_state(self.model_a, merged_state)
        report = self._report(alignment, fingerprint, checks)
        return MergeResult(self.model_a, report, alignment, self.preprocessor, self.source_a.name_or_path)

    def _deviation(self, reference, inputs, actions) -> float:
        stream = actions["residual"].dense(self.schema.hidden_size) if "residual" in actions else None
        worst = 0.0
        for ref, x in zip(reference, inputs, strict=True):
            cand = primary_outputs(self.model_b, _on_device_of(self.model_b, x))
            mask = x.get("attention_mask")
            for key, r in ref.items():
                r = r.to("cpu", torch.float64)
                if key == "last_hidden_state" and stream is not None:
                    r = r @ stream.to("cpu", torch.float64)
                diff = (r - cand[key].to("cpu", torch.float64)).abs()
                if mask is not None and key == "last_hidden_state":
                    diff = diff * mask[..., None]
                worst = max(worst, float(diff.max() / r.abs().max().clamp_min(1e-30)))
        return worst

    def _merge_weights(self, alignment: Alignment, stats: CalibrationStatistics | None) -> dict[str, torch.Tensor]:
        """The merged parameters to load into A. The linear rule (elementwise per tensor) writes
        the trunk straight into A's parameters a few tensors at a time, so no merged copy of the
        whole model is held; what it returns is only what is left to load (the heads)."""
        cfg, schema = self.config, self.schema
        state_a, state_b = model_state(self.model_a), model_state(self.model_b)
        head = set(schema.head_params)
        rule = get_merge_rule(cfg.merge_rule)
        trunk_a = {k: v for k, v in state_a.items() if k not in head}
        trunk_b = {k: v for k, v in state_b.items() if k not in head}
        if cfg.merge_rule == "regmean":
            if stats is None or not stats.grams:
                raise RaotError("merge_rule='regmean' needs calibration data for its Gram matrices")
            grams_a, grams_b = aligned_grams(stats, schema, alignment.applied, self.model_a, self.model_b)
            merged = rule(
                trunk_a,
                trunk_b,
                grams_a=grams_a,
                grams_b=grams_b,
                linear_weights=_finite_gram_keys(stats.gram_keys, grams_a, grams_b),
                alpha=cfg.alpha,
                shrink=cfg.regmean_shrink,
            )
        elif cfg.merge_rule == "fisher":
            fisher_a, fisher_b = self._fishers(set(trunk_a))
            merged = rule(trunk_a, trunk_b, fisher_a=fisher_a, fisher_b=fisher_b, alpha=cfg.alpha)
        else:
            from raot_hf.symmetry import load_state

            def not_a_chunk_summary(record: logging.LogRecord) -> bool:
                return record.funcName != "_finish"

            rule_logger = logging.getLogger("raot_hf.merging")
            rule_logger.addFilter(not_a_chunk_summary)  # one summary below, not one per chunk
            try:
                chunk: list[str] = []
                size, names = 0, list(trunk_a)
                for i, name in enumerate(names):
                    chunk.append(name)
                    size += trunk_a[name].numel() * trunk_a[name].element_size()
                    if size >= 16 << 20 or i == len(names) - 1:  # float64 temporaries stay ~100 MB
                        part = rule({k: trunk_a[k] for k in chunk}, {k: trunk_b[k] for k in chunk}, alpha=cfg.alpha)
                        load_state(self.model_a, part)
                        chunk, size = [], 0
                        del part
            finally:
                rule_logger.removeFilter(not_a_chunk_summary)
            logger.info("linear merge (alpha=%g): %d tensors written into A in place", cfg.alpha, len(names))
            merged = {}
        if head:
            ca, cb = self.model_a.config, self.model_b.config
            merged.update(
                merge_heads(
                    state_a,
                    state_b,
                    sorted(head),
                    policy=cfg.head,
                    num_labels_a=ca.num_labels,
                    num_labels_b=cb.num_labels,
                    id2label_a=getattr(ca, "id2label", None),
                    id2label_b=getattr(cb, "id2label", None),
                    alpha=cfg.alpha,
                )
            )
        return merged

    def _fishers(self, names: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Label-free diagonal Fishers of A and of B′ (measured after alignment, since a
        rotation does not map a diagonal Fisher onto a diagonal one) on the calibration set."""
        from raot_hf.fisher import diagonal_fisher

        if getattr(self, "_calibration", None) is None:
            raise RaotError("merge_rule='fisher' needs calibration data; pass calibration=... (or --calibration)")
        dataset, cal_cfg = self._calibration

        def batches():
            for batch in iter_calibration_batches(dataset, self.preprocessor, cal_cfg):
                yield batch.inputs

        with self.timer.stage("fisher"):
            kw = dict(names=names, max_examples=self.config.fisher_samples, seed=self.config.seed)
            return diagonal_fisher(self.model_a, batches(), **kw), diagonal_fisher(self.model_b, batches(), **kw)

    def _report(self, alignment: Alignment, fingerprint, checks) -> dict[str, Any]:
        import transformers

        from raot_hf.output import hash_checkpoint_files

        def inputs_of(src: ModelSource, model) -> dict[str, Any]:
            info = src.describe()
            info["commit"] = getattr(model.config, "_commit_hash", None)
            info["architecture"] = type(model).__name__
            if src.is_local:
                info["files"] = hash_checkpoint_files(src.name_or_path)
            return info

        return {
            "raot_hf_version": __version__,
            "inputs": {"a": inputs_of(self.source_a, self.model_a), "b": inputs_of(self.source_b, self.model_b)},
            "model_type": self.schema.model_type,
            "norm": self.schema.norm,
            "residual_exact_group": self.schema.residual.exact,
            "settings": self.config.to_dict(),
            "calibration": fingerprint,
            "decisions": [d.to_dict() for d in alignment.decisions],
            "shares_basis": alignment.shares_basis,
            "summary": _summary(alignment),
            # the tensors go to raot_transform.safetensors (raot_hf.symmetry.load_transform reads it)
            "applied_transform": {
                "file": TRANSFORM_NAME if len(alignment.applied) else None,
                "transforms": [t.describe() for t in alignment.applied.transforms],
            },
            "applied_exact": alignment.exact,
            "estimator_logs": alignment.logs,
            "checks": checks,
            "timings": dict(self.timer.times),
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
            },
        }


def _finite_gram_keys(gram_keys: dict[str, str], grams_a, grams_b) -> dict[str, str]:
    """The RegMean weights whose Grams are finite; the others merge linearly (with a warning)."""
    usable = {
        w: key
        for w, key in gram_keys.items()
        if bool(torch.isfinite(grams_a[key]).all()) and bool(torch.isfinite(grams_b[key]).all())
    }
    if len(usable) < len(gram_keys):
        logger.warning(
            "NaN/Inf in the calibration activations: %d of %d RegMean weights fall back to the linear merge",
            len(gram_keys) - len(usable),
            len(gram_keys),
        )
    return usable


def _summary(alignment: Alignment) -> str:
    if not alignment.decisions:
        return "no alignment requested: plain merge in the parents' own bases"
    n = sum(d.applied for d in alignment.decisions)
    if n == 0:
        return (
            f"the gate rejected all {len(alignment.decisions)} estimated transforms: "
            "the pair already shares a basis (nothing to align)"
        )
    kinds = sorted({d.transform for d in alignment.decisions if d.applied})
    return f"{n} of {len(alignment.decisions)} transforms applied ({', '.join(kinds)})"
