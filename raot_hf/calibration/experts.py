"""What the calibration pass observes of a mixture-of-experts block (docs/design.md §10).

Per layer and model, the router's scores of every expert on every token and, for each expert, its
hidden units (the input of its output projection) on the tokens routed to it. The fit phase sums,
over the real tokens of A and B paired by position:

* the router probabilities' moments (E × E, float64): routing frequencies and their co-movement;
* the routed counts — tokens each expert of A receives, each expert of B, and both (E × E);
* for every pair (expert a of A, expert b of B), the moments of their units (f × f) over the tokens
  both routers send them, in the MLP co-moments' precision (docs/design.md §4.3).

These sums are :class:`~raot_hf.calibration.statistics.ExpertMoments`. The held-out phase keeps
the router probabilities' per-expert sums, B's mapped by the candidate's
expert permutation (:class:`~raot_hf.calibration.statistics.PairedDiagonal`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raot_hf.adapters.schema import ExpertLayer

_F64 = torch.float64


@dataclass(frozen=True)
class ExpertObservation:
    """One model's view of one batch at a mixture-of-experts block: ``chosen`` (T, k) the experts
    each token is routed to, and per expert its units (n_e × f) on the tokens routed to it, in
    token order."""

    chosen: torch.Tensor
    units: tuple[torch.Tensor, ...]

    def routed(self, num_experts: int) -> torch.Tensor:
        """(T, E) bool: whether token t is routed to expert e."""
        mask = torch.zeros(self.chosen.shape[0], num_experts, dtype=torch.bool, device=self.chosen.device)
        return mask.scatter_(1, self.chosen.long(), True)


@torch.no_grad()
def observe_experts(module: torch.nn.Module, block: ExpertLayer, hidden: torch.Tensor, chosen: torch.Tensor):
    """The :class:`ExpertObservation` of an experts module called on ``hidden`` (T, d) with the
    router's choice ``chosen`` (T, k): each expert's units computed as the module computes them
    (its input projection, then its gating of the [gate | up] parts)."""
    weights = getattr(module, block.gate_up.rsplit(".", 1)[1])
    routed = ExpertObservation(chosen, ()).routed(block.num_experts)
    units = []
    for e in range(block.num_experts):
        x = hidden[routed[:, e]]
        projected = torch.nn.functional.linear(x, weights[e])
        units.append(module._apply_gate(projected) if block.parts == 2 else module.act_fn(projected))
    return ExpertObservation(chosen.detach(), tuple(u.detach() for u in units))


def router_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """The router's softmax over the experts, in float64 (the statistics' own function of the logits)."""
    return torch.softmax(logits.to(_F64), dim=-1)
