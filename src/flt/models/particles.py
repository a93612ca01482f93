"""Per-particle regressor (``P = 3``): particles are tokens, coordinates are positions, and
every particle gets a prediction (the molecule model pools them into one).

The trunk is the molecule model's (:class:`flt.models.block.Trunk` over centred
coordinates); a token's input is the embedding of its charge, ``-1`` or ``+1``, plus the
absolute encoding of its position (``posenc="none"`` by default: relative mechanisms see
only offsets). Permuting the particles permutes the predictions, translating a cloud
changes nothing (centring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flt.models.block import Trunk, build_posenc
from flt.models.config import LayeredConfig
from flt.models.molecule import tie_isotropic


@dataclass(frozen=True)
class ParticleConfig(LayeredConfig):
    """Per-particle regressor: charge embeddings, 3-D coordinates as positions, one linear
    head per token. ``isotropic`` ties the per-axis lengths of radial spectra (as
    :class:`flt.models.MoleculeConfig`); predictions are ``target_mean + target_std * out``."""

    depth: int = 2
    isotropic: bool = False
    target_mean: float = 0.0
    target_std: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.isotropic, bool):
            raise TypeError(f"isotropic must be a bool, got {self.isotropic!r}")
        for name in ("target_mean", "target_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not self.target_std > 0:
            raise ValueError(f"target_std must be positive, got {self.target_std!r}")


class ParticleRegressor(nn.Module):
    """Shapes: ``forward(charge [B, N] (+-1), pos [B, N, 3]) -> [B, N]`` in target units;
    ``exact=True`` runs every attention layer's O(N^2) ``exact``."""

    def __init__(self, *, dim: int, depth: int, heads: int, mlp_ratio: float, dropout: float, attention: str,
                 attention_options: dict[str, Any], posenc: str, posenc_options: dict[str, Any],
                 isotropic: bool = False, target_mean: float = 0.0, target_std: float = 1.0,
                 layer_attention: list | None = None, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.target_mean, self.target_std = float(target_mean), float(target_std)
        self.embed = nn.Embedding(2, dim, **fk)
        self.posenc = build_posenc(posenc, dim, 3, posenc_options, **fk)
        self.drop = nn.Dropout(dropout)
        self.trunk = Trunk(dim, depth, heads, attention=attention, attention_options=attention_options, pos_dim=3,
                           causal=False, mlp_ratio=mlp_ratio, dropout=dropout, layer_attention=layer_attention, **fk)
        self.head = nn.Linear(dim, 1, **fk)
        if isotropic:
            tie_isotropic(self.trunk)

    def forward(self, charge: torch.Tensor, pos: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        if charge.ndim != 2 or pos.shape != (*charge.shape, 3):
            raise ValueError(f"expected charge [B, N] and pos [B, N, 3], got {tuple(charge.shape)} and {tuple(pos.shape)}")
        if not bool(((charge == 1) | (charge == -1)).all()):
            raise ValueError("charges must be +1 or -1")
        pos = pos - pos.mean(dim=1, keepdim=True)
        x = self.embed((charge > 0).long()) + self.posenc(pos).to(self.embed.weight.dtype)
        x = self.trunk(self.drop(x), pos, exact=exact)
        return self.target_mean + self.target_std * self.head(x).squeeze(-1)
