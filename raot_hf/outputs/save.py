"""Write a merged model as a repository directory that ``from_pretrained`` loads (docs/design.md §6):
``config.json``, safetensors shards and index, A's tokenizer / processor, ``README.md``,
``raot_report.json`` and, when B was moved, ``raot_transform.safetensors``; written atomically."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from raot_hf.errors import RaotError
from raot_hf.outputs.atomic import atomic_directory, check_destination
from raot_hf.outputs.card import CARD_NAME, render_model_card
from raot_hf.outputs.report import REPORT_NAME, model_card_context, report_to_json
from raot_hf.outputs.shards import ShardWriter, parse_size, verify_written_weights, weights_to_save

logger = logging.getLogger("raot_hf.outputs.save")

__all__ = ["write_merged_repo"]


def save_preprocessor(source: Any, directory: Path, trust_remote_code: bool) -> str | None:
    """Save A's tokenizer / processor into ``directory``; a source that cannot be loaded is a
    warning, not an error. Returns the saved object's class name, or ``None``."""
    if source is None:
        return None
    if hasattr(source, "save_pretrained") and not isinstance(source, (str, os.PathLike)):
        source.save_pretrained(str(directory))
        return type(source).__name__
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    failures = []
    for loader in (AutoProcessor, AutoTokenizer, AutoImageProcessor):
        try:
            loaded = loader.from_pretrained(str(source), trust_remote_code=trust_remote_code)
        except Exception as exc:  # any loader failure means: try the next one
            failures.append(f"{loader.__name__}: {type(exc).__name__}")
            continue
        loaded.save_pretrained(str(directory))
        return type(loaded).__name__
    logger.warning(
        "no tokenizer or processor could be loaded from %r (%s); the output has none — copy it from model A",
        str(source),
        "; ".join(failures),
    )
    return None


def save_config(model: torch.nn.Module, directory: Path) -> None:
    """Write ``config.json`` (and the generation config / custom code when the model has them)
    with ``architectures`` and ``dtype`` set as ``save_pretrained`` sets them."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        config.dtype = str(dtype).removeprefix("torch.")
    if getattr(model, "is_remote_code", lambda: False)():
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(model, str(directory), config=config)
    config.save_pretrained(str(directory))
    can_generate = getattr(model, "can_generate", lambda: False)
    if can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(directory))


def write_merged_repo(
    out_dir: str | os.PathLike, model: torch.nn.Module, *, preprocessor_source: Any = None,
    report: dict | Callable[[], dict], card: dict | None = None, overwrite: bool = False,
    max_shard_size: int | str = "2GB", trust_remote_code: bool = False, transform: Any = None,
    more_transforms: dict | None = None, working_files: Any = None,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> Path:  # fmt: skip
    """Write a merged model as a repository directory; return its path. The one writer of every
    execution mode (docs/design.md §7.3).

    ``model``: the merged ``PreTrainedModel``, whose weights are written (``weights_to_save``), or —
    with ``weights``, the (name, tensor) pairs of a streamed merge, written as they come — the
    output's model on the meta device, for its config. ``out_dir``, if non-empty, is replaced only
    with ``overwrite`` and only if it is a model directory
    (:func:`~raot_hf.outputs.atomic.check_destination`). ``preprocessor_source``: A's directory or Hub
    id, or a loaded tokenizer / processor (none loadable: a warning). ``report`` goes to
    ``raot_report.json`` (a function: called once the weights are written, for a report that
    depends on them; it may refuse, and nothing is written), ``card`` is
    :func:`~raot_hf.outputs.card.render_model_card`'s context (default: the report's);
    ``max_shard_size`` in bytes or like ``"2GB"``. ``transform`` (B's alignment) and
    ``more_transforms`` (file name → a further model's) are written bit-exact when not empty.
    ``working_files``: the :class:`~raot_hf.io.offload.WorkingFiles` behind ``model``'s parameters
    when it is offloaded (docs/design.md §7.4). The weight files are checked against the names
    written in a temporary sibling before it is renamed into place; on any error ``out_dir`` is left
    untouched.
    """
    if not hasattr(getattr(model, "config", None), "save_pretrained"):
        raise RaotError(f"cannot write {type(model).__name__}: it has no transformers config; pass a PreTrainedModel")
    max_shard_bytes = parse_size(max_shard_size)
    out = check_destination(out_dir, overwrite)

    with atomic_directory(out) as temporary:
        save_preprocessor(preprocessor_source, temporary, trust_remote_code)
        save_config(model, temporary)
        writer = ShardWriter(temporary, max_shard_bytes, working_files)
        if weights is None:
            weights = weights_to_save(model, working_files).items()
        written = set()
        for name, tensor in weights:
            writer.add(name, tensor)
            written.add(name)
        writer.finish(model.num_parameters() if hasattr(model, "num_parameters") else None)
        verify_written_weights(temporary, written)
        report = report() if callable(report) else report
        card_text = render_model_card(card if card is not None else model_card_context(report))
        (temporary / CARD_NAME).write_text(card_text, encoding="utf-8", newline="\n")
        (temporary / REPORT_NAME).write_text(report_to_json(report), encoding="utf-8", newline="\n")
        from raot_hf.symmetry.io import TRANSFORM_NAME, save_transform

        for name, sequence in {TRANSFORM_NAME: transform, **(more_transforms or {})}.items():
            if sequence is not None and len(sequence):
                save_transform(sequence, temporary / name)
    logger.info("merged model written to %s", out)
    return out
