"""Sinusoidal and learned absolute encodings."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close

from flt.posenc import LearnedEncoding, SinusoidalEncoding


def test_sinusoidal_matches_vaswani_table():
    # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)), written out.
    d, n = 8, 10
    expected = torch.empty(1, n, d, dtype=torch.float64)
    for pos in range(n):
        for i in range(d // 2):
            expected[0, pos, 2 * i] = math.sin(pos / 10000 ** (2 * i / d))
            expected[0, pos, 2 * i + 1] = math.cos(pos / 10000 ** (2 * i / d))
    pos = torch.arange(n, dtype=torch.float64).reshape(1, n, 1)
    assert_close(SinusoidalEncoding(d)(pos), expected)


@pytest.mark.parametrize("pos_dim", [1, 2, 3])
def test_sinusoidal_dot_products_depend_only_on_offsets(pos_dim):
    dim, base = 12 * pos_dim, 100.0
    enc = SinusoidalEncoding(dim, pos_dim, base=base)
    pos = 20 * torch.rand(2, 7, pos_dim, dtype=torch.float64)
    pe = enc(pos)
    gram = pe @ pe.transpose(1, 2)
    # sum over axes and frequencies of cos(omega_k (x_p - y_p)).
    omega = base ** (-torch.arange(0, dim // pos_dim, 2, dtype=torch.float64) / (dim // pos_dim))
    diff = pos.unsqueeze(2) - pos.unsqueeze(1)  # [B, N, N, P]
    expected = torch.cos(diff.unsqueeze(-1) * omega).sum(dim=(-1, -2))
    assert_close(gram, expected)
    shifted = enc(pos + 3.7 * torch.randn(1, 1, pos_dim, dtype=torch.float64))
    assert_close(shifted @ shifted.transpose(1, 2), gram)
    assert not torch.allclose(shifted, pe)  # absolute encodings do move; only the Gram is invariant


def test_sinusoidal_axes_are_concatenated_1d_encodings():
    pos = torch.randn(3, 5, 2, dtype=torch.float64)
    out = SinusoidalEncoding(16, 2)(pos)
    one_d = SinusoidalEncoding(8, 1)
    assert_close(out[..., :8], one_d(pos[..., :1]))
    assert_close(out[..., 8:], one_d(pos[..., 1:]))


def test_sinusoidal_dtypes():
    pos = 50 * torch.rand(2, 9, 1, dtype=torch.float64)
    ref = SinusoidalEncoding(16)(pos)
    low = SinusoidalEncoding(16, dtype=torch.bfloat16)(pos.float())
    assert low.dtype == torch.bfloat16
    assert_close(low, ref, dtype=torch.bfloat16)
    assert SinusoidalEncoding(16)(pos.float()).dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [({"dim": 6, "pos_dim": 2}, "dim = 6"), ({"dim": 7}, "dim = 7"), ({"dim": 0}, "dim"), ({"dim": 8, "base": -1.0}, "base")],
)
def test_sinusoidal_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SinusoidalEncoding(**kwargs)


def test_sinusoidal_bad_positions():
    enc = SinusoidalEncoding(8, 2)
    with pytest.raises(ValueError, match="pos"):
        enc(torch.zeros(4, 2))  # rank 2
    with pytest.raises(ValueError, match="P"):
        enc(torch.zeros(1, 4, 3))
    with pytest.raises(ValueError, match="non-finite"):
        enc(torch.tensor([[[0.0, float("nan")]]]))
    with pytest.raises(TypeError, match="floating"):
        enc(torch.zeros(1, 4, 2, dtype=torch.long))


def test_learned_looks_up_rows_and_trains_only_used_rows():
    enc = LearnedEncoding(6, max_len=10, dtype=torch.float64)
    idx = torch.tensor([[3, 0, 3], [9, 1, 2]])
    out = enc(idx.unsqueeze(-1).double())
    assert_close(out, enc.table.detach()[idx])
    assert_close(enc(idx.unsqueeze(-1)), out)  # integer tensors are accepted too
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    expected = torch.zeros_like(enc.table)
    expected.index_add_(0, idx.flatten(), upstream.reshape(-1, 6))
    assert_close(enc.table.grad, expected)
    assert bool((enc.table.grad[[4, 5, 6, 7, 8]] == 0).all())


def test_learned_rejects_bad_positions_and_options():
    enc = LearnedEncoding(4, max_len=5)
    with pytest.raises(ValueError, match="integer-valued"):
        enc(torch.tensor([[[0.5]]]))
    with pytest.raises(ValueError, match="max_len"):
        enc(torch.tensor([[[5.0]]]))
    with pytest.raises(ValueError, match="max_len"):
        enc(torch.tensor([[[-1.0]]]))
    with pytest.raises(ValueError, match="P"):
        enc(torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match="non-finite"):
        enc(torch.tensor([[[float("inf")]]]))
    with pytest.raises(TypeError, match="dtype"):
        enc(torch.zeros(1, 3, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="pos_dim"):
        LearnedEncoding(4, 2)
    with pytest.raises(ValueError, match="max_len"):
        LearnedEncoding(4, max_len=0)
