"""Learnable Fourier features (Li et al. 2021)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close

from flt.posenc import LearnableFourierFeatures


def test_self_similarity_is_one_half():
    enc = LearnableFourierFeatures(8, 3, num_fourier=64, dtype=torch.float64)
    r = enc.fourier_features(torch.randn(2, 5, 3, dtype=torch.float64))
    assert r.shape == (2, 5, 1, 64)
    assert_close((r * r).sum(-1), torch.full((2, 5, 1), 0.5, dtype=torch.float64))


def test_fourier_kernel_at_init_has_length_scale_gamma():
    # r_x.r_y = (1/F) sum_k cos(w_k.(x - y)) with F/2 = 20000 draws w_k ~ N(0, gamma^-2 I), so it
    # estimates (1/2) exp(-|x-y|^2 / (2 gamma^2)) with standard error <= 0.5 sqrt(0.5 / 20000) = 0.0025.
    # gamma = 2 separates the conventions: drawing W_r with std gamma^-2 (as some ports of the
    # authors' snippet do) would give (1/2) exp(-|d|^2 / (2 gamma^4)), e.g. 0.44 instead of 0.30 at |d| = 2.
    gamma, num_fourier, tol = 2.0, 40000, 0.0125
    enc = LearnableFourierFeatures(4, 2, num_fourier=num_fourier, gamma=gamma, dtype=torch.float64)
    lengths = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    direction = F.normalize(torch.randn(len(lengths), 2, dtype=torch.float64), dim=-1)
    x = torch.randn(len(lengths), 2, dtype=torch.float64)
    y = x + lengths[:, None] * direction
    rx = enc.fourier_features(x.unsqueeze(0))[0, :, 0]
    ry = enc.fourier_features(y.unsqueeze(0))[0, :, 0]
    estimate = (rx * ry).sum(-1)
    expected = 0.5 * torch.exp(-lengths**2 / (2 * gamma**2))
    wrong_convention = 0.5 * torch.exp(-lengths**2 / (2 * gamma**4))
    assert (estimate - expected).abs().max() < tol, (estimate, expected)
    assert (wrong_convention - expected).abs().max() > 10 * tol  # the check can tell the two apart
    # And the initial spread of W_r itself: sample std of 40000 entries within 2% of 1/gamma.
    assert abs(enc.w_r.std().item() * gamma - 1.0) < 0.02


def test_forward_is_the_mlp_of_the_features():
    enc = LearnableFourierFeatures(6, 2, num_fourier=16, hidden=5, dtype=torch.float64)
    pos = torch.randn(3, 4, 2, dtype=torch.float64)
    x = pos.unsqueeze(-2)  # one group
    proj = x @ enc.w_r.T
    r = torch.cat((proj.cos(), proj.sin()), -1) / math.sqrt(16)
    lin1, lin2 = enc.mlp[0], enc.mlp[2]
    expected = F.gelu(r @ lin1.weight.T + lin1.bias) @ lin2.weight.T + lin2.bias
    assert_close(enc(pos), expected.reshape(3, 4, 6))


def test_groups_share_weights_and_concatenate():
    grouped = LearnableFourierFeatures(6, 4, groups=2, num_fourier=16, hidden=8, dtype=torch.float64)
    single = LearnableFourierFeatures(3, 2, groups=1, num_fourier=16, hidden=8, dtype=torch.float64)
    single.load_state_dict(grouped.state_dict())
    pos = torch.randn(2, 5, 4, dtype=torch.float64)
    out = grouped(pos)
    assert out.shape == (2, 5, 6)
    assert_close(out[..., :3], single(pos[..., :2]))
    assert_close(out[..., 3:], single(pos[..., 2:]))


def test_gradients_reach_every_parameter():
    enc = LearnableFourierFeatures(8, 2, num_fourier=8, hidden=4, dtype=torch.float64)
    enc(torch.randn(2, 3, 2, dtype=torch.float64)).pow(2).sum().backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and bool(p.grad.abs().sum() > 0), name


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_fourier": 7}, "num_fourier"),
        ({"groups": 2, "pos_dim": 3}, "pos_dim"),
        ({"groups": 2, "pos_dim": 2, "dim": 5}, "dim"),
        ({"gamma": 0.0}, "gamma"),
        ({"hidden": 0}, "hidden"),
    ],
)
def test_bad_options(kwargs, match):
    options = {"dim": 8, "pos_dim": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        LearnableFourierFeatures(**options)


def test_bad_positions():
    enc = LearnableFourierFeatures(8, 2)
    with pytest.raises(ValueError, match="P"):
        enc(torch.zeros(1, 3, 3))
    with pytest.raises(ValueError, match="non-finite"):
        enc.fourier_features(torch.full((1, 3, 2), float("nan")))
    with pytest.raises(TypeError, match="floating"):
        enc(torch.zeros(1, 3, 2, dtype=torch.int32))
