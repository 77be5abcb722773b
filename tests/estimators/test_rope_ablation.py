"""Decoder head maps from weights (shared KV heads / RoPE) and the RoPE-unrestricted ablation
(docs/design.md §8)."""

import pytest
import torch

from raot_hf import RaotError, RaotMerger, schema_for
from raot_hf.estimators.weight_based import estimate_weight_alignment
from raot_hf.symmetry import (
    HeadAlignment,
    UnrestrictedHeadAlignment,
    is_exact,
    model_state,
    random_group_element,
    random_orthogonal,
    transform_model,
)
from raot_hf.testing import (
    clone,
    exact_rmsnorm,
    example_inputs,
    output_deviation,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
)


def _max_weight_difference(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("model_type,kv", [("llama", 2), ("llama", 4), ("mistral", 1), ("qwen2", 2)])
@pytest.mark.parametrize("match_heads", [True, False])
def test_weight_matching_recovers_shared_kv_rope_heads(model_type, kv, match_heads):
    """B = A under a random MLP and head symmetry (KV heads, and query heads within each KV head
    permuted when ``match_heads``; one RoPE rotation per rotary pair and one V/O map per KV head):
    weight matching finds it, so B′'s weights are A's."""
    a = tiny_model(model_type, "causal", num_key_value_heads=kv)
    schema = schema_for(a)
    symmetry = random_group_element(schema, seed=7, kinds=("mlp", "heads"))
    if not match_heads:  # keep the head correspondence: rotations only
        kept = []
        for t in symmetry.transforms:
            if isinstance(t, HeadAlignment):
                t = HeadAlignment(t.layer, torch.arange(len(t.perm)), t.qk, t.vo)
            kept.append(t)
        symmetry.transforms = kept
    b = transform_model(clone(a), schema, symmetry)
    assert _max_weight_difference(a, b) > 1e-2
    found = estimate_weight_alignment(model_state(a), model_state(b), schema, match_heads=match_heads)
    transform_model(b, schema, found)
    assert _max_weight_difference(a, b) <= 1e-10


def test_weight_rescale_refused_on_shared_kv_heads():
    a = tiny_model("llama", "causal", num_key_value_heads=2)
    with pytest.raises(RaotError, match="rescaling is not implemented.*--no-weight-rescale"):
        estimate_weight_alignment(model_state(a), model_state(clone(a)), schema_for(a), rescale=True)


def _free_head_map(schema, layer, seed):
    g = torch.Generator().manual_seed(seed)
    h, kv, queries_per_kv = schema.head_size, schema.kv_heads, schema.num_heads // schema.kv_heads
    qk = torch.stack([random_orthogonal(h, g) for _ in range(kv)]).repeat_interleave(queries_per_kv, 0)
    eye = torch.eye(h, dtype=torch.float64).expand(schema.num_heads, h, h)
    return UnrestrictedHeadAlignment(layer, torch.arange(schema.num_heads), qk, eye)


def test_unrestricted_head_map_is_inexact_under_rope_and_exact_without():
    """A free Q/K rotation does not commute with RoPE: the Llama's function changes and the
    transform is labelled inexact; GPT-2 has no position rotations, so the same kind of map is
    exact there (≤ 1e-9 in float64)."""
    llama = tiny_model("llama", "causal", num_key_value_heads=2)
    schema = schema_for(llama)
    t = _free_head_map(schema, 0, seed=1)
    assert not is_exact(t, schema)
    with pytest.raises(RaotError, match="commute"):  # the exact class refuses the same maps
        HeadAlignment(t.layer, t.perm, t.qk, t.vo).actions(schema)
    moved = transform_model(clone(llama), schema, t)
    with exact_rmsnorm():
        assert output_deviation(llama, moved, example_inputs(llama), None, relative=True) > 1e-3

    gpt2 = tiny_model("gpt2", "causal")
    schema = schema_for(gpt2)
    t = _free_head_map(schema, 0, seed=1)
    assert is_exact(t, schema)
    moved = transform_model(clone(gpt2), schema, t)
    assert _max_weight_difference(gpt2, moved) > 1e-2
    assert output_deviation(gpt2, moved, example_inputs(gpt2), None) <= 1e-9


def test_rope_unrestricted_merge_reports_its_deviation():
    """The ablation on two independent Llamas: free Q/K maps are estimated and applied (gate off),
    the alignment is reported inexact with B′'s measured deviation, and nothing raises."""
    a = tiny_model("llama", "causal", seed=0, num_key_value_heads=2, vocab_size=40)
    b = tiny_model("llama", "causal", seed=1, num_key_value_heads=2, vocab_size=40)
    data, pre = tiny_text_dataset(64), tiny_tokenizer()
    merger = RaotMerger.from_models(a, b, preprocessor=pre, rope_restricted=False, gate=False)
    result = merger.merge(calibration=data)
    heads = [t for t in result.alignment.applied.transforms if isinstance(t, HeadAlignment)]
    assert heads and all(isinstance(t, UnrestrictedHeadAlignment) for t in heads)
    assert not result.alignment.exact
    check = result.report["checks"][0]
    assert check["exact"] is False and check["value"] > 1e-6
    assert result.report["settings"]["rope_restricted"] is False
