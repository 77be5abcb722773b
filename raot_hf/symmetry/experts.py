"""The symmetry of a mixture-of-experts block (docs/design.md §10): a permutation of the experts
with the router's rows, and a permutation of each expert's units on its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from raot_hf.adapters.schema import ExpertLayer, ModelSchema
from raot_hf.errors import RaotError
from raot_hf.symmetry.transforms import SpaceAction, Transform, _check_perm, _tensor


def expert_block(schema: ModelSchema, layer: int) -> ExpertLayer:
    """Layer ``layer``'s mixture-of-experts block; a one-line error when it has none."""
    block = schema.layers[layer].experts if 0 <= layer < len(schema.layers) else None
    if block is None:
        raise RaotError(f"layer {layer} of the {schema.model_type} schema has no mixture-of-experts block")
    return block


def flat_unit_permutation(perm: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """The permutation of the (expert, unit) pairs, expert-major, that moves expert ``perm[j]`` to
    slot j with its units permuted by ``units[j]``: new pair (j, u) takes old (perm[j], units[j, u])."""
    f = units.shape[1]
    return (perm[:, None] * f + units).reshape(-1)


@dataclass
class ExpertAlignment(Transform):
    """One mixture-of-experts layer's experts permuted with their router rows, each expert's units
    permuted on their own (docs/design.md §10): expert j of B′ is expert ``perm[j]`` of B, whose
    unit u is that expert's unit ``units[j, u]``; router row j of B′ is B's row ``perm[j]``."""

    layer: int
    perm: torch.Tensor  # (E,)
    units: torch.Tensor  # (E, f)
    kind: ClassVar[str] = "expert_alignment"

    def __post_init__(self):
        self.perm = _tensor(self.perm, torch.long)
        self.units = _tensor(self.units, torch.long)

    def may_touch(self, schema, name):
        return name.startswith(f"layers.{self.layer}.")

    def actions(self, schema):
        block = expert_block(schema, self.layer)
        e, f = block.num_experts, block.units
        _check_perm(self.perm, e, f"expert permutation of layer {self.layer}")
        if self.units.shape != (e, f):
            raise RaotError(f"layer {self.layer} expert units: expected shape {(e, f)}, got {tuple(self.units.shape)}")
        for j in range(e):
            _check_perm(self.units[j], f, f"units of expert slot {j} in layer {self.layer}")
        return {
            block.router_space: SpaceAction(perm=self.perm),
            block.experts_space: SpaceAction(perm=flat_unit_permutation(self.perm, self.units)),
        }

    def is_identity(self) -> bool:
        ar = torch.arange(self.units.shape[1])
        return bool(torch.equal(self.perm, torch.arange(len(self.perm)))) and bool((self.units == ar).all())

    def describe(self):
        moved = int((self.perm != torch.arange(len(self.perm))).sum())
        units = int((self.units != torch.arange(self.units.shape[1])).sum())
        return (
            f"layer {self.layer} experts: permutation moving {moved}/{len(self.perm)} experts, "
            f"{units}/{self.units.numel()} expert units moved"
        )


def random_expert_alignment(schema: ModelSchema, layer: int, g: torch.Generator) -> ExpertAlignment:
    """A random exact symmetry of layer ``layer``'s experts: a random expert permutation and a
    random unit permutation per expert."""
    block = expert_block(schema, layer)
    units = torch.stack([torch.randperm(block.units, generator=g) for _ in range(block.num_experts)])
    return ExpertAlignment(layer, torch.randperm(block.num_experts, generator=g), units)
