"""The provenance report of a merge as typed records (``raot_report.json``, docs/design.md §6.4).

A :class:`MergeReport` is built once, when the merge is done, from the stages' own records (gate
decisions, checks, the rule's log, the refit's record) and never changed after: the writer puts
its JSON form (:meth:`MergeReport.to_dict`) into the output. It reads as that JSON form too
(``report["verdict"]``), and :meth:`MergeReport.from_dict` reads any report this project wrote,
including those of earlier versions (``inputs.a`` / ``inputs.b`` rather than ``models``).
"""

from __future__ import annotations

import platform
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from raot_hf.config import RaotConfig
from raot_hf.gate import GateDecision
from raot_hf.merging import RuleLog
from raot_hf.outputs.report import Check
from raot_hf.version import __version__


def versions() -> dict[str, str]:
    """The versions of torch, transformers and Python a report records."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


@dataclass(frozen=True)
class CheckpointRecord:
    """One input checkpoint: where it came from (``id``, ``revision``, ``local``), its commit and
    class, and the SHA-256 of its local files (None for a Hub id)."""

    id: str
    revision: str | None = None
    local: bool = False
    commit: str | None = None
    architecture: str | None = None
    files: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "revision": self.revision, "local": self.local, "commit": self.commit,
               "architecture": self.architecture}  # fmt: skip
        return {**out, "files": self.files} if self.files is not None else out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointRecord:
        return cls(**{f.name: data.get(f.name, f.default) for f in fields(cls)})


@dataclass(frozen=True)
class AlignmentRecord:
    """How one model was aligned to the reference: the gate's decisions, the basis verdict, what was
    applied (described; the tensors go to ``transform_file``), the functional checks, the label-free
    quality of the merge against it, and the calibration data's fingerprint."""

    decisions: tuple[GateDecision, ...]
    shares_basis: bool
    verdict: str
    summary: str
    transform_file: str | None
    transforms: tuple[dict[str, Any], ...]
    exact: bool
    checks: tuple[Check, ...]
    model_fidelity: dict[str, Any] = field(default_factory=dict)
    quality: dict[str, Any] | None = None
    calibration: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "decisions": [d.to_dict() for d in self.decisions],
            "shares_basis": self.shares_basis,
            "verdict": self.verdict,
            "model_fidelity": self.model_fidelity,
            "summary": self.summary,
            "applied_transform": {"file": self.transform_file, "transforms": list(self.transforms)},
            "applied_exact": self.exact,
            "checks": [c.to_dict() for c in self.checks],
            "quality": self.quality,
            "calibration": self.calibration,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AlignmentRecord:
        applied = data.get("applied_transform") or {}
        decisions = tuple(
            GateDecision(**{k: v for k, v in d.items() if k != "model"}) for d in data.get("decisions", [])
        )
        return cls(
            decisions, bool(data.get("shares_basis")), data.get("verdict") or "", data.get("summary") or "",
            applied.get("file"), tuple(applied.get("transforms", ())), bool(data.get("applied_exact", True)),
            tuple(Check.from_dict(c) for c in data.get("checks", [])), dict(data.get("model_fidelity") or {}),
            data.get("quality"), data.get("calibration"),
        )  # fmt: skip


@dataclass(frozen=True)
class ModelRecord:
    """One model of the merge, numbered from 1 in merge order: the reference (model 1), a model
    aligned to it (with its :class:`AlignmentRecord`), or one merged as stored."""

    index: int
    role: str  # "reference" | "aligned" | "merged"
    checkpoint: CheckpointRecord
    alignment: AlignmentRecord | None = None

    def to_dict(self) -> dict[str, Any]:
        alignment = self.alignment.to_dict() if self.alignment is not None else None
        return {"model": self.index, "role": self.role, **self.checkpoint.to_dict(), "alignment": alignment}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelRecord:
        alignment = data.get("alignment")
        return cls(
            int(data["model"]), data.get("role", "merged"), CheckpointRecord.from_dict(data),
            AlignmentRecord.from_dict(alignment) if alignment else None,
        )  # fmt: skip


@dataclass(frozen=True)
class BaseRecord:
    """The base the models' task vectors are measured from (docs/design.md §6.6): its checkpoint, each
    model's median relative distance from it, and the trunk parameters it lacks."""

    checkpoint: CheckpointRecord
    relative_task_norms: list[float] | None = None
    trunk_params_not_in_base: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**self.checkpoint.to_dict(), "relative_task_norms": self.relative_task_norms,
                "trunk_params_not_in_base": list(self.trunk_params_not_in_base)}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BaseRecord:
        missing = list(data.get("trunk_params_not_in_base") or [])
        return cls(CheckpointRecord.from_dict(data), data.get("relative_task_norms"), missing)


@dataclass(frozen=True)
class RefitRecord:
    """What the refit of the merged model did (docs/design.md §6.11): whether it ran and was kept, and
    why; when it ran, its target, steps, the examples it read, the held-out losses before and after
    and the paired test's gain, its curve and its budget's plan."""

    ran: bool
    kept: bool
    reason: str
    mode: str
    decision: str | None = None
    target: str | None = None
    targets_from: str | None = None
    teacher: str | None = None  # the output target's only
    steps: int = 0
    best_step: int = 0
    parameters: int = 0
    values: int = 0
    examples: int = 0
    stop_examples: int = 0
    heldout_examples: int = 0
    heldout_loss_before: float | None = None
    heldout_loss_after: float | None = None
    heldout_gain: float | None = None
    heldout_stderr: float | None = None
    curve: tuple[dict[str, Any], ...] = ()
    budget: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        if not self.ran:
            return {"ran": False, "kept": self.kept, "reason": self.reason, "mode": self.mode}
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["curve"] = list(self.curve)
        if self.target != "output":
            del out["teacher"]
        if self.budget is None:
            del out["budget"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RefitRecord:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["curve"] = tuple(values.get("curve") or ())
        return cls(**values)


@dataclass(frozen=True)
class TowersRecord:
    """A two-tower merge's own part (docs/design.md §11): the model (``name``), the joint map's
    gate decision and exact group, each tower's report by modality, the merged scalars and the
    image–text retrieval on the held-out pairs (``zero_shot``: None without paired data)."""

    name: str
    joint: GateDecision | None
    exact_group: str
    towers: dict[str, MergeReport]
    scalars: dict[str, Any]
    zero_shot: dict[str, Any] | None
    calibration_pairs: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "dual_encoder": self.name,
            "joint": {"decision": self.joint.to_dict() if self.joint else None, "exact_group": self.exact_group},
            "towers": {m: r.to_dict() for m, r in self.towers.items()},
            "scalars": self.scalars,
            "zero_shot": self.zero_shot,
            "calibration_pairs": self.calibration_pairs,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TowersRecord:
        joint = (data.get("joint") or {}).get("decision")
        return cls(
            data["dual_encoder"], GateDecision(**joint) if joint else None,
            (data.get("joint") or {}).get("exact_group", ""),
            {m: MergeReport.from_dict(r) for m, r in (data.get("towers") or {}).items()},
            dict(data.get("scalars") or {}), data.get("zero_shot"), int(data.get("calibration_pairs") or 0),
        )  # fmt: skip


#: The verdict and summary of a merge with no aligned model (merged as stored).
AS_STORED = "no alignment requested: the checkpoints were merged as stored, tensor by tensor"


@dataclass(frozen=True)
class MergeReport(Mapping):
    """The provenance report: every model (``models``, the reference first), the base, the options
    (a :class:`RaotConfig`), how the merge ran, the rule's log, the refit's record, the estimators'
    logs, the stages' seconds and the versions. Reads as its JSON form (a read-only mapping)."""

    models: tuple[ModelRecord, ...]
    settings: RaotConfig
    execution: str
    merge: RuleLog | None = None
    model_type: str | None = None
    norm: str | None = None
    residual_exact_group: str | None = None
    base: BaseRecord | None = None
    reference: dict[str, Any] | None = None
    refit: RefitRecord | None = None
    estimator_logs: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    command: str | None = None
    merge_file: dict[str, Any] | None = None
    #: A two-tower model's joint map, towers, scalars and retrieval check (None for any other model).
    two_towers: TowersRecord | None = None
    #: What the report says when no model was aligned (a merge as stored, or stacked slices).
    unaligned_verdict: str = AS_STORED
    unaligned_summary: str = ""
    versions: dict[str, str] = field(default_factory=versions)
    raot_hf_version: str = __version__

    # -- the models' alignments, gathered ---------------------------------------------------------
    @property
    def alignments(self) -> list[tuple[int, AlignmentRecord]]:
        """(model index, record) of every aligned model, in order."""
        return [(m.index, m.alignment) for m in self.models if m.alignment is not None]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written to ``raot_report.json``: the records, then the alignment's sections
        at the top (those of model 2; with more aligned models, each decision and check names its
        model and the verdicts join)."""
        return dict(self._json)

    @cached_property
    def _json(self) -> dict[str, Any]:
        aligned = self.alignments
        out: dict[str, Any] = {
            "raot_hf_version": self.raot_hf_version,
            "models": [m.to_dict() for m in self.models],
            "base": self.base.to_dict() if self.base is not None else None,
            "model_type": self.model_type,
            "norm": self.norm,
            "residual_exact_group": self.residual_exact_group,
            "settings": self.settings.to_dict(),
            "execution": self.execution,
            "merge": self.merge.to_dict() if self.merge is not None else None,
            "refit": self.refit.to_dict() if self.refit is not None else None,
            "estimator_logs": self.estimator_logs,
            "timings": dict(self.timings),
            "versions": self.versions,
            "command": self.command,
            "merge_file": self.merge_file,
            "reference": self.reference,
        }
        if self.two_towers is not None:
            out.update(self.two_towers.to_dict())
        if not aligned:
            out.update(
                calibration=None, decisions=[], shares_basis=False, verdict=self.unaligned_verdict,
                model_fidelity={}, summary=self.unaligned_summary, applied_transform={"file": None, "transforms": []},
                applied_exact=True, quality=None, checks=[],
            )  # fmt: skip
            return out
        first = aligned[0][1].to_dict()
        out.update({k: first[k] for k in ("calibration", "model_fidelity", "quality")})
        if len(aligned) == 1:
            out.update({k: first[k] for k in ("decisions", "shares_basis", "verdict", "summary", "checks")})
            out.update(applied_transform=first["applied_transform"], applied_exact=first["applied_exact"])
            return out
        records = [(i, r.to_dict()) for i, r in aligned]
        out.update(
            decisions=[{**d, "model": i} for i, r in records for d in r["decisions"]],
            checks=[{**c, "name": f"model {i}: {c['name']}"} for i, r in records for c in r["checks"]],
            verdict=" ".join(f"Model {i}: {r['verdict']}" for i, r in records if r["verdict"]),
            summary="; ".join(f"model {i}: {r['summary']}" for i, r in records),
            shares_basis=all(r["shares_basis"] for _, r in records),
            applied_exact=all(r["applied_exact"] for _, r in records),
            applied_transform={"files": [r["applied_transform"]["file"] for _, r in records
                                         if r["applied_transform"]["file"]]},
        )  # fmt: skip
        return out

    # -- a read-only mapping over the JSON form -----------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self._json[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._json)

    def __len__(self) -> int:
        return len(self._json)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MergeReport:
        """A report from its JSON form, this version's or an earlier one's (``inputs.a`` / ``inputs.b``
        and, with more models, ``inputs.models`` beside the alignments in ``models``)."""
        if "inputs" in data:
            models, base = _earlier_models(data)
        else:
            models = tuple(ModelRecord.from_dict(m) for m in data["models"])
            base = BaseRecord.from_dict(data["base"]) if data.get("base") else None
        merge = data.get("merge")
        aligned = any(m.alignment is not None for m in models)
        verdict, summary = (AS_STORED, "") if aligned else (data.get("verdict") or AS_STORED, data.get("summary") or "")
        return cls(
            models, RaotConfig.from_dict(dict(data.get("settings") or {})), data.get("execution", "in memory"),
            RuleLog.from_dict(merge) if merge else None, data.get("model_type"), data.get("norm"),
            data.get("residual_exact_group"), base, data.get("reference"),
            RefitRecord.from_dict(data["refit"]) if data.get("refit") else None,
            dict(data.get("estimator_logs") or {}), dict(data.get("timings") or {}), data.get("command"),
            data.get("merge_file"), TowersRecord.from_dict(data) if data.get("dual_encoder") else None,
            verdict, summary,
            dict(data.get("versions") or {}), data.get("raot_hf_version", __version__),
        )  # fmt: skip


def _earlier_models(data: Mapping[str, Any]) -> tuple[tuple[ModelRecord, ...], BaseRecord | None]:
    """The models and base of a report written before ``models`` listed them (docs/design.md §6.4)."""
    inputs = data["inputs"]
    listed = inputs.get("models") or [{"model": 1, **inputs["a"]}, {"model": 2, **inputs["b"]}]
    if "models" in data and data["models"] and "decisions" in data["models"][0]:  # the alignments of N models
        by_index = {int(r["model"]): AlignmentRecord.from_dict(r) for r in data["models"]}
    elif data.get("decisions") is not None and data.get("execution") != "streamed":
        by_index = {2: AlignmentRecord.from_dict(data)}
    else:
        by_index = {}
    models = tuple(
        ModelRecord(int(m["model"]), m.get("role") or ("reference" if int(m["model"]) == 1 else "aligned"),
                    CheckpointRecord.from_dict(m), by_index.get(int(m["model"])))
        for m in listed
    )  # fmt: skip
    if not by_index:
        models = tuple(ModelRecord(m.index, "merged", m.checkpoint) for m in models)
    base = BaseRecord.from_dict(inputs["base"]) if inputs.get("base") else None
    return models, base
