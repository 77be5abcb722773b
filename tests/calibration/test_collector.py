"""The two ways the collector runs A and B: in lockstep (a helper thread) and in turn (one thread)."""

import pytest
import torch

from raot_hf.adapters import schema_for
from raot_hf.calibration import CalibrationConfig, iter_calibration_batches
from raot_hf.calibration.collector import StatisticsCollector
from raot_hf.symmetry import random_group_element
from raot_hf.symmetry.apply import transform_model
from raot_hf.testing import architectures, clone, tiny_data, tiny_model, trained_like


def _pair(model_type):
    a = trained_like(tiny_model(model_type, "base", num_layers=2, hidden_size=32, intermediate_size=48))
    b = clone(a)
    schema = schema_for(a)
    transform_model(b, schema, random_group_element(schema, seed=3))
    pre, data = tiny_data(model_type, 24)
    return a, b, list(iter_calibration_batches(data, pre, CalibrationConfig(batch_size=8)))


def _in_turn(collector, batch):
    inputs = dict(batch.inputs)
    if collector.begin(batch):
        collector.observe_in_turn(lambda: collector.model_a(**inputs), lambda: collector.model_b(**inputs))
        collector.finish(batch)


@pytest.mark.parametrize("model_type", architectures(experts=None))
@pytest.mark.parametrize("phase", ["fit", "heldout"])
def test_in_turn_folds_bit_for_bit_what_the_lockstep_folds(model_type, phase):
    """A's forward run to its end with its activations held, then B's, folds the same pairs in the
    same order as the two forwards in lockstep: every sum equal bit for bit, on every family (none
    writes an observed activation in place after its hook, which the in-turn run would refuse)."""
    a, b, batches = _pair(model_type)
    schema = schema_for(a)
    with torch.no_grad():
        with StatisticsCollector(a, b, schema, phase=phase, grams=True) as lockstep:
            for batch in batches:
                lockstep.update(batch)
        with StatisticsCollector(a, b, schema, phase=phase, grams=True) as in_turn:
            for batch in batches:
                _in_turn(in_turn, batch)
    want, got = lockstep.stats.tensors(), in_turn.stats.tensors()
    assert len(got) == len(want) and in_turn.stats.examples == lockstep.stats.examples > 0
    assert any(t.abs().max() > 0 for t in want if t.numel())
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)


def test_an_activation_written_in_place_after_its_hook_is_refused_in_turn():
    """The lockstep reads A's activation at its hook, before anything after it runs; held for B,
    it must still be what the hook saw: a later in-place write to it is refused, not folded."""
    a, b, batches = _pair("llama")
    schema = schema_for(a)
    q_module = a.get_submodule(schema.layers[0].heads.q_module)
    with StatisticsCollector(a, b, schema) as collector:
        handle = q_module.register_forward_hook(lambda _m, _i, out: out.mul_(2.0))  # after the collector's
        try:
            with torch.no_grad():
                collector.update(batches[0])  # the lockstep folded q before the write
                with pytest.raises(RuntimeError, match=r"in place.*offload='never'"):
                    _in_turn(collector, batches[1])
        finally:
            handle.remove()


def test_an_activation_of_one_model_only_is_refused_in_turn():
    a, b, batches = _pair("bert")
    inputs = dict(batches[0].inputs)
    with StatisticsCollector(a, b, schema_for(a)) as collector, torch.no_grad():
        collector.begin(batches[0])
        with pytest.raises(RuntimeError, match="model A produced an activation .* that model B did not"):
            collector.observe_in_turn(lambda: a(**inputs), lambda: None)
        collector.begin(batches[0])
        with pytest.raises(RuntimeError, match="model B produced an activation .* that model A did not"):
            collector.observe_in_turn(lambda: None, lambda: b(**inputs))
