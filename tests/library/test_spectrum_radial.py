"""The radial spectrum (docs/math.md section 3.1, "A radial spectrum"): its exact mask
against independent quadrature, its direction rules' stated errors, rotation invariance of
the mask and of the features, its Gaussian start, and its errors. The generic identities
(features == estimate, gradients, translation, amplitude) run in tests/library/test_spectra.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close, random_rotation
from scipy import integrate

from flt.relative.spectra import SPECTRA, RadialSpectrum
from flt.relative.spectra.radial import chi_quantiles, rule_order, shell_average, shell_rule

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def directions(P: int, count: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(count, P, generator=g, dtype=F64)
    return e / e.norm(dim=-1, keepdim=True)


def spectrum(P=3, R=128, quadrature=8, perturb=0.2, **options) -> RadialSpectrum:
    spec = RadialSpectrum(2, P, R, quadrature=quadrature, dtype=F64, **options)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in spec.parameters():
            p.mul_(1 + perturb * torch.randn(p.shape, generator=g, dtype=F64))
    return spec


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("x", [0.0, 0.05, 0.37, 1.0, 2.6])
def test_shell_average_is_the_mean_of_the_cosine_over_directions(P, x):
    """Independent 1-D integrals: over the angle to e (P = 2) and over mu = cos(theta) (P = 3)."""
    if P == 1:
        reference = math.cos(2 * math.pi * x)
    elif P == 2:
        reference = integrate.quad(lambda phi: math.cos(2 * math.pi * x * math.cos(phi)), 0, math.pi, epsabs=1e-13)[0] / math.pi
    else:
        reference = integrate.quad(lambda mu: math.cos(2 * math.pi * x * mu), -1, 1, epsabs=1e-13)[0] / 2
    value = float(shell_average(torch.tensor(x, dtype=F64), P))
    assert abs(value - reference) < (5e-7 if P == 2 else 1e-12)  # torch's float64 J_0 (shell_average)


@pytest.mark.parametrize("P, order, reach, bound", [
    (2, 8, 1.0, 1e-5), (2, 8, 1.6, 4e-3), (3, 8, 1.0, 1e-5), (3, 8, 1.6, 3e-3), (3, 12, 1.6, 1e-7), (3, 12, 2.0, 1e-5),
])
def test_the_direction_rules_have_their_stated_error(P, order, reach, bound):
    u, q = shell_rule(P, order)
    assert u.shape == (order if P == 2 else order * order, P) and abs(float(q.sum()) - 1) < 1e-14
    assert_close(u.norm(dim=-1), torch.ones(u.shape[0], dtype=F64))
    x = torch.linspace(0, reach, 161, dtype=F64)
    e = directions(P, 500)
    rule = (torch.cos(2 * math.pi * x[:, None, None] * (e @ u.T)) * q).sum(-1)
    error = float((rule - shell_average(x, P)[:, None]).abs().max())
    assert error < bound
    assert error > bound / 1e3  # the bound is the rule's, not a loose one


@pytest.mark.parametrize("order", [8, 16, 24, 36])
def test_rule_order_keeps_the_sphere_rule_within_its_stated_error(order):
    """rule_order's criterion pi x + 4 <= order: at its edge the rule's error is 1e-4 (order
    8) to 6e-3 (order 36), and at three quarters of that x it is below 1e-5."""
    edge = (order - 4) / math.pi
    assert rule_order(0.999 * edge, 1.0) == order and rule_order(1.01 * edge, 1.0) == order + 2
    u, q = shell_rule(3, order)
    e = directions(3, 500)

    def error(x: float) -> float:
        rule = (torch.cos(2 * math.pi * x * (e @ u.T)) * q).sum(-1)
        return float((rule - shell_average(torch.tensor(x, dtype=F64), 3)).abs().max())

    assert 1e-4 < error(edge) < 6e-3
    assert error(0.75 * edge) < 1e-5


def test_bessel_gradient_is_minus_j1_and_a_second_derivative_is_refused():
    x = torch.linspace(0.01, 6.0, 17, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: shell_average(t, 2), [x])
    (g,) = torch.autograd.grad(shell_average(x, 2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad|once_differentiable"):
        g.sum().backward()


@pytest.mark.parametrize("P", [2, 3])
def test_the_mask_is_the_average_of_the_features_cosines_and_within_the_rule_error(P):
    spec = spectrum(P=P, R=64, quadrature=8)
    rho, w = spec.radii()
    reach = 1.0 / float(rho.detach().max())  # rho |Delta| <= 1 for every shell: rule error below 1e-5
    delta = directions(P, 60, seed=1) * torch.linspace(0, reach, 60, dtype=F64)[:, None]
    a, c = spec.features(torch.cat([delta, torch.zeros(1, P, dtype=F64)]))
    products = torch.einsum("bhir,bhr->ih", a[:, :, :-1], c[:, :, -1])
    assert_close(products, spec.estimate(delta))  # the features give the rule's f^ exactly
    error = float((spec.estimate(delta) - spec.mask(delta)).abs().max())
    assert error < 1e-5 * float(w.abs().sum(-1).max())
    assert error > 0  # the rule is not the sinc


@torch.no_grad()
def test_rotation_changes_the_mask_by_rounding_and_the_features_by_the_rule_error():
    spec = spectrum(P=3, R=128, quadrature=8)
    rho, w = spec.radii()
    g = torch.Generator().manual_seed(2)
    pos = torch.randn(40, 3, generator=g, dtype=F64)
    pos = pos / pos.norm(dim=-1).max() * 0.5 / float(rho.max())  # offsets up to 1 / rho_max
    delta = pos[:, None] - pos[None]
    mask, estimate = spec.mask(delta), spec.estimate(delta)
    bound = 2e-5 * float(w.abs().sum(-1).max())
    moved = []
    for seed in range(3):
        rotated = delta @ random_rotation(seed).T
        assert_close(spec.mask(rotated), mask, scale=10)
        moved.append(float((spec.estimate(rotated) - estimate).abs().max()))
    assert max(moved) < bound
    assert max(moved) > 1e-12  # the features' directions turn with nothing: not exact


@pytest.mark.parametrize("P", [1, 2, 3])
def test_a_fresh_spectrum_is_the_gaussian_kernel_by_a_radial_rule(P):
    S = {1: 1, 2: 8, 3: 64}[P]
    spec = RadialSpectrum(2, P, 16 * S, amplitude=1.5, length_scale=3.0, dtype=F64)
    r = torch.linspace(0, 15, 301, dtype=F64)
    delta = torch.zeros(301, P, dtype=F64)
    delta[:, 0] = r
    with torch.no_grad():
        f = spec.mask(delta)
    assert_close(f[0], torch.full((2,), 1.5, dtype=F64))  # amplitude is f(0)
    gaussian = 1.5 * torch.exp(-r * r / 18)
    assert float((f - gaussian[:, None]).abs().max()) < {1: 0.05, 2: 0.015, 3: 0.01}[P]
    # the start is the chi law's quantiles, which a larger K brings closer
    coarse = RadialSpectrum(1, P, 4 * S, amplitude=1.5, length_scale=3.0, dtype=F64)
    with torch.no_grad():
        assert float((coarse.mask(delta)[:, 0] - gaussian).abs().max()) > float((f[:, 0] - gaussian).abs().max())


@pytest.mark.parametrize("dof", [1, 2, 3, 5])
def test_chi_quantiles_invert_the_chi_cdf(dof):
    x = chi_quantiles(dof, 7)
    cdf = torch.special.gammainc(torch.tensor(dof / 2, dtype=F64), x * x / 2)
    assert_close(cdf, (torch.arange(7, dtype=F64) + 0.5) / 7)


def test_the_start_is_deterministic_and_nothing_is_redrawn():
    a, b = RadialSpectrum(2, 3, 64, seed=1), RadialSpectrum(2, 3, 64, seed=2, sampler="iid")
    assert not a.has_random_features and a.random_feature_buffers == ()
    before = a.frequencies()[0].detach().clone()
    a.redraw_random_features(torch.Generator().manual_seed(3))
    assert torch.equal(a.frequencies()[0], before) and torch.equal(b.frequencies()[0], before)
    assert SPECTRA["radial"] is RadialSpectrum


def test_the_radial_spectrum_in_flt_attention_is_rotation_invariant_to_the_rule_error():
    from flt.layers import FLTAttention

    torch.manual_seed(0)
    layer = FLTAttention.from_options(16, 2, pos_dim=3, spectrum="radial", num_frequencies=64, length_scale=2.0,
                                      coupling="multiplicative", dtype=F64)
    x = torch.randn(2, 9, 16, dtype=F64)
    pos = torch.randn(2, 9, 3, dtype=F64)
    with torch.no_grad():
        out = layer(x, pos)
        moved = max(float((layer(x, pos @ random_rotation(s).T) - out).abs().max()) for s in range(3))
    assert moved < 1e-5 * float(out.abs().max())


@pytest.mark.parametrize("options, match", [
    (dict(pos_dim=3, quadrature=7), "quadrature must be even"),
    (dict(pos_dim=3, num_frequencies=100), "multiple of the rule's 64 directions"),
    (dict(pos_dim=2, num_frequencies=12, quadrature=8), "multiple of the rule's 8 directions"),
    (dict(pos_dim=4), "pos_dim must be 1, 2 or 3"),
    (dict(pos_dim=3, length_scale=0.0), "length_scale"),
    (dict(pos_dim=3, quadrature=0), "quadrature"),
    (dict(pos_dim=3, shift=True), "no components to shift"),
    (dict(pos_dim=3, amplitude=float("nan")), "amplitude"),
])
def test_bad_options_are_refused_with_their_name(options, match):
    args = {"heads": 2, "num_frequencies": 64, **options}
    with pytest.raises(ValueError, match=match):
        RadialSpectrum(**args)


def test_it_has_no_density():
    with pytest.raises(ValueError, match="no density"):
        RadialSpectrum(1, 3, 64).density(torch.zeros(1, 3))
