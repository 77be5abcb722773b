"""Write a merged model as a repository directory that ``from_pretrained`` loads.

The directory holds ``config.json``, the weights as ``*.safetensors`` shards with
``model.safetensors.index.json``, A's tokenizer / processor, a model card ``README.md`` and
``raot_report.json``. It is written atomically: everything goes into a hidden temporary sibling
``<parent>/.<name>.tmp-<random>``, the weights are checked there, and only then is it renamed onto
the destination, so a crash never leaves a half-written directory behind.

The weights are written by a streaming shard writer: the tensors are grouped into shards of at
most ``max_shard_size`` bytes and each shard is materialised on the CPU only while it is written.
The key set is the one ``PreTrainedModel.save_pretrained`` writes (tied aliases dropped, weight
renamings reverted to the checkpoint format), so the output reloads with no missing or unexpected
keys. The index is written even for a single shard; identical tensors give byte-identical files.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from huggingface_hub.utils import tqdm
from safetensors import safe_open

from raot_hf.errors import RaotError
from raot_hf.version import __version__

logger = logging.getLogger("raot_hf.output")

SINGLE_WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
REPORT_NAME = "raot_report.json"
CARD_NAME = "README.md"
_SHARD_PATTERN = "model-{index:05d}-of-{count:05d}.safetensors"
_OUTPUT_MARKERS = ("config.json", REPORT_NAME)
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_HASHED_PATTERNS = ("*.safetensors", "*.bin", "config.json")

__all__ = ["file_sha256", "hash_checkpoint_files", "parse_size", "render_model_card", "write_merged_repo"]


# --------------------------------------------------------------------------------- provenance


def file_sha256(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """Return the hex SHA-256 of the file at ``path``, read in ``chunk_size`` blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk_size), b""):
            digest.update(block)
    return digest.hexdigest()


def hash_checkpoint_files(path_or_repo_dir: str | os.PathLike) -> dict[str, str]:
    """SHA-256 of each ``*.safetensors``, ``*.bin`` and ``config.json`` at the top of a local
    model directory (e.g. a Hub cache snapshot), keyed by file name in sorted order."""
    directory = Path(path_or_repo_dir).expanduser()
    if not directory.is_dir():
        raise RaotError(
            f"cannot hash checkpoint files: {str(directory)!r} is not a local directory; pass a model folder"
        )
    names = sorted({p.name for pattern in _HASHED_PATTERNS for p in directory.glob(pattern) if p.is_file()})
    return {name: file_sha256(directory / name) for name in names}


# --------------------------------------------------------------------------------- model card

_TEMPLATE_NAME = "raot_merge.md"
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_FALLBACK_TEMPLATE = """---
{{front_matter}}
---

# {{title}}

Merge of **{{model_a}}** ({{revision_a}}) and **{{model_b}}** ({{revision_b}}) after aligning B to A
under the Transformer's exact symmetries, written by raot-hf {{version}}.

{{summary}}

## Method

* Alignment: {{method}}
* Alignment scope: {{scope}}
* Merge rule: {{merge_rule}}
* Interpolation weight α: {{alpha}}
* Base model (task vectors are measured from it): {{base_model}}

## Gate

{{gate_summary}}

{{gate_table}}

## Functional checks

{{checks_table}}

## Reproduction

```bash
{{command}}
```
"""


def _template_text() -> str:
    """The card template: the packaged copy, else the repository's ``model_cards/`` copy
    (editable installs), else the built-in minimal template."""
    package_dir = Path(__file__).resolve().parent
    for candidate in (package_dir / "templates" / _TEMPLATE_NAME, package_dir.parent / "model_cards" / _TEMPLATE_NAME):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
    return _FALLBACK_TEMPLATE


def _yaml_string(value: str) -> str:
    """A YAML scalar: plain when unambiguous, else double-quoted (JSON strings are valid YAML)."""
    plain = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", value) and not re.fullmatch(
        r"[0-9._eE+-]*|true|false|yes|no|on|off|null", value, flags=re.IGNORECASE
    )
    return value if plain else json.dumps(value)


def _front_matter(card: dict) -> str:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    base_models = []
    for key in ("model_a", "model_b", "base_model"):
        if not card.get(key):
            continue
        try:
            validate_repo_id(str(card[key]))
        except HFValidationError:
            logger.info("%s %r is not a Hub id (a local path?); it is left out of base_model", key, card[key])
            continue
        base_models.append(str(card[key]))
    lines = []
    if base_models:
        lines += ["base_model:", *(f"- {_yaml_string(m)}" for m in base_models), "base_model_relation: merge"]
    lines.append("library_name: transformers")
    if card.get("pipeline_tag"):
        lines.append(f"pipeline_tag: {_yaml_string(str(card['pipeline_tag']))}")
    lines += ["tags:", "- merge", "- raot"]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    """One markdown table cell: numbers to 4 significant digits, ``None`` as a dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) or (hasattr(value, "item") and hasattr(value, "dtype")):
        return f"{float(value):.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _gate_table(rows: list[dict]) -> tuple[str, str]:
    """The gate summary sentence and table (one row per transform decision)."""
    if not rows:
        return "No gate decisions were recorded.", ""
    applied = sum(bool(row.get("applied")) for row in rows)
    if applied == 0:
        summary = (
            f"None of the {len(rows)} transforms beat the identity: A and B already share a basis "
            "(detection, not repair), so B was merged as it is."
        )
    else:
        summary = f"{applied} of {len(rows)} transforms beat the identity and were applied."
    header = ["transform", "layer", "score (identity)", "score (estimate)", "margin", "applied"]
    keys = ["transform", "layer", "identity", "estimate", "margin"]
    table = _table(header, [[row.get(k) for k in keys] + [bool(row.get("applied"))] for row in rows])
    return summary, table


def _checks_table(rows: list[dict]) -> str:
    if not rows:
        return "No functional checks were recorded."
    header = ["check", "kind", "value", "threshold", "passed"]
    return _table(
        header, [[r.get("name"), r.get("kind"), r.get("value"), r.get("threshold"), r.get("passed")] for r in rows]
    )


def _base_rows(card: dict) -> str:
    """The inputs-table row of the base model (empty without one)."""
    if not card.get("base_model"):
        return ""
    revision = card.get("revision_base") or "not pinned"
    return f"| base (task vectors are measured from it) | `{_cell(card['base_model'])}` | {_cell(revision)} |"


def render_model_card(card: dict, *, template: str | None = None) -> str:
    """Render the model card ``README.md`` from ``card``.

    Keys of ``card`` (only ``model_a`` and ``model_b`` are required):

    * ``model_a``, ``model_b``: ids (or local paths) of the inputs; Hub ids go into the YAML
      ``base_model`` list (local paths are left out there, as the Hub would reject them).
    * ``base_model``, ``revision_base`` (optional): the model A and B were fine-tuned from, for
      the base-relative rules; listed in ``base_model`` too and in the card's inputs.
    * ``revision_a``, ``revision_b``: the revisions (commit hashes) that were loaded.
    * ``method``: how B was aligned (estimator); ``scope``: what was aligned (heads, MLP, stream).
    * ``merge_rule``: e.g. ``linear`` or ``regmean``; ``alpha``: the interpolation weight.
    * ``gate_rows``: one dict per gate decision with ``transform``, ``layer``, ``identity``
      (score under the identity), ``estimate`` (score under the estimate), ``margin``, ``applied``.
    * ``checks``: dicts with ``name``, ``value``, ``threshold``, ``passed`` and optionally
      ``kind`` (``exact`` / ``approximate``), e.g. the max deviation of B′ vs B.
    * ``summary``: free text under the title; ``command``: the CLI command that reproduces it.
    * ``pipeline_tag`` (optional): Hub pipeline tag; ``version``: raot-hf version.

    ``template`` (text with ``{{name}}`` placeholders) defaults to ``model_cards/raot_merge.md``.
    """
    missing = [key for key in ("model_a", "model_b") if not card.get(key)]
    if missing:
        raise RaotError(f"model card needs {' and '.join(missing)}; pass the ids of both input models")
    gate_summary, gate_table = _gate_table(list(card.get("gate_rows") or []))
    alpha = card.get("alpha")
    context = {
        "front_matter": _front_matter(card),
        "title": f"RaOT merge of {card['model_a']} and {card['model_b']}",
        "model_a": str(card["model_a"]),
        "model_b": str(card["model_b"]),
        "revision_a": str(card.get("revision_a") or "not pinned"),
        "revision_b": str(card.get("revision_b") or "not pinned"),
        "method": str(card.get("method") or "—"),
        "scope": str(card.get("scope") or "—"),
        "merge_rule": str(card.get("merge_rule") or "—"),
        "base_model": f"`{card['base_model']}`" if card.get("base_model") else "none",
        "base_rows": _base_rows(card),
        "alpha": _cell(float(alpha)) if alpha is not None else "—",
        "gate_summary": gate_summary,
        "gate_table": gate_table,
        "checks_table": _checks_table(list(card.get("checks") or [])),
        "summary": str(card.get("summary") or ""),
        "command": str(card.get("command") or "# command not recorded"),
        "version": str(card.get("version") or __version__),
    }

    def substitute(match: re.Match) -> str:
        name = match.group(1)
        if name not in context:
            raise RaotError(
                f"model card template uses unknown placeholder {{{{{name}}}}}; use one of {sorted(context)}"
            )
        return context[name]

    text = _PLACEHOLDER.sub(substitute, _template_text() if template is None else template)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"


# ------------------------------------------------------------------------------------ weights


def parse_size(size: int | str) -> int:
    """Parse a byte count such as ``2GB`` (10⁹), ``500MiB`` (2²⁰ each) or ``4096`` into an int."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise RaotError(f"cannot read size {size!r}; write it like '2GB', '500MB' or '1GiB'")
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise RaotError(f"max shard size must be positive, got {size!r}; use e.g. '2GB'")
    return value


def _drop_tied_targets(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Fallback for transformers without ``remove_tied_weights_from_state_dict``: drop each tied
    target whose storage is its source's."""
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target in state and source in state and state[target].data_ptr() == state[source].data_ptr():
            del state[target]
    return state


def weights_to_save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` would write, by checkpoint name, without copying them.

    Tied aliases are dropped (the kept name is the one ``from_pretrained`` expects) and the
    model's weight renamings (e.g. ViT's ``layers.N.attention.q_proj`` ↔
    ``encoder.layer.N.attention.attention.query``) are reverted to the checkpoint format.
    """
    state = dict(model.state_dict())
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    for key in ignored:
        state.pop(key, None)
    meta = [name for name, tensor in state.items() if tensor.device.type == "meta"]
    if meta:
        raise RaotError(f"{len(meta)} weights (e.g. {meta[0]!r}) are on the meta device; load the model fully first")
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # older or newer transformers
        remove_tied_weights_from_state_dict = _drop_tied_targets
    all_names = set(state)
    state = remove_tied_weights_from_state_dict(state, model)
    tied_targets = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
    unexplained = all_names - set(state) - tied_targets
    if unexplained:
        raise RuntimeError(f"weights {sorted(unexplained)} would be dropped without being tied: bug in the writer")
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    return revert_weight_conversion(model, state)


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most ``max_shard_bytes`` (a tensor larger
    than the limit gets a shard of its own)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, tensor in tensors.items():
        size = _tensor_nbytes(tensor)
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def _shard_name(index: int, count: int) -> str:
    return SINGLE_WEIGHTS_NAME if count == 1 else _SHARD_PATTERN.format(index=index, count=count)


def _cpu_copy_for_saving(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning exactly its bytes (safetensors refuses partial aliases)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.untyped_storage().nbytes() != _tensor_nbytes(tensor):
        tensor = tensor.clone()
    return tensor


def write_safetensors_shards(
    directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int, *, total_parameters: int | None = None
) -> dict[str, Any]:
    """Stream ``tensors`` into safetensors shards in ``directory`` and write the index (always,
    even for one shard). Returns the index dict."""
    shards = plan_shards(tensors, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total_size = 0
    for number, names in enumerate(tqdm(shards, desc="Writing shards", unit="shard"), start=1):
        filename = _shard_name(number, len(shards))
        shard = {name: _cpu_copy_for_saving(tensors[name]) for name in names}
        safetensors.torch.save_file(shard, str(directory / filename), metadata={"format": "pt"})
        total_size += sum(_tensor_nbytes(t) for t in shard.values())
        weight_map.update(dict.fromkeys(names, filename))
        del shard
    metadata: dict[str, int] = {"total_size": total_size}
    if total_parameters is not None:
        metadata["total_parameters"] = total_parameters
    index = {"metadata": metadata, "weight_map": weight_map}
    with open(directory / INDEX_NAME, "w", encoding="utf-8", newline="\n") as handle:
        handle.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    logger.info("wrote %d weights (%d bytes) in %d shard(s)", len(weight_map), total_size, len(shards))
    return index


def verify_written_weights(directory: Path, expected_keys: set[str]) -> None:
    """Check, from the files on disk, that the index maps exactly ``expected_keys`` and that
    each shard's header holds exactly the keys the index assigns to it (no tensor data read)."""
    with open(directory / INDEX_NAME, encoding="utf-8") as handle:
        weight_map: dict[str, str] = json.load(handle)["weight_map"]
    if set(weight_map) != expected_keys:
        missing = sorted(expected_keys - set(weight_map))[:5]
        extra = sorted(set(weight_map) - expected_keys)[:5]
        raise RuntimeError(f"written index does not match the weights: missing {missing}, unexpected {extra}")
    by_file: dict[str, set[str]] = {}
    for key, filename in weight_map.items():
        by_file.setdefault(filename, set()).add(key)
    for filename, keys in sorted(by_file.items()):
        with safe_open(str(directory / filename), framework="pt") as shard:
            stored = set(shard.keys())
        if stored != keys:
            raise RuntimeError(f"shard {filename} holds {len(stored)} tensors but the index assigns it {len(keys)}")


# ------------------------------------------------------------------------- other repo files


def _save_preprocessor(source: Any, directory: Path, trust_remote_code: bool) -> str | None:
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


def _json_default(value: Any) -> Any:
    """``json.dump`` hook for the scalars and containers a report may still hold."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar or 0-d array
        return value.item() if getattr(value, "ndim", 0) == 0 else value.tolist()
    raise TypeError(f"report value of type {type(value).__name__} is not JSON serializable")


def report_to_json(report: dict) -> str:
    """The report as written to ``raot_report.json``: indented, sorted keys, final newline."""
    return json.dumps(report, indent=2, sort_keys=True, default=_json_default) + "\n"


def _save_config(model: torch.nn.Module, directory: Path) -> None:
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


# -------------------------------------------------------------------------- atomic directory


def _check_destination(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """Validate the destination before any heavy work; returns it as an absolute path."""
    out = Path(out_dir).expanduser().absolute()
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise RaotError(f"output path {str(out)!r} exists and is not a directory; choose another --out")
        if any(out.iterdir()):
            if not overwrite:
                raise RaotError(
                    f"output directory {str(out)!r} exists; pass --overwrite (overwrite=True) or choose another --out"
                )
            if not any((out / marker).exists() for marker in _OUTPUT_MARKERS):
                raise RaotError(
                    f"refusing to replace {str(out)!r}: it holds no config.json or {REPORT_NAME}, so it is not a "
                    "model directory; remove it yourself or choose another --out"
                )
    # nothing is created here: missing parents are made when the output is written, so a merge
    # that fails leaves no empty directories behind
    existing = out.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise RaotError(
            f"{str(existing)!r} is not a directory, so {str(out)!r} cannot be created; choose another --out"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RaotError(
            f"parent directory {str(existing)!r} is not writable; choose another --out or fix its permissions"
        )
    return out


def _make_temp_dir(out: Path) -> Path:
    """Create the hidden sibling ``.<name>.tmp-<random>`` (umask-respecting permissions), and
    any missing parent directories of ``out``."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RaotError(
            f"cannot create parent directory {str(out.parent)!r} ({exc.strerror}); choose another --out"
        ) from exc
    for _ in range(100):
        candidate = out.parent / f".{out.name}.tmp-{secrets.token_hex(6)}"
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise RaotError(f"cannot write into {str(out.parent)!r} ({exc.strerror}); choose another --out") from exc
        return candidate
    raise RaotError(f"could not create a temporary directory next to {str(out)!r}; clean up .{out.name}.tmp-* there")


def _move_into_place(temporary: Path, out: Path) -> None:
    """Rename ``temporary`` onto ``out``; an existing ``out`` is moved aside first and deleted
    only once the new directory is in place (restored if the rename fails)."""
    if not (out.exists() or out.is_symlink()):
        os.rename(temporary, out)
        return
    backup = out.parent / f".{out.name}.old-{secrets.token_hex(6)}"
    os.rename(out, backup)
    try:
        os.rename(temporary, out)
    except BaseException:
        os.rename(backup, out)
        raise
    if backup.is_symlink():
        backup.unlink()
    else:
        shutil.rmtree(backup, ignore_errors=True)


def write_merged_repo(
    out_dir: str | os.PathLike,
    model: torch.nn.Module,
    *,
    preprocessor_source: Any = None,
    report: dict,
    card: dict,
    overwrite: bool = False,
    max_shard_size: int | str = "2GB",
    trust_remote_code: bool = False,
    transform: Any = None,
) -> Path:
    """Write ``model`` as a repository directory that ``from_pretrained`` loads; return its path.

    Args:
        out_dir: destination directory. If it exists and is non-empty, ``overwrite`` must be
            true and it must be a model directory (holding ``config.json`` or
            ``raot_report.json``); it is then replaced as a whole.
        model: a ``transformers`` ``PreTrainedModel`` (the merged model).
        preprocessor_source: model A's local directory or Hub id (its tokenizer / image
            processor is loaded with ``AutoProcessor``, ``AutoTokenizer`` or
            ``AutoImageProcessor``), or an already loaded object with ``save_pretrained``.
            If nothing can be loaded a warning is logged and the output has none.
        report: JSON-safe provenance record written to ``raot_report.json``.
        card: model card context, see :func:`render_model_card`.
        overwrite: replace an existing non-empty output directory.
        max_shard_size: largest shard in bytes, or a size string like ``"2GB"``.
        trust_remote_code: passed to the preprocessor loaders.
        transform: the alignment applied to B (a :class:`~raot_hf.symmetry.TransformSequence`); when it
            is not empty it is written, bit-exact, to ``raot_transform.safetensors``.

    Everything is written to ``<parent>/.<name>.tmp-<random>``, the weight files are checked
    against the expected key set, then the directory is renamed into place. On any error the
    temporary directory is removed and an existing ``out_dir`` is left untouched.
    """
    if not hasattr(getattr(model, "config", None), "save_pretrained"):
        raise RaotError(f"cannot write {type(model).__name__}: it has no transformers config; pass a PreTrainedModel")
    max_shard_bytes = parse_size(max_shard_size)
    card_text = render_model_card(card)
    report_text = report_to_json(report)
    out = _check_destination(out_dir, overwrite)

    temporary = _make_temp_dir(out)
    try:
        _save_preprocessor(preprocessor_source, temporary, trust_remote_code)
        _save_config(model, temporary)
        tensors = weights_to_save(model)
        total_parameters = model.num_parameters() if hasattr(model, "num_parameters") else None
        write_safetensors_shards(temporary, tensors, max_shard_bytes, total_parameters=total_parameters)
        verify_written_weights(temporary, set(tensors))
        del tensors
        (temporary / CARD_NAME).write_text(card_text, encoding="utf-8", newline="\n")
        (temporary / REPORT_NAME).write_text(report_text, encoding="utf-8", newline="\n")
        if transform is not None and len(transform):
            from raot_hf.symmetry.io import TRANSFORM_NAME, save_transform

            save_transform(transform, temporary / TRANSFORM_NAME)
        _move_into_place(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    logger.info("merged model written to %s", out)
    return out


check_destination = _check_destination
