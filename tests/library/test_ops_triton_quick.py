"""One case of each Triton kernel against its float64 reference, for the default suite.

The kernel files (``test_ops_triton*.py``) run under Triton's interpreter on a CPU and take
minutes, so they are marked ``interpreter`` and left out of the default run (``-m
interpreter`` runs them; ``.ci/run`` does, with the slow tests). These are their cheaper
siblings: each calls one of those tests, unchanged, with one set of arguments, so that the
default suite still runs every kernel, forward and backward, on the code path it tests.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (the optional extra 'triton')")

from test_ops_triton import (
    test_gradients_match_reference as _flt_gradients,
    test_kernel_matches_reference_float64 as _flt_forward,
)
from test_ops_triton_split import (
    test_backward_kernels_match_reference_gradients_float64 as _split_backward,
    test_split_kernel_matches_reference_float64 as _split_forward,
)
from test_ops_triton_split_band import test_band_split_matches_reference_float64 as _band
from test_ops_triton_split_kronecker import test_matches_reference_float64 as _kronecker

from flt.ops.triton import interpreted


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    if not interpreted():
        pytest.skip("the triton kernels are compiled for the GPU in this process; run with TRITON_INTERPRET=1 to test them on CPU")


def test_flt_kernel_causal_in_three_segments():
    _flt_forward("multiplicative", True, 3)


def test_flt_kernel_gradients():
    _flt_gradients("logit", True)


def test_split_kernel_ragged_feature_blocks():
    _split_forward("logit", True, 40, 16, 16)


def test_split_kernel_backward():
    _split_backward("logit", True, 40, 16, 16, 5, True)


def test_kronecker_kernel_values_and_gradients():
    _kronecker(True, 1, 16, 1)


def test_band_kernel_values_and_gradients():
    _band(False, 5, 1, False, 3)
