"""ViT-style image classifier with 2-D patch-centre positions (``P = 2``).

An ``S x S`` image cut into ``p x p`` patches gives an ``n x n`` grid (``n = S / p``) of
tokens whose positions are the patch centres on ``[-1, 1]^2``
(:func:`flt.posenc.patch_grid`). FLT uses them through a 2-D spectrum; absolute
encodings take them as coordinates; CAPE perturbs them during training.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import nn

from flt._checks import check_choice
from flt._dtype import compute_dtype
from flt.models.block import trunk_modules
from flt.models.config import POOLINGS
from flt.posenc import CAPE, patch_grid


class ViTClassifier(nn.Module):
    """Patch embedding, pre-norm Transformer, mean or class-token pooling, linear head.

    The class token (``pooling="cls"``) has no place in the image; it sits at the centre
    ``(0, 0)``, so relative mechanisms see it as the centre patch, and CAPE leaves it there.
    The keyword arguments are the fields of :class:`flt.models.ImageConfig`, those of the
    trunk (all but ``dim``) as ``**trunk`` (:func:`flt.models.block.trunk_modules`).

    Shapes: ``forward(images [B, C, S, S]) -> logits [B, num_classes]``.
    """

    patch_pos: torch.Tensor  # buffer [N, 2]

    def __init__(
        self,
        *,
        image_size: int,
        channels: int,
        num_classes: int,
        patch_size: int,
        dim: int,
        pooling: str = "mean",
        cape: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **trunk: Any,
    ) -> None:
        super().__init__()
        check_choice("pooling", pooling, POOLINGS)
        if image_size % patch_size:
            raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.image_size, self.patch_size, self.channels, self.pooling = image_size, patch_size, channels, pooling
        self.grid = image_size // patch_size
        self.to_patch = nn.Linear(channels * patch_size * patch_size, dim, **fk)
        pos_dtype = compute_dtype(dtype or torch.get_default_dtype())
        # Not saved: a function of the config.
        self.register_buffer("patch_pos", patch_grid(self.grid, device=device, dtype=pos_dtype), persistent=False)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim, **fk) * 0.02) if pooling == "cls" else None
        self.cape = CAPE.for_2d_patches(self.grid) if cape else None
        self.posenc, self.drop, self.trunk = trunk_modules(dim=dim, pos_dim=2, causal=False, **fk, **trunk)
        self.head = nn.Linear(dim, num_classes, **fk)

    def positions(self, batch: int) -> torch.Tensor:
        """Patch centres ``[B, N, 2]`` (CAPE-augmented in training mode), without the class token."""
        pos = self.patch_pos.unsqueeze(0).expand(batch, -1, -1)
        return self.cape(pos) if self.cape is not None else pos

    def forward(self, images: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        """``images [B, C, S, S] -> logits [B, num_classes]``."""
        expected = (self.channels, self.image_size, self.image_size)
        if images.ndim != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"images must be [B, {', '.join(map(str, expected))}], got shape {tuple(images.shape)}")
        B = images.shape[0]
        p = self.patch_size
        x = self.to_patch(rearrange(images, "b c (h p) (w q) -> b (h w) (p q c)", p=p, q=p))
        pos = self.positions(B)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)
            pos = torch.cat([pos.new_zeros(B, 1, 2), pos], dim=1)
        x = x + self.posenc(pos).to(x.dtype)
        x = self.trunk(self.drop(x), pos, exact=exact)
        pooled = x[:, 0] if self.cls_token is not None else x.mean(dim=1)
        return self.head(pooled)
