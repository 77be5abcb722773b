"""Measurements of a merged model: accuracy and loss with a given head, frozen-feature linear
probes, the loss barrier along the interpolation path, weight distance after alignment.

The models come from the product (``RaotMerger``); this module only evaluates them. Two
helpers reuse what one merge already produced instead of merging again, and each is checked
against the product on every use (or in the smoke test):

* :func:`with_head_of` — the merged trunk with B′'s classifier head, which is what the
  product's ``head="b"`` policy writes (the trunk of a linear merge does not depend on the
  head policy; the smoke test compares the two).
* :func:`interpolate` — the linear path (1 − α)·A + α·B′ over every parameter (the product's
  linear rule with ``head="average"``); at α = 0.5 its trunk must equal the product's merge,
  which :func:`path_check` verifies for every linear method.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import torch

from raot_hf.adapters.schema import ModelSchema
from raot_hf.symmetry import fold_model, load_state, model_state

logger = logging.getLogger("benchmarks.metrics")


@dataclass
class EncodedSplit:
    """A split turned into model inputs once: a list of input batches and the labels."""

    batches: list[dict[str, torch.Tensor]]
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.numel())


def encode_split(dataset, processor, *, batch_size: int = 128, max_length: int = 64) -> EncodedSplit:
    """Encode a split with an ``image`` or ``text`` column. Text is ordered by length before
    batching (each batch padded to its longest), which saves most of the padding; the labels
    follow the same order."""
    columns = dataset.column_names
    labels = list(dataset["label"])
    batches = []
    if "image" in columns:
        for start in range(0, len(dataset), batch_size):
            chunk = dataset[start : start + batch_size]
            batches.append({"pixel_values": processor(list(chunk["image"]), return_tensors="pt")["pixel_values"]})
        return EncodedSplit(batches, torch.tensor(labels))
    texts = list(dataset["text"])
    lengths = [len(ids) for ids in processor(texts, truncation=True, max_length=max_length)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        enc = processor(
            [texts[i] for i in idx], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        batches.append({k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")})
    return EncodedSplit(batches, torch.tensor([labels[i] for i in order]))


def classifier_module(model: torch.nn.Module, schema: ModelSchema) -> torch.nn.Module:
    """The module whose input is the pooled representation (the classifier head)."""
    modules = dict(model.named_modules())
    for name in schema.head_params:
        owner = name.rsplit(".", 1)[0]
        if owner in modules and isinstance(modules[owner], torch.nn.Linear):
            return modules[owner]
    raise ValueError(f"no classifier Linear among the head parameters {schema.head_params}")


@torch.no_grad()
def evaluate(model, split: EncodedSplit, schema: ModelSchema, *, features: bool = False):
    """Mean cross-entropy and accuracy on ``split``; with ``features`` also the classifier's
    input (CLS / pooled representation) as a float64 numpy array."""
    model.eval()
    captured: list[torch.Tensor] = []
    handle = None
    if features:
        handle = classifier_module(model, schema).register_forward_pre_hook(
            lambda _m, inp: captured.append(inp[0].detach().reshape(inp[0].shape[0], -1).double())
        )
    total_loss, correct, seen = 0.0, 0, 0
    try:
        for batch, start in zip(split.batches, _starts(split), strict=True):
            logits = model(**batch).logits.double()
            labels = split.labels[start : start + logits.shape[0]]
            total_loss += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(-1) == labels).sum())
            seen += logits.shape[0]
    finally:
        if handle is not None:
            handle.remove()
    out = {"loss": total_loss / seen, "accuracy": correct / seen}
    if features:
        return out, torch.cat(captured).numpy()
    return out


def _starts(split: EncodedSplit) -> list[int]:
    starts, pos = [], 0
    for batch in split.batches:
        starts.append(pos)
        pos += next(iter(batch.values())).shape[0]
    return starts


@torch.no_grad()
def features_of(model, split: EncodedSplit, schema: ModelSchema) -> np.ndarray:
    """The classifier-input features of every example of ``split``."""
    return evaluate(model, split, schema, features=True)[1]


def linear_probe(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray) -> float:
    """Test accuracy of a logistic-regression probe fitted on frozen features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if not (np.isfinite(train_x).all() and np.isfinite(test_x).all()):
        return float("nan")
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=1.0))
    probe.fit(train_x, train_y)
    return float(probe.score(test_x, test_y))


def canonical_state(model, schema: ModelSchema) -> dict[str, torch.Tensor]:
    """The model's parameters in the folded parameterization for pre-LN models (LayerNorm γ, β
    folded into their readers, an exact reparameterization), as-is for post-LN models, so that
    distances compare like parameters whatever the alignment folded."""
    if schema.norm == "pre":
        model = fold_model(copy.deepcopy(model), schema)
    return {k: v.detach().double().clone() for k, v in model_state(model).items()}


def weight_distance(state_a: dict, state_b: dict, names: list[str]) -> float:
    """‖A − B‖ / ‖A‖ over the parameters ``names`` (the trunk)."""
    num = sum(float((state_a[n] - state_b[n]).pow(2).sum()) for n in names)
    den = sum(float(state_a[n].pow(2).sum()) for n in names)
    return (num / max(den, 1e-300)) ** 0.5


def with_head_of(merged, source, schema: ModelSchema):
    """A copy of ``merged`` carrying ``source``'s classifier head (the ``head="b"`` policy)."""
    out = copy.deepcopy(merged)
    state = model_state(source)
    load_state(out, {name: state[name] for name in schema.head_params})
    return out


def head_accuracy(features: np.ndarray, labels: torch.Tensor, source, schema: ModelSchema) -> float | None:
    """Accuracy of ``source``'s classifier head applied to a trunk's classifier-input features —
    the same logits as :func:`with_head_of` when the head is that one Linear (ViT, BERT), without
    another forward pass. None when the head has other parameters (use :func:`with_head_of`)."""
    linear = classifier_module(source, schema)
    names = {n for n, p in source.named_parameters() if any(p is q for q in linear.parameters())}
    if set(schema.head_params) != names:
        return None
    with torch.no_grad():
        logits = torch.as_tensor(features) @ linear.weight.double().T + linear.bias.double()
    return float((logits.argmax(-1) == labels).double().mean())


def matching_reference(reference_a, result, schema: ModelSchema):
    """A in the parameterization the merge used: the merger folds A's LayerNorms when it applied
    a residual rotation to a pre-LN model (B′ is folded by the same transform)."""
    from raot_hf.symmetry import ResidualRotation

    rotated = any(isinstance(t, ResidualRotation) for t in result.alignment.applied.transforms)
    if schema.norm == "pre" and rotated:
        return fold_model(copy.deepcopy(reference_a), schema)
    return reference_a


def interpolate(reference_a, b_prime, alpha: float, scratch=None):
    """The model (1 − α)·A + α·B′ over every parameter (written into ``scratch`` if given)."""
    sa, sb = model_state(reference_a), model_state(b_prime)
    out = scratch if scratch is not None else copy.deepcopy(b_prime)
    load_state(out, {k: (1 - alpha) * sa[k].double() + alpha * sb[k].double() for k in sa})
    return out


def path_check(midpoint, merged, schema: ModelSchema) -> float:
    """Largest relative difference between the trunk of the α = 0.5 path point and the product's
    linear merge (should be float rounding)."""
    sm, sp = model_state(merged), model_state(midpoint)
    head = set(schema.head_params)
    worst = 0.0
    for name, value in sm.items():
        if name in head:
            continue
        scale = float(value.double().abs().max().clamp_min(1e-12))
        worst = max(worst, float((value.double() - sp[name].double()).abs().max()) / scale)
    return worst


def barrier(alphas: list[float], losses: list[float]) -> float:
    """max over α of loss(α) − ((1 − α)·loss(0) + α·loss(1)) (the endpoints are the grid's ends)."""
    l0, l1 = losses[0], losses[-1]
    return max(loss - ((1 - a) * l0 + a * l1) for a, loss in zip(alphas, losses, strict=True))


def max_abs_difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float | None:
    """Largest absolute difference between two state dicts' floating tensors (0.0: bitwise equal);
    None when their keys or shapes differ (the weights cannot be compared entry by entry)."""
    if state.keys() != reference.keys():
        return None
    worst = 0.0
    for name, value in state.items():
        other = reference[name]
        if value.shape != other.shape:
            return None
        if value.is_floating_point():
            worst = max(worst, float((value.double() - other.double()).abs().max()) if value.numel() else 0.0)
    return worst


def calibration_tokens(report: dict) -> dict:
    """The fit tokens a merge's moments took and, per layer, those each MLP cross moment and each
    d × d cross moment took (fewer under a token cap, docs/design.md §4.3), from its report."""
    calibration = report.get("calibration") or {}
    return {
        "moment": calibration.get("moment_tokens"),
        "mlp_moment": calibration.get("mlp_moment_tokens"),
        "hidden_moment": calibration.get("hidden_moment_tokens"),
    }


def refit_summary(report: dict) -> dict | None:
    """What the end-to-end refit did in a merge's report: kept or not, why, the steps run and the
    best one and the judged loss before and after (None: the refit was off; its seconds are the
    row's ``timings["refit"]``)."""
    refit = report.get("refit")
    if not refit:
        return None
    keys = ("ran", "kept", "reason", "target", "teacher", "steps", "best_step", "heldout_loss_before",
            "heldout_loss_after")  # fmt: skip
    return {k: refit.get(k) for k in keys}


def correction_summary(report: dict) -> dict | None:
    """What the post-merge correction did in a merge's report: the method, the layers kept and the
    held-out competition's figures with the model-level check (None: no correction ran)."""
    correction = (report.get("merge") or {}).get("correction") or {}
    if correction.get("method", "none") == "none":
        return None
    layers = [layer for layer in correction.get("layers", []) if layer.get("layer") != "final"]
    return {
        "method": correction["method"],
        "layers_kept": [layer["layer"] for layer in layers if layer.get("kept", True)],
        "layers": len(layers),
        "competition": correction.get("competition"),
    }
