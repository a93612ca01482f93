"""Learnable Fourier features (Li et al. 2021, "Learnable Fourier Features for
Multi-Dimensional Spatial Positional Encoding"; docs/math.md section 7).

Positions ``x [B, N, P]`` are split into ``G`` groups of ``M = P / G`` coordinates. Per group

    r_x = F^(-1/2) [cos(x W_r^T), sin(x W_r^T)]          W_r: [F/2, M]
    PE  = GeLU(r_x W_1 + b_1) W_2 + b_2                  W_1: [F, hidden], W_2: [hidden, dim/G]

with the weights shared by all groups, and the ``G`` outputs concatenated to ``dim``.

Initialisation of ``W_r``: entries N(0, gamma^-2), i.e. standard deviation ``1/gamma``,
so that at initialisation ``r_x.r_y -> 1/2 exp(-|x - y|^2 / (2 gamma^2))`` as ``F``
grows (a Gaussian kernel of length scale ``gamma``). This follows the paper's text and
docs/math.md. Implementations derived from the authors' snippet (e.g. LightGlue's) draw
``W_r`` with standard deviation ``gamma^-2`` instead, i.e. a kernel of length scale
``gamma^2``; the two agree only at ``gamma = 1``. The kernel test pins our convention.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from einops import rearrange
from torch import nn

from flt._checks import check_positive_float, check_positive_int
from flt.posenc._common import check_abs_positions, compute_dtype


class LearnableFourierFeatures(nn.Module):
    """Learnable Fourier feature positional encoding with an MLP, in ``P`` dimensions.

    Args:
        dim: output size ``D``; must be divisible by ``groups``.
        pos_dim: ``P``; must be divisible by ``groups``.
        groups: ``G``, number of independent coordinate groups (shared weights).
        num_fourier: ``F``, number of Fourier features (even; ``F/2`` frequencies).
        hidden: MLP hidden width.
        gamma: kernel length scale at initialisation (see the module docstring).

    Shapes: ``fourier_features(pos [B, N, P]) -> [B, N, G, F]``;
    ``forward(pos [B, N, P]) -> [B, N, dim]`` in the parameters' dtype.
    """

    def __init__(
        self,
        dim: int,
        pos_dim: int,
        *,
        groups: int = 1,
        num_fourier: int = 64,
        hidden: int = 32,
        gamma: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        sizes = {"dim": dim, "pos_dim": pos_dim, "groups": groups, "num_fourier": num_fourier, "hidden": hidden}
        for name, value in sizes.items():
            check_positive_int(name, value)
        if num_fourier % 2 != 0:
            raise ValueError(f"num_fourier must be even (cos and sin of F/2 frequencies), got {num_fourier}")
        if pos_dim % groups != 0:
            raise ValueError(f"pos_dim = {pos_dim} must be divisible by groups = {groups}")
        if dim % groups != 0:
            raise ValueError(f"dim = {dim} must be divisible by groups = {groups}")
        self.dim, self.pos_dim, self.groups = dim, pos_dim, groups
        self.num_fourier, self.hidden = num_fourier, hidden
        self.gamma = check_positive_float("gamma", gamma)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.w_r = nn.Parameter(torch.empty(num_fourier // 2, pos_dim // groups, **factory))
        self.mlp = nn.Sequential(
            nn.Linear(num_fourier, hidden, **factory),
            nn.GELU(),
            nn.Linear(hidden, dim // groups, **factory),
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Variance gamma^-2 (std 1/gamma): see the module docstring for the convention.
        nn.init.normal_(self.w_r, mean=0.0, std=1.0 / self.gamma)
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):  # the two linear layers, not the GELU
                layer.reset_parameters()

    def fourier_features(self, pos: torch.Tensor) -> torch.Tensor:
        """``r_x``: ``[B, N, P] -> [B, N, G, F]``, computed in float32 or better."""
        check_abs_positions("pos", pos, self.pos_dim)
        cdt = compute_dtype(pos, self.w_r)
        x = rearrange(pos.to(cdt), "b n (g m) -> b n g m", g=self.groups)
        proj = x @ self.w_r.to(cdt).T  # [B, N, G, F/2]
        return torch.cat((proj.cos(), proj.sin()), dim=-1) / math.sqrt(self.num_fourier)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        r = self.fourier_features(pos).to(self.w_r.dtype)
        out = self.mlp(r)  # [B, N, G, dim/G]
        return rearrange(out, "b n g d -> b n (g d)")

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, pos_dim={self.pos_dim}, groups={self.groups}, "
            f"num_fourier={self.num_fourier}, hidden={self.hidden}, gamma={self.gamma}"
        )
