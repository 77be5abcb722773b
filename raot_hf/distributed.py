"""Data-parallel calibration (DESIGN.md §7): each process runs its shard of the calibration
set; statistics are sums, so one all-reduce makes every process hold the full-data totals.

Under ``accelerate launch`` (or any launcher that sets ``WORLD_SIZE``) the context picks up
the process group through :class:`accelerate.PartialState`. Shards never pad or duplicate
examples (accelerate's ``even_batches`` padding would corrupt the sums), so the result equals a
single-process run up to float summation order.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger("raot_hf.distributed")


@dataclass
class DistributedContext:
    """Rank, world size and the collective ops the merger needs."""

    rank: int = 0
    world_size: int = 1
    state: object | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def detect(cls) -> DistributedContext:
        """The current process group, or a single-process context."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not (
            torch.distributed.is_available() and torch.distributed.is_initialized()
        ):
            return cls()
        from accelerate import PartialState

        state = PartialState()
        return cls(state.process_index, state.num_processes, state)

    def all_reduce_statistics(self, stats) -> None:
        """Sum every statistic across processes, in float64, on CPU (gloo) or the device."""
        import torch.distributed as dist

        backend = dist.get_backend()
        device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())

        def reduce_sum(t: torch.Tensor) -> torch.Tensor:
            buf = t.to(device)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            return buf.to(t.device)

        stats.examples = int(reduce_sum(torch.tensor(float(stats.examples), dtype=torch.float64)))
        stats.all_reduce(reduce_sum)

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
