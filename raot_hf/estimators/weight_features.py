"""A space's parameters as rows over its axis: what the weight-based estimators match (docs/design.md §4.5)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from raot_hf.adapters.schema import Space

_F64 = torch.float64


@dataclass
class SpaceFeatures:
    """A space's members stacked as rows over the space's axis: ``covariant`` (n_c, size) and
    ``contravariant`` (n_k, size). Under a transform M they become ``covariant·M`` and
    ``contravariant·M⁻ᵀ``."""

    covariant: torch.Tensor
    contravariant: torch.Tensor

    def stacked(self) -> torch.Tensor:
        """All rows together (valid for orthogonal actions, which treat both kinds alike)."""
        return torch.cat([self.covariant, self.contravariant], dim=0)

    def rotated(self, matrix: torch.Tensor) -> SpaceFeatures:
        return SpaceFeatures(self.covariant @ matrix, self.contravariant @ matrix)

    def rescaled(self, scale: torch.Tensor) -> SpaceFeatures:
        return SpaceFeatures(self.covariant * scale, self.contravariant / scale)


def space_features(state: Mapping[str, torch.Tensor], space: Space) -> SpaceFeatures:
    """Gather the members of ``space`` from ``state`` as rows over the space axis (float64)."""
    covariant, contravariant = [], []
    for member in space.members:
        if member.role in ("norm", "norm_bias"):  # a norm weight moves by |M| (its signs pass through): not a row
            continue
        x = state[member.name].to(_F64).movedim(member.axis, -1)
        idx = member.index_tensor()
        if idx is not None:
            x = x[..., idx]
        rows = x.reshape(-1, space.size)
        (covariant if member.covariant else contravariant).append(rows)
    empty = torch.zeros(0, space.size, dtype=_F64)
    return SpaceFeatures(
        torch.cat(covariant) if covariant else empty, torch.cat(contravariant) if contravariant else empty
    )
