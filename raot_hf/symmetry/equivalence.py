"""What "the same function" means when comparing a model with its transformed copy: the
outputs that define it, the inputs they are compared on and their deviation (used by the
merger's B′ ≡ B check and, re-exported, by :mod:`raot_hf.testing`)."""

from __future__ import annotations

import torch

from raot_hf.adapters import is_decoder, modality_of

#: The output fields that define a model's function, in the order they are compared.
PRIMARY_KEYS = tuple(
    ["logits", "cls_logits", "distillation_logits", "start_logits", "end_logits", "pooler_output", "last_hidden_state"]
)
#: A dual encoder's tower projected into the joint space (docs/design.md §11): its function, as logits are a head's.
EMBEDDING_KEYS = ("text_embeds", "image_embeds")


def primary_outputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The outputs that define the model's function: logits for task heads; for base models
    ``last_hidden_state`` (in the stream basis) and ``pooler_output`` when present."""
    with torch.no_grad():
        return select_primary(model(**inputs))


def select_primary(out, rows: int | None = None) -> dict[str, torch.Tensor]:
    """:func:`primary_outputs` of a model output already computed (its first ``rows`` rows)."""
    res = {}
    for key in PRIMARY_KEYS + EMBEDDING_KEYS:
        value = getattr(out, key, None)
        if value is not None:
            res[key] = value if rows is None else value[:rows]
    if "logits" in res or "start_logits" in res or any(k in res for k in EMBEDDING_KEYS):
        res.pop("last_hidden_state", None)
    pooled, hidden = res.get("pooler_output"), res.get("last_hidden_state")
    # a pooled output that is the first token's stream vector (DINOv2) is in the stream basis and says nothing more
    if (
        pooled is not None
        and hidden is not None
        and pooled.shape == hidden[:, 0].shape
        and torch.equal(pooled, hidden[:, 0])
    ):
        res.pop("pooler_output")
    return res


def example_inputs(model: torch.nn.Module, batch: int = 3, seq: int = 9, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs for ``model``: token ids with a padded tail, or pixel values."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    if modality_of(cfg.model_type) == "image":
        size = cfg.image_size
        px = torch.randn(batch, cfg.num_channels, size, size, generator=g)
        return {"pixel_values": px.to(next(model.parameters()).dtype)}
    ids = torch.randint(3, cfg.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        mask[-1, seq // 2 :] = 0
    if is_decoder(cfg.model_type) and cfg.pad_token_id is not None:
        ids = ids.masked_fill(mask == 0, cfg.pad_token_id)  # right padding, as the calibration batches
    out = {"input_ids": ids, "attention_mask": mask}
    if getattr(cfg, "type_vocab_size", 0):
        out["token_type_ids"] = torch.randint(0, cfg.type_vocab_size, (batch, seq), generator=g)
    return out


def deviation_forms(
    reference: dict[str, torch.Tensor],
    candidate: dict[str, torch.Tensor],
    mask: torch.Tensor | None = None,
    stream_map: torch.Tensor | None = None,
    relative: bool = False,
) -> dict[str, float]:
    """Both forms of the difference between two sets of primary outputs, from one float64 pass,
    padding positions ignored, the worst over the outputs: ``"max"`` — max abs (or relative: over the
    reference's largest real entry) — and ``"norm"`` — the Frobenius norm of the difference (relative:
    over the reference's norm), which one massive entry does not dominate. ``stream_map`` (d×d) maps
    the reference's ``last_hidden_state`` into the candidate's basis (base models' output lives in the
    stream). The one comparison behind the B′ ≡ B check and :func:`output_deviation`."""
    worst = {"max": 0.0, "norm": 0.0}
    for key, r in reference.items():
        r = r.detach().to("cpu", torch.float64)
        c = candidate[key].detach().to("cpu", torch.float64)
        if key == "last_hidden_state" and stream_map is not None:
            r = r @ stream_map.to("cpu", torch.float64)
        # where the reference is not finite the candidate must not be either (a model that overflows
        # on some input is still compared elsewhere); a non-finite entry of one side only is an
        # infinite deviation (NaN would otherwise compare as none)
        same_fault = ~torch.isfinite(r) & ~torch.isfinite(c)
        diff, r = torch.where(same_fault, 0.0, (r - c).abs()), torch.where(same_fault, 0.0, r.abs())
        if mask is not None and diff.ndim >= 2 and diff.shape[:2] == tuple(mask.shape):
            m = mask.to("cpu", torch.float64)
            m = m[..., None] if diff.ndim == 3 else m
            # padding positions are left out, whatever they hold (a padded query may be NaN)
            diff, r = torch.where(m > 0, diff, 0.0), torch.where(m > 0, r, 0.0)
        if not (torch.isfinite(diff).all() and torch.isfinite(r).all()):
            return {"max": float("inf"), "norm": float("inf")}
        for form, (d, scale) in (("max", (diff.max(), r.max())), ("norm", (diff.norm(), r.norm()))):
            d, scale = float(d), float(scale)
            worst[form] = max(worst[form], d / max(scale, 1e-30) if relative else d)
    return worst


def compare_outputs(
    reference: dict[str, torch.Tensor],
    candidate: dict[str, torch.Tensor],
    mask: torch.Tensor | None = None,
    stream_map: torch.Tensor | None = None,
    relative: bool = False,
    form: str = "max",
) -> float:
    """One form (``"max"`` or ``"norm"``) of :func:`deviation_forms`."""
    return deviation_forms(reference, candidate, mask, stream_map, relative)[form]


def output_deviation(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    stream_map: torch.Tensor | None = None,
    relative: bool = False,
) -> float:
    """Max abs (or relative) difference between the primary outputs of two models on ``inputs``
    (:func:`compare_outputs`)."""
    ref, cand = primary_outputs(reference, inputs), primary_outputs(candidate, inputs)
    return compare_outputs(ref, cand, inputs.get("attention_mask"), stream_map, relative)
