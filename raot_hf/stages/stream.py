"""Execution mode: a merge that reads no data, streamed from the checkpoints' files (docs/design.md §7.3).

With no alignment every output tensor is a function of input tensors found by name — the same name
in every model, or, for stacked slices, the same place in each source's layer range — so local
safetensors checkpoints are read, merged by the rule and written a few tensors at a time, beside a
meta-device skeleton of the output: memory holds one chunk of every model and one output shard,
and the result is the in-memory merge's, bit for bit. A :class:`PlainMerge` says what runs: the
checkpoints, the output's slices of their layers, and the rule's parameters at every level (the
command line's options, or a merge file's, :mod:`raot_hf.merging.mergefile`). Any ``transformers``
checkpoint merges this way, with or without an adapter: layers are found from the tensor names.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raot_hf.errors import RaotError
from raot_hf.io.checkpoint import Checkpoint, check_finite, prefix_variants
from raot_hf.io.loading import LOAD_DTYPES, ModelSource, has_adapter, load_preprocessor, meta_model
from raot_hf.merging import merge_heads, merge_rule_spec, rule_options
from raot_hf.merging.base_rules import median_ratio, task_norm_ratio
from raot_hf.merging.layered import count_layers, first_setting, layer_index, with_layer
from raot_hf.merging.log import RuleLog
from raot_hf.merging.siblings import refuse_unrelated
from raot_hf.outputs.record import AS_STORED, BaseRecord, MergeReport, ModelRecord
from raot_hf.stages.combine import CHUNK_BYTES, merge_by_chunks

logger = logging.getLogger("raot_hf.stages.stream")
_STAGE = {"stage": True}
#: Names of the layer count in a config, most common first.
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


@dataclass
class PlainSource:
    """One input of an output slice: a checkpoint (by index), its layers ``[start, end)`` (None:
    all of them) and the parameters given for it (rule keywords → settings)."""

    checkpoint: int
    layers: tuple[int, int] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class PlainSlice:
    """Output layers merged from ``sources`` layer for layer; ``base``: the checkpoint that is the
    task vectors' origin (or SLERP's first model), ``parameters``: the slice's own."""

    sources: list[PlainSource]
    base: int | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class PlainMerge:
    """A merge of checkpoints as stored: the rule, every checkpoint it reads (``labels`` name them
    in messages), the output's slices, the whole merge's parameters (rule keywords → settings:
    numbers, gradients or filters, :mod:`raot_hf.merging.layered`), the dtype the inputs are read in
    (None: the donor config's) and the one written (``out_dtype``), whose config and tokenizer the
    output takes (``donor``), the output vocabulary and chat template of a merge file, the head
    policy's parameters (``head``: the adapter's head parameters are merged by ``config.head``)
    and what the report records (``config``, ``document``)."""

    rule: str
    checkpoints: list[ModelSource]
    labels: list[str]
    slices: list[PlainSlice]
    parameters: dict[str, Any]
    config: Any
    dtype: str | None = None
    out_dtype: str | None = None
    donor: int = 0
    tokenizer: Any = None
    chat_template: str | None = None
    refs: dict[Any, int] = field(default_factory=dict)
    head: bool = False
    document: dict[str, Any] | None = None
    stacked: bool = False

    @property
    def base(self) -> int | None:
        """The whole merge's base checkpoint (its first slice's)."""
        return self.slices[0].base

    @classmethod
    def from_config(cls, config, sources: list[ModelSource], base: ModelSource | None) -> PlainMerge:
        """The merge the command line's options describe: whole models, one weight each."""
        from raot_hf.stages.members import model_weights

        spec = merge_rule_spec(config.merge_rule)
        weights = model_weights(config, len(sources))
        options = {k: v for k, v in rule_options(spec, config, len(sources)).items() if k != "densities"}
        densities = rule_options(spec, config, len(sources)).get("densities")
        merged = [
            PlainSource(i, None, {"weights": w, **({"densities": densities[i]} if densities else {})})
            for i, w in enumerate(weights)
        ]
        index = len(sources) if base is not None else None
        pieces = [PlainSlice([*merged, *([PlainSource(index)] if base is not None else [])], index)]
        labels = [("AB"[i] if i < 2 else f"model {i + 1}") for i in range(len(sources))]
        checkpoints = [*sources, *([base] if base is not None else [])]
        dtype = config.dtype if config.dtype != "auto" else None
        return cls(config.merge_rule, checkpoints, labels + ["base"] * (base is not None), pieces, options, config,
                   dtype=dtype, head=True)  # fmt: skip


def plain_merge_of(document, config, sources: dict) -> PlainMerge:
    """The merge a merge-file document (:class:`raot_hf.merging.mergefile.MergeDocument`) describes,
    merged as stored: ``config`` its RaotConfig (``raot:`` and the flags), ``sources`` each model
    reference's :class:`ModelSource`. mergekit's parameter names become the rule's keywords; a
    model's parameter given nowhere takes mergekit's default (the weight: 1/N)."""
    from raot_hf.merging.mergefile import rule_keywords

    spec = merge_rule_spec(document.method)
    refs = {ref: i for i, ref in enumerate(document.models())}
    global_ = {k: v for k, v in rule_options(spec, config, 2).items() if v is not None and k != "densities"}
    global_.update({keyword: default for keyword, default in spec.model_parameters.values() if default is not None})
    global_.update(rule_keywords(document.method, document.parameters))
    pieces = []
    for piece in document.slices:
        base = piece.base or document.base
        sources_ = [PlainSource(refs[s.model], s.layer_range, rule_keywords(document.method, s.parameters,
                                per_model_only=True)) for s in piece.sources]  # fmt: skip
        pieces.append(PlainSlice(sources_, refs[base] if base is not None else None,
                                 rule_keywords(document.method, piece.parameters)))  # fmt: skip
    first = next(s.model for s in document.slices[0].sources if s.model != document.base or
                 len(document.slices[0].sources) == 1)  # fmt: skip
    donor = refs[document.base] if document.base is not None else refs[first]
    labels = [str(ref) for ref in refs]
    return PlainMerge(
        document.method, [sources[ref] for ref in refs], labels, pieces, global_, config, dtype=document.dtype,
        out_dtype=document.out_dtype, donor=donor, tokenizer=document.tokenizer, chat_template=document.chat_template,
        refs=refs, document=document.data, stacked=document.stacks_layers,
    )  # fmt: skip


@dataclass
class _Recipe:
    """One output tensor: the (checkpoint, stored name) of each merged model in the rule's order,
    the base's (None: not stored there), the slice it belongs to and its place on a gradient."""

    name: str
    inputs: list[tuple[int, str]]
    base: tuple[int, str] | None
    slice: int
    position: float
    nbytes: int = 0


class _Reading:
    """The checkpoints of one plain merge, opened from their headers, with the donor's skeleton."""

    def __init__(self, job: PlainMerge, configs: list):
        self.job = job
        self.files = [Checkpoint(Path(s.name_or_path)) for s in job.checkpoints]
        self.configs = configs
        self.skeleton = meta_model(configs[job.donor])  # parameter names and order, no memory
        order = list(self.skeleton.state_dict())
        self.order = {name: i for i, name in enumerate(order)}
        self.first_layer = next((i for i, n in enumerate(order) if layer_index(n) is not None), len(order))
        self.prefix = getattr(self.skeleton, "base_model_prefix", "") or ""
        self.layers = [count_layers(f.keys()) for f in self.files]
        self.head: set[str] = set()
        if job.head and has_adapter(configs[job.donor].model_type):
            from raot_hf.adapters import schema_for

            self.head = set(schema_for(self.skeleton).head_params)
        self.embeddings = _embedding_names(self.skeleton)

    def find(self, checkpoint: int, name: str) -> str | None:
        """The stored name of tensor ``name`` in ``checkpoint`` (across the model's prefix), or None."""
        files = self.files[checkpoint].files
        return next((c for c in prefix_variants(name, self.prefix) if c in files), None)

    def read(self, checkpoint: int, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        tensor = self.files[checkpoint].get(name)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        check_finite(self.job.labels[checkpoint], name, tensor)
        return tensor

    def release(self) -> None:
        for checkpoint in self.files:
            checkpoint.release()


def _embedding_names(skeleton: torch.nn.Module) -> set[str]:
    """The parameter names of the input embedding and output head (rows indexed by token)."""
    found = set()
    by_id = {id(p): name for name, p in skeleton.named_parameters(remove_duplicate=False)}
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(skeleton, getter)()
        except (AttributeError, NotImplementedError):
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and id(weight) in by_id:
            found.add(by_id[id(weight)])
    return found


def _roles(job: PlainMerge, piece: PlainSlice) -> tuple[list[PlainSource], PlainSource | None]:
    """The slice's merged sources in the rule's order and its base source (the origin), from what
    ``base_model`` is to the rule (:class:`raot_hf.merging.MergeRuleSpec`'s ``base_role``)."""
    spec = merge_rule_spec(job.rule)
    role = "origin" if spec.needs_base else spec.base_role
    base = next((s for s in piece.sources if s.checkpoint == piece.base), None) if piece.base is not None else None
    if base is None or role == "model":
        return list(piece.sources), None
    others = [s for s in piece.sources if s is not base]
    return ([base, *others], None) if role == "first" else (others, base)


def _recipes(job: PlainMerge, reading: _Reading) -> tuple[list[_Recipe], list[tuple[int, int]]]:
    """Every output tensor, in order (tensors before the layers, the layers slice by slice, those
    after), and each output layer's (checkpoint, layer) of origin."""
    layer_recipes, origins, pre, post = [], [], [], []
    counter = 0
    for number, piece in enumerate(job.slices):
        merged, base = _roles(job, piece)
        sources = [*merged, *([base] if base is not None else [])]
        spans = {s.checkpoint: s.layers or (0, reading.layers[s.checkpoint]) for s in sources}
        lengths = {end - start for start, end in spans.values()}
        if len(lengths) != 1:
            counts = ", ".join(f"{job.labels[c]} {end - start}" for c, (start, end) in spans.items())
            raise RaotError(f"the models have different numbers of layers ({counts}); merge models of one shape, "
                            "or give layer ranges of equal length under slices:")  # fmt: skip
        for c, (_, end) in spans.items():
            if end > reading.layers[c]:
                raise RaotError(
                    f"layer_range ends at {end} but {job.labels[c]} has {reading.layers[c]} layers; fix the range"
                )
        (length,) = lengths
        lead = merged[0].checkpoint
        names = reading.files[lead].keys()
        for offset in range(length):
            at = spans[lead][0] + offset
            position = offset / (length - 1) if length > 1 else 1.0
            for name in (n for n in names if layer_index(n) == at):
                out = with_layer(name, counter)
                inputs = [_input(reading, job, s.checkpoint, with_layer(name, spans[s.checkpoint][0] + offset))
                          for s in merged]  # fmt: skip
                origin = None
                if base is not None:
                    stored = reading.find(base.checkpoint, with_layer(name, spans[base.checkpoint][0] + offset))
                    origin = (base.checkpoint, stored) if stored is not None else None
                layer_recipes.append(_Recipe(out, inputs, origin, number, position))
            origins.append((lead, at))
            counter += 1
        if number in (0, len(job.slices) - 1):
            for name in (n for n in names if layer_index(n) is None):
                before = reading.order.get(name, -1 if _looks_like_embedding(name) else len(reading.order))
                if (before < reading.first_layer) != (number == 0) and len(job.slices) > 1:
                    continue  # before the layers from the first slice, after them from the last
                inputs = [_input(reading, job, s.checkpoint, name) for s in merged]
                stored = reading.find(base.checkpoint, name) if base is not None else None
                recipe = _Recipe(name, inputs, (base.checkpoint, stored) if stored else None, number, 0.0)
                (pre if before < reading.first_layer else post).append(recipe)
    recipes = pre + layer_recipes + post
    for recipe in recipes:
        checkpoint, stored = recipe.inputs[0]
        recipe.nbytes = reading.files[checkpoint].nbytes[stored]
    return recipes, origins


def _looks_like_embedding(name: str) -> bool:
    return any(part in name for part in ("embed", "wte", "wpe"))


def _input(reading: _Reading, job: PlainMerge, checkpoint: int, name: str) -> tuple[int, str]:
    stored = reading.find(checkpoint, name)
    if stored is None:
        raise RaotError(f"{job.labels[checkpoint]} stores no tensor {name!r}; merge checkpoints of one architecture")
    return checkpoint, stored


def _evaluated(job: PlainMerge, recipe: _Recipe, merged: list[PlainSource]) -> tuple[list[float], dict[str, Any]]:
    """The weights and the rule's keywords for one output tensor: each read from the most specific
    level that gives it (the model's, the slice's, the whole merge's) at the tensor's name and place."""
    spec = merge_rule_spec(job.rule)
    piece = job.slices[recipe.slice]
    lists = {keyword for keyword, _ in spec.model_parameters.values()}
    options = {}
    for keyword in {*job.parameters, *piece.parameters} - lists - {"weights"}:
        value = first_setting([piece.parameters, job.parameters], keyword, recipe.name, recipe.position)
        if value is not None:
            options[keyword] = value
    defaults = dict(spec.model_parameters.values())
    weights, per_model = [], {}
    for source, (_, stored) in zip(merged, recipe.inputs, strict=True):
        levels = [source.parameters, piece.parameters, job.parameters]
        weight = first_setting(levels, "weights", stored, recipe.position)
        weights.append(1.0 / len(merged) if weight is None else float(weight))
        for keyword in lists - {"weights"}:
            per_model.setdefault(keyword, []).append(first_setting(levels, keyword, stored, recipe.position))
    for keyword, values in per_model.items():
        if any(v is not None for v in values):
            options[keyword] = [defaults[keyword] if v is None else v for v in values]
    return weights, options


def _output_config(job: PlainMerge, reading: _Reading, origins: list[tuple[int, int]], vocabulary, dtype):
    """The output's config: the donor's, with the stacked layer count (and every per-layer list
    following its layers), the new vocabulary's size and the dtype written."""
    config = copy.deepcopy(reading.configs[job.donor])
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = reading.layers[job.donor]
    if len(origins) != layers:
        key = next((k for k in _LAYER_COUNT_KEYS if getattr(text, k, None) == layers), None)
        if key is None:
            raise RaotError(f"{job.labels[job.donor]}'s config names no layer count equal to its {layers} layers; "
                            "slices cannot set the output's")  # fmt: skip
        for name, value in list(vars(text).items()):
            if isinstance(value, (list, tuple)) and len(value) == layers and not name.startswith("_"):
                per_source = [getattr(reading.configs[c].get_text_config(), name, value) for c, _ in origins]
                setattr(text, name, type(value)(v[i] for v, (_, i) in zip(per_source, origins, strict=True)))
        setattr(text, key, len(origins))
    if vocabulary is not None:
        text.vocab_size = vocabulary.size
    if dtype is not None:
        config.dtype = dtype
    return config


def merge_streamed(job: PlainMerge, configs: list, out, *, overwrite: bool = False, max_shard_size="2GB",
                   command: str | None = None, preprocessor=None) -> tuple[Path, MergeReport]:  # fmt: skip
    """Run ``job`` (local safetensors checkpoints, ``configs`` read and checked) tensor by tensor into
    the directory ``out``; returns its path and the report. ``preprocessor``: the donor's (loaded)."""
    from raot_hf.outputs import write_merged_repo

    started = time.perf_counter()
    reading = _Reading(job, configs)
    recipes, origins = _recipes(job, reading)
    vocabulary = _vocabulary(job, reading) if job.tokenizer is not None else None
    read_dtype = LOAD_DTYPES[job.dtype] if job.dtype else _config_dtype(configs[job.donor])
    out_dtype = LOAD_DTYPES[job.out_dtype] if job.out_dtype else None
    output = meta_model(_output_config(job, reading, origins, vocabulary, job.out_dtype or job.dtype))
    if job.out_dtype or job.dtype:
        output.to(out_dtype or read_dtype)
    tokenizer = vocabulary.tokenizer if vocabulary is not None else preprocessor
    if job.chat_template is not None:
        tokenizer = _with_chat_template(job, reading, tokenizer)
    logger.info("streaming the merge of %d checkpoints tensor by tensor (no calibration needed)",
                len(job.checkpoints), extra=_STAGE)  # fmt: skip
    ratios: dict[int, list[float]] = {}
    log = RuleLog(job.rule)
    spec = merge_rule_spec(job.rule)

    def merged_tensors():
        for call in _rule_calls(job, reading, recipes):
            yield from _merge_call(job, spec, reading, call, read_dtype, vocabulary, ratios, log)
            reading.release()

    def weights():
        for name, tensor in merged_tensors():
            yield name, (tensor.to(out_dtype) if out_dtype is not None and tensor.is_floating_point() else tensor)

    written: dict[str, Any] = {}

    def report() -> MergeReport:
        medians = None
        if job.base is not None and spec.needs_base:  # each model's median relative distance from the base (§6.6)
            medians = [median_ratio(ratios.get(c, [])) for c in sorted(ratios)]
            refuse_unrelated({job.labels[c]: median_ratio(r) for c, r in sorted(ratios.items())})
        written["report"] = plain_report(job, reading, log, medians, time.perf_counter() - started, command)
        return written["report"]

    path = write_merged_repo(out, output, preprocessor_source=tokenizer, report=report, weights=weights(),
                             overwrite=overwrite, max_shard_size=max_shard_size)  # fmt: skip
    return path, written["report"]


def _config_dtype(config) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None)
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _rule_calls(job: PlainMerge, reading: _Reading, recipes: list[_Recipe]):
    """The recipes in runs of about :data:`~raot_hf.stages.combine.CHUNK_BYTES` that one call of the
    rule merges: consecutive tensors with the same weights and settings, the head's alone, the
    base's stored ones apart from those it lacks. Yields ``(recipes, weights, options)``."""
    call, size, key = [], 0, None
    for recipe in recipes:
        merged, _ = _roles(job, job.slices[recipe.slice])
        weights, options = _evaluated(job, recipe, merged)
        this = (weights, options, recipe.name in reading.head, recipe.base is None)
        if call and (this[0] != key[0] or not _same(this[1], key[1]) or this[2:] != key[2:] or size >= CHUNK_BYTES):
            yield call, key[0], key[1]
            call, size = [], 0
        call.append(recipe)
        size += recipe.nbytes
        key = this
    if call:
        yield call, key[0], key[1]


def _merge_call(job, spec, reading: _Reading, call, dtype, vocabulary, ratios, log: RuleLog):
    """Read and merge one call of :func:`_rule_calls` (:func:`~raot_hf.stages.combine.merge_by_chunks`),
    yielding the merged tensors: each model's tensors cast to ``dtype`` and checked, embedding rows
    moved to the merge file's vocabulary, the base's distance from the models measured (§6.6)."""
    recipes, weights, options = call
    base: dict[str, torch.Tensor] = {}
    by_name = {r.name: r for r in recipes}

    def read(names: list[str]) -> list[dict[str, torch.Tensor]]:
        states: list[dict[str, torch.Tensor]] = []
        for name in names:
            recipe = by_name[name]
            tensors = {c: reading.read(c, stored, dtype) for c, stored in recipe.inputs}
            origin = reading.read(*recipe.base, dtype) if recipe.base is not None else None
            if vocabulary is not None and name in reading.embeddings:
                moved = vocabulary.moved({**tensors, **({recipe.base[0]: origin} if origin is not None else {})})
                tensors = {c: moved[c] for c in tensors}
                origin = moved[recipe.base[0]] if origin is not None else None
            if origin is not None:
                base[name] = origin
                if spec.needs_base:
                    for c, t in tensors.items():
                        if (r := task_norm_ratio(t, origin)) is not None:
                            ratios.setdefault(c, []).append(r)
            if not states:
                states = [{} for _ in tensors]
            for state, (c, _) in zip(states, recipe.inputs, strict=True):
                state[name] = tensors[c]
        return states

    names = list(by_name)
    out: dict[str, torch.Tensor] = {}
    if names[0] in reading.head:
        labels = [(reading.configs[c].num_labels, getattr(reading.configs[c], "id2label", None))
                  for c, _ in recipes[0].inputs]  # fmt: skip
        out.update(merge_heads(read(names), names, weights, policy=job.config.head, labels=labels))
    elif spec.needs_base and recipes[0].base is None:  # tensors the base does not store merge linearly, as the rules do
        logger.warning("%d tensor(s) are not in the base (first: %s): they merge linearly", len(names), names[0])
        log.add(merge_by_chunks(merge_rule_spec("linear"), [(names, weights, {})], read, out.update))
    else:
        inputs = {**options, **({"base": base} if spec.needs_base or recipes[0].base is not None else {})}
        log.add(merge_by_chunks(spec, [(names, weights, inputs)], read, out.update))
    yield from out.items()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def _vocabulary(job: PlainMerge, reading: _Reading):
    """The output vocabulary of the merge file's ``tokenizer:`` (:mod:`raot_hf.merging.vocab`)."""
    from raot_hf.merging.vocab import build_vocabulary

    tokenizers = {}
    for i, source in enumerate(job.checkpoints):
        tokenizer = load_preprocessor(source)
        if tokenizer is not None and hasattr(tokenizer, "get_vocab"):
            tokenizers[i] = tokenizer
    if job.donor not in tokenizers and (job.base is None or job.base not in tokenizers):
        raise RaotError(f"tokenizer: needs {job.labels[job.donor]}'s tokenizer, which it does not ship; add it")
    embedding = min(reading.embeddings, key=lambda n: reading.order.get(n, 0), default=None)
    if embedding is None:
        raise RaotError("tokenizer: the model has no input embedding to move into the new vocabulary")
    rows = {}
    for i in range(len(job.checkpoints)):
        stored = reading.find(i, embedding)
        header = reading.files[i]
        rows[i] = header.numel[stored] // _width(reading, stored) if stored is not None else 0
    order = sorted(range(len(job.checkpoints)), key=lambda i: (i != job.base, i))
    return build_vocabulary(job.tokenizer, tokenizers, rows, job.base, order, job.refs)


def _width(reading: _Reading, name: str) -> int:
    parameter = dict(reading.skeleton.named_parameters(remove_duplicate=False)).get(name)
    return int(parameter.shape[-1]) if parameter is not None else 1


def _with_chat_template(job: PlainMerge, reading: _Reading, tokenizer):
    """The output tokenizer with the merge file's ``chat_template`` (``auto``: the models' most common)."""
    from raot_hf.merging.vocab import chat_template_text

    if tokenizer is None:
        logger.warning("chat_template: the output has no tokenizer to carry it (the donor ships none)")
        return None
    loaded = [load_preprocessor(s) for s in job.checkpoints] if job.chat_template == "auto" else []
    template = chat_template_text(job.chat_template, [t for t in loaded if t is not None])
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def plain_report(
    job: PlainMerge, reading: _Reading, merge_log: RuleLog, medians, seconds: float, command: str | None = None
) -> MergeReport:
    """The provenance report of a plain merge: no alignment, no calibration, every model listed."""
    from raot_hf.stages.provenance import checkpoint_record

    base = job.base if merge_rule_spec(job.rule).needs_base else None
    merged = [i for i in range(len(job.checkpoints)) if i != base]
    models = tuple(
        ModelRecord(n, "merged", checkpoint_record(job.checkpoints[i], reading.skeleton))
        for n, i in enumerate(merged, start=1)
    )
    base_record = (
        BaseRecord(checkpoint_record(job.checkpoints[base], reading.skeleton), medians) if base is not None else None
    )
    verdict = AS_STORED
    if job.stacked:
        verdict = "alignment does not apply: passthrough and stacked slices copy layers as stored"
    schema = None
    if has_adapter(reading.configs[job.donor].model_type):
        from raot_hf.adapters import schema_for

        schema = schema_for(reading.skeleton)
    return MergeReport(
        models, job.config, "streamed", merge_log, reading.configs[job.donor].model_type,
        schema.norm if schema is not None else None, schema.residual.exact if schema is not None else None,
        base=base_record, timings={"streamed merge": seconds}, command=command, merge_file=job.document,
        unaligned_verdict=verdict,
        unaligned_summary=f"{len(merged)} checkpoints merged by {job.rule}, streamed from their files",
    )  # fmt: skip
