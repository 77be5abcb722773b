"""The provenance record of a merge (``raot_report.json``, docs/design.md §6.4), built from what the
stages returned."""

from __future__ import annotations

import platform
from typing import Any

import torch

from raot_hf.io.loading import ModelSource
from raot_hf.merging import RuleLog
from raot_hf.outputs import hash_checkpoint_files
from raot_hf.outputs.card import alignment_summary
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


def _inputs(ctx: PairContext, sources: list[ModelSource], members: list) -> dict[str, Any]:
    """The inputs section: A and B (files hashed once), every model when more than two, and the base."""
    models = [ctx.model_a, *(m.ctx.model_b for m in members)]
    described = [inputs_of(s, m) for s, m in zip(sources, models, strict=True)]
    inputs: dict[str, Any] = {"a": described[0], "b": described[1]}
    if len(described) > 2:
        inputs["models"] = [
            {"model": i, "role": "reference" if i == 1 else "aligned", **info}
            for i, info in enumerate(described, start=1)
        ]
    if ctx.base is not None:
        inputs["base"] = base = inputs_of(ctx.base.source, ctx.base.model)
        base.update(
            # loaded with A's class; the checkpoint's own class is the one its config names
            architecture=(getattr(ctx.base.model.config, "architectures", None) or [base["architecture"]])[0],
            relative_task_norms=ctx.base.task_norms,
            trunk_params_not_in_base=ctx.base.missing,
        )
    return inputs


def transform_file(index: int) -> str:
    """The file of model ``index``'s alignment (model 2's keeps the two-model name)."""
    return TRANSFORM_NAME if index == 2 else TRANSFORM_NAME.replace(".safetensors", f".model{index}.safetensors")


def alignment_record(index: int, member, quality: dict | None) -> dict[str, Any]:
    """One aligned model's section: its gate decisions, verdict, applied transforms, checks and quality."""
    a = member.alignment
    return {
        "model": index,
        "decisions": [d.to_dict() for d in a.decisions],
        "shares_basis": a.shares_basis,
        "verdict": a.verdict,
        "model_fidelity": a.model_fidelity,
        "summary": alignment_summary(a.decisions),
        "applied_transform": {
            # the tensors go to raot_transform.safetensors (raot_hf.symmetry.load_transform reads it)
            "file": transform_file(index) if len(a.applied) else None,
            "transforms": [t.describe() for t in a.applied.transforms],
        },
        "applied_exact": a.exact,
        "checks": [c.to_dict() for c in member.checks],
        "quality": quality,
        "calibration": member.fingerprint,
    }


def build_report(
    members: list, sources: list[ModelSource], merge_log: RuleLog | None, quality: list[dict | None],
    reference_log: dict | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The report of a merge of the reference and its aligned ``members`` (:class:`~raot_hf.stages.members.Member`)."""
    ctx = members[0].ctx
    records = [alignment_record(i, m, q) for i, (m, q) in enumerate(zip(members, quality, strict=True), start=2)]
    return report_of(
        ctx.schema, ctx.config, _inputs(ctx, sources, members), records, merge_log,
        execution=execution(ctx), timings=dict(ctx.timer.times), estimator_logs=members[0].alignment.logs,
        reference_log=reference_log,
    )  # fmt: skip


def report_of(
    schema, config, inputs: dict, records: list[dict], merge_log: RuleLog | None, *, execution: str,
    timings: dict[str, float], estimator_logs: dict | None = None, reference_log: dict | None = None,
    verdict: str = "", summary: str = "", model_type: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The report dict (docs/design.md §6.4). ``records``: one :func:`alignment_record` per aligned model
    (none for checkpoints merged as stored: ``verdict`` and ``summary`` say so); with more than one,
    ``models`` lists each and the top-level sections gather all. ``schema`` is None for a model type
    without an adapter (merged as stored), named by ``model_type``."""
    first = records[0] if records else {
        "calibration": None, "decisions": [], "shares_basis": False, "verdict": verdict, "model_fidelity": {},
        "summary": summary, "applied_transform": {"file": None, "transforms": []}, "applied_exact": True,
        "quality": None, "checks": [],
    }  # fmt: skip
    report = {
        "raot_hf_version": __version__,
        "inputs": inputs,
        "model_type": schema.model_type if schema is not None else model_type,
        "norm": schema.norm if schema is not None else None,
        "residual_exact_group": schema.residual.exact if schema is not None else None,
        "settings": config.to_dict(),
        "calibration": first["calibration"],
        "decisions": first["decisions"],
        "shares_basis": first["shares_basis"],
        "verdict": first["verdict"],
        "model_fidelity": first["model_fidelity"],
        "summary": first["summary"],
        "applied_transform": {k: first["applied_transform"][k] for k in ("file", "transforms")},
        "applied_exact": first["applied_exact"],
        "merge": merge_log.to_dict() if merge_log is not None else None,
        "execution": execution,
        "quality": first["quality"],
        "estimator_logs": estimator_logs or {},
        "checks": first["checks"],
        "timings": timings,
        "versions": versions(),
    }
    if len(records) > 1:
        report.update(
            models=records,
            reference=reference_log or {"rule": "first", "chosen": 1},
            decisions=[{**d, "model": r["model"]} for r in records for d in r["decisions"]],
            checks=[{**c, "name": f"model {r['model']}: {c['name']}"} for r in records for c in r["checks"]],
            verdict=" ".join(f"Model {r['model']}: {r['verdict']}" for r in records if r["verdict"]),
            summary="; ".join(f"model {r['model']}: {r['summary']}" for r in records),
            shares_basis=all(r["shares_basis"] for r in records),
            applied_exact=all(r["applied_exact"] for r in records),
            applied_transform={
                "files": [r["applied_transform"]["file"] for r in records if r["applied_transform"]["file"]]
            },
        )
    return report


def execution(ctx) -> str:
    """How the merge of the pair ``ctx`` ran: "layer-wise" (models offloaded to working files, §7.4) or "in memory"."""
    return "layer-wise" if ctx.working_files.of(ctx.model_a) is not None else "in memory"


def versions() -> dict[str, str]:
    """The versions of torch, transformers and Python a report records."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
