"""What every stage reads: the two models, their schema, the options, the process group, the clock.

The stages of a merge (docs/architecture.md) are plain functions of a :class:`PairContext` and
of what the previous stage returned; nothing is kept on the side.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.adapters.schema import ModelSchema
from raot_hf.config import RaotConfig
from raot_hf.distributed import DistributedContext
from raot_hf.io.offload import WorkingFiles
from raot_hf.plan import MergePlan, plan_for


class StageTimer:
    """Wall time per stage name (a stage entered twice adds up). Exclusive: a stage run inside
    another (the layer-by-layer calibration solves each layer as it completes) is counted under its
    own name only, so the stages' times add up to at most the merge's."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self._inner: list[float] = []  # per open stage, the time of the stages run inside it so far

    @contextmanager
    def stage(self, name: str):
        """Time the block under ``name``, less the stages timed inside it."""
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            inner = self._inner.pop()
            self.times[name] = self.times.get(name, 0.0) + elapsed - inner
            if self._inner:
                self._inner[-1] += elapsed


@dataclass
class BaseModel:
    """The checkpoint A and B were fine-tuned from (base-relative rules, docs/design.md §6.6):
    its trunk under A's names, A's trunk names it lacks, and A's and B's distances from it."""

    model: torch.nn.Module
    state: dict[str, torch.Tensor]
    missing: list[str]
    task_norms: dict[str, float]
    source: Any


@dataclass
class PairContext:
    """The pair being merged and everything the stages share."""

    model_a: torch.nn.Module
    model_b: torch.nn.Module
    schema: ModelSchema
    config: RaotConfig
    preprocessor: Any
    dist: DistributedContext
    timer: StageTimer = field(default_factory=StageTimer)
    base: BaseModel | None = None
    # A's and B's norm affines from before a fold (the apply stage records them; RegMean reads them)
    unfolded_norms: tuple[dict, dict] | None = None
    # the working files of the offloaded models (docs/design.md §7.4): every loop that reads
    # weights releases their pages through it; empty for an in-memory merge (releases do nothing)
    working_files: WorkingFiles = field(default_factory=WorkingFiles)

    # what this merge will do, decided once from the options
    plan: MergePlan = field(init=False)

    def __post_init__(self):
        self.plan = plan_for(self.config)

    @property
    def stats_device(self) -> torch.device:
        """Where the calibration statistics accumulate: this process's accelerator when the pass is
        sharded, else A's device."""
        return self.dist.device if self.dist.is_distributed else next(self.model_a.parameters()).device


def on_device_of(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``inputs`` moved to ``model``'s device."""
    device = next(model.parameters()).device
    return {k: v.to(device) for k, v in inputs.items()}


@contextmanager
def one_thread():
    """Run the solve on one intra-op thread: its many small operations (k×k correlations, batched h×h
    SVDs, scipy assignments) mostly wait for the slowest thread in parallel (docs/design.md §7.2)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
