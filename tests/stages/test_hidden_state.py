"""No hidden state: a merge keeps what it needs in its own objects (the pair context, the working
files of docs/design.md §7.4), never on the user's. Every ``__setattr__`` / ``__delattr__`` of the
models, their configs, every submodule and the preprocessor is recorded while they are merged, in
memory and layer by layer, and each object's attributes, parameters, buffers, submodules and hooks
are compared before and after. The merged weights are written into A's parameters in place (tensor
copies, no attribute set): that is the documented contract and is not an attribute write."""

import torch

from raot_hf import RaotMerger
from raot_hf.io.loading import HEAD_MODULE_KEYS, LABEL_KEYS
from raot_hf.testing import scrambled_near_copy, tiny_model, tiny_text_dataset, tiny_tokenizer, trained_like

VOCAB = 100
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_forward_hooks_with_kwargs")


def _pair(model_type="llama", head="causal", seed=1, **config):
    """A trained-like model and a drifted scramble of it: the gate moves B, so apply, fold and the
    correction all run."""
    shape = dict(hidden_size=32, num_heads=4, num_layers=2, intermediate_size=64, **config)
    if head == "causal":
        shape.update(vocab_size=VOCAB, num_kv_heads=2)
    a = trained_like(tiny_model(model_type, head, **shape)).float()
    b = scrambled_near_copy(a, seed)
    return a, b


def _watched(models, preprocessor) -> dict[str, object]:
    """Every object a merge must leave alone, by a readable label."""
    objects = {}
    for label, model in zip("AB", models, strict=True):
        objects[f"{label}.config"] = model.config
        for name, module in model.named_modules():
            objects[f"{label}:{name or '<model>'}"] = module
    if preprocessor is not None:
        objects["preprocessor"] = preprocessor
    return objects


def _record_writes(monkeypatch, objects: dict[str, object]) -> list[tuple[str, str]]:
    """Make the ``__setattr__`` and ``__delattr__`` of each object record (label, attribute) before
    writing; the classes are patched for the test only and other instances are not recorded."""
    label_of = {id(obj): label for label, obj in objects.items()}
    writes: list[tuple[str, str]] = []
    for cls in {type(obj) for obj in objects.values()}:
        setter, deleter = cls.__setattr__, cls.__delattr__  # the ones in force (maybe inherited)

        def recording_set(self, name, value, _set=setter):
            if id(self) in label_of:
                writes.append((label_of[id(self)], name))
            _set(self, name, value)

        def recording_del(self, name, _del=deleter):
            if id(self) in label_of:
                writes.append((label_of[id(self)], "del " + name))
            _del(self, name)

        monkeypatch.setattr(cls, "__setattr__", recording_set)
        monkeypatch.setattr(cls, "__delattr__", recording_del)
    return writes


def _snapshot(objects: dict[str, object]) -> dict[str, object]:
    """What each object holds: its attributes (by identity), its parameters, buffers and submodules
    (by identity), its hooks, and a config's serialised content."""
    shot = {}
    for label, obj in objects.items():
        state = {k: id(v) for k, v in vars(obj).items()}
        if isinstance(obj, torch.nn.Module):
            for table in ("_parameters", "_buffers", "_modules", *_HOOKS):
                state[table] = {k: id(v) for k, v in getattr(obj, table).items()}
        if hasattr(obj, "to_dict") and not isinstance(obj, torch.nn.Module):
            state["content"] = repr(obj.to_dict())
        shot[label] = state
    return shot


def _changed(before: dict, after: dict) -> list[str]:
    return [label for label in before if before[label] != after[label]]


def _merge_watched(monkeypatch, merger, calibration, allowed=frozenset()):
    """Merge with every write to the user's objects recorded; returns the result and the writes
    beyond ``allowed`` ((label, attribute) pairs)."""
    objects = _watched(merger.models, merger.preprocessor)
    before = _snapshot(objects)
    writes = _record_writes(monkeypatch, objects)
    result = merger.merge(calibration=calibration)
    monkeypatch.undo()
    unexpected = sorted(set(writes) - set(allowed))
    changed = [label for label in _changed(before, _snapshot(objects)) if not any(w[0] == label for w in allowed)]
    return result, unexpected, changed


def test_an_in_memory_merge_sets_no_attribute_on_the_models_their_configs_or_the_preprocessor(monkeypatch):
    a, b = _pair()
    merger = RaotMerger.from_models(a, b, preprocessor=tiny_tokenizer(VOCAB))
    result, writes, changed = _merge_watched(monkeypatch, merger, tiny_text_dataset(192, vocab_size=VOCAB))
    assert result.report["execution"] == "in memory"
    assert any(d["applied"] for d in result.report["decisions"])  # B was moved: every stage ran
    assert writes == [] and changed == []


def test_a_layerwise_merge_sets_no_attribute_on_the_models_their_configs_or_the_preprocessor(monkeypatch, tmp_path):
    a, b = _pair()
    for name, model in (("a", a), ("b", b)):
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer(VOCAB).save_pretrained(tmp_path / name)
    work = tmp_path / "work"
    work.mkdir()
    merger = RaotMerger.from_pretrained(tmp_path / "a", tmp_path / "b", offload="always", offload_dir=work)
    result, writes, changed = _merge_watched(monkeypatch, merger, tiny_text_dataset(192, vocab_size=VOCAB))
    assert result.report["execution"] == "layer-wise"
    assert any(d["applied"] for d in result.report["decisions"])
    assert writes == [] and changed == []
    objects = _watched(merger.models, merger.preprocessor)
    before = _snapshot(objects)
    writes = _record_writes(monkeypatch, objects)
    result.save_pretrained(tmp_path / "out")  # writing the offloaded result sets nothing either
    assert writes == [] and _changed(before, _snapshot(objects)) == []


def test_a_head_b_merge_writes_only_b_label_config_into_a(monkeypatch):
    """``head="b"`` documents that A takes B's label space (:func:`raot_hf.io.loading.adopt_head`):
    A's config gets B's label and head-module keys and A its ``num_labels``. Those writes, and only
    those, are allowed; with B's head of A's shape no parameter of A is replaced."""
    a, b = _pair("bert", "sequence")
    b.config.id2label = {0: "no", 1: "maybe", 2: "yes"}
    b.config.label2id = {v: k for k, v in b.config.id2label.items()}
    merger = RaotMerger.from_models(a, b, preprocessor=tiny_tokenizer(), head="b")
    allowed = {("A.config", key) for key in (*LABEL_KEYS, *HEAD_MODULE_KEYS)} | {("A:<model>", "num_labels")}
    result, writes, changed = _merge_watched(monkeypatch, merger, tiny_text_dataset(128), allowed)
    assert writes == [] and changed == []
    assert result.model.config.id2label == b.config.id2label
