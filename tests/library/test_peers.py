"""Numerical agreement with maintained peer packages, where they are installed.

Skipped when the peer is missing; ``pip install --no-deps performer-pytorch`` (plus its pure
Python dependencies) enables them. Convention differences are noted in the docstrings of
the corresponding flt functions.
"""

import pytest
import torch

from flt.ops import favor_plus_features, gaussian_orthogonal_random_matrix, linear_attention

F64 = torch.float64


def test_favor_plus_agrees_with_performer_pytorch():
    peer = pytest.importorskip("performer_pytorch.performer_pytorch")
    torch.manual_seed(0)
    B, H, N, D, m = 2, 3, 17, 16, 64
    q, k, v = (torch.randn(B, H, N, D, dtype=F64) * 0.5 for _ in range(3))
    proj = gaussian_orthogonal_random_matrix(m, D, dtype=F64)
    # performer-pytorch scales inputs by D^(-1/4) itself and adds eps = 1e-4 to every
    # feature after its max-shift (a bias; flt adds none): match with eps = 0.
    qf_peer = peer.softmax_kernel(q, projection_matrix=proj, is_query=True, eps=0.0)
    kf_peer = peer.softmax_kernel(k, projection_matrix=proj, is_query=False, eps=0.0)
    qf, _ = favor_plus_features(q * D**-0.25, proj)
    kf, kls = favor_plus_features(k * D**-0.25, proj)
    # Per-token shifts differ (theirs: max of W x; ours: max of W x - |x|^2/2), and cancel.
    torch.testing.assert_close(qf / qf.sum(-1, keepdim=True), qf_peer / qf_peer.sum(-1, keepdim=True), rtol=1e-10, atol=1e-12)
    ours = linear_attention(qf, kf, v, key_log_scale=kls)
    theirs = peer.linear_attention(qf_peer, kf_peer, v)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
