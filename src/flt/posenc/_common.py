"""Helpers shared by the positional encodings: position validation and compute dtypes
(the generic validators they use live in :mod:`flt._checks`)."""

from __future__ import annotations

import torch

from flt._checks import check_dim, check_finite, check_tensor
from flt._dtype import compute_dtype  # noqa: F401 (the posenc modules import it from here)


def check_abs_positions(name: str, pos: torch.Tensor, pos_dim: int) -> None:
    """Require floating positions ``[B, N, P]`` with ``P == pos_dim`` and finite entries."""
    check_tensor(name, pos, ndim=3, layout="[B, N, P]")
    check_dim(name, pos, 2, pos_dim, "position dimension P")
    check_finite(name, pos)
