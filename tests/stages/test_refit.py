"""The end-to-end refit of the merged model (docs/design.md §6.11): ``auto`` where the gate moved
B (in memory, a model with scores, at most 50 M parameters), towards the parents' predicted
distributions or their last stream, early-stopped on half the held-out examples and kept only when
it beats the merge without it on the other half."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raot_hf.merger as merger_module
from raot_hf import RaotConfig, RaotError, RaotMerger, schema_for, scramble
from raot_hf.outputs import model_card_context
from raot_hf.stages import refit as refit_stage
from raot_hf.stages.offload import offload_models
from raot_hf.stages.refit import RefitChunk, confident_mix, divergences, refit_parameter_names
from raot_hf.testing import clone, scrambled_near_copy, tiny_data, tiny_model, trained_like

#: The refit as it was opt-in: norms and biases, towards the last stream.
NORMS_HIDDEN = {"mode": "on", "parameters": "norms_biases", "target": "hidden"}

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
    """``refit.steps`` 0 is no refit whatever the other refit options say, as ``mode="off"`` is: the
    same weights, bit for bit, no ``refit`` record (None) and no refit time."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    plain = _merge(clone(a), clone(b), refit={"mode": "off"})
    off = _merge(clone(a), clone(b), refit={"steps": 0, "lr": 0.5, "examples": 3, "eval_every": 1, "patience": 1,
                                            "mode": "on"})  # fmt: skip
    assert _equal_states(plain.model, off.model)
    for result in (plain, off):
        assert result.report["refit"] is None and "refit" not in result.report["timings"]
    assert off.report["settings"]["refit"]["steps"] == 0


def test_by_default_a_pair_that_differs_is_refitted_towards_its_parents_predictions():
    """The default (``auto``, output target, every trunk parameter): the gate moved B, so the merge is
    refitted; the judged loss — the KL divergence from the parents' mixed distribution — falls, the
    refit is kept and written (the weights differ from the merge without it), the head is not moved.
    (300 steps: this tiny merge takes a fraction of a second, whose budget affords too few.)"""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    plain = _merge(clone(a), clone(b), refit={"mode": "off"})
    refit = _merge(clone(a), clone(b), refit={"steps": 300})
    record = refit.report["refit"]
    assert record["ran"] and record["mode"] == "auto" and record["target"] == "output"
    assert record["decision"].startswith("auto: the gate moved B")
    assert record["kept"], record["reason"]
    assert record["heldout_loss_after"] < 0.99 * record["heldout_loss_before"]
    assert record["stop_examples"] + record["heldout_examples"] >= 8
    head = set(schema_for(refit.model).head_params)
    before, after = plain.model.state_dict(), refit.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(after[k].ndim == 2 for k in moved) and not moved & head
    assert "refitted end to end towards the parents' predictions" in model_card_context(refit.report)["merge_rule"]
    assert "refitted" not in (model_card_context(plain.report)["merge_rule"] or "")


def test_refit_of_a_pair_that_differs_lowers_the_heldout_loss_and_is_reported():
    """A scrambled, perturbed copy: the merge misses both parents, and refitting its norms and biases
    to the parents' mix lowers the held-out loss; the refit is kept, only norms and biases move,
    and the report records the run."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    # the last-stream target reads B′ whole: its merge runs the three stages, as the plain one here
    plain = _merge(clone(a), clone(b), refit={"mode": "off"}, gate={"sweep": False})
    refit = _merge(clone(a), clone(b), refit={"steps": 60, "lr": 0.01, "eval_every": 10, **NORMS_HIDDEN})
    record = refit.report["refit"]
    assert record["kept"], record["reason"]
    assert record["heldout_loss_after"] < record["heldout_loss_before"]
    assert 0 < record["best_step"] <= record["steps"] <= 60
    assert record["heldout_examples"] >= 4 and record["examples"] > 0 and record["parameters"] > 0
    assert record["curve"] and refit.report["timings"]["refit"] > 0
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
    plain = _merge(clone(a), clone(b), refit={"mode": "off"}, gate={"sweep": False})  # as the last-stream target's
    refit = _merge(clone(a), clone(b), refit={"steps": 40, "lr": 1e-3, "eval_every": 10, "parameters": "all",
                                              "target": "hidden", "mode": "on"})  # fmt: skip
    record = refit.report["refit"]
    assert record["kept"], record["reason"]
    assert record["heldout_loss_after"] < record["heldout_loss_before"]
    head = set(schema_for(refit.model).head_params)
    before, after = plain.model.state_dict(), refit.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(after[k].ndim == 2 for k in moved) and not moved & head


@pytest.mark.parametrize("target", ["output", "hidden"])
def test_a_refit_that_cannot_help_is_dropped_and_the_merge_is_unchanged(target):
    """B = scramble(A): the merge is A, already the parents' mix (loss ~0, round-off); the refit does
    not descend, nothing is written, and the weights are the no-refit merge's, bit for bit."""
    a = _bert()
    b = clone(a)
    scramble(b, seed=1)
    plain = _merge(clone(a), clone(b), refit={"mode": "off"})
    refit = _merge(clone(a), clone(b), refit={"mode": "on", "target": target, "eval_every": 5, "patience": 2})
    record = refit.report["refit"]
    assert not record["kept"] and record["best_step"] == 0 and record["steps"] == 0
    assert record["heldout_loss_before"] <= refit_stage.FOLLOWED and "already follows" in record["reason"]
    assert _equal_states(plain.model, refit.model)


def test_too_few_heldout_examples_leave_the_merge_alone():
    """Three held-out examples (one to judge) cannot judge a refit: it does not run, and the merge is
    unchanged."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    plain = _merge(clone(a), clone(b), n=12, refit={"mode": "off"})
    refit = _merge(clone(a), clone(b), n=12, refit={"steps": 20, "mode": "on"})
    record = refit.report["refit"]
    assert record["stop_examples"] + record["heldout_examples"] == 3
    assert record["heldout_examples"] < 4 and record["steps"] == 0 and not record["kept"]
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
        ({"refit": {"mode": "always"}}, "refit_mode"),
        ({"refit": {"target": "logits"}}, "refit_target"),
        ({"refit": {"z": -1}}, "refit_z"),
        ({"refit": {"teacher": "sure"}}, "refit_teacher"),
        ({"refit": {"teacher": "confident", "target": "hidden"}}, "refit_teacher"),
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
    merger = RaotMerger.from_models(a, b, preprocessor=pre, working_files=files, refit={"mode": "on", "steps": 10})
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
    defaults = RaotConfig().refit
    assert (defaults.mode, defaults.target, defaults.parameters) == ("auto", "output", "all")


def test_an_offloaded_merge_skips_the_auto_refit_and_says_why(tmp_path):
    """``auto`` does not refuse an offloaded merge: it skips the refit (the descent needs the whole
    model in memory) and the report says so."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    files = offload_models([a, b], ["A", "B"], schema_for(a), tmp_path)
    pre, data = tiny_data("bert", 96)
    result = RaotMerger.from_models(a, b, preprocessor=pre, working_files=files).merge(calibration=data)
    record = result.report["refit"]
    assert not record["ran"] and "offloaded" in record["reason"] and "refit" not in result.report["timings"]


def test_auto_skips_siblings_models_without_scores_and_large_models(monkeypatch):
    """``auto`` refits only where the gate moved B, the model returns logits and it is small enough;
    elsewhere the merge is bit for bit the one with the refit off and the report says why."""
    a = _bert()
    sibling = clone(a)
    with torch.no_grad():
        for p in sibling.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    off, auto = _merge(clone(a), clone(sibling), refit={"mode": "off"}), _merge(clone(a), clone(sibling))
    assert _equal_states(off.model, auto.model)
    assert not auto.report["refit"]["ran"] and "share a basis" in auto.report["refit"]["reason"]

    bare_a = trained_like(tiny_model("bert", "base", seed=0, **SHAPE), seed=0).float()
    bare_b = scrambled_near_copy(bare_a, seed=1, noise=0.3)
    bare = _merge(clone(bare_a), clone(bare_b))
    assert not bare.report["refit"]["ran"] and "no logits" in bare.report["refit"]["reason"]
    with pytest.raises(RaotError, match="refit target hidden"):
        _merge(clone(bare_a), clone(bare_b), refit={"mode": "on"})

    b = scrambled_near_copy(a, seed=1, noise=0.3)
    monkeypatch.setattr(refit_stage, "AUTO_MAX_PARAMETERS", sum(p.numel() for p in a.parameters()) - 1)
    large = _merge(clone(a), clone(b))
    assert not large.report["refit"]["ran"] and "parameters >" in large.report["refit"]["reason"]

    monkeypatch.setattr(refit_stage, "TARGET_BUDGET", 1024)  # the parents' distributions do not fit
    assert "would take" in _merge(clone(a), clone(b)).report["refit"]["reason"]
    pre, data = tiny_data("bert", 96)
    merger = RaotMerger.from_models(clone(a), clone(b), preprocessor=pre, refit={"mode": "on"})
    with pytest.raises(RaotError, match="refit examples") as err:
        merger.merge(calibration=data)
    assert "\n" not in str(err.value) and not merger.timer.times  # refused before any work


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), seq=st.integers(1, 5), vocab=st.integers(2, 6), seed=st.integers(0, 1000))
def test_divergences_are_the_mean_kl_over_real_tokens(rows, seq, vocab, seed):
    """Per example, the mean over real tokens of KL(p̄ ‖ softmax(scores)), p̄ a mix with zeros in it
    (0·log 0 = 0); zero where the scores give p̄ back; a classifier's example is one token."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, seq, vocab, generator=g, dtype=torch.float64)
    target = torch.rand(rows, seq, vocab, generator=g, dtype=torch.float64)
    target[..., 0] = 0.0
    target = target / target.sum(-1, keepdim=True)
    mask = torch.rand(rows, seq, generator=g) < 0.7
    mask[:, 0] = True
    got = divergences(scores, target, mask)
    for r in range(rows):
        kls = [sum(float(target[r, t, v] * (target[r, t, v].log() - scores[r, t].log_softmax(-1)[v]))
                   for v in range(vocab) if target[r, t, v] > 0) for t in range(seq) if mask[r, t]]  # fmt: skip
        assert got[r].item() == pytest.approx(sum(kls) / len(kls), rel=1e-9, abs=1e-12)
    positive = target.clamp_min(1e-3)
    positive = positive / positive.sum(-1, keepdim=True)
    assert divergences(positive.log(), positive, mask).abs().max() < 1e-12
    flat = divergences(scores[:, 0], target[:, 0], torch.ones(rows, 1, dtype=torch.bool))
    assert torch.allclose(flat, divergences(scores[:, :1], target[:, :1], mask[:, :1]))


def test_the_heldout_halves_alternate_and_together_are_every_example():
    inputs = {"input_ids": torch.arange(7)[:, None].repeat(1, 3)}
    chunk = RefitChunk(inputs, torch.ones(7, 3, dtype=torch.bool), torch.arange(7.0)[:, None])
    stop, judge = chunk.rows(0), chunk.rows(1)
    assert stop.inputs["input_ids"][:, 0].tolist() == [0, 2, 4, 6] and judge.target[:, 0].tolist() == [1, 3, 5]


@settings(max_examples=40, deadline=None)
@given(parents=st.integers(2, 3), rows=st.integers(1, 3), classes=st.integers(2, 6), seed=st.integers(0, 1000))
def test_the_confident_teacher_weighs_each_parent_by_its_weight_times_exp_minus_entropy(parents, rows, classes, seed):
    """Per token α_p ∝ w_p·exp(−H(p_p)), written out one token at a time; a distribution; parents
    as sure as each other (the same distribution up to a permutation of classes) keep their merge
    weights, the plain mix."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(parents, generator=g, dtype=torch.float64) + 0.1
    weights = (weights / weights.sum()).tolist()
    dists = [torch.rand(rows, classes, generator=g, dtype=torch.float64).softmax(-1) for _ in range(parents)]
    got = confident_mix(dists, weights)
    for r in range(rows):
        sure = [w * float(torch.exp((p[r] * p[r].log()).sum())) for p, w in zip(dists, weights)]
        want = sum(s / sum(sure) * p[r] for s, p in zip(sure, dists))
        assert torch.allclose(got[r], want, rtol=1e-12, atol=1e-15)
    assert torch.allclose(got.sum(-1), torch.ones(rows, dtype=torch.float64))
    permuted = [dists[0][:, torch.randperm(classes, generator=g)] for _ in range(parents)]
    plain = sum(w * p for w, p in zip(weights, permuted))
    assert torch.allclose(confident_mix(permuted, weights), plain, rtol=1e-12, atol=1e-15)


def test_where_one_parent_is_sure_and_the_other_is_not_the_confident_teacher_follows_the_sure_one():
    """A parent near one-hot and one near uniform: the plain mix halves the sure parent's top class,
    the confident teacher keeps most of it (α ≥ 0.8 for 10 classes)."""
    sure = torch.full((1, 10), 1e-4, dtype=torch.float64)
    sure[0, 3] = 1.0
    sure = sure / sure.sum()
    unsure = torch.full((1, 10), 0.1, dtype=torch.float64)
    mixed = confident_mix([sure, unsure], [0.5, 0.5])
    plain = 0.5 * sure + 0.5 * unsure
    assert mixed[0, 3] > 0.8 * sure[0, 3] and plain[0, 3] < 0.6 * sure[0, 3]
    assert torch.allclose(confident_mix([unsure, sure], [0.5, 0.5]), mixed)


def test_a_refit_with_the_confident_teacher_runs_is_judged_and_names_its_teacher():
    """End to end: the confident teacher's refit lowers the judged loss of a pair that differs and
    differs from the plain mix's refit; the record names the teacher (only the output target has one)."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    plain = _merge(clone(a), clone(b), refit={"steps": 40, "mode": "on"})
    confident = _merge(clone(a), clone(b), refit={"steps": 40, "mode": "on", "teacher": "confident"})
    record = confident.report["refit"]
    assert record["teacher"] == "confident" and plain.report["refit"]["teacher"] == "mix"
    assert record["ran"] and record["heldout_loss_after"] < record["heldout_loss_before"]
    assert not _equal_states(plain.model, confident.model)
    assert "weighted per token by its confidence" in model_card_context(confident.report)["merge_rule"]
    hidden = _merge(clone(a), clone(b), refit={"steps": 5, "mode": "on", "target": "hidden"})
    assert "teacher" not in hidden.report["refit"]


def test_the_targets_made_from_the_calibration_pass_are_those_the_parents_give_again(monkeypatch):
    """The output target is made from the calibration pass's own forwards of A and B (each parent
    layer runs once per token, docs/design.md §5.7): the same batches the refit would run the
    parents on again, so the same targets — the refit and the merge are those of targets made
    afresh, bit for bit."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    options = {"steps": 30, "mode": "on", "eval_every": 5}
    captured = _merge(clone(a), clone(b), refit=options)
    monkeypatch.setattr(merger_module, "prediction_capture", lambda ctx: None)
    again = _merge(clone(a), clone(b), refit=options)
    one, two = captured.report["refit"], again.report["refit"]
    assert one["targets_from"] == "calibration pass" and two["targets_from"] == "parents run again"
    assert one["heldout_loss_before"] == two["heldout_loss_before"] and one["curve"] == two["curve"]
    assert _equal_states(captured.model, again.model)


@settings(max_examples=60, deadline=None)
@given(
    seconds=st.floats(0.01, 1000.0),
    step_s=st.floats(1e-4, 10.0),
    score_s=st.floats(0.0, 10.0),
    eval_every=st.integers(1, 50),
    limit=st.integers(1, 2000),
)
def test_the_budget_plans_the_most_steps_whose_time_fits(seconds, step_s, score_s, eval_every, limit):
    """``refit.steps="auto"``: the steps planned are ``eval_every`` × a power of two (or the limit):
    the most such whose time, with a held-out score every ``eval_every`` of them and one at the
    last, fits in the budget's seconds — at least ``eval_every`` — or the limit when all fit."""
    budget = refit_stage.RefitBudget(limit, seconds, seconds)
    n = budget.plan(step_s, score_s, eval_every)

    def cost(steps: int) -> float:
        return steps * step_s + math.ceil(steps / eval_every) * score_s

    if cost(limit) <= seconds:
        assert n == limit
        return
    k = n // eval_every
    assert n % eval_every == 0 and k & (k - 1) == 0 and n < limit or n == eval_every
    assert n == eval_every or cost(n) <= seconds
    assert 2 * n >= limit or cost(2 * n) > seconds


def test_the_default_refit_descends_for_the_steps_its_budget_plans_and_reports_them():
    """The default (``refit.steps="auto"``): the descent's steps come from the measured time of a
    step and of a held-out score against the rest of the merge's, and the report says so; a
    number given runs that many steps at most, whatever the time."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    auto = _merge(clone(a), clone(b), refit={"mode": "on", "eval_every": 5, "budget": 200.0})
    record = auto.report["refit"]
    budget = record["budget"]
    assert budget["steps"] == "auto" and budget["rest_s"] > 0
    assert budget["seconds"] == pytest.approx(200 * budget["rest_s"])
    assert 10 <= record["steps"] <= budget["planned"] <= 1000 and budget["step_s"] > 0
    given = _merge(clone(a), clone(b), refit={"mode": "on", "steps": 7, "eval_every": 5})
    assert given.report["refit"]["budget"]["steps"] == given.report["refit"]["budget"]["planned"] == 7
    assert given.report["refit"]["steps"] <= 7


def test_a_budget_that_affords_fewer_than_two_scores_does_not_descend():
    """A tiny merge's budget (a fraction of a second) affords fewer steps than two held-out scores
    take: the descent does not run, the merge is the one without the refit, and the report says why."""
    a = _bert()
    b = scrambled_near_copy(a, seed=1, noise=0.3)
    plain = _merge(clone(a), clone(b), refit={"mode": "off"})
    short = _merge(clone(a), clone(b), refit={"mode": "on", "budget": 1e-3})
    record = short.report["refit"]
    assert record["ran"] and record["steps"] == 0 and not record["kept"]
    assert "the budget affords fewer than" in record["reason"]
    assert _equal_states(plain.model, short.model)
