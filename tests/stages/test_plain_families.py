"""Plain merges of any ``transformers`` checkpoint (docs/design.md §7.3): every rule that needs no
alignment, with layer gradients and module filters, runs on families raot_hf has no adapter for —
tiny ones built here from their config classes — streamed from the files, layers found from the
tensor names; an aligned merge of such a family is refused in one line naming ``--alignment none``."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file

from raot_hf import merge_checkpoints
from raot_hf.cli import main
from raot_hf.testing import drift, tiny_tokenizer

_COMMON = dict(
    vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
FAMILIES = {
    "qwen3": lambda: (transformers.Qwen3Config(**_COMMON, head_dim=4), transformers.Qwen3ForCausalLM),
    "gemma2": lambda: (transformers.Gemma2Config(**_COMMON, head_dim=4), transformers.Gemma2ForCausalLM),
    "phi3": lambda: (transformers.Phi3Config(**_COMMON, pad_token_id=0), transformers.Phi3ForCausalLM),
    "starcoder2": lambda: (transformers.Starcoder2Config(**_COMMON), transformers.Starcoder2ForCausalLM),
    "phimoe": lambda: (  # a mixture of experts without an adapter
        transformers.PhimoeConfig(**_COMMON, num_local_experts=2, num_experts_per_tok=1),
        transformers.PhimoeForCausalLM,
    ),
    "distilbert": lambda: (
        transformers.DistilBertConfig(vocab_size=64, dim=16, hidden_dim=24, n_layers=3, n_heads=4),
        transformers.DistilBertForMaskedLM,
    ),
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Per family: a base and two fine-tunes of it (small perturbations), saved with a tokenizer."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family, build in FAMILIES.items():
        config, cls = build()
        torch.manual_seed(0)
        base = cls(config).eval()
        paths = []
        for i, name in enumerate(("base", "a", "b")):
            model = cls(config)
            model.load_state_dict(base.state_dict())
            drift(model, 0.05 * i, seed=i)
            model.save_pretrained(root / family / name)
            tiny_tokenizer(64).save_pretrained(root / family / name)
            paths.append(root / family / name)
        out[family] = (cls, paths)
    return out


def _weights(directory):
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _loads(cls, out):
    model, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


def test_starcoder2_linear_is_the_average_through_the_cli_and_a_merge_file(families, tmp_path):
    cls, (_, a, b) = families["starcoder2"]
    res = CliRunner().invoke(main, ["-q", "merge", str(a), str(b), "--alignment", "none", "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    config = tmp_path / "m.yml"
    config.write_text(f"models:\n  - model: {a}\n  - model: {b}\nmerge_method: linear\n")
    res = CliRunner().invoke(main, ["-q", "merge", "--config", str(config), "--out", str(tmp_path / "f")])
    assert res.exit_code == 0, res.output
    x, y = _weights(a), _weights(b)
    for out in (tmp_path / "c", tmp_path / "f"):
        merged = _weights(out)
        assert set(merged) == set(x)
        # (A + B)/2 of two float32 tensors is exact in float64, then rounded once, as the merge rounds it
        assert all(torch.equal(merged[k], ((x[k].double() + y[k].double()) / 2).float()) for k in x)
        _loads(cls, out)
        assert json.loads((out / "raot_report.json").read_text())["model_type"] == "starcoder2"


RULES = {
    "linear": ({"weights": [0.3, 0.7]}, False),
    "task_arithmetic": ({"task_scale": 0.8}, True),
    "ties": ({"density": 0.5}, True),
    "dare_ties": ({"density": 0.5}, True),
    "slerp": ({"mergekit": {"t": {"self_attn": [0.0, 1.0], "mlp": [1.0, 0.0], "default": 0.5}}}, False),
    "nuslerp": ({"weights": [0.4, 0.6], "mergekit": {"flatten": False}}, False),
    "model_stock": ({}, True),
    "della": ({"mergekit": {"density": [0.5, 0.8], "epsilon": 0.1}}, True),
    "breadcrumbs": ({"mergekit": {"density": {"mlp": 0.8, "default": 0.9}, "gamma": 0.05}}, True),
}


#: Every rule on one family; linear, a gradient (SLERP) and a base-relative rule on every family.
CASES = [("qwen3", rule) for rule in sorted(RULES)] + [
    (family, rule) for family in sorted(FAMILIES) if family != "qwen3" for rule in ("linear", "slerp", "ties")
]


@pytest.mark.parametrize("family,rule", CASES)
def test_every_plain_rule_runs_on_every_family(families, tmp_path, family, rule):
    cls, (base, a, b) = families[family]
    options, needs_base = RULES[rule]
    out, report = merge_checkpoints(a, b, out=tmp_path / "o", alignment="none", merge_rule=rule,
                                    **({"base": base} if needs_base else {}), **options)  # fmt: skip
    assert report["execution"] == "streamed" and report["model_type"] == family
    model = _loads(cls, out)
    merged, x, y = _weights(out), _weights(a), _weights(b)
    assert any(not torch.equal(merged[k], x[k]) and not torch.equal(merged[k], y[k]) for k in merged)  # a merge
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_layer_gradients_read_the_layer_from_the_tensor_names(families, tmp_path):
    """SLERP with t = [0, 1] over DistilBERT's ``transformer.layer.N`` and PhiMoE's experts: the
    first layer is A's, the last B's."""
    for family in ("distilbert", "phimoe"):
        _, (_, a, b) = families[family]
        out, _ = merge_checkpoints(a, b, out=tmp_path / family, alignment="none", merge_rule="slerp",
                                   mergekit={"t": [0.0, 1.0]})  # fmt: skip
        merged, x, y = _weights(out), _weights(a), _weights(b)
        first = [k for k in merged if "layer.0." in k or "layers.0." in k]
        last = [k for k in merged if "layer.2." in k or "layers.2." in k]
        assert first and last
        assert all(torch.equal(merged[k], x[k]) for k in first) and all(torch.equal(merged[k], y[k]) for k in last)


def test_a_merge_file_of_a_family_without_an_adapter_runs_with_its_gradients(families, tmp_path):
    cls, (base, a, b) = families["gemma2"]
    config = tmp_path / "m.yml"
    config.write_text(
        f"models:\n  - model: {a}\n    parameters: {{weight: [0.2, 0.8], density: 0.6}}\n  - model: {b}\n"
        f"    parameters: {{weight: 0.5, density: [{{filter: mlp, value: 0.4}}, {{value: 0.9}}]}}\n"
        f"merge_method: dare_ties\nbase_model: {base}\n"
    )
    res = CliRunner().invoke(main, ["merge", "--config", str(config), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    _loads(cls, tmp_path / "o")


@pytest.mark.parametrize("family", ["starcoder2", "phimoe"])
def test_an_aligned_merge_of_a_family_without_an_adapter_is_refused_in_one_line(families, tmp_path, family):
    _, (_, a, b) = families[family]
    res = CliRunner().invoke(main, ["merge", str(a), str(b), "--calibration", "cal.csv", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert f"model type '{family}'" in res.stderr and "no adapter" in res.stderr and "--alignment none" in res.stderr
    res = CliRunner().invoke(main, ["merge", str(a), str(b), "--alignment", "none", "--no-stream", "--out",
                                    str(tmp_path / "o")])  # fmt: skip
    assert res.exit_code == 2 and "merges only as stored, streamed" in res.stderr and "--no-stream" in res.stderr
    assert not (tmp_path / "o").exists()
