"""Stage: how a merge runs — streamed from the files, in memory, or layer by layer — chosen once,
before any weights are read, for the Python API and the command line alike (docs/design.md §7.3, §7.4)."""

from __future__ import annotations

import logging
from pathlib import Path

from raot_hf.distributed import DistributedContext
from raot_hf.errors import RaotError
from raot_hf.io.checkpoint import Checkpoint
from raot_hf.io.loading import has_adapter, meta_model, no_adapter
from raot_hf.merging import merge_rule_spec
from raot_hf.outputs.shards import parse_size
from raot_hf.plan import ExecutionPlan, plan_for
from raot_hf.stages.offload import RUNTIME_BYTES, choose_offload, local_safetensors

logger = logging.getLogger("raot_hf.stages.execution")


def stream_blocker(config, sources: list, base=None, configs: list | None = None) -> str | None:
    """Why this merge cannot be streamed from the files (None: it can). ``configs``: the models'
    (read before any weights), to check that the files store the models' tensors under one set of
    names."""
    plan = plan_for(config)
    spec = merge_rule_spec(config.merge_rule)
    if plan.estimator is not None:
        return "an alignment reads the models' activations"
    if plan.needs_data or config.refine.steps or config.refit.requested:
        return "the rule, the correction or a refit reads calibration data"
    if not spec.per_tensor:
        return f"merge_rule={config.merge_rule!r} merges whole layers"
    if config.head == "b":
        return "--head b adopts B's head module"
    if DistributedContext.detect().is_distributed:
        return "under accelerate launch the merge runs in memory on the main process"
    not_local = (src for src in [*sources, *([base] if base is not None else [])] if local_safetensors(src) is None)
    why = next((f"{src.name_or_path} is not a local safetensors checkpoint" for src in not_local), None)
    if why is not None or configs is None:
        return why
    keys = [set(Checkpoint(Path(s.name_or_path)).keys()) for s in sources]
    different = next((i for i, k in enumerate(keys[1:], start=2) if k != keys[0]), None)
    if different is not None:
        return f"model {different} stores other tensors than model 1"
    if has_adapter(configs[0].model_type):  # an adapter's head policy reads the model's own names
        names = set(meta_model(configs[0]).state_dict())
        renamed = next((k for k in sorted(keys[0]) if k not in names), None)
        if renamed is not None:
            return f"checkpoint key {renamed!r} is not a parameter name of the model"
    return None


def _checkpoint_sizes(source) -> tuple[int, int]:
    """(total bytes, largest tensor's bytes) of a local safetensors checkpoint, from its headers."""
    sizes = Checkpoint(Path(source.name_or_path)).sizes()
    return sum(sizes), max(sizes, default=0)


def shard_bytes_within(cap: int, sources, base_source, max_shard_bytes: int) -> int:
    """The output shard size that keeps a streamed merge under ``cap`` bytes (one float64 tensor of
    every model and the base, the runtime and one shard); a cap it cannot keep is refused."""
    local = [*sources, *([base_source] if base_source else [])]
    if any(local_safetensors(s) is None for s in local):
        raise RaotError("--max-memory needs local safetensors checkpoints (their sizes are read from the files)")
    sizes = [_checkpoint_sizes(s) for s in local]
    gib = 2**30
    largest = max(biggest for _, biggest in sizes)
    # the rules' float64 temporaries of the largest tensor: about two float64 copies per model and
    # two more (TIES on three models and a base: ~3 GB for a 131 MB tensor)
    need = RUNTIME_BYTES + 4 * (len(local) + 2) * largest
    if cap < need + largest:
        minimum = (need + largest) / gib
        raise RaotError(
            f"--max-memory {cap / gib:.2f} GiB is below what one tensor of every model needs ({minimum:.2f} GiB with "
            "the runtime); raise it"
        )
    return max(largest, min(max_shard_bytes, int(cap - need)))


def plan_execution(
    config, sources: list, base_source, configs: list, *, stream: bool = True, offload="auto", max_memory=None,
    max_shard_size="2GB",
) -> ExecutionPlan:  # fmt: skip
    """Streamed when the merge reads no data and the checkpoints are local safetensors files (and
    ``stream``); else layer-wise when an in-memory merge would not fit (``offload``, ``max_memory``),
    else in memory. A model type without an adapter only streams: anything else is refused here."""
    shard = parse_size(max_shard_size)
    cap = parse_size(max_memory) if max_memory is not None else None
    why = stream_blocker(config, sources, base_source, configs) if stream else "--no-stream"
    if why is None:
        if cap is not None:
            shard = shard_bytes_within(cap, sources, base_source, shard)
        return ExecutionPlan("streamed", "", shard)
    for i, (source, cfg) in enumerate(zip(sources, configs, strict=True)):
        if not has_adapter(cfg.model_type):
            label = "AB"[i] if i < 2 else str(i + 1)
            if plan_for(config).estimator is not None:
                raise RaotError(no_adapter(label, source.name_or_path, cfg.model_type))
            raise RaotError(
                f"model {label} ({source.name_or_path}) has model type {cfg.model_type!r}, which raot_hf has no "
                f"adapter for: it merges only as stored, streamed from local safetensors files, and this merge cannot "
                f"stream ({why})"
            )
    logger.info("merging in memory: %s", why)
    per_layer = config.alignment == "activation"
    layerwise = choose_offload(offload, sources, configs[0], config.dtype, cap, per_layer)
    return ExecutionPlan("layer-wise" if layerwise else "in memory", why, shard)
