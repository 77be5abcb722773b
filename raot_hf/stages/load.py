"""Stage: load — configs and tokenizers checked before any weights are read, then A, B (and the base).

Every refusal here is one line naming the problem and the fix, raised before heavy work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raot_hf.io.loading import (
    ModelSource,
    check_base_compatible,
    check_base_tokenizer,
    check_compatible,
    check_tokenizers,
    load_base_model,
    load_config,
    load_model,
    load_preprocessor,
)
from raot_hf.io.offload import WorkingFiles
from raot_hf.merging import base_relative_rules, merge_rule_spec
from raot_hf.merging.siblings import base_state_for, check_base_use, check_task_norms
from raot_hf.outputs.shards import parse_size
from raot_hf.plan import plan_for
from raot_hf.stages.calibrate import check_calibration_early
from raot_hf.stages.context import BaseModel, StageTimer
from raot_hf.stages.offload import check_parking_room, choose_offload, load_layerwise
from raot_hf.symmetry import model_state

logger = logging.getLogger("raot_hf.stages.load")


def check_base_matches_rule(config, has_base: bool) -> None:
    """A base-relative rule needs a base, and a base needs a base-relative rule."""
    needs_base = merge_rule_spec(config.merge_rule).needs_base
    check_base_use(config.merge_rule, needs_base, has_base, base_relative_rules())


@dataclass
class LoadedPair:
    """What :func:`load_pair` read: models, A's preprocessor, sources, the base (if any), the early
    calibration sample, load time and the models' working files (empty when in memory)."""

    model_a: torch.nn.Module
    model_b: torch.nn.Module
    preprocessor: Any
    sources: tuple[ModelSource, ...]
    more_models: tuple[torch.nn.Module, ...] = ()
    base_model: torch.nn.Module | None = None
    source_base: ModelSource | None = None
    base_missing: tuple[str, ...] = ()
    early_calibration: Any = None
    times: dict[str, float] = field(default_factory=dict)
    working_files: WorkingFiles = field(default_factory=WorkingFiles)


def _label(i: int) -> str:
    return "AB"[i] if i < 2 else f"model {i + 1}"


def check_before_weights(
    config, sources, src_base, memory: dict | None = None, *, adapter: bool = True, early: bool = True,
    vocabulary: bool = True, layers: bool = True,
):  # fmt: skip
    """The input checks every execution mode runs before any weights are read: configs, shapes,
    tokenizers, the memory the merge needs (``memory``: the ``offload`` and ``max_memory`` options;
    its "layerwise" entry is set to whether the models will be offloaded) and (``early``) the
    calibration sample. ``adapter``: refuse a model type without an adapter; ``vocabulary`` and
    ``layers``: compare the vocabularies and layer counts (a merge file's tokenizer and slices
    take models that differ in them)."""
    configs = [load_config(src, _label(i), adapter) for i, src in enumerate(sources)]
    ignore = (() if vocabulary else ("vocab_size",)) + (() if layers else ("num_hidden_layers", "layer_types"))
    for cfg in configs[1:]:
        check_compatible(configs[0], cfg, head_policy=config.head, ignore=ignore)
    if memory is not None:
        cap = parse_size(memory["max_memory"]) if memory["max_memory"] is not None else None
        per_layer = config.alignment == "activation"  # its layers are solved as the pass completes them
        memory["layerwise"] = choose_offload(memory["offload"], sources, configs[0], config.dtype, cap, per_layer)
    cfg_base = load_config(src_base, "base", adapter) if src_base else None
    if cfg_base is not None:
        check_base_compatible(configs[0], cfg_base, ignore=ignore)
    pre_a = load_preprocessor(sources[0])
    if vocabulary:
        for src in sources[1:]:
            check_tokenizers(pre_a, load_preprocessor(src))
        if src_base is not None:
            check_base_tokenizer(pre_a, load_preprocessor(src_base))
    sample = None
    if early and plan_for(config).needs_data and config.calibration.source is not None and pre_a is not None:
        sample = check_calibration_early(config.calibration, pre_a)
    return (configs, cfg_base), pre_a, sample


def model_sources(
    models, base=None, revision=None, revision_b=None, base_revision=None, access: tuple = ()
) -> tuple[list[ModelSource], ModelSource | None]:
    """The sources of ``models`` (the first at ``revision``, the others at ``revision_b`` or else
    ``revision``) and of the base; ``access``: (token, trust_remote_code, allow_pickle)."""
    revisions = [revision] + [revision_b or revision] * (len(models) - 1)
    sources = [ModelSource(str(m), r, *access) for m, r in zip(models, revisions)]
    return sources, (ModelSource(str(base), base_revision, *access) if base else None)


def load_pair(
    a: str | Path, b: str | Path, config, *more: str | Path, revision: str | None = None, revision_b: str | None = None,
    token: str | bool | None = None, trust_remote_code: bool = False, allow_pickle: bool = False,
    base: str | Path | None = None, base_revision: str | None = None, offload: str | bool = "auto",
    offload_dir: str | Path | None = None, max_memory: str | int | None = None,
) -> LoadedPair:  # fmt: skip
    """Load A and B (and ``more`` models: every one after A takes ``revision_b``, else
    ``revision``) from Hub ids or local directories, and the base, after every cheap check.
    ``offload`` ("auto", "always", "never"), ``offload_dir`` and ``max_memory``: whether the models
    are offloaded into working files and run layer by layer (:mod:`raot_hf.stages.offload`)."""
    check_base_matches_rule(config, base is not None)
    access = (token, trust_remote_code, allow_pickle)
    sources, src_base = model_sources([a, b, *more], base, revision, revision_b, base_revision, access)
    timer = StageTimer()
    with timer.stage("load"):
        memory = {"offload": offload, "max_memory": max_memory}
        (configs, cfg_base), pre_a, early = check_before_weights(config, sources, src_base, memory)
        names = ", ".join(f"{_label(i)} ({s.name_or_path})" for i, s in enumerate(sources))
        logger.info("loading %s", names, extra={"stage": True})  # a line the CLI shows by default
        models, files = [], WorkingFiles()
        for i, (src, cfg) in enumerate(zip(sources, configs, strict=True)):
            if memory["layerwise"]:  # each model goes to its working file before the next is read
                models.append(load_layerwise(src, _label(i), cfg, config.dtype, offload_dir, files))
            else:
                models.append(load_model(src, _label(i), dtype=config.dtype, config=cfg))
        if memory["layerwise"]:
            check_parking_room(models[0], files)
        base_model, missing = (
            load_base_model(src_base, configs[0], dtype=config.dtype, config=cfg_base) if src_base else (None, ())
        )
    return LoadedPair(
        models[0], models[1], pre_a, tuple(sources), tuple(models[2:]), base_model, src_base, tuple(missing),
        early, timer.times, files,
    )  # fmt: skip


def base_for(model_a, model_b, schema, base_model, source: ModelSource | None, missing) -> BaseModel | None:
    """The base's trunk under A's names, and A's and B's distances from it (docs/design.md §6.6)."""
    if base_model is None:
        return None
    check_base_compatible(model_a.config, base_model.config)
    head = set(schema.head_params)
    trunk = [name for name in model_state(model_a) if name not in head]
    prefix = getattr(model_a, "base_model_prefix", "") or ""
    state = base_state_for(trunk, base_model.eval(), list(missing), prefix)
    source = source or ModelSource(getattr(base_model, "name_or_path", "") or "base")
    task_norms = check_task_norms(state, model_state(model_a), model_state(model_b))
    return BaseModel(base_model, state, sorted(set(trunk) - set(state)), task_norms, source)
