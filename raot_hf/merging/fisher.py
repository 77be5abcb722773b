"""Label-free diagonal Fisher information for Fisher-weighted merging (Matena & Raffel).

F_θ = E_x E_{y∼p_θ(·|x)} [(∂ log p_θ(y|x) / ∂θ)²], estimated per example with y sampled from
the model's own predictive distribution (no labels needed), over real tokens only for
token-level heads. Per-example gradients are squared before summing, so the estimate is the
diagonal Fisher, not the squared mean gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from raot_hf.errors import RaotError

logger = logging.getLogger("raot_hf.merging.fisher")


def _log_prob_of_sample(logits: torch.Tensor, mask: torch.Tensor | None, generator: torch.Generator) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    probs = logp.detach().exp().reshape(-1, logp.shape[-1])
    y = torch.multinomial(probs, 1, generator=generator).reshape(logp.shape[:-1])
    picked = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    if mask is not None and picked.ndim == 2 and picked.shape == mask.shape:
        picked = picked * mask.to(picked.dtype)
    return picked.sum()


def diagonal_fisher(
    model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], *, names: set[str] | None = None,
    max_examples: int = 64, seed: int = 0,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Diagonal Fisher of ``model``'s parameters (restricted to ``names``) over up to
    ``max_examples`` examples drawn from ``batches`` (dicts of model inputs)."""
    params = {n: p for n, p in model.named_parameters() if names is None or n in names}
    fisher = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    requires = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(n in params)
    seen = skipped = 0
    try:
        for inputs in batches:
            size = next(iter(inputs.values())).shape[0]
            for row in range(size):
                if seen >= max_examples:
                    break
                single = {k: v[row : row + 1] for k, v in inputs.items()}
                out = model(**single)
                logits = getattr(out, "logits", None)
                if logits is None:
                    raise RaotError(
                        f"{type(model).__name__} has no task head, so it has no predictive distribution; "
                        "Fisher merging needs a classification or masked-LM model — use --merge-rule linear"
                    )
                if not bool(torch.isfinite(logits).all()):
                    skipped += 1  # NaN/Inf outputs have no predictive distribution to sample from
                    continue
                model.zero_grad(set_to_none=True)
                _log_prob_of_sample(logits, single.get("attention_mask"), generator).backward()
                for n, p in params.items():
                    if p.grad is not None:
                        fisher[n] += p.grad.detach().to(torch.float64) ** 2
                seen += 1
            if seen >= max_examples:
                break
    finally:
        model.zero_grad(set_to_none=True)
        for n, p in model.named_parameters():
            p.requires_grad_(requires[n])
        model.train(was_training)
    if skipped:
        logger.warning("Fisher of %s: %d examples with NaN/Inf outputs were skipped", type(model).__name__, skipped)
    if seen == 0:
        raise RaotError(
            "no calibration examples reached the Fisher estimate (none given, or every output was NaN/Inf); "
            "pass calibration data on which the model's outputs are finite, or use --merge-rule linear"
        )
    return {n: f / seen for n, f in fisher.items()}
