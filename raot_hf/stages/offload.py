"""Stage: choosing between the in-memory merge and the layer-wise one, before any weights are read
(docs/design.md §7.4).

An aligned merge holds about :data:`IN_MEMORY_FACTOR` × the checkpoints. When that would not fit
in ``--max-memory`` (else in the memory available), the models are *offloaded*
(:mod:`raot_hf.io.offload`): read tensor by tensor into disk-backed working files (or loaded whole,
then moved there), with about one layer of each resident. The statistics stay in memory: a cap
below what the layer-wise merge needs is refused in one line.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from raot_hf.errors import RaotError
from raot_hf.io.loading import load_model_checks
from raot_hf.io.offload import WorkingFiles, load_offloaded, offload_model
from raot_hf.memory import release_freed_memory

logger = logging.getLogger("raot_hf.stages.offload")

#: The interpreter with torch and transformers imported (about 370 MiB, benchmarks/perf/).
RUNTIME_BYTES = 400 * 2**20
#: An in-memory aligned merge peaks at about this many times the checkpoints (benchmarks/perf/).
IN_MEMORY_FACTOR = 3.5
#: Activations, temporaries and the gate's captured calls beside the statistics, per model byte of
#: the largest layer (a layer's weights touched, merged and transformed at once).
LAYER_FACTOR = 6
_GIB = 2**30
_CHOICES = ("auto", "always", "never")


def local_safetensors(source) -> Path | None:
    """The directory of ``source`` if it is a local safetensors checkpoint, else None."""
    from raot_hf.io.checkpoint import weight_files

    path = Path(source.name_or_path)
    return path if source.is_local and weight_files(path) else None


def _tensor_sizes(source, dtype: str = "auto") -> list[int] | None:
    """Every tensor's bytes of a local safetensors checkpoint in the merge's dtype, from the
    headers (None: not a local safetensors checkpoint)."""
    from raot_hf.io.checkpoint import Checkpoint
    from raot_hf.io.loading import LOAD_DTYPES

    path = local_safetensors(source)
    return None if path is None else Checkpoint(path).sizes(LOAD_DTYPES.get(dtype))


def checkpoint_bytes(source, dtype: str = "auto") -> int | None:
    """A local safetensors checkpoint's parameter bytes in the merge's dtype (None: not local)."""
    sizes = _tensor_sizes(source, dtype)
    return None if sizes is None else sum(sizes)


def largest_tensor_bytes(source, dtype: str = "auto") -> int:
    """A local safetensors checkpoint's largest tensor, in bytes in the merge's dtype."""
    return max(_tensor_sizes(source, dtype), default=0)


def statistics_bytes(hf_config, dtype: str = "auto", per_layer: bool = False) -> int:
    """The calibration statistics of one pair (fit moments: each layer's f × f MLP co-moment and
    d × d-sized attention and stream moments, in float32 — float64 for float64 models);
    ``per_layer``: one layer's co-moments at a time (the layer-by-layer pass solving each layer as
    it completes)."""
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    d = getattr(text, "hidden_size", None) or getattr(text, "n_embd", 0)
    f = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * d
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", 0)
    quad = 8 if dtype == "float64" else 4
    return int(((1 if per_layer else layers) * (f * f + 3 * d * d) + 4 * d * d) * quad)


def reads_tensorwise(source, hf_config) -> bool:
    """Whether a layer-wise merge reads ``source`` tensor by tensor into its working file (a local
    safetensors checkpoint storing the model's own parameter names), rather than loading it whole."""
    from raot_hf.io.checkpoint import Checkpoint
    from raot_hf.io.loading import meta_model
    from raot_hf.io.offload import checkpoint_keys

    path = local_safetensors(source)
    if path is None:
        return False
    model = meta_model(hf_config)
    names = [n for n, _ in model.named_parameters()]
    return checkpoint_keys(model, names, set(Checkpoint(path).keys())) is not None


def layerwise_bytes(
    sizes: list[int], hf_config, dtype: str = "auto", largest: int | None = None, per_layer: bool = True
) -> int:
    """What the layer-wise merge keeps resident: the runtime, the statistics (``per_layer``: solved
    and freed layer by layer), a few copies of one layer, and for loading two copies of the
    ``largest`` tensor (None: the largest model, loaded whole before it is offloaded)."""
    layers = getattr(getattr(hf_config, "get_text_config", lambda: hf_config)(), "num_hidden_layers", None) or 1
    layer = max(sizes) // max(layers, 1)
    loading = max(sizes) if largest is None else 2 * largest
    return RUNTIME_BYTES + loading + statistics_bytes(hf_config, dtype, per_layer) + LAYER_FACTOR * layer


def available_memory() -> int | None:
    """The memory the system can give this process now (Linux's MemAvailable; None elsewhere)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), None)


def choose_offload(
    offload, sources, hf_config, dtype: str = "auto", cap: int | None = None, per_layer: bool = True
) -> bool:
    """Whether the models are offloaded (``offload``: "auto", "always"/True or "never"/False); ``auto``:
    when the in-memory merge would exceed ``cap`` (bytes; None: the available memory). A cap the
    chosen path cannot keep is refused. ``per_layer``: the estimator solves each layer as it completes."""
    mode = {True: "always", False: "never", None: "auto"}.get(offload, offload)
    if mode not in _CHOICES:
        raise RaotError(f"offload must be one of {', '.join(_CHOICES)}, got {offload!r}")
    tensors = [_tensor_sizes(s, dtype) for s in sources]  # each checkpoint's headers read once
    known = None not in tensors
    sizes = [sum(t) for t in tensors] if known else []
    in_memory = RUNTIME_BYTES + IN_MEMORY_FACTOR * sum(sizes) if known else None
    layerwise = None
    if known:
        tensorwise = all(reads_tensorwise(s, hf_config) for s in sources)
        largest = max(max(t, default=0) for t in tensors) if tensorwise else None
        layerwise = layerwise_bytes(sizes, hf_config, dtype, largest, per_layer)
    if mode == "never":
        if cap is not None and known and cap < in_memory:
            raise RaotError(
                f"--max-memory {cap / _GIB:.1f} GiB is below what this merge needs in memory "
                f"({in_memory / _GIB:.1f} GiB: it loads every model); raise it, or drop --offload never"
            )
        return False
    if mode == "auto":
        limit = cap if cap is not None else available_memory()
        if not known or limit is None or in_memory <= limit:
            return False
    if cap is not None and known and cap < layerwise:
        raise RaotError(
            f"--max-memory {cap / _GIB:.2f} GiB is below what even a layer-wise merge needs ({layerwise / _GIB:.2f} "
            "GiB: the calibration statistics, a few layers and what loading the checkpoints takes); raise it"
        )
    if mode == "auto":
        why = f"--max-memory {cap / _GIB:.1f} GiB" if cap is not None else f"{limit / _GIB:.1f} GiB available"
        message = "an in-memory merge needs about %.1f GiB (%s): the models are offloaded and run layer by layer"
        logger.info(message, in_memory / _GIB, why, extra={"stage": True})
    return True


def offload_models(models, labels, schema, directory) -> WorkingFiles:
    """Offload each loaded model (:func:`raot_hf.io.offload.offload_model`) and release each
    layer's pages after its forward; returns their working files, for the merge to carry."""
    from raot_hf.gate.fidelity import layer_module_names

    files = WorkingFiles()
    for model, label in zip(models, labels, strict=True):
        offload_model(model, directory, label, files)
        files.release_after_forward(model, layer_module_names(model, schema))
        release_freed_memory(files)
    return files


def check_parking_room(model: torch.nn.Module, files: WorkingFiles) -> None:
    """Before any calibration: room in the offload directory, beside the models' working files
    (written by now), for what the pass over the layers parks there until its last layer (§7.4):
    one copy of ``model``'s parameters outside its layers, the merged trunk (B′'s mapped ones, and
    A's folded, are made again after the last layer instead, §5.7)."""
    from raot_hf.adapters import schema_for
    from raot_hf.gate.fidelity import layer_module_names
    from raot_hf.io.offload import check_room

    if files.directory is None:
        return
    in_layer = tuple(n + "." for n in layer_module_names(model, schema_for(model)))
    outside = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith(in_layer))
    check_room(files.directory, outside, "parking the parameters outside the layers while the layers run")


def load_layerwise(source, label: str, hf_config, dtype: str, directory, files: WorkingFiles):
    """One model for a layer-wise merge, its working file recorded in ``files``: a local safetensors
    checkpoint read tensor by tensor into it (:func:`raot_hf.io.offload.load_offloaded`), anything
    else (a Hub id, renamed keys) loaded whole, then offloaded."""
    from raot_hf.adapters import schema_for
    from raot_hf.gate.fidelity import layer_module_names
    from raot_hf.io.loading import load_model, model_class

    model, path = None, local_safetensors(source)
    if path is not None:
        load_model_checks(source, label, hf_config)
        model = load_offloaded(model_class(hf_config), path, hf_config, dtype, directory, label, files)
    if model is None:
        model = load_model(source, label, dtype=dtype, config=hf_config)
        offload_model(model, directory, label, files)
    files.release_after_forward(model, layer_module_names(model, schema_for(model)))
    release_freed_memory(files)
    return model
