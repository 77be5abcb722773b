"""mergekit's SLERP, NuSLERP, Model Stock, DELLA and Breadcrumbs rules against hand computations,
per-layer and per-module parameters, and the shared SLERP merge file run on tiny checkpoints."""

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from raot_hf import RaotError
from raot_hf.cli import main
from raot_hf.merging import get_merge_rule, merge_rule_spec
from raot_hf.merging.layered import count_layers, evaluate_setting, parse_setting
from raot_hf.merging.mergekit_rules import (
    breadcrumbs,
    breadcrumbs_ties,
    della,
    della_linear,
    model_stock,
    nuslerp,
    slerp,
)
from raot_hf.testing import tiny_model, tiny_tokenizer

R = math.sqrt(0.5)


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


def _np_slerp(t, v0, v1):
    """SLERP of flattened arrays, written out from the formula (linear when |cos| > 0.9995)."""
    v0, v1 = np.asarray(v0, dtype=np.float64), np.asarray(v1, dtype=np.float64)
    cos = float(np.sum(v0 * v1) / (np.linalg.norm(v0) * np.linalg.norm(v1)))
    if abs(cos) > 0.9995:
        return (1 - t) * v0 + t * v1
    theta = math.acos(cos)
    return (math.sin((1 - t) * theta) * v0 + math.sin(t * theta) * v1) / math.sin(theta)


# ----------------------------------------------------------------------------- SLERP / NuSLERP


def test_slerp_by_hand():
    a = {"model.layers.0.mlp.w": _t(1.0, 0.0), "model.layers.1.mlp.w": _t(1.0, 1.0), "emb": _t(3.0, 0.0)}
    b = {"model.layers.0.mlp.w": _t(0.0, 2.0), "model.layers.1.mlp.w": _t(2.0, 2.0), "emb": _t(0.0, 3.0)}
    merged = slerp([a, b], [], t=0.5)
    # quarter circle: θ = π/2, sin(π/4)/1 each: 1·[1,0]·√½ + √½·[0,2]
    assert torch.allclose(merged["model.layers.0.mlp.w"], _t(R, 2 * R))
    assert torch.allclose(merged["model.layers.1.mlp.w"], _t(1.5, 1.5))  # colinear: linear
    assert torch.allclose(merged["emb"], _t(3 * R, 3 * R))
    assert torch.equal(slerp([a, b], [], t=0.0)["emb"], a["emb"])  # t = 0 gives the base model
    # the merger's two-model form is the same rule
    assert torch.allclose(get_merge_rule("slerp")([a, b], [0.1, 0.9], t=0.5)["emb"], _t(3 * R, 3 * R))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    got = slerp([{"w": torch.from_numpy(x)}, {"w": torch.from_numpy(y)}], [], t=0.3)["w"]
    assert np.allclose(got.numpy(), _np_slerp(0.3, x, y), atol=1e-12)


def test_slerp_needs_t_and_two_models():
    a = {"w": _t(1.0, 0.0)}
    with pytest.raises(RaotError, match="has no t"):
        slerp([a, a], [])
    with pytest.raises(RaotError, match="exactly two models"):
        slerp([a, a, a], [], t=0.5)
    assert merge_rule_spec("slerp").max_models == 2


def test_nuslerp_rows_and_flattened_by_hand():
    a = {"w": torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)}
    b = {"w": torch.tensor([[0.0, 1.0], [2.0, 2.0]], dtype=torch.float64)}
    rows = nuslerp([a, b], [1.0, 1.0], flatten=False)  # t = w2/(w1+w2) = 0.5; row 2 colinear → linear
    assert torch.allclose(rows["w"], torch.tensor([[R, R], [1.5, 1.5]], dtype=torch.float64))
    cols = nuslerp([a, b], [1.0, 3.0], flatten=False, row_wise=True)  # t = 0.75, columns
    for j in range(2):
        want = _np_slerp(0.75, a["w"][:, j].numpy(), b["w"][:, j].numpy())
        assert np.allclose(cols["w"][:, j].numpy(), want, atol=1e-12)
    flat = nuslerp([a, b], [1.0, 1.0])  # mergekit's default: the whole tensor as one vector
    assert np.allclose(flat["w"].numpy(), _np_slerp(0.5, a["w"].numpy(), b["w"].numpy()), atol=1e-12)
    base = {"w": torch.full((2, 2), 0.5, dtype=torch.float64)}
    tv = nuslerp([a, b], [1.0, 1.0], base=base, flatten=False)
    want = 0.5 + np.stack([_np_slerp(0.5, (a["w"] - 0.5)[i].numpy(), (b["w"] - 0.5)[i].numpy()) for i in range(2)])
    assert np.allclose(tv["w"].numpy(), want, atol=1e-12)


# ----------------------------------------------------------------------------- Model Stock


def test_model_stock_two_and_three_models_by_hand():
    base = {"w": _t(1.0, 1.0)}
    a, b = {"w": _t(2.0, 1.0)}, {"w": _t(2.0, 2.0)}  # τ = [1,0], [1,1]: cos = √½
    c = math.sqrt(0.5)
    t = 2 * c / (1 + c)
    want = t * np.array([2.0, 1.5]) + (1 - t) * np.array([1.0, 1.0])
    assert np.allclose(model_stock([a, b], [], base=base)["w"].numpy(), want)
    assert np.allclose(get_merge_rule("model_stock")([a, b], [0.5, 0.5], base=base)["w"].numpy(), want)
    c3 = {"w": _t(1.0, 2.0)}  # τ3 = [0,1]: cosines √½, √½, 0 → mean √2/3
    cos = (c + c + 0.0) / 3
    t3 = 3 * cos / (1 + 2 * cos)
    want3 = t3 * np.array([5 / 3, 5 / 3]) + (1 - t3) * np.array([1.0, 1.0])
    got = merge_rule_spec("model_stock").fn([a, b, c3], [1, 1, 1], base=base)
    assert np.allclose(got["w"].numpy(), want3)


def test_model_stock_filter_wise_by_hand():
    base = {"w": torch.zeros(2, 2, dtype=torch.float64)}
    a = {"w": torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)}
    b = {"w": torch.tensor([[0.0, 1.0], [2.0, 0.0]], dtype=torch.float64)}
    got = model_stock([a, b], [], base=base, filter_wise=True)["w"]
    # row 1: cos 0 → t 0 → base; row 2: cos 1 → t 1 → mean [1.5, 0]
    assert torch.allclose(got, torch.tensor([[0.0, 0.0], [1.5, 0.0]], dtype=torch.float64))


# ----------------------------------------------------------------------------- Breadcrumbs and DELLA


def test_breadcrumbs_drops_the_largest_and_smallest_by_hand():
    tau = torch.arange(1.0, 11.0, dtype=torch.float64) * torch.tensor([1, -1] * 5, dtype=torch.float64)
    base = {"x": torch.zeros(10, dtype=torch.float64)}
    one = {"x": tau}
    two = {"x": torch.full((10,), 0.5, dtype=torch.float64)}
    # n = 10, density 0.5 keeps 5, gamma 0.1 drops the top 1: magnitudes 5..9 of τ₁ survive; τ₂ all ties:
    # stable order keeps entries 5..9 (index 4..8)
    kept1 = np.where((np.abs(tau.numpy()) >= 5) & (np.abs(tau.numpy()) <= 9), tau.numpy(), 0.0)
    kept2 = np.where((np.arange(10) >= 4) & (np.arange(10) <= 8), 0.5, 0.0)
    got = breadcrumbs([one, two], [0.6, 0.4], base=base, density=0.5, gamma=0.1)
    assert np.allclose(got["x"].numpy(), 0.6 * kept1 + 0.4 * kept2)
    got = breadcrumbs_ties([one, two], [0.6, 0.4], base=base, density=0.5, gamma=0.1, scale=2.0)
    mass = 0.6 * kept1 + 0.4 * kept2
    sign = np.where(mass >= 0, 1.0, -1.0)
    agree = [np.sign(0.6 * kept1) == sign, np.sign(0.4 * kept2) == sign]
    want = 2.0 * (np.where(agree[0], 0.6 * kept1, 0) + np.where(agree[1], 0.4 * kept2, 0))
    assert np.allclose(got["x"].numpy(), want)
    three = {"x": -tau}
    got = merge_rule_spec("breadcrumbs").fn([one, two, three], [1, 1, 1], base=base, density=0.5, gamma=0.1)
    assert np.allclose(got["x"].numpy(), kept2)  # τ₁ and −τ₁ cancel


def test_della_at_full_density_is_ties_with_the_normalised_mean():
    base = {"x": _t(0.0, 0.0, 0.0)}
    a, b = {"x": _t(1.0, -2.0, 3.0)}, {"x": _t(-3.0, 1.0, 1.0)}
    got = della([a, b], [1.0, 2.0], base=base)  # density 1: nothing dropped
    # Σwτ = [-5, 0, 5] → signs -, +, +; agreeing: [b], [b], [a, b]
    want = np.array([-6.0 / 2.0, 2.0 / 2.0, (3.0 + 2.0) / 3.0])
    assert np.allclose(got["x"].numpy(), want)
    lin = della_linear([a, b], [1.0, 2.0], base=base)
    assert np.allclose(lin["x"].numpy(), [-5.0, 0.0, 5.0])  # weighted sum, not normalised


def test_della_drops_by_rank_rescales_and_is_seeded():
    g = torch.Generator().manual_seed(0)
    base = {"x": torch.zeros(4, 50, dtype=torch.float64)}
    a = {"x": torch.randn(4, 50, generator=g, dtype=torch.float64)}
    zero = {"x": torch.zeros(4, 50, dtype=torch.float64)}
    kw = dict(base=base, density=0.5, epsilon=0.2)
    first = della_linear([a, zero], [1.0, 1.0], seed=3, **kw)
    again = della_linear([a, zero], [1.0, 1.0], seed=3, **kw)
    other = della_linear([a, zero], [1.0, 1.0], seed=4, **kw)
    assert torch.equal(first["x"], again["x"]) and not torch.equal(first["x"], other["x"])
    kept = first["x"] != 0
    # kept entries are the task's, rescaled to its L1 norm
    ratio = first["x"][kept] / a["x"][kept]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio))
    assert math.isclose(float(first["x"].abs().sum()), float(a["x"].abs().sum()), rel_tol=1e-12)
    # keep probability rises with magnitude: the larger half is kept more often
    order = a["x"].abs().argsort(dim=1)
    small, large = kept.gather(1, order[:, :25]).sum(), kept.gather(1, order[:, 25:]).sum()
    assert large > small
    with pytest.raises(RaotError, match="epsilon"):
        della([a, zero], [1.0, 1.0], base=base, density=0.9, epsilon=0.15)


# ----------------------------------------------------------------------------- per-layer and per-module parameters


def test_gradients_follow_mergekit_positions():
    grad = [0.0, 0.5, 0.3, 0.7, 1.0]
    name = "model.layers.{}.self_attn.q_proj.weight"
    assert [evaluate_setting(grad, name.format(i), 2) for i in range(2)] == [0.0, 1.0]
    assert evaluate_setting(grad, name.format(1), 3) == 0.3  # position ½ → index 2
    assert math.isclose(evaluate_setting(grad, name.format(1), 4), 0.5 * 2 / 3 + 0.3 / 3)  # position ⅓ → 4/3
    assert evaluate_setting(grad, "model.embed_tokens.weight", 4) == 0.0  # outside the layers: position 0
    assert evaluate_setting(grad, name.format(0), 1) == 1.0  # one layer: position 1
    assert count_layers([name.format(i) for i in (0, 3)] + ["lm_head.weight"]) == 4


def test_filters_choose_by_module_with_a_default():
    setting = parse_setting("t", "self_attn=0,0.5,0.3,0.7,1;mlp=1,0.5,0.7,0.3,0;default=0.5")
    assert setting == {
        "self_attn": [0.0, 0.5, 0.3, 0.7, 1.0],
        "mlp": [1.0, 0.5, 0.7, 0.3, 0.0],
        "default": 0.5,
    }
    assert evaluate_setting(setting, "model.layers.1.mlp.up_proj.weight", 2) == 0.0
    assert evaluate_setting(setting, "model.layers.0.mlp.up_proj.weight", 2) == 1.0
    assert evaluate_setting(setting, "model.layers.0.input_layernorm.weight", 2) == 0.5
    assert evaluate_setting({"mlp": 1.0}, "model.norm.weight", 2) is None
    a = {"model.layers.0.mlp.w": _t(1.0, 0.0), "model.layers.1.self_attn.w": _t(1.0, 0.0)}
    b = {"model.layers.0.mlp.w": _t(0.0, 1.0), "model.layers.1.self_attn.w": _t(0.0, 1.0)}
    merged = slerp([a, b], [], t={"self_attn": [0.0, 1.0], "default": 0.5})
    assert torch.allclose(merged["model.layers.0.mlp.w"], _t(R, R))
    assert torch.allclose(merged["model.layers.1.self_attn.w"], b["model.layers.1.self_attn.w"])
    # a few tensors at a time: the layer count is passed, not counted from the chunk
    part = slerp([{"model.layers.0.mlp.w": a["model.layers.0.mlp.w"]}, {"model.layers.0.mlp.w": b[
        "model.layers.0.mlp.w"]}], [], t=[0.0, 1.0, 0.0], layer_count=3)  # fmt: skip
    assert torch.allclose(part["model.layers.0.mlp.w"], a["model.layers.0.mlp.w"])


# ----------------------------------------------------------------------------- the shared merge file

SHARED_SLERP = """slices:
  - sources:
      - model: {a}
        layer_range: [0, 2]
      - model: {b}
        layer_range: [0, 2]
merge_method: slerp
base_model: {a}
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5
dtype: bfloat16
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("slerp")
    for name, seed in (("a", 0), ("b", 1)):
        tiny_model("llama", "causal", seed=seed, dtype=torch.float32).save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    return root


def _weights(directory):
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _expected_t(name):
    """The config's t for a tensor of the two-layer model: layer 0 at position 0, layer 1 at 1."""
    if ".layers." not in name:
        return 0.5
    layer = int(name.split(".layers.")[1].split(".")[0])
    if "self_attn" in name:
        return [0.0, 1.0][layer]
    if "mlp" in name:
        return [1.0, 0.0][layer]
    return 0.5


def test_the_shared_slerp_config_runs_verbatim_and_matches_hand_slerp(pair, tmp_path):
    config = tmp_path / "merge.yml"
    config.write_text(SHARED_SLERP.format(a=pair / "a", b=pair / "b"))
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["-q", "merge", "--config", str(config), "--alignment", "none", "--out", str(out)])
    assert res.exit_code == 0, res.output
    merged, a, b = _weights(out), _weights(pair / "a"), _weights(pair / "b")
    assert set(merged) == set(a)
    for name, w in merged.items():
        assert w.dtype == torch.bfloat16, name
        x, y = (t.to(torch.bfloat16).double().numpy() for t in (a[name], b[name]))
        want = _np_slerp(_expected_t(name), x, y)
        assert np.allclose(w.double().numpy(), want, rtol=1e-2, atol=1e-2), name
    report = json.loads((out / "raot_report.json").read_text())
    assert report["merge_file"]["parameters"]["t"][2] == {"value": 0.5} and report["execution"] == "streamed"
    card = (out / "README.md").read_text()
    assert "slerp with the merge file's parameters — mergekit's definition on the checkpoints as stored" in card


@pytest.mark.parametrize(
    "slices,message",
    [
        ("[{sources: [{model: A, layer_range: [0, 1]}, {model: B, layer_range: [0, 2]}]}]", "span [1, 2] layers"),
        ("[{sources: [{model: A, layer_range: [0, 3]}, {model: B, layer_range: [0, 3]}]}]", "ends at 3 but"),
        (
            "[{sources: [{model: A, layer_range: [0, 1]}, {model: B, layer_range: [0, 1]}]}, {sources: [{model: B, "
            "layer_range: [1, 2]}]}]",
            "does not list base_model",
        ),  # fmt: skip
        ("[{sources: [{model: A, layer_range: [2, 1]}, {model: B, layer_range: [0, 1]}]}]", "holds no layer"),
    ],
)
def test_bad_slices_are_refused_in_one_line(pair, tmp_path, slices, message):
    body = f"slices: {slices}\nmerge_method: slerp\nbase_model: A\nparameters: {{t: 0.5}}\n"
    body = body.replace("model: A", f"model: {pair / 'a'}").replace("model: B", f"model: {pair / 'b'}")
    body = body.replace("base_model: A", f"base_model: {pair / 'a'}")
    config = tmp_path / "bad.yml"
    config.write_text(body)
    res = CliRunner().invoke(
        main, ["merge", "--config", str(config), "--alignment", "none", "--out", str(tmp_path / "o")]
    )
    assert res.exit_code == 2, res.output
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "o").exists()


def test_passthrough_takes_one_source_per_slice(pair, tmp_path):
    config = tmp_path / "p.yml"
    config.write_text(f"models:\n  - model: {pair / 'a'}\n  - model: {pair / 'b'}\nmerge_method: passthrough\n")
    res = CliRunner().invoke(main, ["merge", "--config", str(config), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "passthrough, which copies one model's layers" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_command_line_gradient_equals_the_merge_file(pair, tmp_path):
    args = ["-q", "merge", str(pair / "a"), str(pair / "b"), "--alignment", "none", "--merge-rule", "slerp"]
    t = "self_attn=0,0.5,0.3,0.7,1;mlp=1,0.5,0.7,0.3,0;default=0.5"
    res = CliRunner().invoke(main, [*args, "--t", t, "--dtype", "bfloat16", "--out", str(tmp_path / "cli")])
    assert res.exit_code == 0, res.output
    config = tmp_path / "merge.yml"
    config.write_text(SHARED_SLERP.format(a=pair / "a", b=pair / "b"))
    res = CliRunner().invoke(
        main, ["-q", "merge", "--config", str(config), "--alignment", "none", "--out", str(tmp_path / "yml")]
    )
    assert res.exit_code == 0, res.output
    x, y = _weights(tmp_path / "cli"), _weights(tmp_path / "yml")
    assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize(
    "rule,options,with_base",
    [
        ("slerp", {"t": {"self_attn": [0.0, 1.0], "default": [0.2, 0.6]}}, False),
        ("della", {"density": [0.5, 0.7], "epsilon": 0.1}, True),
        ("breadcrumbs_ties", {"density": {"mlp": [0.6, 0.9], "default": 0.8}, "gamma": 0.05}, True),
        ("model_stock", {}, True),
    ],
)
def test_streamed_merge_with_layer_settings_is_the_in_memory_merge(pair, tmp_path, rule, options, with_base):
    from raot_hf import RaotConfig, merge_checkpoints

    models = [pair / "a", pair / "b"]
    base = {}
    if with_base:  # two drifts of A, A the base
        models = []
        for i in (1, 2):
            model = tiny_model("llama", "causal", seed=0, dtype=torch.float32)
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g))
            model.save_pretrained(tmp_path / f"m{i}")
            tiny_tokenizer().save_pretrained(tmp_path / f"m{i}")
            models.append(tmp_path / f"m{i}")
        base = {"base": pair / "a"}
    config = RaotConfig.from_dict({"merge_rule": rule, "alignment": "none", "mergekit": options})
    streamed, report = merge_checkpoints(*models, out=tmp_path / "s", config=config, **base)
    loaded, _ = merge_checkpoints(*models, out=tmp_path / "m", config=config, stream=False, **base)
    assert report["execution"] == "streamed"
    x, y = _weights(streamed), _weights(loaded)
    assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)
