"""The spine promise for two-tower models (docs/design.md §11): B = an exact symmetry of A — each
tower's whole group and one map of the joint space — and merge(A, B) gives A back to ≤ 1e-4
relative, under each moment precision, with the zero-shot check equal to A's; fine-tuned siblings
share a basis; plain merges of two-tower checkpoints run through every kind of rule."""

import pytest
import torch
import transformers

from raot_hf import RaotError, RaotMerger, merge_checkpoints, schema_for
from raot_hf.adapters import get_dual_encoder
from raot_hf.dual import joint_schema, tower_models
from raot_hf.symmetry import ResidualRotation, random_group_element, transform_model
from raot_hf.symmetry.group import mean_fixing, random_orthogonal
from raot_hf.testing import clone, drift, tiny_dual_model, tiny_dual_processor, tiny_paired_dataset, trained_like

DUALS = ["clip", "siglip"]


def _model(model_type, seed=0):
    return trained_like(tiny_dual_model(model_type, seed=seed, hidden_size=32, num_layers=2), seed=seed).float()


def _scrambled(model, seed=1):
    """A copy under the joint map and both towers' whole groups (heads, scales, units, stream)."""
    moved = clone(model)
    spec = get_dual_encoder(model.config.model_type)
    schema = joint_schema(spec, moved)
    g = torch.Generator().manual_seed(seed)
    p = schema.hidden_size
    u = mean_fixing(random_orthogonal(p - 1, g)) if schema.residual.exact == "mean_fixing" else random_orthogonal(p, g)
    transform_model(moved, schema, ResidualRotation(u))
    for i, tower in enumerate(tower_models(spec, moved).values()):
        transform_model(tower, schema_for(tower), random_group_element(schema_for(tower), seed=seed + 10 + i))
    return moved


def _logits(model, processor):
    data = tiny_paired_dataset(6, seed=99)
    inputs = processor(text=list(data["text"]), images=list(data["image"]), return_tensors="pt", padding=True)
    inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "pixel_values")}
    with torch.no_grad():
        return model(**inputs).logits_per_image


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", DUALS)
def test_two_tower_models_recover_both_towers_and_the_joint_map(model_type, precision):
    a, processor = _model(model_type), tiny_dual_processor(model_type)
    b = _scrambled(a)
    reference = clone(a)
    options = {"calibration": {"moment_precision": precision}}
    result = RaotMerger.from_models(a, b, preprocessor=processor, **options).merge(calibration=tiny_paired_dataset(128))
    decisions = result.alignment.decisions
    assert decisions[0].transform == "joint" and all(d.applied for d in decisions), [d.reason for d in decisions]
    assert result.alignment.exact and all(c["passed"] for c in result.report["checks"])
    for tower in result.report["towers"].values():
        assert tower["calibration"]["moment_precision"]["used"] == precision
    want = _logits(reference, processor)
    assert (_logits(result.model, processor) - want).abs().max() <= 1e-4 * want.abs().max()
    zero_shot = result.report["zero_shot"]
    assert zero_shot["pairs"] == 32 and zero_shot["merge"] == zero_shot["a"] == zero_shot["b"]


def _contrastive_steps(model, processor, seed, steps=15, lr=0.01):
    """A few steps of the model's own image–text loss on random pairs: a fine-tuned sibling."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        data = tiny_paired_dataset(8, seed=int(torch.randint(0, 10**6, (1,), generator=g)))
        inputs = processor(text=list(data["text"]), images=list(data["image"]), return_tensors="pt", padding=True)
        inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "pixel_values")}
        loss = model(**inputs, return_loss=True).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("model_type", DUALS)
def test_two_tower_siblings_share_a_basis(model_type):
    base, processor = _model(model_type), tiny_dual_processor(model_type)
    a, b = _contrastive_steps(clone(base), processor, 1), _contrastive_steps(clone(base), processor, 2)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    result = RaotMerger.from_models(a, b, preprocessor=processor).merge(calibration=tiny_paired_dataset(128))
    assert result.alignment.decisions and not any(d.applied for d in result.alignment.decisions)
    assert result.alignment.shares_basis and result.report["shares_basis"]


def _checkpoints(root, model_type):
    processor = tiny_dual_processor(model_type)
    base = tiny_dual_model(model_type, dtype=torch.float32)
    paths = []
    for i, name in enumerate(("base", "a", "b")):
        model = clone(base)
        drift(model, 0.05 * i, seed=i)
        model.save_pretrained(root / name)
        processor.save_pretrained(root / name)
        paths.append(root / name)
    return paths


@pytest.mark.parametrize("rule", ["linear", "ties", "slerp", "regmean"])
@pytest.mark.parametrize("model_type", DUALS)
def test_plain_merges_of_two_tower_checkpoints(tmp_path, model_type, rule):
    paths = _checkpoints(tmp_path, model_type)
    options = {"base": paths[0]} if rule == "ties" else {}
    options.update({"t": 0.5} if rule == "slerp" else {})
    if rule == "regmean":
        options["calibration"] = tiny_paired_dataset(32)
    out, report = merge_checkpoints(*paths[1:], out=tmp_path / "out", alignment="none", merge_rule=rule, **options)
    cls = transformers.CLIPModel if model_type == "clip" else transformers.SiglipModel
    merged, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert report["dual_encoder"] == model_type and (report["zero_shot"] is None) == (rule != "regmean")
    if rule == "linear":
        a, b = (cls.from_pretrained(p) for p in paths[1:])
        for (name, p), q, m in zip(a.named_parameters(), b.parameters(), merged.parameters(), strict=True):
            assert torch.allclose(m, 0.5 * (p + q), atol=1e-6), name


def test_a_two_tower_merge_without_captions_is_refused_before_any_forward():
    a = _model("clip")
    images = tiny_paired_dataset(16).remove_columns(["text"])
    with pytest.raises(RaotError, match="text column"):
        RaotMerger.from_models(a, clone(a), preprocessor=tiny_dual_processor("clip")).merge(calibration=images)
