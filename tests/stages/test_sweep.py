"""The one sweep after the solve (docs/design.md §5.7): the gate, the apply and the correction
layer by layer in one pass, the model-level check reading the merge as written."""

import pytest
import torch

from raot_hf import RaotMerger, schema_for
from raot_hf.adapters import is_decoder
from raot_hf.calibration import CalibrationConfig, iter_calibration_batches
from raot_hf.gate import Status
from raot_hf.io.offload import mapped_file_ranges
from raot_hf.stages.offload import offload_models
from raot_hf.testing import (
    architectures,
    clone,
    scrambled_near_copy,
    tiny_architecture,
    tiny_data,
    tiny_model,
    trained_like,
)

SHAPE = dict(hidden_size=32, num_heads=4, num_layers=2, intermediate_size=64)


def _pair(model_type: str, head: str):
    a = trained_like(tiny_model(model_type, head, seed=1, **SHAPE), seed=1).float()
    b = trained_like(tiny_model(model_type, head, seed=2, **SHAPE), seed=2).float()
    return a, b


def drifted_pair(model_type: str):
    """A trained-like model and a drifted scramble of it (the merge is neither A nor trivial)."""
    head, decoder = tiny_architecture(model_type).task_head, is_decoder(model_type)
    extra = dict(vocab_size=100, num_kv_heads=2) if decoder else {}
    a = trained_like(tiny_model(model_type, head, num_layers=4, hidden_size=32, num_heads=4,
                                intermediate_size=80, **extra)).float()  # fmt: skip
    pre, data = tiny_data(model_type, 192 if decoder else 128, **({"vocab_size": 100} if decoder else {}))
    return a, scrambled_near_copy(a, 1), pre, data


def _merge(a, b, model_type: str, n: int = 96, **options):
    pre, data = tiny_data(model_type, n)
    return RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, **options).merge(calibration=data)


def _state(result) -> dict:
    return {k: v.clone() for k, v in result.model.state_dict().items()}


def _layer_rows(result) -> list[tuple]:
    """Each layer decision as the layer decided it (accepted, or accepted and then vetoed by the
    model-level check), with its figures."""
    block = {Status.ACCEPTED, Status.VETOED}
    return [
        (d.transform, d.layer, d.status in block, d.gain, d.stderr, d.fidelity_estimate)
        for d in result.alignment.decisions
        if d.layer is not None
    ]


@pytest.mark.parametrize(("model_type", "head"), [("llama", "causal"), ("bert", "sequence")])
def test_the_sweep_decides_every_layer_as_the_gate_stage_and_checks_the_merge_as_written(model_type, head):
    """Independently trained pairs: the sweep's per-layer decisions are those of the gate stage, bit
    for bit (block-local, at the parents' own calls); its model-level check reads the merge as
    written — its aligned fidelity is the correction's held-out figure for the written merge, where
    the gate stage reads an uncorrected merge that is never written."""
    a, b = _pair(model_type, head)
    swept = _merge(a, b, model_type)
    staged = _merge(a, b, model_type, gate={"sweep": False})
    assert "sweep" in swept.report["timings"] and "gate" not in swept.report["timings"]
    assert "gate" in staged.report["timings"] and "sweep" not in staged.report["timings"]
    assert _layer_rows(swept) == _layer_rows(staged)
    competition = swept.report["merge"]["correction"]["competition"]
    assert swept.alignment.model_fidelity["aligned"] == pytest.approx(competition["written"], abs=1e-12)
    if competition["layers_kept"]:  # the correction changed the merge: the stage's figure is another merge's
        assert staged.alignment.model_fidelity["aligned"] != swept.alignment.model_fidelity["aligned"]
    assert swept.alignment.model_fidelity["identity"] == staged.alignment.model_fidelity["identity"]
    assert [c["passed"] for c in swept.report["checks"]] == [True]  # B′ ≡ B: B as the sweep built it


@pytest.mark.parametrize("offload", [False, True])
def test_a_veto_writes_the_plain_average_and_gives_b_back(offload, tmp_path):
    """A model-level check that cannot pass (a floor of 2, above any gain) vetoes after every layer
    was written: A's module holds the plain average, bit for bit as the merge without alignment,
    B's module its own parameters, and no correction ran — in memory, and layer by layer, where
    the layers were written in place into the working files and come back from the sweep's stash."""
    a, b = _pair("bert", "sequence")
    b_before = {k: v.clone() for k, v in b.state_dict().items()}
    pre, data = tiny_data("bert", 96)
    model_a, model_b = clone(a), clone(b)
    files = offload_models([model_a, model_b], ["A", "B"], schema_for(a), tmp_path) if offload else None
    merger = RaotMerger.from_models(model_a, model_b, preprocessor=pre, gate={"min_gain": 2.0}, working_files=files)
    vetoed = merger.merge(data)
    plain = _merge(a, b, "bert", alignment="none")
    assert vetoed.report["execution"] == ("layer-wise" if offload else "in memory")
    assert "sweep" in vetoed.report["timings"]
    assert not any(d.applied for d in vetoed.alignment.decisions)
    assert any(d.status == Status.VETOED for d in vetoed.alignment.decisions)
    state, reference = _state(vetoed), _state(plain)
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)
    assert all(torch.equal(v, b_before[k]) for k, v in model_b.state_dict().items())
    assert vetoed.report["merge"]["correction"]["method"] == "none"


def test_too_few_gate_examples_run_the_stages():
    """Fewer held-out examples than the merge gate needs (3 < 4): the sweep writes nothing and the
    stages run, giving the merge the stages give."""
    a, b = _pair("bert", "sequence")
    few = _merge(a, b, "bert", n=12, gate={"min_heldout_tokens": 1})
    staged = _merge(a, b, "bert", n=12, gate={"min_heldout_tokens": 1, "sweep": False})
    assert "sweep" in few.report["timings"] and "apply" in few.report["timings"]
    statuses = {d.status for d in few.alignment.decisions}
    assert statuses == {Status.TOO_FEW_EXAMPLES} == {d.status for d in staged.alignment.decisions}
    state, reference = _state(few), _state(staged)
    assert all(torch.equal(state[k], reference[k]) for k in state)


@pytest.mark.parametrize(
    "options",
    [{"merge_rule": "regmean"}, {"correction": "none"}, {"refine": {"steps": 2}}, {"gate": {"objective": "alignment"}}],
)
def test_merges_the_sweep_does_not_serve_run_the_stages(options):
    """A rule that reads the aligned models whole (RegMean), no correction, the learned alignment,
    the alignment objective: the gate, the apply and the merge run as stages."""
    a, b = _pair("bert", "sequence")
    result = _merge(a, b, "bert", **options)
    assert "sweep" not in result.report["timings"]


def _outputs(result, pre, data) -> torch.Tensor:
    batch = next(iter_calibration_batches(data, pre, CalibrationConfig(num_samples=32, batch_size=32)))
    with torch.no_grad():
        out = result.model(**batch.inputs)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).double()


@pytest.mark.parametrize("model_type", architectures())
def test_the_sweep_writes_the_stages_merge_to_round_off(model_type):
    """A drifted scramble on every architecture: the one sweep, which reads the parents' outputs
    kept from the calibration pass (B's mapped into B′'s basis) where the stages run A's and B′'s
    layers again, decides alike, keeps the same layers' corrections, and writes a merge that
    computes what the stages' merge computes, to the round-off of those outputs (the correction's
    least squares, nearly flat on a drifted scramble, moves its weights by more). (The refit that
    follows takes its targets from B in the sweep and from B′ in the stages: off here, compared
    below.)"""
    a, b, pre, data = drifted_pair(model_type)
    off = {"refit": {"mode": "off"}}
    swept = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, **off).merge(calibration=data)
    staged = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, gate={"sweep": False}, **off).merge(data)
    assert "sweep" in swept.report["timings"] and "sweep" not in staged.report["timings"]
    # a writer a LayerScale folds into (DINOv2, §9.8) is read from a run of the parents
    layer_scale = any(fold.writers for fold in schema_for(a).folds)
    kept_from = "parents run again" if layer_scale else "calibration pass"
    assert swept.report["merge"]["correction"]["parent_outputs"] == kept_from
    assert [(d.transform, d.layer, d.applied) for d in swept.alignment.decisions] == [
        (d.transform, d.layer, d.applied) for d in staged.alignment.decisions
    ]
    assert any(d.applied for d in swept.alignment.decisions)

    def kept(result):
        return [e.get("kept") for e in result.report["merge"]["correction"]["layers"]]

    assert kept(swept) == kept(staged)
    got, reference = _outputs(swept, pre, data), _outputs(staged, pre, data)
    assert float((got - reference).norm() / reference.norm()) < 1e-4


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_the_default_refit_keeps_the_sweep_and_its_targets_are_the_stages_to_round_off(model_type):
    """The default refit follows the parents' predictions, which B gives as B′ does (an exact
    symmetry): the merge keeps its one sweep, the refit runs after it, and its loss before the refit
    is the three stages' to round-off (their targets come from B′)."""
    a, b, pre, data = drifted_pair(model_type)
    steps = {"refit": {"steps": 40}}  # a tiny merge's budget affords too few steps to descend
    swept = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, **steps).merge(calibration=data)
    staged = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, gate={"sweep": False}, **steps).merge(data)
    assert "sweep" in swept.report["timings"] and "refit" in swept.report["timings"]
    one, three = swept.report["refit"], staged.report["refit"]
    assert one["ran"] and three["ran"] and one["target"] == "output"
    assert one["targets_from"] == three["targets_from"] == "calibration pass"  # B's predictions are B′'s
    assert one["steps"] > 0 and three["steps"] > 0  # a drifted pair: something to follow, a descent ran
    assert one["heldout_loss_before"] == pytest.approx(three["heldout_loss_before"], rel=1e-2)


def test_a_merge_of_loaded_checkpoints_equals_the_merge_of_their_copies_in_memory(tmp_path):
    """Checkpoints loaded from files hand their non-layer pages back once the sweep has captured
    its inputs (docs/design.md §5.7): read again from the files, they give the merge that copies of
    the same models in memory give, bit for bit."""
    a, b = _pair("bert", "sequence")
    pre, data = tiny_data("bert", 96)
    for name, model in (("A", a), ("B", b)):
        model.save_pretrained(tmp_path / name)
        pre.save_pretrained(tmp_path / name)
    off = {"refit": {"mode": "off"}}  # the default refit's steps follow the host's time: not compared here
    merger = RaotMerger.from_pretrained(tmp_path / "A", tmp_path / "B", **off)
    table = merger.model_a.get_input_embeddings().weight
    assert any(lo <= table.data_ptr() < hi for lo, hi in mapped_file_ranges())  # what this test is about
    loaded = merger.merge(calibration=data)
    copies = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, **off).merge(calibration=data)
    assert "sweep" in loaded.report["timings"] and any(d.applied for d in loaded.alignment.decisions)
    state, reference = _state(loaded), _state(copies)
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)


def test_without_room_to_keep_the_parents_outputs_the_sweep_runs_them_again(monkeypatch):
    """Where the kept outputs would not fit in the temporary directory's share, nothing is kept and
    the sweep runs the parents' layers again, as the stages do: the same merge, bit for bit."""
    import raot_hf.calibration.kept as kept

    monkeypatch.setattr(kept, "DISK_SHARE", 0.0)
    a, b, pre, data = drifted_pair("bert")
    off = {"refit": {"mode": "off"}}
    swept = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, **off).merge(calibration=data)
    staged = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, gate={"sweep": False}, **off).merge(data)
    assert swept.report["merge"]["correction"]["parent_outputs"] == "parents run again"
    state, reference = _state(swept), _state(staged)
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)
