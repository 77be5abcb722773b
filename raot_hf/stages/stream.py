"""Execution mode: a merge that reads no data, streamed from the checkpoints' files (docs/design.md §7.3).

With no alignment and a per-tensor rule each output tensor depends only on the same-named inputs,
so local safetensors checkpoints are read, merged (:func:`raot_hf.stages.combine.merge_by_chunks`)
and written a few tensors at a time, beside a meta-device skeleton: memory holds one chunk of every
model and one output shard, and the result is the in-memory merge's, bit for bit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from raot_hf.errors import RaotError
from raot_hf.io.checkpoint import Checkpoint, prefix_variants
from raot_hf.io.loading import LOAD_DTYPES
from raot_hf.merging import merge_heads, merge_rule_spec, rule_options
from raot_hf.merging.base_rules import median_ratio, task_norm_ratio
from raot_hf.merging.siblings import refuse_unrelated
from raot_hf.plan import plan_for
from raot_hf.stages.combine import chunks_of, merge_by_chunks
from raot_hf.stages.offload import RUNTIME_BYTES, local_safetensors

logger = logging.getLogger("raot_hf.stages.stream")
_STAGE = {"stage": True}


def stream_blocker(config, sources: list, base=None) -> str | None:
    """Why this merge cannot be streamed from the files (None: it can)."""
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
    not_local = (src for src in [*sources, *([base] if base is not None else [])] if local_safetensors(src) is None)
    return next((f"{src.name_or_path} is not a local safetensors checkpoint" for src in not_local), None)


class _ShardWriter:
    """Merged tensors into shards of at most ``max_bytes``, renamed and indexed at the end."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size, self.files, self.total = 0, [], 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.detach().contiguous()
        self.size += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        file = self.directory / f"part-{len(self.files):05d}.safetensors"
        safetensors.torch.save_file(self.pending, str(file), metadata={"format": "pt"})
        self.files.append((file, list(self.pending)))
        self.total += self.size
        self.pending, self.size = {}, 0

    def finish(self) -> set[str]:
        from raot_hf.outputs.shards import shard_name, write_index

        self.flush()
        weight_map = {}
        for i, (file, names) in enumerate(self.files, start=1):
            final = shard_name(i, len(self.files))
            file.rename(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        write_index(self.directory, weight_map, self.total)
        return set(weight_map)


class _Reading:
    """The checkpoints of one streamed merge, with the names checked against A's skeleton."""

    def __init__(self, sources, base_source, configs):
        from raot_hf.adapters import schema_for
        from raot_hf.io.loading import meta_model

        self.models = [Checkpoint(Path(s.name_or_path)) for s in sources]
        self.base = Checkpoint(Path(base_source.name_or_path)) if base_source is not None else None
        self.skeleton = meta_model(configs[0])  # A's model on the meta device: parameter names, no memory
        self.schema = schema_for(self.skeleton)
        names = set(self.skeleton.state_dict())
        self.keys = self.models[0].keys()
        renamed = [k for k in self.keys if k not in names]
        if renamed:
            raise _NotStreamable(f"checkpoint key {renamed[0]!r} is not a parameter name of the model")
        for i, m in enumerate(self.models[1:], start=2):
            if set(m.keys()) != set(self.keys):
                raise _NotStreamable(f"model {i} stores other tensors than model 1")
        self.head = set(self.schema.head_params) & set(self.keys)


class _NotStreamable(Exception):
    """The files cannot be merged name by name (the in-memory path runs instead)."""


class _BaseTensors(Mapping):
    """The base's tensors of the chunk being merged, under A's names (across A's ``base_model_prefix``);
    :meth:`read_chunk` reads a chunk of every model and the base and measures their distance (§6.6)."""

    def __init__(self, reading: _Reading, read, ratios: list[list[float]]):
        prefix = getattr(reading.skeleton, "base_model_prefix", "") or ""
        self.found = {}
        for name in reading.keys:
            if (key := next((c for c in prefix_variants(name, prefix) if c in reading.base.files), None)) is not None:
                self.found[name] = key
        self.reading, self.read, self.ratios, self.chunk = reading, read, ratios, {}

    def read_chunk(self, names: list[str]) -> list[dict[str, torch.Tensor]]:
        states = [{n: self.read(m, n) for n in names} for m in self.reading.models]
        self.chunk = {n: self.read(self.reading.base, self.found[n]) for n in names if n in self.found}
        for n, origin in self.chunk.items():
            for i, state in enumerate(states):
                if (r := task_norm_ratio(state[n], origin)) is not None:
                    self.ratios[i].append(r)
        return states

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.chunk[name]

    def __iter__(self):
        return iter(self.chunk)

    def __len__(self) -> int:
        return len(self.chunk)


def _merged_head(reading: _Reading, config, configs, names: list[str], read, weights) -> dict[str, torch.Tensor]:
    """The head's tensors by the policy: the reference's, or (``average``) the models' average."""
    if config.head != "average":
        return {n: read(reading.models[0], n) for n in names}
    states = [{n: read(m, n) for n in names} for m in reading.models]
    labels = [(c.num_labels, getattr(c, "id2label", None)) for c in configs]
    return merge_heads(states, names, weights, policy="average", labels=labels)


def merge_streamed(
    sources, config, out, *, base_source=None, overwrite: bool = False, max_shard_size="2GB", command: str | None = None
):
    """Merge the checkpoints ``sources`` (:class:`raot_hf.io.loading.ModelSource`, local safetensors)
    tensor by tensor into the directory ``out``; returns its path and the report. Raises
    :class:`_NotStreamable` (nothing written) when the files cannot be merged name by name."""
    from raot_hf.outputs import model_card_context
    from raot_hf.outputs.atomic import atomic_directory, check_destination
    from raot_hf.outputs.card import CARD_NAME, render_model_card
    from raot_hf.outputs.report import REPORT_NAME, report_to_json
    from raot_hf.outputs.save import save_config, save_preprocessor
    from raot_hf.outputs.shards import parse_size, verify_written_weights
    from raot_hf.stages.load import _check_before_weights
    from raot_hf.stages.members import model_weights

    started = time.perf_counter()
    max_bytes = parse_size(max_shard_size)
    destination = check_destination(out, overwrite)
    (configs, _), preprocessor, _ = _check_before_weights(config, sources, base_source)
    reading = _Reading(sources, base_source, configs)
    if config.dtype != "auto":  # the written config names the dtype the weights were cast to (meta: no memory)
        dtype = LOAD_DTYPES[config.dtype]
        reading.skeleton.to(dtype)
        reading.skeleton.config.dtype = dtype
    else:  # the dtype the in-memory path would load the models in: the config's
        dtype = getattr(configs[0], "dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    weights = model_weights(config, len(sources))
    logger.info("streaming the merge of %d checkpoints tensor by tensor (no calibration needed)", len(sources),
                extra=_STAGE)  # fmt: skip
    ratios: list[list[float]] = [[] for _ in sources]
    spec = merge_rule_spec(config.merge_rule)
    inputs = rule_options(spec, config, len(sources), names=reading.keys)

    def read(ckpt: Checkpoint, name: str) -> torch.Tensor:
        t = ckpt.get(name)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    def write(part: dict) -> None:
        for checkpoint in [*reading.models, *([reading.base] if reading.base is not None else [])]:
            checkpoint.release()
        for name, tensor in part.items():
            writer.add(name, tensor)

    def read_chunk(names: list[str]) -> list[dict[str, torch.Tensor]]:
        return [{n: read(m, n) for n in names} for m in reading.models]

    if spec.needs_base:
        inputs["base"] = base = _BaseTensors(reading, read, ratios)
        read_chunk = base.read_chunk
    sizes = {n: b for n, b in reading.models[0].nbytes.items() if n not in reading.head}
    with atomic_directory(destination) as temporary:
        save_preprocessor(preprocessor, temporary, False)
        save_config(reading.skeleton, temporary)
        writer = _ShardWriter(temporary, max_bytes)
        log = merge_by_chunks(spec, chunks_of(sizes), read_chunk, weights, inputs, write)
        if reading.head:
            write(_merged_head(reading, config, configs, sorted(reading.head), read, weights))
        verify_written_weights(temporary, writer.finish())
        if len(sources) > 2:
            log.settings["weights"] = weights
        medians = None
        if reading.base is not None:  # each model's median relative distance from the base (§6.6)
            medians = [median_ratio(r) for r in ratios]
            refuse_unrelated({f"model {i}": value for i, value in enumerate(medians, start=1)})
        report = streamed_report(sources, base_source, config, reading, log, medians, time.perf_counter() - started)
        if command:
            report["command"] = command
        card = render_model_card(model_card_context(report))
        (temporary / CARD_NAME).write_text(card, encoding="utf-8", newline="\n")
        (temporary / REPORT_NAME).write_text(report_to_json(report), encoding="utf-8", newline="\n")
    return destination, report


def streamed_report(sources, base_source, config, reading: _Reading, merge_log, medians, seconds) -> dict[str, Any]:
    """The provenance report of a streamed merge: no alignment, no calibration, every model listed."""
    from raot_hf.stages.provenance import inputs_of, report_of

    described = [inputs_of(s, reading.skeleton) for s in sources]  # each model's files hashed once
    inputs: dict[str, Any] = {"a": described[0], "b": described[1]}
    inputs["models"] = [{"model": i, **info} for i, info in enumerate(described, start=1)]
    if base_source is not None:
        inputs["base"] = {**inputs_of(base_source, reading.skeleton), "relative_task_norms": medians}
    return report_of(
        reading.schema, config, inputs, [], merge_log, execution="streamed", timings={"streamed merge": seconds},
        verdict="no alignment requested: the checkpoints were merged as stored, tensor by tensor",
        summary=f"{len(sources)} checkpoints merged by {config.merge_rule}, streamed from their files",
    )  # fmt: skip


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


def run_streamed(sources, base_source, config, out, *, stream=True, overwrite=False, max_shard_size="2GB",
                 max_memory=None, command=None):  # fmt: skip
    """The merge streamed from the files when it can be (and ``stream``): ``((path, report),
    shard_bytes)``, else ``(None, shard_bytes)`` (the reason logged). ``max_memory`` (bytes or a size
    string): too small is refused, streamed shards shrink to fit."""
    from raot_hf.outputs.shards import parse_size

    why = stream_blocker(config, sources, base_source) if stream else "--no-stream"
    shard = parse_size(max_shard_size)
    cap = parse_size(max_memory) if max_memory is not None else None
    if cap is not None and why is None:
        shard = shard_bytes_within(cap, sources, base_source, shard)
    if why is None:
        try:
            done = merge_streamed(sources, config, out, base_source=base_source, overwrite=overwrite,
                                  max_shard_size=shard, command=command)  # fmt: skip
            return done, shard
        except _NotStreamable as exc:
            why = str(exc)
    logger.info("merging in memory: %s", why)
    return None, shard
