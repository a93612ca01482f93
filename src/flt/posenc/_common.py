"""Helpers shared by the positional encodings: position validation and compute dtypes."""

from __future__ import annotations

import math

import torch

from flt._checks import check_dim, check_finite, check_tensor, check_values
from flt._dtype import compute_dtype  # noqa: F401 (the posenc modules import it from here)


def check_abs_positions(name: str, pos: torch.Tensor, pos_dim: int) -> None:
    """Require floating positions ``[B, N, P]`` with ``P == pos_dim`` and finite entries."""
    check_tensor(name, pos, ndim=3, layout="[B, N, P]")
    check_dim(name, pos, 2, pos_dim, "position dimension P")
    check_finite(name, pos)


def integer_positions(name: str, pos: torch.Tensor) -> torch.Tensor:
    """Return integer-valued positions as ``torch.long``.

    Accepts an integer tensor or a floating tensor whose entries are all whole numbers;
    anything else (bool, fractional or non-finite values) raises.
    """
    if not isinstance(pos, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(pos).__name__}")
    if pos.dtype == torch.bool or pos.is_complex():
        raise TypeError(f"{name} must have an integer or floating-point dtype, got {pos.dtype}")
    if pos.is_floating_point():
        check_finite(name, pos)
        check_values(name, pos, lambda p: p == p.round(), f"{name} must hold integer-valued positions, got fractional values", tag="integer")
    return pos.long()


def check_positive_float(name: str, value: object) -> float:
    """Require a finite real number ``> 0`` and return it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_nonnegative_float(name: str, value: object) -> float:
    """Require a finite real number ``>= 0`` and return it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)
