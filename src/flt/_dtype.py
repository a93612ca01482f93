"""The one rule for compute dtypes: float32 or better.

Exponentials, normalisers and position arithmetic run in float32 even for bfloat16 or
float16 inputs, and in float64 whenever an input is float64 (the tests' exact references).
"""

from __future__ import annotations

import torch


def compute_dtype(*args: torch.Tensor | torch.dtype) -> torch.dtype:
    """The promotion of float32 with the dtypes of ``args`` (tensors or dtypes)."""
    dtype = torch.float32
    for a in args:
        dtype = torch.promote_types(dtype, a if isinstance(a, torch.dtype) else a.dtype)
    return dtype
