"""Merge files: mergekit's configuration language (YAML or JSON, one or several documents separated
by ``---``), read into typed records before any checkpoint is opened (docs/design.md §6.9, §6.10)::

    models:
      - model: ./base                     # the base may be listed, with or without parameters
      - model: ./chat
        parameters: {density: [1, 0.5], weight: 0.6}   # a gradient over the layers
      - model: ./code
        parameters:
          weight: [{filter: mlp, value: 0.5}, {value: 0.3}]   # filters on the tensor's name
    merge_method: dare_ties
    base_model: ./base
    parameters: {lambda: 1.0, rescale: false}
    tokenizer: {source: union}
    chat_template: auto
    dtype: bfloat16
    raot:                                 # this project's options (any RaotConfig field or section)
      calibration: {source: calib.csv}    # with calibration data the models are aligned first

A ``models:`` list is one slice of whole models; ``slices:`` stack layer ranges (``passthrough``
copies them: depth up-scaling). A parameter is read from the most specific level that gives it —
a slice's source (a ``models:`` entry), the slice, the whole merge — each a number, a list (a
gradient over the slice's layers) or ``{filter, value}`` entries chosen by the tensor's name.
Documents with a ``name:`` are intermediate merges the later ones use as models. Anything this
project does not run is refused in one line naming the key and the nearest supported form.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from raot_hf.errors import RaotError

logger = logging.getLogger("raot_hf.config")

#: Top-level keys of a merge-file document.
KEYS = (
    "name", "models", "slices", "merge_method", "base_model", "parameters", "dtype", "out_dtype",
    "tokenizer_source", "tokenizer", "chat_template", "raot",
)  # fmt: skip
#: mergekit keys with no counterpart here, and the nearest form that runs.
REFUSED_KEYS = {
    "modules": "modules: (a separate merge per sub-model) is not supported; merge the text model with models: or "
    "slices:",
}
#: mergekit's methods that are not implemented here → the nearest one that is.
NEAREST_METHODS = {
    "karcher": "linear (or slerp for two models)", "multislerp": "slerp (two models) or linear", "sce": "ties",
    "ram": "ties", "ramplus_tl": "ties", "nearswap": "slerp", "arcee_fusion": "slerp",
}  # fmt: skip
#: Every parameter name mergekit's methods read (a name outside this set is a typo: refused).
MERGEKIT_PARAMETERS = (
    "weight", "density", "epsilon", "gamma", "lambda", "t", "normalize", "rescale", "int8_mask", "filter_wise",
    "nuslerp_row_wise", "nuslerp_flatten", "scale", "select_topk", "normalize_weights", "eps", "max_iter", "tol",
)  # fmt: skip
#: dtype names a merge file may give (mergekit's, with or without ``torch.``, and common short forms).
DTYPES = {
    "float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64",
}  # fmt: skip
_SLICE_KEYS = ("sources", "parameters", "base_model")
#: A merge file's parameters → the ``mergekit`` options section of an aligned merge.
#: The whole merge's parameters of the rules that vary by layer → (their section, field).
_SECTION_OF = {
    "t": ("mergekit", "t"), "filter_wise": ("mergekit", "filter_wise"), "nuslerp_row_wise": ("mergekit", "row_wise"),
    "nuslerp_flatten": ("mergekit", "flatten"), "density": ("task_vectors", "density"),
    "epsilon": ("task_vectors", "epsilon"), "gamma": ("task_vectors", "gamma"), "lambda": ("task_vectors", "scale"),
}  # fmt: skip
_SOURCE_KEYS = ("model", "layer_range", "parameters")


@dataclass(frozen=True)
class ModelRef:
    """A checkpoint a merge file names: a path or Hub id, with mergekit's ``@revision``."""

    path: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.path}@{self.revision}" if self.revision else self.path


@dataclass
class SliceSource:
    """One input of an output slice: a model and its layers ``[start, end)`` (None: all of them, a
    ``models:`` entry), with the parameters given for it (rule keywords → settings)."""

    model: ModelRef
    layer_range: tuple[int, int] | None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class OutputSlice:
    """Layers of the output: its sources (merged layer for layer), its own ``base_model`` (None:
    the document's) and the parameters given for the slice."""

    sources: list[SliceSource]
    base: ModelRef | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenSource:
    """Where a token's embedding row comes from (mergekit's ``tokenizer.tokens``): ``model`` — the
    token's own row in ``model``; ``model_token`` — the row of ``token`` (or ``token_id``) in
    ``model``; ``zero`` — zeros. ``force``: for every model, even those that have the token."""

    kind: str
    model: ModelRef | None = None
    token: str | None = None
    token_id: int | None = None
    force: bool = False


@dataclass
class TokenizerSpec:
    """The output vocabulary: ``source`` is ``"base"``, ``"union"`` or a model; ``tokens`` set
    (and add) single tokens' embeddings; the vocabulary padded to ``pad_to_multiple_of``."""

    source: str | ModelRef
    tokens: dict[str, TokenSource] = field(default_factory=dict)
    pad_to_multiple_of: int | None = None


@dataclass
class MergeDocument:
    """One merge of a merge file. ``slices`` are normalised: a ``models:`` list is one slice of
    whole models, the base appended when it is not listed (as mergekit does); ``parameters`` hold
    rule keywords → settings (mergekit's names translated by the rule's registration)."""

    method: str
    slices: list[OutputSlice]
    base: ModelRef | None = None
    name: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer: TokenizerSpec | None = None
    chat_template: str | None = None
    raot: dict[str, Any] = field(default_factory=dict)
    #: True for ``models:`` (whole models); False for ``slices:``.
    whole_models: bool = True
    #: The document as written (for the report).
    data: dict[str, Any] = field(default_factory=dict)
    #: Options given beside the file (the command line's flags, Python's keywords): a function of
    #: the document's RaotConfig; and whether they name an alignment.
    configure: Any = None
    alignment_given: bool = False

    @property
    def stacks_layers(self) -> bool:
        """Whether the output's layers are copied or stacked rather than merged in place."""
        ranges = {s.layer_range for piece in self.slices for s in piece.sources}
        return self.method == "passthrough" or len(self.slices) > 1 or (None not in ranges and len(ranges) > 1)

    def models(self) -> list[ModelRef]:
        """Every checkpoint the document reads, in order of first mention (the base first)."""
        seen = [self.base] if self.base is not None else []
        for piece in self.slices:
            for ref in [piece.base, *(s.model for s in piece.sources)]:
                if ref is not None and ref not in seen:
                    seen.append(ref)
        if self.tokenizer is not None:
            refs = [self.tokenizer.source, *(t.model for t in self.tokenizer.tokens.values())]
            seen += [r for r in refs if isinstance(r, ModelRef) and r not in seen]
        return seen

    def config(self):
        """The :class:`raot_hf.RaotConfig` of this document: ``raot:`` options, the method and the
        dtype, then the options given beside the file (:attr:`configure`)."""
        from raot_hf.config import RaotConfig

        config = RaotConfig.from_dict({**self.raot, "merge_rule": self.method, **_dtype_option(self.dtype)})
        return self.configure(config) if self.configure is not None else config


@dataclass
class MergeFile:
    """A merge file's documents in run order (each after the merges it uses by name); the last
    one is the merge written to the output directory."""

    documents: list[MergeDocument]
    text: str = ""

    @property
    def output(self) -> MergeDocument:
        return self.documents[-1]

    @property
    def config(self):
        """The output document's RaotConfig."""
        return self.output.config()

    def configured(self, configure, alignment_given: bool = False) -> MergeFile:
        """The file with options given beside it: ``configure`` maps each document's RaotConfig to
        the one it runs with; ``alignment_given``: they name an alignment (then a document without
        calibration data is refused rather than merged as stored)."""
        import dataclasses

        documents = [dataclasses.replace(d, configure=configure, alignment_given=alignment_given)
                     for d in self.documents]  # fmt: skip
        return MergeFile(documents, self.text)


# ----------------------------------------------------------------------------- reading


def looks_like_merge_file(data: Any) -> bool:
    """Whether parsed ``--config`` content is a merge file (it lists models or names a method), not
    a RaotConfig JSON (whose ``models`` is the several-model options section, a mapping)."""
    if isinstance(data, list):
        return bool(data) and all(looks_like_merge_file(d) for d in data)
    if not isinstance(data, dict):
        return False
    return bool({"merge_method", "slices"} & set(data)) or isinstance(data.get("models"), list)


def parse_text(text: str, name: str) -> Any:
    """YAML (JSON is YAML too) into Python data; several ``---`` documents into a list. A syntax
    error is one line."""
    import yaml

    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise RaotError(f"--config {name} is not valid YAML or JSON{where}; fix the file") from None
    return documents[0] if len(documents) == 1 else documents


def load_merge_file(path: str | Path) -> MergeFile:
    """Read and check the merge file at ``path`` (YAML or JSON)."""
    path = Path(path)
    if not path.is_file():
        raise RaotError(f"--config {path} does not exist; pass a merge file (YAML) or a RaotConfig JSON")
    text = path.read_text(encoding="utf-8")
    data = json.loads(text) if path.suffix.lower() == ".json" else parse_text(text, str(path))
    if not looks_like_merge_file(data):
        raise RaotError(f"--config {path} names no models: or merge_method:; it is not a merge file")
    return read_merge_file(data, text)


def read_merge_file(data: dict | list[dict], text: str = "") -> MergeFile:
    """The documents a parsed merge file describes, in run order (see the module docstring)."""
    documents = data if isinstance(data, list) else [data]
    docs = [read_document(d, i if len(documents) > 1 else None) for i, d in enumerate(documents, start=1)]
    return MergeFile(_run_order(docs), text)


def read_document(data: Any, number: int | None = None) -> MergeDocument:
    """One document (a mapping) as a :class:`MergeDocument`; ``number``: its place in a file of several."""
    where = f"document {number}: " if number is not None else ""
    if not isinstance(data, dict):
        raise RaotError(f"{where}a merge file document must be a mapping (models:, merge_method:, …)")
    try:
        return _document(data)
    except RaotError as exc:
        if not where:
            raise
        raise RaotError(f"{where}{exc}") from None


def _document(data: dict) -> MergeDocument:
    for key in data:
        if key in REFUSED_KEYS:
            raise RaotError(REFUSED_KEYS[key])
        if key not in KEYS:
            raise RaotError(f"unknown merge-file key {key!r}; valid: {', '.join(KEYS)}")
    method = _check_method(data.get("merge_method"))
    base = _model_ref(data["base_model"], "base_model") if data.get("base_model") is not None else None
    if ("models" in data) == ("slices" in data):
        raise RaotError("a merge file document gives models: or slices: (exactly one of them); list the models")
    if "models" in data:
        slices = [_models_slice(data["models"], base)]
    else:
        slices = [_slice(piece, i) for i, piece in enumerate(_list(data["slices"], "slices"), start=1)]
    if "tokenizer_source" in data and "tokenizer" in data:
        raise RaotError("the merge file gives tokenizer_source: and tokenizer:; keep one (tokenizer: {source: ...})")
    document = MergeDocument(
        method=method,
        slices=slices,
        base=base,
        name=_name(data.get("name")),
        parameters=_parameters(data.get("parameters"), "parameters:"),
        dtype=_dtype(data.get("dtype"), "dtype"),
        out_dtype=_dtype(data.get("out_dtype"), "out_dtype"),
        tokenizer=_tokenizer(data),
        chat_template=_chat_template(data.get("chat_template")),
        raot=_raot_section(data),
        whole_models="models" in data,
        data=data,
    )
    _check_slices(document)
    return document


def _list(value: Any, key: str) -> list:
    if not isinstance(value, list) or not value:
        raise RaotError(f"{key}: must be a non-empty list")
    return value


def _name(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or "/" in value:
        raise RaotError(f"name: {value!r} must be a plain name (no '/'), which later documents use as a model")
    return value


def _model_ref(value: Any, where: str) -> ModelRef:
    """A model reference: ``path``, ``path@revision``, or mergekit's mapping ``{model: …}``."""
    if isinstance(value, dict):
        if value.get("lora") is not None:
            raise RaotError(f"{where}: lora: adds a LoRA adapter to a model; merge it into its model first (peft's "
                            "merge_and_unload) and name that checkpoint")  # fmt: skip
        extra = sorted(k for k in value if k not in ("model", "lora") and value[k] is not None)
        if extra:
            raise RaotError(f"{where}: {', '.join(extra)} is not supported; name a checkpoint whose config.json "
                            "names the architecture")  # fmt: skip
        value = value.get("model")
        if isinstance(value, dict):  # {path, revision}
            return ModelRef(str(value.get("path")), value.get("revision"))
    if not isinstance(value, str) or not value.strip():
        raise RaotError(f"{where}: {value!r} must name a checkpoint (a path or Hub id)")
    if "+" in value:
        raise RaotError(
            f"{where}: {value} adds a LoRA adapter to a model; merge it into its model first (peft's "
            "merge_and_unload) and name that checkpoint"
        )
    path, _, revision = value.partition("@")
    return ModelRef(path, revision or None)


def _layer_range(value: Any, where: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(b, int) and b >= 0 for b in value)):
        raise RaotError(f"{where} layer_range {value!r} must be [start, end], two integers")
    start, end = value
    if end <= start:
        raise RaotError(f"{where} layer_range [{start}, {end}] holds no layer; give [start, end] with start < end")
    return start, end


def _models_slice(entries: Any, base: ModelRef | None) -> OutputSlice:
    """``models:`` as one slice of whole models; the base is appended when it is not listed."""
    if not isinstance(entries, list) or not entries:
        raise RaotError("the merge file has no models: list; add one '- model: <path or Hub id>' entry per model")
    sources = []
    for i, entry in enumerate(entries, start=1):
        if not isinstance(entry, dict) or not entry.get("model"):
            raise RaotError(f"models: entry {i} has no 'model:'; write '- model: <path or Hub id>'")
        unknown = sorted(set(entry) - {"model", "parameters"})
        if unknown:
            raise RaotError(f"models: entry {i} has unknown key(s) {', '.join(unknown)}; valid: model, parameters")
        ref = _model_ref(entry["model"], f"models: entry {i}")
        params = _parameters(entry.get("parameters"), f"models: entry {i} parameters")
        sources.append(SliceSource(ref, None, params))
    if base is not None and base not in [s.model for s in sources]:
        sources.append(SliceSource(base, None, {}))
    return OutputSlice(sources)


def _slice(piece: Any, number: int) -> OutputSlice:
    where = f"slices: slice {number}"
    if not isinstance(piece, dict):
        raise RaotError(f"{where} must be a mapping with sources:")
    unknown = sorted(set(piece) - set(_SLICE_KEYS))
    if unknown:
        raise RaotError(f"{where} has unknown key(s) {', '.join(unknown)}; valid: {', '.join(_SLICE_KEYS)}")
    raw = piece.get("sources")
    if not isinstance(raw, list) or not raw:
        raise RaotError(f"{where}: slices: entry must hold sources: (a list of model: and layer_range:)")
    sources = []
    for j, source in enumerate(raw, start=1):
        at = f"{where} source {j}"
        if not isinstance(source, dict) or not source.get("model") or "layer_range" not in source:
            raise RaotError(f"{at} needs model: and layer_range: [start, end]")
        unknown = sorted(set(source) - set(_SOURCE_KEYS))
        if unknown:
            raise RaotError(f"{at} has unknown key(s) {', '.join(unknown)}; valid: {', '.join(_SOURCE_KEYS)}")
        params = _parameters(source.get("parameters"), f"{at} parameters")
        sources.append(SliceSource(_model_ref(source["model"], at), _layer_range(source["layer_range"], at), params))
    lengths = {s.layer_range[1] - s.layer_range[0] for s in sources}
    if len(lengths) != 1:
        raise RaotError(f"{where}: its sources span {sorted(lengths)} layers; give every source of a slice as many")
    base = _model_ref(piece["base_model"], f"{where} base_model") if piece.get("base_model") else None
    return OutputSlice(sources, base, _parameters(piece.get("parameters"), f"{where} parameters"))


def _check_slices(document: MergeDocument) -> None:
    """What a method asks of its slices: passthrough one source each, SLERP two, a base among the
    sources of every slice of a rule that reads one."""
    from raot_hf.merging import merge_rule_spec

    spec = merge_rule_spec(document.method)
    for i, piece in enumerate(document.slices, start=1):
        where = "models:" if document.whole_models else f"slices: slice {i}"
        base = piece.base or document.base
        models = [s.model for s in piece.sources]
        if document.method == "passthrough" and len(models) != 1:
            raise RaotError(
                f"{where} gives {len(models)} sources to passthrough, which copies one model's layers; give each "
                "slice one source (stack slices to take layers from several models)"
            )
        needs = spec.needs_base or spec.base_role == "first"
        if needs and base is None:
            role = "the model at t = 0" if spec.base_role == "first" else "the models' common origin"
            raise RaotError(f"merge_method: {document.method} needs base_model: ({role})")
        if base is not None and (needs or spec.base_role == "origin") and base not in models:
            raise RaotError(
                f"{where} does not list base_model {base} among its sources; add it with the same layer_range"
            )
        merged = len(models) - (1 if base is not None and (spec.needs_base or spec.base_role == "origin") else 0)
        if spec.max_models is not None and merged > spec.max_models and document.method != "passthrough":
            raise RaotError(
                f"{where} gives {merged} models to {document.method}, which merges {spec.max_models}; use ties, "
                "model_stock or linear for more"
            )


def _check_method(method: Any) -> str:
    from raot_hf.merging import available_merge_rules

    if not isinstance(method, str) or not method:
        raise RaotError(f"the merge file has no merge_method:; choose one of: {', '.join(available_merge_rules())}")
    if method not in available_merge_rules():
        nearest = NEAREST_METHODS.get(method)
        hint = f"the nearest is {nearest}; " if nearest else ""
        raise RaotError(
            f"merge_method: {method!r} is not supported; {hint}choose one of: {', '.join(available_merge_rules())}"
        )
    return method


def _setting(name: str, value: Any, where: str) -> Any:
    from raot_hf.merging.layered import check_setting

    try:
        return check_setting(name, value)
    except RaotError as exc:
        raise RaotError(f"{where} {exc}") from None


def _parameters(params: Any, where: str) -> dict[str, Any]:
    """A level's parameters under mergekit's names, checked as settings (translated to the rule's
    keywords when the document is run: :func:`rule_keywords`)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise RaotError(f"{where} must be a mapping of parameter names to values (weight, density, t, lambda, …)")
    out = {}
    for name, value in params.items():
        if name not in MERGEKIT_PARAMETERS:
            close = get_close_matches(str(name), MERGEKIT_PARAMETERS, 1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RaotError(
                f"{where} {name!r} is not a mergekit parameter; {hint}valid: {', '.join(MERGEKIT_PARAMETERS)}"
            )
        out[name] = _setting(name, value, where)
    return out


def rule_keywords(method: str, params: dict[str, Any], *, per_model_only: bool = False) -> dict[str, Any]:
    """A level's parameters (mergekit's names) as the rule's keywords: the whole merge's by the
    rule's ``file_parameters``, each model's by the list keyword of its ``model_parameters``. Names
    the method does not read are dropped, as mergekit drops them (``per_model_only``: a source's
    level, where mergekit reads only the models' own parameters)."""
    from raot_hf.merging import merge_rule_spec

    spec = merge_rule_spec(method)
    out = {}
    for name, value in params.items():
        if name in spec.model_parameters:
            out[spec.model_parameters[name][0]] = value
        elif name in spec.file_parameters and not per_model_only:
            keyword = spec.file_parameters[name]
            if keyword is not None:
                out[keyword] = value
        else:
            logger.warning(
                "merge_method %s does not read parameter %r there; it is ignored, as in mergekit", method, name
            )
    return out


def aligned_models(document: MergeDocument):
    """What an aligned merge of ``document`` runs (its models with calibration data, §6.9): the
    models in order, the base (None when it is one of the merged models) and the RaotConfig with
    one weight and density per model. What an aligned merge cannot take is refused in one line."""
    from raot_hf.merging import merge_rule_spec
    from raot_hf.merging.layered import DEFAULT_KEY

    fix = "or drop the calibration to merge the checkpoints as stored"
    if document.stacks_layers:
        raise RaotError(f"{document.method} over stacked slices copies layers and cannot be aligned; {fix}")
    if document.tokenizer is not None:
        raise RaotError(f"tokenizer: builds a vocabulary an aligned merge does not; remove it, {fix}")
    spec = merge_rule_spec(document.method)
    (piece,) = document.slices
    base = piece.base or document.base
    role = "origin" if spec.needs_base else spec.base_role
    sources = list(piece.sources)
    if role == "origin" and base is not None:
        sources = [s for s in sources if s.model != base]
        if not spec.needs_base:
            raise RaotError(f"{document.method} with a base_model (task-vector interpolation) runs as stored; {fix}")
    elif role == "first":
        sources.sort(key=lambda s: s.model != base)  # the base first: the reference
        base = None
    else:
        base = None
    if len(sources) < 2:
        raise RaotError(f"the merge file lists {len(sources)} model(s) to merge besides the base; list at least two")
    top = document.parameters | piece.parameters

    def number(name: str, value: Any, where: str) -> float:
        if isinstance(value, dict) and set(value) == {DEFAULT_KEY}:
            value = value[DEFAULT_KEY]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RaotError(f"{where} {name} varies by layer or module; an aligned merge takes one number per model "
                            f"— give one, {fix}")  # fmt: skip
        return float(value)

    weights, densities = [], []
    for i, source in enumerate(sources, start=1):
        given = {**top, **source.parameters}
        extra = sorted(set(source.parameters) & {"epsilon", "gamma"})
        if extra:
            raise RaotError(f"models: entry {i} sets {extra[0]}, which an aligned merge takes for all models "
                            f"(parameters: {extra[0]}); move it there, {fix}")  # fmt: skip
        weights.append(number("weight", given["weight"], f"models: entry {i}") if "weight" in given else None)
        densities.append(number("density", source.parameters["density"], f"models: entry {i}")
                         if "density" in source.parameters else None)  # fmt: skip
    weights = [1.0 / len(sources) if w is None else w for w in weights]
    config = document.config().to_dict()
    config["models"] = {**config["models"], "weights": weights}
    if any(d is not None for d in densities):
        default = number("density", top["density"], "parameters:") if "density" in top else 1.0
        config["models"]["densities"] = [default if d is None else d for d in densities]
    for name in ("normalize", "rescale"):
        if name in top and top[name] is not _switch_default(document.method, name):
            raise RaotError(f"parameters: {name}: {top[name]} with calibration data: an aligned merge runs "
                            f"{document.method} as defined; remove it, {fix}")  # fmt: skip
    if spec.layered:
        for key, value in top.items():
            if key in _SECTION_OF:
                section, name = _SECTION_OF[key]
                config[section] = {**config.get(section, {}), name: value}
    else:
        rules = dict(config.get("task_vectors") or {})
        if "lambda" in top:
            rules["scale"] = number("lambda", top["lambda"], "parameters:")
        if "density" in top:
            rules["density"] = number("density", top["density"], "parameters:")
        config["task_vectors"] = rules
    from raot_hf.config import RaotConfig

    return [str(s.model) for s in sources], (str(base) if base is not None else None), RaotConfig.from_dict(config)


def _switch_default(method: str, name: str) -> bool | None:
    from raot_hf.merging.base_rules import TASK_VECTOR_RULES

    rule = TASK_VECTOR_RULES.get(method)
    if rule is not None:
        return getattr(rule, name)
    return True if (method, name) == ("linear", "normalize") else None


def _dtype(value: Any, key: str) -> str | None:
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise RaotError(f"{key}: {value!r} is not supported; choose one of: {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def _dtype_option(dtype: str | None) -> dict[str, str]:
    return {"dtype": dtype} if dtype else {}


def _tokenizer(data: dict) -> TokenizerSpec | None:
    if data.get("tokenizer_source") is not None:
        return TokenizerSpec(_vocabulary_source(data["tokenizer_source"], "tokenizer_source"))
    spec = data.get("tokenizer")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise RaotError(
            "tokenizer: must be a mapping {source: base | union | <model>, tokens: ..., pad_to_multiple_of}"
        )
    unknown = sorted(set(spec) - {"source", "tokens", "pad_to_multiple_of"})
    if unknown:
        raise RaotError(
            f"tokenizer: has unknown key(s) {', '.join(unknown)}; valid: source, tokens, pad_to_multiple_of"
        )
    pad = spec.get("pad_to_multiple_of")
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad <= 0):
        raise RaotError(f"tokenizer: pad_to_multiple_of {pad!r} must be a positive integer")
    tokens = spec.get("tokens") or {}
    if not isinstance(tokens, dict):
        raise RaotError("tokenizer: tokens must map each token to {source: ..., force: ...}")
    return TokenizerSpec(
        _vocabulary_source(spec.get("source", "union"), "tokenizer: source"),
        {str(token): _token_source(token, how) for token, how in tokens.items()},
        pad,
    )


def _vocabulary_source(value: Any, where: str) -> str | ModelRef:
    return value if value in ("base", "union") else _model_ref(value, where)


def _token_source(token: str, how: Any) -> TokenSource:
    where = f"tokenizer: tokens {token!r}"
    if not isinstance(how, dict) or set(how) - {"source", "force"}:
        raise RaotError(f"{where} must be {{source: <model> | {{kind: model_token | zero, ...}}, force: ...}}")
    force = how.get("force", False)
    if not isinstance(force, bool):
        raise RaotError(f"{where} force {force!r} must be true or false")
    source = how.get("source")
    if source is None:
        raise RaotError(f"{where} needs source: (a model, or {{kind: model_token, ...}} or {{kind: zero}})")
    if isinstance(source, dict) and "kind" in source:
        kind = source["kind"]
        if kind == "zero":
            return TokenSource("zero", force=force)
        if kind != "model_token" or not source.get("model"):
            raise RaotError(f"{where} source kind {kind!r}: use kind: zero, or kind: model_token with model:")
        token_id, name = source.get("token_id"), source.get("token")
        if (token_id is None) == (name is None):
            raise RaotError(f"{where} gives kind: model_token with one of token: or token_id:")
        ref = _model_ref(source["model"], where)
        return TokenSource("model_token", ref, name, token_id, force)
    return TokenSource("model", _model_ref(source, where), force=force)


def _chat_template(value: Any) -> str | None:
    from raot_hf.merging.vocab import CHAT_TEMPLATES

    if value is None:
        return None
    if not isinstance(value, str) or (
        value != "auto" and value not in CHAT_TEMPLATES and (len(value) < 20 or "{" not in value)
    ):
        raise RaotError(
            f"chat_template: {value!r} is not a template; give auto (the models' most common one), a name "
            f"({', '.join(CHAT_TEMPLATES)}) or a Jinja template"
        )
    return value


def _raot_section(data: dict) -> dict:
    from raot_hf.config.core import current_section_names

    raot = data.get("raot") or {}
    if not isinstance(raot, dict):
        raise RaotError("raot: must be a mapping of RaotConfig options (e.g. alignment, calibration, correction)")
    for key, where in (("merge_rule", "merge_method:"), ("dtype", "dtype:"), ("alpha", "parameters: weight")):
        if key in raot:
            raise RaotError(f"raot: {key} is set by the merge file's {where}; remove it from raot:")
    raot = current_section_names(raot)  # ``group:`` of earlier versions reads as ``models:``
    section = raot.get("models") or {}
    if isinstance(section, dict) and ({"weights", "densities"} & set(section)):
        raise RaotError("raot: models weights and densities come from the models' parameters:; remove them from raot:")
    return raot


def _run_order(docs: list[MergeDocument]) -> list[MergeDocument]:
    """The documents ordered so that each runs after the merges it names; the output last."""
    if len(docs) == 1:
        return docs
    names = [d.name for d in docs if d.name is not None]
    if len(set(names)) != len(names):
        raise RaotError(f"two documents share a name ({', '.join(sorted({n for n in names if names.count(n) > 1}))}); "
                        "give each intermediate merge its own name:")  # fmt: skip
    if sum(d.name is None for d in docs) > 1:
        raise RaotError("only the output document may go without name:; name every intermediate merge")
    uses = {id(d): {r.path for r in d.models() if r.path in names} for d in docs}
    used = set().union(*uses.values())
    finals = [d for d in docs if d.name is None or d.name not in used]
    if len(finals) != 1:
        described = ", ".join(d.name or "(unnamed)" for d in finals) or "none"
        raise RaotError(
            f"a merge file of several documents writes one of them to --out: leave exactly one without name: (or "
            f"unused by the others); found {described}"
        )
    ordered: list[MergeDocument] = []
    by_name = {d.name: d for d in docs if d.name is not None}

    def visit(doc: MergeDocument, path: tuple[str, ...]) -> None:
        if doc in ordered:
            return
        for name in sorted(uses[id(doc)]):
            if name in path:
                raise RaotError(f"the merges {' → '.join((*path, name))} use each other in a cycle; break it")
            visit(by_name[name], (*path, name))
        ordered.append(doc)

    visit(finals[0], (finals[0].name or "output",))
    unused = [d.name for d in docs if d not in ordered]
    if unused:
        raise RaotError(f"the merge(s) {', '.join(map(str, unused))} are used by no later document; remove them")
    return ordered


__all__ = [
    "MergeDocument",
    "MergeFile",
    "ModelRef",
    "OutputSlice",
    "SliceSource",
    "TokenSource",
    "TokenizerSpec",
    "load_merge_file",
    "looks_like_merge_file",
    "read_document",
    "read_merge_file",
    "rule_keywords",
    "aligned_models",
]
