"""The end-to-end refit of the merged model (docs/design.md §6.11): opt-in, norms and biases only,
early-stopped on held-out examples and kept only when it beats the merge without it."""

import pytest
import torch

from raot_hf import RaotConfig, RaotError, RaotMerger, schema_for, scramble
from raot_hf.stages.offload import offload_models
from raot_hf.stages.refit import refit_parameter_names
from raot_hf.testing import clone, scrambled_near_copy, tiny_data, tiny_model, trained_like

SHAPE = dict(hidden_size=32, num_heads=4, num_layers=2, intermediate_size=64)


def _bert(seed=0):
    return trained_like(tiny_model("bert", "sequence", seed=seed, **SHAPE), seed=seed).float()


def _merge(a, b, n=96, **options):
    pre, data = tiny_data("bert", n)
    return RaotMerger.from_models(a, b, preprocessor=pre, **options).merge(calibration=data)


def _equal_states(x, y) -> bool:
    sx, sy = x.state_dict(), y.state_dict()
    return sx.keys() == sy.keys() and all(torch.equal(sx[k], sy[k]) for k in sx)


def test_refit_off_changes_nothing():
    """``refit.steps`` 0 (the default) is no refit whatever the other refit options say: the same
    weights, bit for bit, no ``refit`` record and no refit time."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    plain = _merge(clone(a), clone(b))
    off = _merge(clone(a), clone(b), refit={"steps": 0, "lr": 0.5, "examples": 3, "eval_every": 1, "patience": 1})
    assert _equal_states(plain.model, off.model)
    assert "refit" not in off.report and "refit" not in off.report["timings"]
    assert off.report["settings"]["refit"]["steps"] == 0


def test_refit_of_a_pair_that_differs_lowers_the_heldout_loss_and_is_reported():
    """A scrambled, perturbed copy: the merge misses both parents, and refitting its norms and biases
    to the parents' mix lowers the held-out loss; the refit is kept, only norms and biases move,
    and the report records the run."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    plain = _merge(clone(a), clone(b))
    refit = _merge(clone(a), clone(b), refit={"steps": 60, "lr": 0.01, "eval_every": 10})
    record = refit.report["refit"]
    assert record["kept"], record["reason"]
    assert record["heldout_loss_after"] < record["heldout_loss_before"]
    assert 0 < record["best_step"] <= record["steps"] <= 60
    assert record["heldout_examples"] >= 4 and record["examples"] > 0 and record["parameters"] > 0
    assert record["curve"] and record["seconds"] > 0 and refit.report["timings"]["refit"] > 0
    allowed = set(refit_parameter_names(refit.model, set(schema_for(refit.model).head_params)))
    before, after = plain.model.state_dict(), refit.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and moved <= allowed
    assert not any(k.endswith("weight") and after[k].ndim == 2 for k in moved)  # no weight matrix


def test_a_refit_of_every_trunk_parameter_moves_weight_matrices_too():
    """``refit.parameters="all"``: the weight matrices are fitted with the norms and biases (the
    task head still not); the held-out loss falls and the refit is kept."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    plain = _merge(clone(a), clone(b))
    refit = _merge(clone(a), clone(b), refit={"steps": 40, "lr": 1e-3, "eval_every": 10, "parameters": "all"})
    record = refit.report["refit"]
    assert record["kept"], record["reason"]
    assert record["heldout_loss_after"] < record["heldout_loss_before"]
    head = set(schema_for(refit.model).head_params)
    before, after = plain.model.state_dict(), refit.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(after[k].ndim == 2 for k in moved) and not moved & head


def test_a_refit_that_cannot_help_is_dropped_and_the_merge_is_unchanged():
    """B = scramble(A): the merge is A, already the parents' mix (loss ~0); no refit can beat it on
    held-out examples, so it is dropped and the weights are the no-refit merge's, bit for bit."""
    a = _bert()
    b = clone(a)
    scramble(b, seed=1)
    plain = _merge(clone(a), clone(b))
    refit = _merge(clone(a), clone(b), refit={"steps": 30, "eval_every": 5, "patience": 2})
    record = refit.report["refit"]
    assert not record["kept"] and record["best_step"] == 0
    assert record["heldout_loss_before"] < 1e-9
    assert _equal_states(plain.model, refit.model)


def test_too_few_heldout_examples_leave_the_merge_alone():
    """Three held-out examples cannot judge a refit: it does not run, and the merge is unchanged."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    plain = _merge(clone(a), clone(b), n=12)
    refit = _merge(clone(a), clone(b), n=12, refit={"steps": 20})
    record = refit.report["refit"]
    assert record["heldout_examples"] == 3 and record["steps"] == 0 and not record["kept"]
    assert "held-out examples" in record["reason"]
    assert _equal_states(plain.model, refit.model)


@pytest.mark.parametrize(
    "options, name",
    [
        ({"refit": {"steps": -1}}, "refit_steps"),
        ({"refit_steps": -1}, "refit_steps"),
        ({"refit": {"lr": 0}}, "refit_lr"),
        ({"refit": {"eval_every": 0}}, "refit_eval_every"),
        ({"refit": {"patience": 0}}, "refit_patience"),
        ({"refit": {"examples": 0}}, "refit_examples"),
        ({"refit": {"steps": 1.5}}, "refit_steps"),
        ({"refit": {"parameters": "weights"}}, "refit_parameters"),
    ],
)
def test_invalid_refit_options_are_one_line_errors(options, name):
    with pytest.raises(RaotError) as err:
        RaotConfig().replace(**options)
    assert name in str(err.value) and "\n" not in str(err.value)


def test_a_refit_of_offloaded_models_is_refused_before_any_work(tmp_path):
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    files = offload_models([a, b], ["A", "B"], schema_for(a), tmp_path)
    pre, data = tiny_data("bert", 96)
    merger = RaotMerger.from_models(a, b, preprocessor=pre, working_files=files, refit_steps=10)
    with pytest.raises(RaotError, match="offload") as err:
        merger.merge(calibration=data)
    assert "\n" not in str(err.value)
    assert not merger.merged and not merger.timer.times  # nothing ran


def test_the_refit_section_round_trips_through_json_and_keywords():
    config = RaotConfig(refit={"steps": 100, "lr": 0.002, "eval_every": 5, "patience": 4, "examples": 64})
    again = RaotConfig.from_json(config.to_json())
    assert again == config and again.refit.to_dict() == config.refit.to_dict()
    assert RaotConfig().replace(refit_steps=100).refit.steps == 100
    assert RaotConfig.from_dict({"refit": {"steps": 7}}).refit.steps == 7
    assert RaotConfig().refit.steps == 0  # off by default
