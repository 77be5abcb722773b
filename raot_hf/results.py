"""What a merge returns: the alignment (decisions, applied transforms, verdict) and the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raot_hf.gate import GateDecision
from raot_hf.gate.verdict import BasisVerdict, Verdict
from raot_hf.io.offload import WorkingFiles
from raot_hf.outputs.record import MergeReport
from raot_hf.symmetry import TransformSequence


@dataclass
class Alignment:
    """What the estimators proposed, what the gate decided and what was applied to B."""

    decisions: list[GateDecision]
    applied: TransformSequence
    exact: bool
    logs: dict[str, Any] = field(default_factory=dict)
    # do A and B share a basis, with the evidence (docs/design.md §5); None: no alignment was asked for
    basis_verdict: BasisVerdict | None = None
    model_fidelity: dict[str, Any] = field(default_factory=dict)  # the model-level check's numbers

    @property
    def verdict(self) -> str:
        """The basis verdict's one line ("" without one)."""
        return "" if self.basis_verdict is None else self.basis_verdict.text

    @property
    def verdict_code(self) -> Verdict | None:
        """The basis verdict's code (None without one)."""
        return None if self.basis_verdict is None else self.basis_verdict.code

    @property
    def shares_basis(self) -> bool:
        """True when the gate rejected every transform (the pair already shares a basis); False when
        nothing could be tested (then there is no verdict, only the identity by default)."""
        if not self.decisions or any(d.applied for d in self.decisions):
            return False
        return not all(d.untested for d in self.decisions)

    def table(self) -> str:
        from raot_hf.outputs.card import gate_table_text

        return gate_table_text(self.decisions)


@dataclass
class MergeResult:
    """The merged model, the alignment behind it and the provenance report."""

    model: torch.nn.Module
    report: MergeReport
    alignment: Alignment
    preprocessor: Any = None
    source_a: str | None = None
    #: With more than two models: the alignments of models 3, 4, … by the file each is written to
    #: (model 2's is ``alignment``'s, in ``raot_transform.safetensors``).
    more_transforms: dict[str, TransformSequence] = field(default_factory=dict)
    #: The working files behind the model's parameters when it was merged layer by layer (docs/design.md
    #: §7.4): the writer drops each weight's pages once written. Empty (or None) in memory.
    working_files: WorkingFiles | None = None

    def save_pretrained(self, out_dir: str | Path, *, overwrite: bool = False, max_shard_size: str = "2GB") -> Path:
        """Write a directory ``from_pretrained`` loads, with model card and ``raot_report.json``."""
        from raot_hf.outputs import model_card_context, write_merged_repo

        return write_merged_repo(
            out_dir,
            self.model,
            preprocessor_source=self.preprocessor if self.preprocessor is not None else self.source_a,
            report=self.report,
            card=model_card_context(self.report),
            overwrite=overwrite,
            max_shard_size=max_shard_size,
            transform=self.alignment.applied,
            more_transforms=self.more_transforms,
            working_files=self.working_files,
        )

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
