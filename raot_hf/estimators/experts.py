"""The expert matching of a mixture-of-experts layer (docs/design.md §10), from its fit statistics
(:class:`~raot_hf.calibration.statistics.ExpertMoments`).

Each pair (expert a of A, expert b of B) is scored by three numbers that an exact symmetry makes 1
for the true pair and at most 1 for every other:

* ``routing``: the Pearson correlation of their router probabilities over every fit token;
* ``tokens``: the overlap (Jaccard) of the token sets the two routers send them;
* ``units``: how well their hidden units correspond on the tokens both routers send them — per
  unit the best correlation with a unit of the other, averaged over both experts' units.

One assignment on the mean of the three matches the experts; near ties that the scores' precision
cannot order are resolved from the router probabilities' exact means and spreads, as near-twin
MLP units are (:mod:`raot_hf.estimators.ties`). Each matched pair then gets its unit permutation
from its own moments (:func:`~raot_hf.estimators.activation.estimate_mlp_permutation`).
"""

from __future__ import annotations

import torch

from raot_hf.calibration.precision import correlation_error_bound
from raot_hf.calibration.statistics import ExpertMoments
from raot_hf.estimators.activation import estimate_mlp_permutation
from raot_hf.estimators.head_fit import assign
from raot_hf.estimators.ties import resolve_near_ties, unit_mismatch
from raot_hf.symmetry.experts import ExpertAlignment

_F64 = torch.float64


def unit_correspondence(stats: ExpertMoments) -> torch.Tensor:
    """(E × E) per pair: ½·(mean over A's units of its best correlation with a unit of B's expert +
    the same from B's side), on the tokens both routers send them (0 where they share none)."""
    e = stats.num_experts
    out = torch.zeros(e, e, dtype=_F64)
    for a in range(e):
        for b in range(e):
            pair = stats.pair(a, b)
            if float(pair.n_cross) < 2:
                continue
            corr = pair.correlation()
            out[a, b] = 0.5 * (corr.max(1).values.mean() + corr.max(0).values.mean())
    return out


def expert_scores(stats: ExpertMoments) -> dict[str, torch.Tensor]:
    """The three pair scores (routing, tokens, units) and their mean (``score``), each E × E."""
    routing = stats.router.correlation()
    union = stats.routed_a[:, None] + stats.routed_b[None, :] - stats.both
    tokens = torch.where(union > 0, stats.both / union.clamp_min(1), torch.zeros_like(union))
    units = unit_correspondence(stats)
    return {"routing": routing, "tokens": tokens, "units": units, "score": (routing + tokens + units) / 3}


def estimate_expert_alignment(stats: ExpertMoments, layer: int, *, return_log: bool = False):
    """The :class:`ExpertAlignment` of layer ``layer`` (B′ expert j = B expert perm[j], its units
    matched to A's expert j's) and, with ``return_log``, its log."""
    scores = expert_scores(stats)
    score = scores["score"]
    e = stats.num_experts
    products = stats.units[0].product_dtype if stats.units else None
    # the mean's error: a third of each part's (the routing's float64 moments, exact counts, the units')
    tolerance = (correlation_error_bound(_F64) + correlation_error_bound(products)) / 3
    mean_a, std_a, mean_b, std_b = stats.router.unit_statistics()

    def mismatch(rows, cols):
        return unit_mismatch(mean_a, std_a, mean_b, std_b, rows, cols)

    perm, ties = resolve_near_ties(score, assign(score), tolerance, mismatch)
    units, unit_logs = [], []
    for j in range(e):
        pair = stats.pair(j, int(perm[j]))
        if float(pair.n_cross) < 2:  # no token reaches both: nothing to match the units on
            units.append(torch.arange(pair.sum_a.numel()))
            unit_logs.append({"tokens": int(pair.n_cross), "skipped": "fewer than 2 shared tokens"})
            continue
        t, log = estimate_mlp_permutation(pair, layer, return_log=True)
        units.append(t.perm)
        unit_logs.append({"tokens": int(pair.n_cross), "moved": log["moved"], "near_ties": log["near_ties"]})
    transform = ExpertAlignment(layer, perm, torch.stack(units))
    if not return_log:
        return transform
    ar = torch.arange(e)
    log = {
        "experts": e,
        "perm": perm.tolist(),
        "fit_score_matched": score[ar, perm].tolist(),
        "fit_score_same_index": score.diagonal().tolist(),
        **{f"fit_{k}_matched": v[ar, perm].tolist() for k, v in scores.items() if k != "score"},
        "routed_tokens_a": stats.routed_a.tolist(),
        "routed_tokens_b": stats.routed_b.tolist(),
        "near_ties": ties.to_dict(),
        "units": unit_logs,
    }
    return transform, log
