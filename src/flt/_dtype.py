"""The one rule for compute dtypes: float32 or better.

Exponentials, normalisers and position arithmetic run in float32 even for bfloat16 or
float16 inputs, and in float64 whenever an input is float64 (the tests' exact references).
"""

from __future__ import annotations

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast gives matrix products on ``device_type`` ("cpu", "cuda", ...), or
    None when autocast is off there."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4: no device argument
        if device_type == "cuda":
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None


def compute_dtype(*args: torch.Tensor | torch.dtype) -> torch.dtype:
    """The promotion of float32 with the dtypes of ``args`` (tensors or dtypes)."""
    dtype = torch.float32
    for a in args:
        dtype = torch.promote_types(dtype, a if isinstance(a, torch.dtype) else a.dtype)
    return dtype
