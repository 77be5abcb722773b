"""What "the same function" means when comparing a model with its transformed copy: the
outputs that define it (used by the merger's B′ ≡ B check and by :mod:`raot_hf.testing`)."""

from __future__ import annotations

import torch


def primary_outputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The outputs that define the model's function: logits for task heads; for base models
    ``last_hidden_state`` (in the stream basis) and ``pooler_output`` when present."""
    with torch.no_grad():
        return select_primary(model(**inputs))


def select_primary(out, rows: int | None = None) -> dict[str, torch.Tensor]:
    """:func:`primary_outputs` of a model output already computed (its first ``rows`` rows)."""
    res = {}
    for key in (
        "logits",
        "cls_logits",
        "distillation_logits",
        "start_logits",
        "end_logits",
        "pooler_output",
        "last_hidden_state",
    ):
        value = getattr(out, key, None)
        if value is not None:
            res[key] = value if rows is None else value[:rows]
    if "logits" in res or "start_logits" in res:
        res.pop("last_hidden_state", None)
    return res
