"""One run of one pair: build (cached), merge with every method through ``RaotMerger``, measure.

:func:`evaluate_run` returns a JSON-able dict; :mod:`benchmarks.run` runs many in worker
processes and :mod:`benchmarks.report` aggregates them.
"""

from __future__ import annotations

import copy
import gc
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.methods import Method, base_keyword
from benchmarks.metrics import (
    barrier,
    calibration_tokens,
    canonical_state,
    correction_summary,
    encode_split,
    evaluate,
    features_of,
    head_accuracy,
    interpolate,
    linear_probe,
    matching_reference,
    max_abs_difference,
    path_check,
    refit_summary,
    weight_distance,
    with_head_of,
)
from benchmarks.pairs import PairSpec, build_model, calibration_set, load_task, probe_indices

logger = logging.getLogger("benchmarks.harness")

IMAGE_TASKS = ("digits", "mnist8", "tiny")
#: Largest tolerated relative difference between the α = 0.5 path point and the product's merge.
PATH_TOLERANCE = 1e-4


def _load(path: Path, task: str):
    import transformers

    if task in IMAGE_TASKS:
        model = transformers.AutoModelForImageClassification.from_pretrained(path)
        processor = transformers.AutoImageProcessor.from_pretrained(path)
    else:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(path)
        processor = transformers.AutoTokenizer.from_pretrained(path)
    return model.eval(), processor


class _TaskData:
    """A task's test split and probe-training subset, encoded once with A's processor."""

    def __init__(self, task: str, processor, pair: PairSpec):
        splits = load_task(task)
        test = splits["test"]
        if pair.max_test is not None and len(test) > pair.max_test:
            test = test.select(probe_indices(len(test), pair.max_test, seed=1))
        train = splits["train"].select(probe_indices(len(splits["train"]), pair.probe_train))
        self.test = encode_split(test, processor)
        self.train = encode_split(train, processor)


def _labels_equal(model_a, model_b) -> bool:
    ca, cb = model_a.config, model_b.config
    return ca.num_labels == cb.num_labels and {int(k): v for k, v in ca.id2label.items()} == {
        int(k): v for k, v in cb.id2label.items()
    }


def _gate_summary(result) -> dict[str, Any]:
    decisions = result.alignment.decisions
    by_kind: dict[str, list[int]] = {}
    for d in decisions:
        applied, total = by_kind.setdefault(d.transform, [0, 0])
        by_kind[d.transform] = [applied + int(d.applied), total + 1]
    return {
        "applied": sum(int(d.applied) for d in decisions),
        "total": len(decisions),
        "by_kind": by_kind,
        "decisions": [
            {
                "transform": d.transform,
                "layer": d.layer,
                "gain": _finite(d.gain),
                "margin": _finite(d.margin),
                "identity": _finite(d.identity),
                "estimate": _finite(d.estimate),
                "applied": bool(d.applied),
                "reason": getattr(d, "reason", None),  # the merge-objective gate says why
            }
            for d in decisions
        ],
    }


def _jsonable(value):
    """Numbers, strings and nested dicts / lists of them, with tensors turned into floats or lists."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


def _finite(x) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if np.isfinite(x) else None


def evaluate_run(pair: PairSpec, run_index: int, methods: list[Method], alphas: list[float]) -> dict[str, Any]:
    """Merge run ``run_index`` of ``pair`` with every method and measure each merge."""
    from raot_hf import schema_for

    started = time.perf_counter()
    spec_a, spec_b = pair.runs()[run_index]
    dir_a, dir_b = build_model(spec_a), build_model(spec_b)
    spec_base = pair.base_of(run_index)
    dir_base = build_model(spec_base) if spec_base is not None else None
    # Base-relative rules need a base; "average" first, as every other merge is compared with it.
    methods = sorted((m for m in methods if dir_base or not m.needs_base), key=lambda m: m.name != "average")
    model_a, processor = _load(dir_a, pair.task_a)
    model_b, _ = _load(dir_b, pair.task_b)
    schema = schema_for(model_a)
    tasks = {"a": _TaskData(pair.task_a, processor, pair)}
    tasks["b"] = tasks["a"] if pair.same_task else _TaskData(pair.task_b, processor, pair)
    calibration = calibration_set(pair)
    shared_labels = _labels_equal(model_a, model_b)
    ctx = _RunContext(pair, dir_a, dir_b, calibration, tasks, schema, model_a, model_b, alphas, shared_labels)
    ctx.dir_base = dir_base

    # Parents: own heads on own tasks, probes of their features on both tasks.
    parents: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
    for side, model in (("a", model_a), ("b", model_b)):
        for which in ctx.task_keys:
            res, test_x = evaluate(model, tasks[which].test, schema, features=True)
            parents[side][f"loss_{which}"] = res["loss"]
            parents[side][f"probe_{which}"] = ctx.probe(model, which, test_x)
            if which == side or pair.same_task:
                parents[side]["accuracy"] = res["accuracy"]
                parents[side]["loss"] = res["loss"]
    ctx.parents = parents
    out: dict[str, Any] = {
        "pair": pair.name,
        "run": run_index,
        "models": {"a": Path(dir_a).name, "b": Path(dir_b).name},  # folder names in the zoo cache
        "specs": {"a": spec_a.describe(), "b": spec_b.describe()},
        "base": None if dir_base is None else {"model": Path(dir_base).name, "spec": spec_base.describe()},
        "schema": {
            "model_type": schema.model_type,
            "norm": schema.norm,
            "layers": schema.num_layers,
            "hidden": schema.hidden_size,
            "heads": schema.num_heads,
            "mlp": schema.intermediate_size,
        },
        "test_examples": {"a": len(tasks["a"].test), "b": len(tasks["b"].test)},
        "probe_train_examples": len(tasks["a"].train),
        "calibration_examples": len(calibration),
        "shared_label_space": shared_labels,
        "parents": parents,
        "distance_before": weight_distance(ctx.canon_a, canonical_state(model_b, schema), ctx.trunk),
        "alphas": alphas,
        "methods": {},
    }
    for method in methods:
        try:
            out["methods"][method.name] = _evaluate_method(method, ctx)
        except Exception as exc:  # one failing method must not hide the others
            logger.exception("%s run %d: method %s failed", pair.name, run_index, method.name)
            out["methods"][method.name] = {"error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
    out["seconds"] = time.perf_counter() - started
    return out


class _RunContext:
    """What every method of one run shares: parents, data, schema, reference states."""

    def __init__(self, pair, dir_a, dir_b, calibration, tasks, schema, model_a, model_b, alphas, shared_labels):
        self.pair, self.dir_a, self.dir_b, self.calibration = pair, dir_a, dir_b, calibration
        self.tasks, self.schema, self.model_a, self.model_b = tasks, schema, model_a, model_b
        self.alphas, self.shared_labels = alphas, shared_labels
        self.task_keys = ("a",) if pair.same_task else ("a", "b")
        self.canon_a = canonical_state(model_a, schema)
        head = set(schema.head_params)
        self.trunk = [n for n in self.canon_a if n not in head]
        self.parents: dict[str, dict[str, Any]] = {}
        self.dir_base: Path | None = None
        self.average_state: dict[str, torch.Tensor] | None = None  # the plain average's merged weights

    def probe(self, model, which: str, test_x: np.ndarray) -> float:
        """Probe accuracy on task ``which`` from ``model``'s frozen features (test features given)."""
        data = self.tasks[which]
        train_x = features_of(model, data.train, self.schema)
        return linear_probe(train_x, data.train.labels.numpy(), test_x, data.test.labels.numpy())


def _evaluate_method(method: Method, ctx: _RunContext) -> dict[str, Any]:
    from raot_hf import RaotMerger

    pair, schema, tasks = ctx.pair, ctx.schema, ctx.tasks
    calibration = {"num_samples": len(ctx.calibration), "max_length": 64, "batch_size": 32}
    options = {
        **pair.options,
        **method.options,
        "calibration": {**calibration, **method.options.get("calibration", {})},
    }
    if method.needs_base:
        options[base_keyword()] = ctx.dir_base
    t0 = time.perf_counter()
    merger = RaotMerger.from_pretrained(ctx.dir_a, ctx.dir_b, **options)
    result = merger.merge(calibration=ctx.calibration)
    merge_seconds = time.perf_counter() - t0
    merged, b_prime = result.model, merger.model_b
    row: dict[str, Any] = {"merge_seconds": merge_seconds, "timings": dict(result.report["timings"])}
    row["calibration_tokens"] = calibration_tokens(result.report)
    # Trunk-head compatibility and frozen-feature probes from one pass over each test split.
    for which in ctx.task_keys:
        res, test_x = evaluate(merged, tasks[which].test, schema, features=True)
        if which == "a":
            row["acc_head_a"] = res["accuracy"]
        if which == "b" or pair.same_task:
            acc_b = head_accuracy(test_x, tasks[which].test.labels, b_prime, schema)
            if acc_b is None:  # a head with more than one Linear: evaluate the swapped model
                acc_b = evaluate(with_head_of(merged, b_prime, schema), tasks[which].test, schema)["accuracy"]
            row["acc_head_b"] = acc_b
        row[f"probe_{which}"] = ctx.probe(merged, which, test_x)
    row["distance_after"] = weight_distance(ctx.canon_a, canonical_state(b_prime, schema), ctx.trunk)
    row["exact"] = bool(result.alignment.exact)
    row["deviation"] = float(result.report["checks"][0]["value"]) if result.report.get("checks") else None
    row["gate"] = _gate_summary(result)
    row["shares_basis"] = bool(result.alignment.shares_basis)
    verdict = getattr(result.alignment, "verdict", None)
    row["verdict"] = None if verdict is None else str(verdict)
    row["model_fidelity"] = _jsonable(getattr(result.alignment, "model_fidelity", None) or {})
    row["correction"] = correction_summary(result.report)
    row["refit"] = refit_summary(result.report)
    state = merged.state_dict()
    if method.name == "average":
        ctx.average_state = {k: v.detach().clone() for k, v in state.items()}
    elif ctx.average_state is not None:  # does this merge equal the plain average? (0.0: bitwise)
        row["max_abs_vs_average"] = max_abs_difference(state, ctx.average_state)
    if method.linear and ctx.shared_labels and ctx.alphas:
        row.update(_barrier(ctx, result, merged, b_prime, float(options.get("alpha", 0.5))))
    del merger, result, merged, b_prime
    return row


def _barrier(ctx: _RunContext, result, merged, b_prime, merge_alpha: float) -> dict[str, Any]:
    """Test loss along (1 − α)·A + α·B′ on each task, and the barrier. The ends are the parents'
    losses (α = 1 is B′, which computes B's function when the alignment is exact)."""
    ref = matching_reference(ctx.model_a, result, ctx.schema)
    scratch = copy.deepcopy(b_prime)
    exact = bool(result.alignment.exact)
    row: dict[str, Any] = {}
    curves: dict[str, list[float]] = {which: [] for which in ctx.task_keys}
    for alpha in ctx.alphas:
        point = None
        if 0 < alpha < 1 or (alpha == 1 and not exact):
            point = b_prime if alpha == 1 else interpolate(ref, b_prime, alpha, scratch)
        if alpha == 0.5 and merge_alpha == 0.5:
            row["path_check"] = path_check(point, merged, ctx.schema)
            if row["path_check"] > PATH_TOLERANCE:
                raise RuntimeError(
                    f"the interpolation path at α=0.5 differs from the product's linear merge by "
                    f"{row['path_check']:.3g} (relative); the barrier would not describe the merge"
                )
        for which in curves:
            if point is None:
                curves[which].append(ctx.parents["a" if alpha == 0 else "b"][f"loss_{which}"])
            else:
                curves[which].append(evaluate(point, ctx.tasks[which].test, ctx.schema)["loss"])
    row["path_loss"] = curves
    for which, losses in curves.items():
        row[f"barrier_{which}"] = barrier(ctx.alphas, losses)
    return row


def parameter_count(model: torch.nn.Module) -> int:
    """Number of parameters (for the report)."""
    return sum(p.numel() for p in model.parameters())
