"""Sparse pair products of near sets against their dense formulas, forward and backward."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close
from flt.ops.pairs import flat_index, gather_sum, pair_dots, scatter_sum

F64 = torch.float64


#: The CUDA path (cuSPARSE's sampled product, embedding_bag's kernels) runs with ``-m cuda``.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def listed(R=37, k=5, E=6, Rb=41, device="cpu"):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(R, E, dtype=F64, generator=g).to(device).requires_grad_()
    b = torch.randn(Rb, E, dtype=F64, generator=g).to(device).requires_grad_()
    w = torch.randn(R, k, dtype=F64, generator=g).to(device).requires_grad_()
    index = torch.randint(0, Rb, (R, k), generator=g).to(device)  # repeated keys too: their gradients add up
    return a, b, w, index


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("R, k, E, Rb", [(37, 5, 6, 41), (1, 1, 1, 1), (9, 1, 3, 50), (20, 7, 4, 3)])
def test_pair_products_equal_their_dense_formulas_forward_and_backward(R, k, E, Rb, device):
    # Rb = 50 > R k: most key rows listed by no query (their scattered sums are zero);
    # Rb = 3: every key listed many times, repeated within rows.
    a, b, w, index = listed(R, k, E, Rb, device)
    onehot = torch.nn.functional.one_hot(index, b.shape[0]).to(F64)  # [R, k, Rb]
    cases = [
        (lambda: pair_dots(a, b, index), lambda: (onehot @ b) @ a.unsqueeze(-1)),
        (lambda: gather_sum(w, b, index), lambda: (w.unsqueeze(1) @ (onehot @ b)).squeeze(1)),
        (lambda: scatter_sum(w, a, index, b.shape[0]), lambda: (onehot * w.unsqueeze(-1)).flatten(0, 1).T @ a.repeat_interleave(index.shape[1], 0)),
    ]
    for fast, slow in cases:
        out, ref = fast(), slow().reshape(fast().shape)
        assert_close(out, ref)
        up = torch.randn_like(out)
        g_out = torch.autograd.grad((out * up).sum(), (a, b, w), allow_unused=True)
        g_ref = torch.autograd.grad((ref * up).sum(), (a, b, w), allow_unused=True)
        for x, y in zip(g_out, g_ref):
            assert (x is None) == (y is None)
            if x is not None:
                assert_close(x, y)


def test_pair_products_keep_float32_and_listed_order():
    a, b, w, index = (t.detach().float() if t.is_floating_point() else t for t in listed(R=8, k=4, E=3, Rb=6))
    out = pair_dots(a, b, index)
    assert out.dtype == torch.float32
    assert torch.allclose(out, (b[index] * a.unsqueeze(1)).sum(-1), atol=1e-6)  # slot t is index[r, t], unsorted
    assert torch.allclose(gather_sum(w, b, index), (w.unsqueeze(-1) * b[index]).sum(1), atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_pair_products_pass_gradcheck_and_second_order(device):
    a, b, w, index = listed(R=6, k=3, E=2, Rb=5, device=device)
    assert torch.autograd.gradcheck(lambda a, b: pair_dots(a, b, index), (a, b))
    assert torch.autograd.gradcheck(lambda w, b: gather_sum(w, b, index), (w, b))
    assert torch.autograd.gradgradcheck(lambda w, a: scatter_sum(w, a, index, 5), (w, a))


def test_flat_index_addresses_rows_of_b_h_n_e_tensors():
    B, H, N, k = 2, 3, 4, 2
    idx = torch.randint(0, N, (B, N, k))
    t = torch.randn(B, H, N, 5)
    rows = t.reshape(B * H * N, 5)[flat_index(idx, B, H)].view(B, H, N, k, 5)
    expected = torch.stack([torch.stack([t[b, h][idx[b]] for h in range(H)]) for b in range(B)])
    assert torch.equal(rows, expected)
    shared = flat_index(idx[:1], B, H).view(B, H, N, k)  # batch-shared near sets
    assert torch.equal(shared[1, 2], idx[0] + (1 * H + 2) * N)
