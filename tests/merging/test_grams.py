"""RegMean Grams of B′ are B's Grams under the applied transform (docs/design.md §6), including
pre-LN folding — checked against Grams measured on B′ directly."""

import pytest
import torch

from raot_hf import schema_for
from raot_hf.calibration import CalibrationConfig, iter_calibration_batches
from raot_hf.calibration.collector import StatisticsCollector
from raot_hf.merging.grams import aligned_grams
from raot_hf.symmetry import fold_model, norm_affines, random_group_element, transform_model
from raot_hf.testing import (
    tiny_image_dataset,
    tiny_image_processor,
    tiny_model,
    tiny_text_dataset,
    tiny_tokenizer,
)


def _collect(a, b, schema, pre, data):
    cfg = CalibrationConfig(batch_size=16)
    with StatisticsCollector(a, b, schema, grams=True) as col:
        for batch in iter_calibration_batches(data, pre, cfg):
            col.update(batch)
    return col.stats


@pytest.mark.parametrize("model_type,head", [("bert", "sequence"), ("vit", "image")])
def test_transformed_grams_match_measured(model_type, head):
    a = tiny_model(model_type, head, seed=0)
    b = tiny_model(model_type, head, seed=5)  # independent, so B′ ≠ A
    pre, data = (
        (tiny_image_processor(), tiny_image_dataset(32))
        if model_type == "vit"
        else (tiny_tokenizer(), tiny_text_dataset(32))
    )
    schema = schema_for(a)
    before = _collect(a, b, schema, pre, data)
    transform = random_group_element(schema, seed=3)  # includes a residual rotation for ViT (folds)
    norms = (norm_affines(a, schema), norm_affines(b, schema))  # what the fold removes
    transform_model(b, schema, transform)
    if model_type == "vit":
        fold_model(a, schema)
    assert not hasattr(a, "_raot_unfolded_norms") and not hasattr(b, "_raot_unfolded_norms")
    after = _collect(a, b, schema, pre, data)
    grams_a, grams_b = aligned_grams(before, schema, transform, a, b, unfolded_norms=norms)
    for key, gram in after.grams.items():
        scale = gram.b.abs().max()
        assert torch.allclose(grams_b[key], gram.b, atol=1e-9 * scale), key
        assert torch.allclose(grams_a[key], gram.a, atol=1e-9 * gram.a.abs().max()), key
