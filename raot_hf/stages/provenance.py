"""The provenance record of a merge (``raot_report.json``, docs/design.md §6.4), built from what the
stages returned; :mod:`raot_hf.outputs.report` serialises it and renders the card from it."""

from __future__ import annotations

import platform
from typing import Any

import torch

from raot_hf.io.loading import ModelSource
from raot_hf.outputs import hash_checkpoint_files
from raot_hf.outputs.card import alignment_summary
from raot_hf.results import Alignment
from raot_hf.stages.context import PairContext
from raot_hf.symmetry.io import TRANSFORM_NAME
from raot_hf.version import __version__


def inputs_of(src: ModelSource, model) -> dict[str, Any]:
    """One input checkpoint as the report lists it: its source, commit, class and (local) file hashes."""
    info = src.describe()
    info["commit"] = getattr(model.config, "_commit_hash", None)
    info["architecture"] = type(model).__name__
    if src.is_local:
        info["files"] = hash_checkpoint_files(src.name_or_path)
    return info


def _inputs(ctx: PairContext, source_a: ModelSource, source_b: ModelSource) -> dict[str, Any]:
    inputs = {"a": inputs_of(source_a, ctx.model_a), "b": inputs_of(source_b, ctx.model_b)}
    if ctx.base is not None:
        inputs["base"] = base = inputs_of(ctx.base.source, ctx.base.model)
        base.update(
            # loaded with A's class; the checkpoint's own class is the one its config names
            architecture=(getattr(ctx.base.model.config, "architectures", None) or [base["architecture"]])[0],
            relative_task_norms=ctx.base.task_norms,
            trunk_params_not_in_base=ctx.base.missing,
        )
    return inputs


def build_report(
    ctx: PairContext,
    sources: tuple[ModelSource, ModelSource],
    alignment: Alignment,
    fingerprint: dict | None,
    checks: list[dict],
    merge_log: dict | None,
    quality: dict | None = None,
) -> dict[str, Any]:
    """The report dict: inputs (with file hashes), settings, calibration fingerprint, gate
    decisions and verdict, applied transforms, merge log, checks, timings and versions."""

    return {
        "raot_hf_version": __version__,
        "inputs": _inputs(ctx, *sources),
        "model_type": ctx.schema.model_type,
        "norm": ctx.schema.norm,
        "residual_exact_group": ctx.schema.residual.exact,
        "settings": ctx.config.to_dict(),
        "calibration": fingerprint,
        "decisions": [d.to_dict() for d in alignment.decisions],
        "shares_basis": alignment.shares_basis,
        "verdict": alignment.verdict,
        "model_fidelity": alignment.model_fidelity,
        "summary": alignment_summary(alignment.decisions),
        # the tensors go to raot_transform.safetensors (raot_hf.symmetry.load_transform reads it)
        "applied_transform": {
            "file": TRANSFORM_NAME if len(alignment.applied) else None,
            "transforms": [t.describe() for t in alignment.applied.transforms],
        },
        "applied_exact": alignment.exact,
        "merge": merge_log,
        "execution": execution(ctx),
        "quality": quality,
        "estimator_logs": alignment.logs,
        "checks": checks,
        "timings": dict(ctx.timer.times),
        "versions": versions(),
    }


def execution(ctx) -> str:
    """How the merge of the pair ``ctx`` ran: "layer-wise" with the models offloaded to working
    files (docs/design.md §7.4), else "in memory"."""
    return "layer-wise" if ctx.working_files.of(ctx.model_a) is not None else "in memory"


def versions() -> dict[str, str]:
    """The versions of torch, transformers and Python a report records."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
