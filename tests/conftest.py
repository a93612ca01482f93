"""Shared test helpers: one float-tolerance table and deterministic seeds."""

from __future__ import annotations

import pytest
import torch

#: (rtol, atol) per dtype for comparisons of a fast path with its reference.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (1e-2, 1e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None, scale: float = 1.0, msg: str = "") -> None:
    """Compare with the per-dtype tolerance; ``scale`` loosens both tolerances."""
    dtype = dtype or expected.dtype
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol * scale, atol=atol * scale, msg=msg or None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """One torch thread for the test: tiny models are fastest on one, and several OpenMP
    threads on a busy machine can be a hundred times slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
