"""Layer-wise execution with the models offloaded to working files (docs/design.md §7.4): the same
merge as in memory, bit for bit, on every architecture; weights released layer by layer; memory
caps and the offload directory checked before any work."""

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file

from raot_hf import RaotError, RaotMerger, merge_checkpoints
from raot_hf.adapters import is_decoder
from raot_hf.cli import main
from raot_hf.io.offload import WorkingFiles, mapped_file_ranges, offload_model, release_mapped
from raot_hf.stages.offload import choose_offload, layerwise_bytes, offload_models
from raot_hf.testing import (
    architectures,
    clone,
    example_inputs,
    output_deviation,
    scrambled_near_copy,
    tiny_architecture,
    tiny_data,
    tiny_model,
    trained_like,
)

ARCHS = architectures()
VOCAB = 100
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def _pair(model_type, seed=1):
    """A trained-like model and a drifted scramble of it (so the merge is neither A nor trivial)."""
    shape = dict(hidden_size=32, num_heads=4, num_layers=4, intermediate_size=80)
    head = tiny_architecture(model_type).task_head
    if is_decoder(model_type):
        a = trained_like(tiny_model(model_type, head, vocab_size=VOCAB, num_kv_heads=2, **shape)).float()
        pre, data = tiny_data(model_type, 192, vocab_size=VOCAB)
    else:
        a = trained_like(tiny_model(model_type, head, **shape)).float()
        pre, data = tiny_data(model_type, 128)
    b = scrambled_near_copy(a, seed)
    return a, b, pre, data


def _merge(a, b, pre, data, tmp_path, offload: bool):
    """The merge in memory or layer by layer, the refit off (``auto`` refits in memory only,
    docs/design.md §6.11: the layer-wise merge is the in-memory merge without it), the correction
    in the chunks a layer-wise merge fits it in by default."""
    a, b = clone(a), clone(b)
    files = None
    if offload:
        from raot_hf.adapters import schema_for

        files = offload_models([a, b], ["A", "B"], schema_for(a), tmp_path)
        assert files.of(a) is not None and files.of(b) is not None
    # the correction in chunks of 16 examples in both (layer by layer its default, §6.7)
    options = {"refit": {"mode": "off"}, "correction": {"batch_size": 16}}
    return RaotMerger.from_models(a, b, preprocessor=pre, working_files=files, **options).merge(calibration=data)


@pytest.mark.parametrize("model_type", architectures(experts=None))  # mixtures of experts too (§10)
def test_layerwise_merge_is_the_in_memory_merge(model_type, tmp_path):
    """Same decisions, same B′ ≡ B deviation, and the same merged weights to float rounding: the
    calibration pass ran layer by layer (the stream moment sums its sites in another order)."""
    a, b, pre, data = _pair(model_type)
    memory = _merge(a, b, pre, data, tmp_path, offload=False)
    layerwise = _merge(a, b, pre, data, tmp_path, offload=True)
    assert layerwise.report["execution"] == "layer-wise" and memory.report["execution"] == "in memory"
    # both decided, applied and corrected in the one sweep after the solve (docs/design.md §5.7)
    assert "sweep" in layerwise.report["timings"] and "sweep" in memory.report["timings"]
    decisions = [(d["transform"], d["layer"], d["applied"]) for d in memory.report["decisions"]]
    assert decisions == [(d["transform"], d["layer"], d["applied"]) for d in layerwise.report["decisions"]]
    assert any(applied for *_, applied in decisions)  # the gate moved B: apply, fold and correction all ran
    got, want = dict(layerwise.model.state_dict()), dict(memory.model.state_dict())
    assert set(got) == set(want)
    worst = max(float((got[k] - w).abs().max() / w.abs().max().clamp_min(1e-30)) for k, w in want.items())
    assert worst <= 1e-5, worst
    x = example_inputs(memory.model)
    assert output_deviation(memory.model, layerwise.model, x, relative=True) <= 1e-6
    # the B′ ≡ B deviations are float round-off of different summation orders: each is held to the
    # check's own bound, never to the other (two round-off values need not agree to any ratio)
    for check in (layerwise.report["checks"][0], memory.report["checks"][0]):
        assert check["passed"] and check["value"] <= check["threshold"], check
    assert not list(tmp_path.iterdir())  # the working files were unlinked as soon as they were mapped


def test_offloading_keeps_values_dtypes_and_ties(tmp_path):
    model = tiny_model("llama", "causal", vocab_size=VOCAB, tie_word_embeddings=True, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs = {"input_ids": torch.randint(0, VOCAB, (2, 7))}
    with torch.no_grad():
        want = model(**inputs).logits
    attributes = set(vars(model))
    files = WorkingFiles()
    weights = offload_model(model, tmp_path, "A", files)
    assert set(vars(model)) == attributes and files.of(model) is weights  # nothing is hung on the model
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    for name, p in model.named_parameters():
        assert weights.owns(p) is not None and p.dtype == before[name].dtype and torch.equal(p, before[name])
    files.release_all()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, want)
        model.model.norm.weight.mul_(2.0)  # a write lands in the working file and survives a release
    files.release_all()
    assert torch.equal(model.model.norm.weight, 2 * before["model.norm.weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", ARCHS)
def test_checkpoints_are_read_into_working_files_as_from_pretrained_loads_them(model_type, dtype, tmp_path):
    """Read tensor by tensor into the working file: every parameter (ViT's under its legacy name on
    disk), dtype (DeBERTa keeps its q/v biases in float32), buffer and tie as ``from_pretrained``
    gives them."""
    from raot_hf.io.loading import ModelSource, load_config, load_model, model_class
    from raot_hf.io.offload import load_offloaded

    tiny_model(model_type, tiny_architecture(model_type).task_head, dtype=dtype).save_pretrained(tmp_path / "m")
    source = ModelSource(str(tmp_path / "m"))
    config = load_config(source, "A")
    want = load_model(source, "A", config=config)
    files = WorkingFiles()
    got = load_offloaded(model_class(config), tmp_path / "m", config, "auto", tmp_path, "A", files)
    assert files.of(got) is not None and not got.training
    params, expected = dict(got.named_parameters()), dict(want.named_parameters())
    assert set(params) == set(expected)
    for name, p in expected.items():
        assert params[name].dtype == p.dtype and torch.equal(params[name], p) and files.of(got).owns(params[name])
    buffers, expected = dict(got.named_buffers()), dict(want.named_buffers())
    assert set(buffers) == set(expected) and all(torch.equal(buffers[k], v) for k, v in expected.items())
    if (
        want.get_output_embeddings() is not None
        and want.get_output_embeddings().weight is want.get_input_embeddings().weight
    ):
        assert got.get_output_embeddings().weight is got.get_input_embeddings().weight


def _status_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@linux_only
def test_each_layer_leaves_memory_after_its_forward(tmp_path):
    """A forward touches every layer, yet the resident file pages afterwards are the trunk's, not
    the layers': each layer's pages were released as soon as it returned."""
    from raot_hf.adapters import schema_for

    model = tiny_model("llama", "base", vocab_size=8, hidden_size=256, num_layers=8, intermediate_size=1024,
                       dtype=torch.float32)  # fmt: skip
    size = sum(p.numel() * p.element_size() for p in model.parameters()) // 1024
    files = offload_models([model], ["A"], schema_for(model), tmp_path)
    files.release_all()
    resident = _status_kib("RssFile")
    with torch.no_grad():
        model(input_ids=torch.randint(0, 8, (1, 16)))
    assert _status_kib("RssFile") - resident < 0.2 * size  # one layer is 1/8 of the weights
    with torch.no_grad():
        total = sum(float(p.sum()) for p in model.parameters())  # outside a forward: every page read back
    assert total == total and _status_kib("RssFile") - resident > 0.8 * size
    files.release_all()
    assert _status_kib("RssFile") - resident < 0.05 * size


@linux_only
@pytest.mark.parametrize("model_type,head", [("llama", "base"), ("gpt2", "causal")])
def test_writing_an_offloaded_model_copies_nothing_and_leaves_no_pages_behind(tmp_path, model_type, head):
    """The shard writer reads each weight from the working file once, with no copy of the shard
    (the weights share the file's storage, which safetensors' writer would clone whole), and drops
    each tensor's pages once written. The names written are the in-memory model's (tied aliases
    dropped, GPT-2's LM head included), with the same values."""
    from raot_hf.adapters import schema_for
    from raot_hf.outputs.shards import weights_to_save, write_safetensors_shards

    model = tiny_model(model_type, head, vocab_size=8, hidden_size=256, num_layers=8, intermediate_size=1024,
                       dtype=torch.float32)  # fmt: skip
    expected = {k: v.clone() for k, v in weights_to_save(model).items()}
    size = sum(p.numel() * p.element_size() for p in model.parameters()) // 1024
    files = offload_models([model], ["A"], schema_for(model), tmp_path)
    files.release_all()
    file_pages, anonymous = _status_kib("RssFile"), _status_kib("RssAnon")
    (tmp_path / "out").mkdir()
    write_safetensors_shards(tmp_path / "out", weights_to_save(model, files), 10**9, working_files=files)
    assert _status_kib("RssFile") - file_pages < 0.05 * size
    assert _status_kib("RssAnon") - anonymous < 0.5 * size
    from safetensors.torch import load_file

    written = load_file(str(next((tmp_path / "out").glob("*.safetensors"))))
    assert set(written) == set(expected) and all(torch.equal(written[k], expected[k]) for k in written)


def _saved_pair(root, model_type="llama"):
    a, b, pre, data = _pair(model_type)
    for name, model in (("a", a), ("b", b)):
        model.save_pretrained(root / name)
        pre.save_pretrained(root / name)
    data.to_csv(root / "cal.csv")
    return [str(root / "a"), str(root / "b")], str(root / "cal.csv")


def _weights(directory):
    out = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_checkpoints_merged_layer_wise_give_the_in_memory_merge(tmp_path, monkeypatch):
    """The in-memory merge's weights (to float rounding: the calibration ran layer by layer), with
    no model ever loaded whole: each is read tensor by tensor into its working file."""
    import transformers

    paths, cal = _saved_pair(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    _, memory = merge_checkpoints(*paths, out=tmp_path / "m", calibration=cal, offload="never")

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded whole")

    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", refuse)
    _, layerwise = merge_checkpoints(*paths, out=tmp_path / "l", calibration=cal, offload="always", offload_dir=work)
    assert memory["execution"] == "in memory" and layerwise["execution"] == "layer-wise"
    a, b = _weights(tmp_path / "m"), _weights(tmp_path / "l")
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
    assert [d["applied"] for d in memory["decisions"]] == [d["applied"] for d in layerwise["decisions"]]
    assert json.loads((tmp_path / "l" / "raot_report.json").read_text())["execution"] == "layer-wise"
    assert not list(work.iterdir())


def test_a_cap_between_the_two_needs_runs_layer_wise_and_one_below_both_is_refused(tmp_path):
    from raot_hf.io.loading import ModelSource, load_config
    from raot_hf.stages.offload import IN_MEMORY_FACTOR, RUNTIME_BYTES, checkpoint_bytes, largest_tensor_bytes

    paths, cal = _saved_pair(tmp_path)
    sources = [ModelSource(p) for p in paths]
    sizes = [checkpoint_bytes(s) for s in sources]
    hf_config = load_config(sources[0], "A")
    in_memory = RUNTIME_BYTES + IN_MEMORY_FACTOR * sum(sizes)
    least = layerwise_bytes(sizes, hf_config, largest=largest_tensor_bytes(sources[0]))
    assert least < in_memory and least < layerwise_bytes(sizes, hf_config)  # read tensor by tensor: no whole model
    assert choose_offload("auto", sources, hf_config, cap=int(in_memory) + 1) is False
    assert choose_offload("auto", sources, hf_config, cap=least + 1) is True
    args = ["merge", *paths, "--calibration", cal]
    res = CliRunner().invoke(main, [*args, "--max-memory", str(least + 1), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "o" / "raot_report.json").read_text())["execution"] == "layer-wise"
    for extra in (["--max-memory", str(least - 1)], ["--max-memory", str(int(in_memory) - 1), "--offload", "never"]):
        out = tmp_path / "refused"
        res = CliRunner().invoke(main, [*args, *extra, "--out", str(out)])
        assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
        assert "--max-memory" in res.stderr and not out.exists()


def test_a_checkpoint_missing_a_parameter_is_loaded_whole_then_offloaded(tmp_path):
    from safetensors.torch import save_file

    from raot_hf.io.loading import ModelSource, load_config, model_class
    from raot_hf.io.offload import load_offloaded
    from raot_hf.stages.offload import load_layerwise

    tiny_model("bert", "sequence", dtype=torch.float32).save_pretrained(tmp_path / "m")
    state = load_file(tmp_path / "m" / "model.safetensors")
    del state["classifier.weight"]  # from_pretrained initialises it; a tensor-wise read cannot
    save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    source = ModelSource(str(tmp_path / "m"))
    config = load_config(source, "A")
    files = WorkingFiles()
    assert load_offloaded(model_class(config), tmp_path / "m", config, "auto", tmp_path, "A", files) is None
    assert len(files) == 0
    model = load_layerwise(source, "A", config, "auto", tmp_path, files)
    assert files.of(model) is not None and files.of(model).owns(model.classifier.weight)


def test_an_offload_directory_without_room_is_refused(tmp_path, monkeypatch):
    import shutil

    model = tiny_model("bert", "base", dtype=torch.float32)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: shutil._ntuple_diskusage(1, 0, 1))
    files = WorkingFiles()
    with pytest.raises(RaotError, match="--offload-dir"):
        offload_model(model, tmp_path, "A", files)
    assert files.of(model) is None and not list(tmp_path.iterdir())
    with pytest.raises(RaotError, match="does not exist"):
        offload_model(model, tmp_path / "missing", "A", files)
    with pytest.raises(RaotError, match="offload must be one of"):
        choose_offload("sometimes", [], None)


def test_an_offload_directory_without_room_to_park_the_trunk_is_refused_before_calibration(tmp_path, monkeypatch):
    """Room for both working files but not, beside them, for the parameters outside the layers parked
    while the layers run: refused at load (the calibration never starts), nothing left behind."""
    import shutil

    from raot_hf.io.offload import DISK_MARGIN
    from raot_hf.stages import calibrate

    paths, cal = _saved_pair(tmp_path)
    model = _pair("llama")[0]
    outside = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("model.layers.")
    )
    work = tmp_path / "work"
    work.mkdir()

    def started(*args, **kwargs):
        raise AssertionError("the calibration started")

    def disk(after_files: int):
        calls = []

        def usage(_path):  # ample for the two working files, then what is left beside them
            calls.append(1)
            free = 1 << 40 if len(calls) <= 2 else after_files
            return shutil._ntuple_diskusage(free, 0, free)

        return usage

    monkeypatch.setattr(shutil, "disk_usage", disk(DISK_MARGIN + outside - 1))
    with (
        monkeypatch.context() as patch,
        pytest.raises(RaotError, match=r"parking the parameters outside.*--offload-dir"),
    ):
        patch.setattr(calibrate, "run_phase", started)
        merge_checkpoints(*paths, out=tmp_path / "m", calibration=cal, offload="always", offload_dir=work)
    assert not list(work.iterdir()) and not (tmp_path / "m").exists()
    monkeypatch.setattr(shutil, "disk_usage", disk(DISK_MARGIN + outside))  # exactly enough: the merge runs
    _, report = merge_checkpoints(*paths, out=tmp_path / "m", calibration=cal, offload="always", offload_dir=work)
    assert report["execution"] == "layer-wise"


@linux_only
def test_without_a_cap_the_available_memory_decides(tmp_path):
    from raot_hf.io.loading import ModelSource, load_config
    from raot_hf.stages.offload import available_memory

    free = available_memory()
    assert 0 < free <= _status_kib("VmSize") * 1024 + int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    paths, _ = _saved_pair(tmp_path)
    sources = [ModelSource(p) for p in paths]
    hf_config = load_config(sources[0], "A")
    assert choose_offload("auto", sources, hf_config) is False  # a few hundred kB fit anywhere
    assert choose_offload("always", sources, hf_config) is True
    assert choose_offload("never", sources, hf_config) is False


@pytest.mark.parametrize("model_type", ["bert", "qwen2"])
def test_layer_by_layer_calibration_sums_and_early_solves_match_the_batch_by_batch_pass(model_type):
    """The calibration pass layer by layer: every sum the batch-by-batch pass takes (Qwen2's first
    layer attends through a sliding window, the others do not: each layer keeps its own mask),
    and each layer solved as soon as it is complete equals the solve from the finished sums, with
    its f × f co-moment allocated only while its layer runs."""
    from raot_hf import RaotConfig
    from raot_hf.adapters import schema_for
    from raot_hf.calibration import CalibrationConfig, iter_calibration_batches
    from raot_hf.calibration.collector import StatisticsCollector
    from raot_hf.calibration.sequential import observe_layer_by_layer
    from raot_hf.estimators import EstimationRequest
    from raot_hf.estimators.builtin import activation_candidates, solve_layer_early
    from raot_hf.gate.fidelity import layer_module_names

    a, b, pre, data = _pair(model_type)
    schema, config = schema_for(a), RaotConfig()
    batches = list(iter_calibration_batches(data, pre, CalibrationConfig(column="text", batch_size=16), split="fit"))
    whole = StatisticsCollector(a, b, schema, phase="fit")
    for batch in batches:
        whole.update(batch)
    layered = StatisticsCollector(a, b, schema, phase="fit", defer_mlp=True)
    stats = layered.stats
    fit = stats.fit
    assert all(m.comoment.numel() == 0 for m in fit.mlp + fit.q + fit.k + fit.ctx)
    alive, solved = [], {}

    def solve(i):
        alive.append([j for j in range(4) if all(g[j].comoment.numel() for g in (fit.mlp, fit.q, fit.k, fit.ctx))])
        assert not any(g[j].comoment.numel() for g in (fit.mlp, fit.q, fit.k, fit.ctx) for j in range(4) if j != i)
        solve_layer_early(stats, schema, config, i, solved)

    folded = observe_layer_by_layer(layered, batches, layer_module_names(a, schema), on_layer=solve)
    assert alive == [[0], [1], [2], [3]]  # one layer's f × f sum at a time
    assert folded == len(batches) and stats.examples == whole.stats.examples
    assert all(m.comoment.numel() == 0 for m in fit.mlp) and set(solved) == {0, 1, 2, 3}
    for got, want in zip(fit.q + fit.ctx + [fit.stream], whole.stats.fit.q + whole.stats.fit.ctx
                         + [whole.stats.fit.stream], strict=True):  # fmt: skip
        for x, y in zip(got.tensors(), want.tensors(), strict=True):  # per-coordinate sums (co-moments freed)
            if x.numel():
                assert torch.allclose(x.double(), y.double(), rtol=1e-9, atol=1e-9)
    early, _ = activation_candidates(EstimationRequest(stats, schema, {}, {}, config, False, solved_layers=solved))
    late, _ = activation_candidates(EstimationRequest(whole.stats, schema, {}, {}, config, False))
    assert [type(t) for t in early] == [type(t) for t in late]
    for t, u in zip(early, late, strict=True):
        for x, y in zip(vars(t).values(), vars(u).values(), strict=True):
            assert not isinstance(x, torch.Tensor) or torch.allclose(x.double(), y.double(), atol=1e-8)


@linux_only
def test_parked_tensors_are_the_same_values_in_a_working_file_with_their_ties(tmp_path):
    """What a layer-by-layer pass holds from its first layer to its last goes to a file of its own:
    equal values, dtypes and shapes, one view for names that shared one tensor, no resident pages
    until read; an in-memory merge (no working file) keeps its tensors as they are."""
    table = torch.randn(512, 256)
    tensors = {"embed.weight": table, "head.weight": table, "norm.weight": torch.randn(256).to(torch.bfloat16)}
    assert WorkingFiles().park(tensors, "trunk") is tensors
    files = WorkingFiles()
    model = tiny_model("llama", "base", vocab_size=VOCAB, dtype=torch.float32)
    offload_model(model, tmp_path, "A", files)  # the merge's offloaded model, beside which the file lies
    own = dict(model.named_parameters())["norm.weight"]  # a parent's parameter: in its working file already
    assert files.park({"norm.weight": own}, "trunk")["norm.weight"] is own
    resident = _status_kib("RssFile")
    parked = files.park(tensors, "trunk")
    assert _status_kib("RssFile") - resident < table.numel() * 4 // 1024 // 4  # its pages were dropped
    assert parked.keys() == tensors.keys() and parked["embed.weight"] is parked["head.weight"]
    ranges = mapped_file_ranges()
    for name, t in tensors.items():
        p = parked[name]
        start = p.untyped_storage().data_ptr()
        assert p is not t and p.dtype == t.dtype and torch.equal(p, t)
        assert any(lo <= start < hi for lo, hi in ranges)  # a file's memory, not the heap's


def test_release_mapped_hands_back_a_checkpoints_pages_and_keeps_its_values(tmp_path):
    """A loaded checkpoint's embedding table, read whole: its resident pages go back to the file and
    a later read gives the same values (from the file, not zeros); memory that is no file's is left
    as it is."""
    config = transformers.BertConfig(
        vocab_size=4096, hidden_size=256, num_hidden_layers=1, num_attention_heads=4, intermediate_size=256
    )
    transformers.BertModel(config).save_pretrained(tmp_path / "m")
    model = transformers.BertModel.from_pretrained(tmp_path / "m")
    table = model.embeddings.word_embeddings.weight.detach()  # 4 MiB
    assert any(lo <= table.data_ptr() < hi for lo, hi in mapped_file_ranges())  # what this test is about
    original = table.clone()
    heap = torch.randn(1024, 1024)
    heap_before = heap.clone()
    resident = _status_kib("RssFile")
    release_mapped([table, heap])
    assert resident - _status_kib("RssFile") > 3 * table.numel() * 4 // 1024 // 4  # most of its 4 MiB
    assert torch.equal(table, original) and torch.equal(heap, heap_before)


def test_layer_by_layer_the_correction_fits_in_chunks_by_default(tmp_path):
    """``correction.batch_size="auto"``: 64 examples per forward in memory (M's layer once per
    layer), 16 layer by layer, where memory is what the merge is short of (docs/design.md §6.7)."""
    a, b, pre, data = _pair("llama")
    off = {"refit": {"mode": "off"}}
    memory = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, **off).merge(calibration=data)
    a2, b2 = clone(a), clone(b)
    from raot_hf.adapters import schema_for

    files = offload_models([a2, b2], ["A", "B"], schema_for(a2), tmp_path)
    layerwise = RaotMerger.from_models(a2, b2, preprocessor=pre, working_files=files, **off).merge(calibration=data)
    per_forward = [r.report["merge"]["correction"]["examples_per_forward"] for r in (memory, layerwise)]
    assert per_forward == [min(64, memory.report["merge"]["correction"]["examples"]), 16]
