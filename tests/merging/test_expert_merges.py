"""Plain merges of mixture-of-experts checkpoints (no alignment) run through every merge rule, as
for any checkpoint (docs/design.md §10.1): transformers writes the experts per expert on disk and
fuses them into 3-D tensors in memory; a checkpoint stored fused streams its 3-D tensors through the
per-tensor rules bit for bit as the in-memory merge does."""

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from raot_hf import merge_checkpoints
from raot_hf.errors import RaotError
from raot_hf.merging import available_merge_rules, merge_rule_spec
from raot_hf.testing import clone, drift, tiny_model, tiny_text_dataset, tiny_tokenizer


def _family(root, *, fused: bool):
    """A base and two drifts of a tiny Mixtral, saved as transformers saves them (per expert) or fused."""
    base = tiny_model("mixtral", "causal", dtype=torch.float32)
    paths = []
    for i, name in enumerate(("base", "a", "b")):
        model = clone(base)
        drift(model, 0.05 * i, seed=i)
        if fused:  # the in-memory names and 3-D expert tensors, as some tools write them
            (root / name).mkdir()
            model.config.architectures = [type(model).__name__]
            model.config.save_pretrained(root / name)
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            save_file(state, root / name / "model.safetensors", metadata={"format": "pt"})
        else:
            model.save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
        paths.append(root / name)
    return paths


def _options(rule, paths):
    spec = merge_rule_spec(rule)
    options = {"base": paths[0]} if spec.needs_base else {}
    if spec.needs_grams or spec.needs_fisher:
        options["calibration"] = tiny_text_dataset(24)
    if rule == "slerp":
        options["t"] = 0.5
    return options


def _weights(directory):
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("rule", [r for r in available_merge_rules() if (merge_rule_spec(r).max_models or 2) >= 2])
def test_every_rule_merges_mixtral_checkpoints(tmp_path, rule):
    paths = _family(tmp_path, fused=False)
    out, report = merge_checkpoints(*paths[1:], out=tmp_path / "out", alignment="none", merge_rule=rule,
                                    **_options(rule, paths))  # fmt: skip
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert any(k.endswith("experts.0.w1.weight") for k in _weights(out))  # written per expert, as transformers writes
    if rule == "linear":  # the 3-D expert tensors are the parents' average
        a, b = (transformers.AutoModelForCausalLM.from_pretrained(p) for p in paths[1:])
        for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
            want = 0.5 * (a.get_parameter(name).double() + b.get_parameter(name).double())
            assert torch.allclose(merged.get_parameter(name).double(), want, atol=1e-6)


@pytest.mark.parametrize("rule", ["linear", "ties", "nuslerp", "model_stock"])
def test_fused_checkpoints_stream_their_3d_tensors_bit_for_bit(tmp_path, rule):
    paths = _family(tmp_path, fused=True)
    options = _options(rule, paths)
    streamed, report = merge_checkpoints(*paths[1:], out=tmp_path / "s", alignment="none", merge_rule=rule, **options)
    loaded, _ = merge_checkpoints(
        *paths[1:], out=tmp_path / "m", alignment="none", merge_rule=rule, stream=False, **options
    )
    assert report["execution"] == "streamed"
    s = _weights(streamed)
    assert s["model.layers.0.mlp.experts.gate_up_proj"].ndim == 3
    merged = transformers.AutoModelForCausalLM.from_pretrained(streamed)
    in_memory = transformers.AutoModelForCausalLM.from_pretrained(loaded)
    for (name, p), q in zip(merged.named_parameters(), in_memory.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_rule_of_one_model_is_refused_for_two_before_any_weight_is_read(tmp_path):
    paths = _family(tmp_path, fused=False)
    with pytest.raises(RaotError, match="passthrough.*at most 1 model"):
        merge_checkpoints(*paths[1:], out=tmp_path / "out", alignment="none", merge_rule="passthrough")
    assert not (tmp_path / "out").exists()
