"""RaotMerger: estimate, gate, apply, check and merge (docs/design.md §4–6).

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
    adopt_head,
    check_base_compatible,
    check_base_tokenizer,
    check_compatible,
    check_tokenizers,
    load_base_model,
    load_config,
    load_model,
    load_preprocessor,
)
from raot_hf.merging import base_relative_rules, merge_heads, merge_rule_spec
from raot_hf.merging.siblings import base_state_for, check_base_use, check_task_norms, refuse_moved_b
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
    verdict: str = ""  # one line: do A and B share a basis, with the evidence (docs/design.md §5)
    model_fidelity: dict[str, Any] = field(default_factory=dict)  # the model-level check's numbers

    @property
    def shares_basis(self) -> bool:
        """True when the gate rejected every transform: the pair already shares a basis."""
        return bool(self.decisions) and not any(d.applied for d in self.decisions)

    def table(self) -> str:
        """The gate table as aligned plain text."""
        head = (
            f"{'transform':<10} {'layer':>5} {'identity':>10} {'estimate':>10} {'gain':>10} {'margin':>10} "
            f"{'align.gain':>10}  applied"
        )
        lines = [head, "-" * len(head)]
        for d in self.decisions:
            layer = "-" if d.layer is None else str(d.layer)
            diagnostic = d.alignment_gain if d.objective == "merge" else d.gain
            lines.append(
                f"{d.transform:<10} {layer:>5} {d.identity:>10.4f} {d.estimate:>10.4f} {d.gain:>10.4f} "
                f"{d.margin:>10.4f} {diagnostic:>10.4f}  {'yes' if d.applied else 'no'} ({d.reason})"
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


def _check_calibration_early(cal: CalibrationConfig, preprocessor) -> tuple[dict[str, Any], Any, str]:
    """Load the calibration sample and resolve its column before any weights are read, so a
    wrong path, split, column or modality fails in seconds. Returns the request, the sample
    and its column, which the pass reuses (the data is read and announced once)."""
    dataset = load_calibration_dataset(cal)
    column = check_column(dataset, cal.column, detect_modality(preprocessor), model_label="model A")
    return cal.to_dict(), dataset, column


def _check_base_use(config: RaotConfig, has_base: bool) -> None:
    needs_base = merge_rule_spec(config.merge_rule).needs_base
    check_base_use(config.merge_rule, needs_base, has_base, base_relative_rules())


def _check_rule_fits(config: RaotConfig, model_type: str) -> None:
    """Refuse, from the config alone, a merge rule the architecture cannot serve yet."""
    if merge_rule_spec(config.merge_rule).needs_grams and model_type == "gpt2":
        raise RaotError(
            f"merge_rule={config.merge_rule!r} is not available for gpt2 yet (its Conv1D layers give no "
            "RegMean Grams); use --merge-rule linear or fisher"
        )


def residual_mode(schema: ModelSchema, requested: str) -> str:
    """``auto`` → the mean-fixing rotation where it is exact, the permutation otherwise; a
    rotation of an RMSNorm stream ranges over all of O(d) (``"orthogonal"``, docs/design.md §8)."""
    if requested in ("auto", "rotation") and schema.residual.exact == "orthogonal":
        return "orthogonal"
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
        base_model=None,
        source_base: ModelSource | None = None,
        base_missing: list[str] | tuple[str, ...] = (),
    ):
        self.config = config or RaotConfig()
        _check_base_use(self.config, base_model is not None)
        self.model_a, self.model_b = model_a.eval(), model_b.eval()
        check_compatible(model_a.config, model_b.config, head_policy=self.config.head)
        _check_rule_fits(self.config, model_a.config.model_type)
        self.schema = schema_for(model_a)
        schema_b = schema_for(model_b)
        if schema_b.parameter_names() != self.schema.parameter_names():
            raise RaotError("A and B resolve to different parameter sets; load both with the same class.")
        self.preprocessor = preprocessor
        self.source_a = source_a or ModelSource(getattr(model_a, "name_or_path", "") or "model_a")
        self.source_b = source_b or ModelSource(getattr(model_b, "name_or_path", "") or "model_b")
        self.timer = _Timer()
        self.dist = DistributedContext.detect()
        self._set_base(base_model, source_base, base_missing)

    def _set_base(self, base_model, source: ModelSource | None, missing) -> None:
        """The base's trunk under A's names, and A's and B's distances from it (docs/design.md §6)."""
        self.base_model, self.base_state, self.base_missing, self.task_norms = base_model, None, list(missing), None
        self.source_base = source
        if base_model is None:
            return
        check_base_compatible(self.model_a.config, base_model.config)
        head = set(self.schema.head_params)
        trunk = [name for name in model_state(self.model_a) if name not in head]
        prefix = getattr(self.model_a, "base_model_prefix", "") or ""
        self.base_state = base_state_for(trunk, base_model.eval(), missing, prefix)
        self.base_missing = sorted(set(trunk) - set(self.base_state))
        self.source_base = source or ModelSource(getattr(base_model, "name_or_path", "") or "base")
        state_a, state_b = model_state(self.model_a), model_state(self.model_b)
        self.task_norms = check_task_norms(self.base_state, state_a, state_b)

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
        base: str | Path | None = None,
        base_revision: str | None = None,
        **options,
    ) -> RaotMerger:
        """Load A and B (Hub ids or local directories). ``revision`` applies to A (and to B
        unless ``revision_b`` is given); ``options`` override fields of ``config``. ``base``
        (with ``base_revision``) is the checkpoint A and B were fine-tuned from, for the
        base-relative rules (``task_arithmetic``, ``ties``, ``dare_ties``)."""
        config = (config or RaotConfig()).replace(**options) if options else (config or RaotConfig())
        _check_base_use(config, base is not None)
        src_a = ModelSource(str(a), revision, token, trust_remote_code, allow_pickle)
        src_b = ModelSource(str(b), revision_b or revision, token, trust_remote_code, allow_pickle)
        src_base = ModelSource(str(base), base_revision, token, trust_remote_code, allow_pickle) if base else None
        timer = _Timer()
        early = None
        with timer.stage("load"):
            cfg_a, cfg_b = load_config(src_a, "A"), load_config(src_b, "B")
            check_compatible(cfg_a, cfg_b, head_policy=config.head)
            _check_rule_fits(config, cfg_a.model_type)
            cfg_base = load_config(src_base, "base") if src_base else None
            if cfg_base is not None:
                check_base_compatible(cfg_a, cfg_base)  # before any weights load
            pre_a, pre_b = load_preprocessor(src_a), load_preprocessor(src_b)
            check_tokenizers(pre_a, pre_b)
            if src_base is not None:
                check_base_tokenizer(pre_a, load_preprocessor(src_base))
            if config.needs_calibration and config.calibration.source is not None and pre_a is not None:
                early = _check_calibration_early(config.calibration, pre_a)
            stage = {"stage": True}  # a line the CLI shows by default (raot_hf.cli.verbosity)
            logger.info("loading A (%s) and B (%s)", src_a.name_or_path, src_b.name_or_path, extra=stage)
            model_a = load_model(src_a, "A", dtype=config.dtype, config=cfg_a)
            model_b = load_model(src_b, "B", dtype=config.dtype, config=cfg_b)
            base_model, missing = (
                load_base_model(src_base, cfg_a, dtype=config.dtype, config=cfg_base) if src_base else (None, ())
            )
        merger = cls(
            model_a,
            model_b,
            config=config,
            preprocessor=pre_a,
            source_a=src_a,
            source_b=src_b,
            base_model=base_model,
            source_base=src_base,
            base_missing=missing,
        )
        merger.timer.times.update(timer.times)
        merger._early_calibration = early
        return merger

    @classmethod
    def from_models(
        cls, model_a, model_b, *, preprocessor=None, config: RaotConfig | None = None, base_model=None, **options
    ) -> RaotMerger:
        """Wrap two loaded models (the merge writes into ``model_a``); ``base_model``, for the
        base-relative rules, may be A's class or the bare model A's head class wraps. (Load it with
        its own class: parameters ``from_pretrained`` initialised at random cannot be told apart here.)"""
        config = (config or RaotConfig()).replace(**options) if options else (config or RaotConfig())
        return cls(model_a, model_b, config=config, preprocessor=preprocessor, base_model=base_model)

    # -- calibration ----------------------------------------------------------------------------
    def _calibration_config(self, calibration) -> tuple[CalibrationConfig, Any]:
        cal = self.config.calibration
        if isinstance(calibration, CalibrationConfig):
            return calibration, None
        if isinstance(calibration, (str, Path)):
            return cal.__class__.from_dict({**cal.to_dict(), "source": str(calibration)}), None
        if calibration is None:
            if cal.source is None:
                with_base = getattr(self, "base_state", None) is not None
                hint = " — or alignment='none' to skip the gate's shared-basis check" if with_base else ""
                raise RaotError(f"this merge needs calibration data; pass calibration=... (or --calibration){hint}")
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
            early = getattr(self, "_early_calibration", None)
            if data is None and early is not None and early[0] == cal_cfg.to_dict():
                dataset, column = early[1:]  # from_pretrained's early check loaded this very sample
            else:
                dataset = load_calibration_dataset(data if data is not None else cal_cfg, config=cal_cfg)
                column = cal_cfg.column
            column = check_column(dataset, column, detect_modality(self.preprocessor), model_label="model A")
            cal_cfg = CalibrationConfig.from_dict({**cal_cfg.to_dict(), "column": column})
            fingerprint = dataset_fingerprint(dataset, column)
            self._calibration = (dataset, cal_cfg)
            # Σbᵀb of the stream is read only when a residual rotation is estimated
            residual_wanted = residual_mode(self.schema, self.config.residual)
            rotation = "residual" in self.config.scope and residual_wanted in ("rotation", "orthogonal")
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
        the identity (per-coordinate sums, docs/design.md §5), added into ``stats`` in place. Also
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
                    structure = {"num_kv_heads": schema.num_kv_heads, "rope": schema.qk_structure == "rope"}
                    t, log = estimate_head_alignment(
                        fit.q[i], fit.k[i], fit.ctx[i], i, H, h, rotations=cfg.rotations, return_log=True, **structure
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
            from raot_hf.merge_gate import merge_gate

            decisions, verdict, fidelity = merge_gate(self, parts, stats, self._gate(parts, stats))
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
        alignment = Alignment(decisions, applied, is_exact(applied, self.schema), logs, verdict, fidelity)
        return alignment, stats, fingerprint

    # -- the whole job --------------------------------------------------------------------------
    def merge(self, calibration=None) -> MergeResult:
        """Estimate, gate, apply to B, check B′ ≡ B, merge, and return a :class:`MergeResult`.

        Model A's object receives the merged weights (no third copy of the model is made).
        """
        cfg = self.config
        alignment, stats, fingerprint = self.align(calibration)
        if self.base_state is not None:  # task vectors need B in the base's basis (docs/design.md §6)
            refuse_moved_b(alignment.decisions, cfg.merge_rule)
        if not merge_rule_spec(cfg.merge_rule).needs_grams:
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
        spec = merge_rule_spec(cfg.merge_rule)
        trunk_a = {k: v for k, v in state_a.items() if k not in head}
        trunk_b = {k: v for k, v in state_b.items() if k not in head}
        # what the rule reads besides A, B′ and α, as its registration declares (raot_hf.merging)
        inputs: dict[str, Any] = {name: getattr(cfg, field) for name, field in spec.options.items()}
        if spec.needs_grams:
            if stats is None or not stats.grams:
                raise RaotError(f"merge_rule={cfg.merge_rule!r} needs calibration data for its Gram matrices")
            grams_a, grams_b = aligned_grams(stats, schema, alignment.applied, self.model_a, self.model_b)
            linear_weights = _finite_gram_keys(stats.gram_keys, grams_a, grams_b)
            inputs.update(grams_a=grams_a, grams_b=grams_b, linear_weights=linear_weights)
        if spec.needs_fisher:
            inputs["fisher_a"], inputs["fisher_b"] = self._fishers(set(trunk_a))
        if spec.needs_base:
            inputs["base"] = self.base_state
        if spec.per_tensor:
            self._merge_in_place(spec, trunk_a, trunk_b, inputs)
            merged = {}
        else:
            merged, self.merge_log = spec.fn(trunk_a, trunk_b, alpha=cfg.alpha, return_log=True, **inputs)
            self.merge_log.pop("params", None)
        if head:
            ca, cb = self.model_a.config, self.model_b.config
            if cfg.head == "b":  # A's trunk takes B′'s head: B's label config and head shapes first
                adopt_head(self.model_a, self.model_b, sorted(head))
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

    def _merge_in_place(self, spec, trunk_a: dict, trunk_b: dict, inputs: dict[str, Any]) -> None:
        """Run a per-tensor rule a few tensors at a time, writing each result straight into A's
        parameters (float64 temporaries stay ~100 MB); the chunks' logs add up in ``self.merge_log``."""
        from raot_hf.symmetry import load_state

        def not_a_chunk_summary(record: logging.LogRecord) -> bool:
            return record.funcName != "_finish"

        base = inputs.pop("base", None)
        log: dict[str, Any] = {"rule": spec.name, "settings": {}, "counts": {}}
        rule_logger = logging.getLogger("raot_hf.merging")
        rule_logger.addFilter(not_a_chunk_summary)  # one summary below, not one per chunk
        try:
            chunk: list[str] = []
            size, names = 0, list(trunk_a)
            for i, name in enumerate(names):
                chunk.append(name)
                size += trunk_a[name].numel() * trunk_a[name].element_size()
                if size >= 16 << 20 or i == len(names) - 1:
                    if base is not None:
                        inputs["base"] = {k: base[k] for k in chunk if k in base}
                    part, part_log = spec.fn(
                        {k: trunk_a[k] for k in chunk},
                        {k: trunk_b[k] for k in chunk},
                        alpha=self.config.alpha,
                        return_log=True,
                        **inputs,
                    )
                    load_state(self.model_a, part)
                    _add_chunk_log(log, part_log)
                    chunk, size = [], 0
                    del part
        finally:
            rule_logger.removeFilter(not_a_chunk_summary)
        counts = ", ".join(f"{n} {m}" for m, n in sorted(log["counts"].items()))
        logger.info("%s merge (alpha=%g): %s; written into A in place", spec.name, self.config.alpha, counts)
        self.merge_log = log

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

        inputs = {"a": inputs_of(self.source_a, self.model_a), "b": inputs_of(self.source_b, self.model_b)}
        if self.base_model is not None:
            inputs["base"] = base = inputs_of(self.source_base, self.base_model)
            base.update(
                # loaded with A's class; the checkpoint's own class is the one its config names
                architecture=(getattr(self.base_model.config, "architectures", None) or [base["architecture"]])[0],
                relative_task_norms=self.task_norms,
                trunk_params_not_in_base=self.base_missing,
            )
        return {
            "raot_hf_version": __version__,
            "inputs": inputs,
            "model_type": self.schema.model_type,
            "norm": self.schema.norm,
            "residual_exact_group": self.schema.residual.exact,
            "settings": self.config.to_dict(),
            "calibration": fingerprint,
            "decisions": [d.to_dict() for d in alignment.decisions],
            "shares_basis": alignment.shares_basis,
            "verdict": alignment.verdict,
            "model_fidelity": alignment.model_fidelity,
            "summary": _summary(alignment),
            # the tensors go to raot_transform.safetensors (raot_hf.symmetry.load_transform reads it)
            "applied_transform": {
                "file": TRANSFORM_NAME if len(alignment.applied) else None,
                "transforms": [t.describe() for t in alignment.applied.transforms],
            },
            "applied_exact": alignment.exact,
            "merge": getattr(self, "merge_log", None),
            "estimator_logs": alignment.logs,
            "checks": checks,
            "timings": dict(self.timer.times),
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
            },
        }


def _add_chunk_log(total: dict[str, Any], part: dict[str, Any]) -> None:
    """Sum one chunk's rule log into ``total`` (counts and totals add, lists such as ``not_in_base`` extend)."""
    for key, value in part.get("settings", {}).items():
        if isinstance(value, list):
            total["settings"].setdefault(key, []).extend(value)
        else:
            total["settings"][key] = value
    for method, n in part.get("counts", {}).items():
        total["counts"][method] = total["counts"].get(method, 0) + n
    for name, n in part.get("totals", {}).items():  # entry counts of the base-relative rules
        total.setdefault("totals", {})[name] = total.get("totals", {}).get(name, 0) + n


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
