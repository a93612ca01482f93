"""Small numerical helpers shared by the ops."""

from __future__ import annotations

import torch

#: Denominators whose magnitude is below this are treated as zero (see :func:`safe_divide`).
DENOMINATOR_EPS = 1e-30


def safe_divide(num: torch.Tensor, den: torch.Tensor, eps: float = DENOMINATOR_EPS) -> torch.Tensor:
    """``num / den`` where rows with ``|den| <= eps`` give 0 instead of inf or NaN.

    A zero denominator means every weight in the row vanished (all keys masked), so the
    output of that row is defined as zero. Signed FLT masks can also make a row sum
    exactly cancel; those rows get zero too. The tiny ``eps`` keeps ordinary rows exact.
    """
    dead = den.abs() <= eps
    safe = torch.where(dead, torch.ones_like(den), den)
    return torch.where(dead, torch.zeros_like(num), num / safe)


def causal_mask_like(x: torch.Tensor) -> torch.Tensor:
    """Lower-triangular 0/1 mask of ``x``'s last two dimensions, same dtype and device."""
    n, nk = x.shape[-2], x.shape[-1]
    return torch.ones(n, nk, dtype=x.dtype, device=x.device).tril()
