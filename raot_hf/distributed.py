"""Data-parallel calibration (docs/design.md §7): each process runs its shard of the calibration
set; statistics are sums, so one all-reduce makes every process hold the full-data totals.

The process group comes from :class:`accelerate.PartialState` (``accelerate launch``, ``WORLD_SIZE``
or an initialised ``torch.distributed``). Shards never pad or duplicate examples, so the result
equals a single-process run up to float summation order; the main process alone solves, gates,
merges and writes (:func:`follow_main`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("raot_hf.distributed")

#: Tensors up to this many elements are summed together in one flat buffer (fewer collectives).
_BUCKET_ELEMENTS = 1 << 20


@dataclass
class DistributedContext:
    """Rank, world size, the device of this process's forward passes, and the collectives
    the merger needs. ``device`` is the accelerator that ``accelerate`` assigns this process
    (``cuda:<local rank>`` under ``--multi_gpu``) or the CPU."""

    rank: int = 0
    world_size: int = 1
    state: object | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_processes: bool = False  # whether detect() created the process group (then close() ends it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def detect(cls) -> DistributedContext:
        """The current process group, or a single-process context on the CPU."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not (
            torch.distributed.is_available() and torch.distributed.is_initialized()
        ):
            return cls()
        from accelerate import PartialState

        existed = torch.distributed.is_available() and torch.distributed.is_initialized()
        state = PartialState()
        rank, world = state.process_index, state.num_processes
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # a process group initialised by the caller (e.g. accelerate's debug launcher) is authoritative
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        device = torch.device(state.device) if state.device is not None else torch.device("cpu")
        if world > 1:
            logger.info("distributed calibration: process %d of %d on %s", rank, world, device)
        return cls(rank, world, state, device, owns_processes=not existed)

    def _collective_device(self) -> torch.device:
        import torch.distributed as dist

        backend = str(dist.get_backend()).lower()
        if "nccl" in backend and torch.cuda.is_available():
            return self.device if self.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce_statistics(self, stats) -> None:
        """Sum every statistic (and the example count) across processes, in place, in float64:
        small tensors in flat buckets, the large cross moments one by one."""
        if not self.is_distributed:
            return
        import torch.distributed as dist

        device = self._collective_device()
        examples = torch.tensor(float(stats.examples), dtype=torch.float64)
        # co-moments are centered at each process's own means: they travel as raw float64 sums
        # (this process's C + ΣaΣbᵀ/n) and are re-centered at the global means after the sum
        moments = stats.moments()
        local = [(m.xsum_a.clone(), m.xsum_b.clone(), m.n_cross.clone()) for m in moments]
        centered = {id(m.comoment) for m in moments}
        tensors = [t for t in (*stats.tensors(), examples) if id(t) not in centered]
        small = [t for t in tensors if t.numel() <= _BUCKET_ELEMENTS]
        large = [t for t in tensors if t.numel() > _BUCKET_ELEMENTS]
        for start in range(0, len(small), 4096):
            bucket = small[start : start + 4096]
            flat = torch.cat([t.reshape(-1).to(device, torch.float64) for t in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for t in bucket:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view(t.shape))
                offset += n
        for t in large:
            buf = t.to(device)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            if buf is not t:
                t.copy_(buf)
        for m, (xa, xb, n) in zip(moments, local, strict=True):
            raw = torch.outer(xa, xb).div_(n.clamp_min(1)).add_(m.comoment.to(torch.float64)).to(device)
            dist.all_reduce(raw, op=dist.ReduceOp.SUM)
            raw = raw.to(m.comoment.device).sub_(torch.outer(m.xsum_a, m.xsum_b).div_(m.n_cross.clamp_min(1)))
            m.comoment.copy_(raw)
        stats.examples = round(float(examples))

    def broadcast_object(self, obj: Any) -> Any:
        """The main process's ``obj`` on every process (pickled; no-op in a single process)."""
        if not self.is_distributed:
            return obj
        import torch.distributed as dist

        buf = [obj if self.is_main else None]
        dist.broadcast_object_list(buf, src=0, device=self._collective_device())
        return buf[0]

    def barrier(self) -> None:
        """Wait for every process (no-op in a single process)."""
        if self.is_distributed:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        """End the process group if :meth:`detect` created it (call once, at the end of a run);
        a process group its caller set up is left to the caller."""
        if self.owns_processes and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self.owns_processes = False


def statistics_pass_needed(config, calibration: Any = None) -> bool:
    """Whether :meth:`RaotMerger.align` runs the calibration pass for ``config`` — the one step
    in which every process takes part (the plan's rule: :meth:`raot_hf.plan.MergePlan.statistics_pass`)."""
    from raot_hf.plan import plan_for

    return plan_for(config).statistics_pass(calibration, config.calibration.source)


def follow_main(merger, calibration: Any = None) -> None:
    """On a non-main process: take part in the main process's sharded statistics pass (fit shard
    and all-reduce, candidates by broadcast, held-out shard and all-reduce), then return."""
    if merger.dist.is_main:
        raise RuntimeError("follow_main is for non-main processes; the main process calls merge() or align()")
    if statistics_pass_needed(merger.config, calibration):
        merger.calibrate_and_solve(calibration)  # receives the main process's candidates, solves nothing
    logger.info("process %d: statistics shard contributed; the main process finishes the merge", merger.dist.rank)
