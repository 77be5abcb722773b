"""The provenance record of a merge (``raot_report.json``, docs/design.md §6.4), built once from what
the stages returned (:class:`~raot_hf.outputs.record.MergeReport`)."""

from __future__ import annotations

from raot_hf.io.loading import ModelSource
from raot_hf.merging import RuleLog
from raot_hf.outputs import hash_checkpoint_files
from raot_hf.outputs.card import alignment_summary
from raot_hf.outputs.record import AlignmentRecord, BaseRecord, CheckpointRecord, MergeReport, ModelRecord, RefitRecord
from raot_hf.symmetry.io import TRANSFORM_NAME


def checkpoint_record(src: ModelSource, model) -> CheckpointRecord:
    """One input checkpoint as the report lists it: its source, commit, class and (local) file hashes."""
    files = hash_checkpoint_files(src.name_or_path) if src.is_local else None
    commit = getattr(model.config, "_commit_hash", None)
    return CheckpointRecord(str(src.name_or_path), src.revision, src.is_local, commit, type(model).__name__, files)


def base_record(src: ModelSource, model, task_norms, missing=()) -> BaseRecord:
    """The base of a base-relative merge: its checkpoint (the class its config names: it was loaded
    with A's), each model's median relative distance from it, the trunk parameters it lacks."""
    checkpoint = checkpoint_record(src, model)
    named = (getattr(model.config, "architectures", None) or [checkpoint.architecture])[0]
    checkpoint = CheckpointRecord(**{**checkpoint.__dict__, "architecture": named})
    return BaseRecord(checkpoint, task_norms, list(missing))


def transform_file(index: int) -> str:
    """The file of model ``index``'s alignment (model 2's keeps the two-model name)."""
    return TRANSFORM_NAME if index == 2 else TRANSFORM_NAME.replace(".safetensors", f".model{index}.safetensors")


def alignment_record(index: int, member, quality: dict | None) -> AlignmentRecord:
    """One aligned model's record: its gate decisions, verdict, applied transforms, checks and quality."""
    a = member.alignment
    return AlignmentRecord(
        tuple(a.decisions), a.shares_basis, a.verdict, alignment_summary(a.decisions),
        transform_file(index) if len(a.applied) else None, tuple(t.describe() for t in a.applied.transforms),
        a.exact, tuple(member.checks), dict(a.model_fidelity), quality, member.fingerprint,
    )  # fmt: skip


def build_report(
    members: list, sources: list[ModelSource], merge_log: RuleLog | None, quality: list[dict | None], *,
    reference_log: dict | None = None, refit: RefitRecord | None = None, command: str | None = None,
) -> MergeReport:  # fmt: skip
    """The report of a merge of the reference and its aligned ``members``
    (:class:`~raot_hf.stages.members.AlignedModel`), built once."""
    ctx = members[0].ctx
    models = [ctx.model_a, *(m.ctx.model_b for m in members)]
    alignments = [
        None,
        *(alignment_record(i, m, q) for i, (m, q) in enumerate(zip(members, quality, strict=True), start=2)),
    ]
    records = tuple(
        ModelRecord(i, "reference" if i == 1 else "aligned", checkpoint_record(src, model), alignment)
        for i, (src, model, alignment) in enumerate(zip(sources, models, alignments, strict=True), start=1)
    )
    base = None
    if ctx.base is not None:
        base = base_record(ctx.base.source, ctx.base.model, ctx.base.task_norms, ctx.base.missing)
    schema = ctx.schema
    return MergeReport(
        records, ctx.config, execution(ctx), merge_log, schema.model_type, schema.norm, schema.residual.exact,
        base=base, reference=(reference_log or {"rule": "first", "chosen": 1}) if len(members) > 1 else None,
        refit=refit, estimator_logs=members[0].alignment.logs, timings=dict(ctx.timer.times), command=command,
    )  # fmt: skip


def execution(ctx) -> str:
    """How the merge of the pair ``ctx`` ran: "layer-wise" (models offloaded to working files, §7.4) or "in memory"."""
    return "layer-wise" if ctx.working_files.of(ctx.model_a) is not None else "in memory"
