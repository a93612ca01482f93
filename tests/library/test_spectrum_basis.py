"""The Gaussian mixture as a fixed basis (``basis``, ``alpha_scale``;
src/flt/relative/spectra/gaussian_mixture.py, docs/offsets.md): centres frozen on a grid of
offsets, lengths frozen, only the weights learnt. Float64 throughout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flt.relative.spectra import SPECTRA

F64 = torch.float64
C, EXTENT, LENGTH = 8, 64.0, 8.0
BASIS = {"components": C, "basis": EXTENT, "length_scale": LENGTH, "length_spread": 1.0, "shift": True, "shift_scale": 32.0}

pytestmark = pytest.mark.usefixtures("one_thread")


def basis(R=4 * C, seed=0, **options):
    """A basis spectrum with random weights (the same weights whatever ``R`` and ``seed``)."""
    spec = SPECTRA["gaussian_mixture"](2, 1, R, dtype=F64, seed=seed, **{**BASIS, **options})
    with torch.no_grad():
        spec.alpha.copy_(torch.randn(spec.alpha.shape, generator=torch.Generator().manual_seed(5), dtype=F64))
    return spec


def closed_form(spec, delta):
    """``sum_c alpha_scale alpha_c exp(-(Delta - c EXTENT / (C - 1))^2 / (2 LENGTH^2))``: ``[N, 1] -> [N, H]``."""
    centres = torch.linspace(0, EXTENT, C, dtype=F64)
    bumps = torch.exp(-((delta - centres) ** 2) / (2 * LENGTH**2))  # [N, C]
    return bumps @ (spec.alpha_scale * spec.alpha.detach()).T


@pytest.mark.parametrize("alpha_scale", [1.0, 16.0])
def test_mask_is_its_closed_form(alpha_scale):
    spec = basis(alpha_scale=alpha_scale)
    delta = torch.linspace(-20, 100, 241, dtype=F64).unsqueeze(-1)
    with torch.no_grad():
        torch.testing.assert_close(spec.mask(delta), closed_form(spec, delta), rtol=0, atol=1e-12)
    torch.testing.assert_close(spec.shifts()[0, :, 0], torch.linspace(0, EXTENT, C, dtype=F64))
    torch.testing.assert_close(spec.lengths(), torch.full((2, C, 1), LENGTH, dtype=F64))


def _feature_rmse(R, seeds):
    """Root mean square of ``a(r).c(r') - f(r - r')`` over the pairs of 0..95 and the seeds."""
    pos = torch.arange(96, dtype=F64).unsqueeze(-1)
    sq = []
    with torch.no_grad():
        for s in seeds:
            spec = basis(R=R, seed=s)
            a, c = spec.features(pos)
            est = torch.einsum("bhir,bhjr->ijh", a, c)
            sq.append((est - spec.mask(pos[:, None] - pos[None])).pow(2).mean())
    return math.sqrt(float(torch.stack(sq).mean()))


def test_random_feature_estimate_converges_to_the_mask():
    """``a(r).c(r')`` -> ``f(r - r')`` at the Monte Carlo rate ``R^-1/2`` as frequencies grow."""
    Rs = (4 * C, 64 * C, 1024 * C)
    errs = [_feature_rmse(R, range(6)) for R in Rs]
    slope = np.polyfit(np.log(Rs), np.log(errs), 1)[0]
    assert -0.75 < slope < -0.3, (errs, slope)
    assert errs[-1] < 0.1 * errs[0], errs


def test_only_the_weights_learn_and_the_mask_is_linear_in_them():
    spec = basis(alpha_scale=4.0)
    assert [n for n, p in spec.named_parameters() if p.requires_grad] == ["alpha"]
    frozen = {n: p.detach().clone() for n, p in spec.named_parameters() if n != "alpha"}
    delta = torch.arange(0, 80, dtype=F64).unsqueeze(-1)
    target = closed_form(spec, delta) + 1.0
    opt = torch.optim.Adam([p for p in spec.parameters() if p.requires_grad], lr=0.05)
    before = float((spec.mask(delta) - target).detach().pow(2).mean())
    for _ in range(20):
        opt.zero_grad()
        (spec.mask(delta) - target).pow(2).mean().backward()
        opt.step()
    assert float((spec.mask(delta) - target).detach().pow(2).mean()) < 0.5 * before
    for n, p in spec.named_parameters():
        if n != "alpha":
            assert torch.equal(p.detach(), frozen[n]), n
    # Linear: the mask of a sum of weights is the sum of the masks.
    one, two = basis(), basis()
    with torch.no_grad():
        two.alpha.mul_(-0.3).add_(0.7)
        total = basis()
        total.alpha.copy_(one.alpha + two.alpha)
        torch.testing.assert_close(total.mask(delta), one.mask(delta) + two.mask(delta), rtol=0, atol=1e-12)


def test_alpha_scale_keeps_the_initial_mask_and_scales_the_step():
    """``amplitude`` is still the initial ``f(0)`` of an unshifted mixture; the weights'
    gradient step is ``alpha_scale`` times larger (Adam moves ``alpha`` by the same amount)."""
    plain = SPECTRA["gaussian_mixture"](2, 1, 8, components=2, amplitude=1.5, dtype=F64)
    scaled = SPECTRA["gaussian_mixture"](2, 1, 8, components=2, amplitude=1.5, alpha_scale=16.0, dtype=F64)
    zero = torch.zeros(1, 1, dtype=F64)
    torch.testing.assert_close(scaled.mask(zero), torch.full((1, 2), 1.5, dtype=F64))
    torch.testing.assert_close(scaled.weights(), plain.weights())
    moved = []
    for spec in (plain, scaled):
        opt = torch.optim.Adam([spec.alpha], lr=0.01)
        spec.mask(zero).sum().backward()
        opt.step()
        moved.append(float((spec.weights().detach() - 0.75).abs().max()))
    assert moved[1] == pytest.approx(16 * moved[0], rel=1e-6)


def test_the_basis_represents_the_offsets_target():
    """The ``offsets`` task's ``f`` (bumps of height 3 and width 24 at 64 and 256) is a
    least-squares combination of 32 components of length 16 on the grid 0..512 to 1e-3."""
    d = torch.arange(0, 512, dtype=F64).unsqueeze(-1)
    f = 3 * (torch.exp(-((d - 64) ** 2) / (2 * 24.0**2)) + torch.exp(-((d - 256) ** 2) / (2 * 24.0**2)))
    spec = SPECTRA["gaussian_mixture"](1, 1, 32, components=32, basis=512.0, length_scale=16.0, length_spread=1.0,
                                       shift=True, shift_scale=256.0, dtype=F64)
    bumps = torch.exp(-((d - spec.shifts()[0, :, 0]) ** 2) / (2 * 16.0**2))  # [512, 32]
    weights = torch.linalg.lstsq(bumps, f).solution
    with torch.no_grad():
        spec.alpha.copy_(weights.T)
        assert float((spec.mask(d) - f).abs().max()) < 1e-3


@pytest.mark.parametrize("options, match", [
    ({"shift": False}, "basis=64.0 fixes the component centres on a grid of offsets: it needs shift=True"),
    ({"mean_scale": 0.1}, "mean_scale=0"),
    ({"alpha_scale": 0.0}, "alpha_scale must be a finite number > 0"),
    ({"alpha_scale": -2.0}, "alpha_scale must be a finite number > 0"),
    ({"basis": float("inf")}, "basis must be a finite number >= 0"),
])
def test_bad_basis_options_are_rejected(options, match):
    with pytest.raises(ValueError, match=match):
        SPECTRA["gaussian_mixture"](2, 1, 4 * C, **{**BASIS, **options})


def test_basis_needs_one_position_dimension():
    with pytest.raises(ValueError, match="pos_dim=1"):
        SPECTRA["gaussian_mixture"](2, 2, 4 * C, **BASIS)


def test_head_value_equals_the_mask_with_a_length_floor():
    """The per-score form (FlexAttention's ``score_mod``) takes ``min_length`` as ``mask`` does."""
    spec = SPECTRA["gaussian_mixture"](2, 1, 12, dtype=F64, seed=0, components=3, min_length=2.0, length_scale=4.0)
    with torch.no_grad():
        spec.alpha.copy_(torch.tensor([[1.0, -0.5, 0.7], [0.3, 0.9, -1.2]], dtype=F64))
    delta = torch.linspace(-9, 9, 37, dtype=F64)
    mask = spec.mask(delta.view(-1, 1))  # [37, H]
    for h in range(2):
        value = spec.head_value([delta], torch.tensor(h))
        torch.testing.assert_close(value, mask[:, h], rtol=1e-12, atol=1e-14)
