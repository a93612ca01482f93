"""CAPE position augmentation (Likhomanenko et al. 2021)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close

from flt.posenc import CAPE, patch_grid


def _grid_1d(batch: int, length: int) -> torch.Tensor:
    return torch.arange(length, dtype=torch.float64).reshape(1, length, 1).expand(batch, length, 1).clone()


def test_eval_is_identity_without_centring_and_a_translation_with_it():
    pos = 10 * torch.randn(3, 7, 2, dtype=torch.float64)
    cape = CAPE(2, max_global_shift=3.0, max_local_shift=0.5, max_global_scaling=1.5, mean_center=False).eval()
    assert torch.equal(cape(pos), pos)
    centred = CAPE(2, max_global_shift=3.0, max_local_shift=0.5, max_global_scaling=1.5, mean_center=True).eval()(pos)
    assert_close(centred, pos - pos.mean(dim=1, keepdim=True))
    assert_close(centred.mean(dim=1), torch.zeros(3, 2, dtype=torch.float64))


def test_training_applies_the_formula_with_the_drawn_values():
    cape = CAPE(2, max_global_shift=2.0, max_local_shift=0.3, max_global_scaling=1.4, mean_center=True)
    pos = torch.randn(4, 6, 2, dtype=torch.float64)
    out = cape(pos, generator=torch.Generator().manual_seed(7))
    draws = cape.sample(4, 6, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x = pos - pos.mean(dim=1, keepdim=True)
    expected = torch.exp(draws.log_scale) * (x + draws.shift + draws.local)
    assert_close(out, expected)
    assert not torch.allclose(out, x)
    assert torch.equal(out, cape(pos, generator=torch.Generator().manual_seed(7)))  # reproducible
    assert not torch.equal(out, cape(pos, generator=torch.Generator().manual_seed(8)))


def test_training_gradient_is_the_scale():
    cape = CAPE(1, max_global_scaling=2.0, mean_center=False)
    pos = torch.randn(5, 3, 1, dtype=torch.float64, requires_grad=True)
    out = cape(pos, generator=torch.Generator().manual_seed(1))
    out.sum().backward()
    scale = (out / pos).detach()  # pure scaling here, so out = lambda * pos
    assert_close(pos.grad, scale)


def test_global_shift_statistics():
    dmax, batch = 3.0, 20000
    cape = CAPE(2, max_global_shift=dmax, mean_center=False)
    pos = torch.randn(batch, 4, 2, dtype=torch.float64)
    delta = cape(pos) - pos
    assert (delta - delta[:, :1]).abs().max() < 1e-12  # one shift per sample and axis
    d = delta[:, 0]  # [B, 2]
    assert d.abs().max() <= dmax
    assert d.min() < -0.99 * dmax and d.max() > 0.99 * dmax
    # U[-a, a]: mean 0, variance a^2/3; the sample variance has relative std ~0.6%.
    assert d.mean(0).abs().max() < 0.05
    assert ((d.var(0) / (dmax**2 / 3)) - 1).abs().max() < 0.05
    assert abs(torch.corrcoef(d.T)[0, 1]) < 0.05  # axes drawn independently


def test_local_shift_statistics():
    emax = 0.4
    cape = CAPE(3, max_local_shift=emax, mean_center=False)
    pos = torch.randn(2000, 16, 3, dtype=torch.float64)
    eps = cape(pos) - pos
    assert eps.abs().max() <= emax
    assert abs(eps.var().item() / (emax**2 / 3) - 1) < 0.05
    per_sample_mean = eps.mean(dim=1)  # independent per token: the mean over 16 tokens shrinks by 16
    assert abs(per_sample_mean.var().item() / (emax**2 / 3 / 16) - 1) < 0.1


def test_global_scaling_statistics():
    lmax = 1.4
    cape = CAPE(2, max_global_scaling=lmax, mean_center=False)
    pos = torch.rand(20000, 5, 2, dtype=torch.float64) + 1.0  # away from 0 so the ratio is defined
    ratio = cape(pos) / pos
    assert (ratio - ratio[:, :1, :1]).abs().max() < 1e-12  # one scale per sample, shared by axes
    log_scale = ratio[:, 0, 0].log()
    assert log_scale.abs().max() <= math.log(lmax) + 1e-12
    assert abs(log_scale.var().item() / (math.log(lmax) ** 2 / 3) - 1) < 0.05


def test_half_step_local_shift_keeps_token_order():
    pos = _grid_1d(512, 64)
    for cape in (CAPE.for_1d(), CAPE.for_1d(max_global_scaling=1.3)):
        out = cape(pos)
        assert bool((out.diff(dim=1) > 0).all())
    # The check is sensitive: a full-step local shift does reorder tokens.
    out = CAPE.for_1d(max_local_shift=1.0)(pos)
    assert bool((out.diff(dim=1) < 0).any())


def test_2d_patch_preset_and_grid():
    n = 6
    grid = patch_grid(n, dtype=torch.float64)
    assert grid.shape == (n * n, 2)
    assert_close(grid.mean(0), torch.zeros(2, dtype=torch.float64))
    assert grid.min() > -1 and grid.max() < 1
    rows = grid.reshape(n, n, 2)[..., 0]
    assert_close(rows[1:] - rows[:-1], torch.full((n - 1, n), 2 / n, dtype=torch.float64))
    cape = CAPE.for_2d_patches(n)
    assert (cape.max_global_shift, cape.max_local_shift, cape.max_global_scaling, cape.mean_center) == (0.5, 1 / n, 1.4, False)
    out = cape(grid.expand(256, n * n, 2)).reshape(256, n, n, 2)
    # Local shift = half the patch spacing: rows stay ordered along x, columns along y.
    assert bool((out[:, 1:, :, 0] > out[:, :-1, :, 0]).all())
    assert bool((out[:, :, 1:, 1] > out[:, :, :-1, 1]).all())
    assert_close(cape.eval()(grid.unsqueeze(0)), grid.unsqueeze(0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_global_shift": -1.0}, "max_global_shift"),
        ({"max_local_shift": float("nan")}, "max_local_shift"),
        ({"max_global_scaling": 0.5}, "max_global_scaling"),
        ({"mean_center": 1}, "mean_center"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        CAPE(1, **kwargs)


def test_bad_positions():
    cape = CAPE(2, max_global_shift=1.0)
    with pytest.raises(ValueError, match="P"):
        cape(torch.zeros(1, 3, 1))
    with pytest.raises(ValueError, match="rank"):
        cape(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="non-finite"):
        cape(torch.tensor([[[0.0, float("inf")]]]))
    with pytest.raises(TypeError, match="floating"):
        cape(torch.zeros(1, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="num_patches_per_side"):
        CAPE.for_2d_patches(0)
