"""Spectral families (docs/math.md sections 3, 3.1 and identity 10.2), parametrised over SPECTRA.

Every family must satisfy: f == FT(g) by quadrature, a.c == f^ exactly, f^ unbiased with
error ~ R^-1/2, amplitude semantics, reparameterised gradients, translation invariance,
fixed or redrawn frequencies, and clear errors on bad input.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, special
from torch import nn

from conftest import assert_close
from flt.relative.spectra import SPECTRA, LocalSpectrum, MaternSpectrum, NeuralSpectrum

F64 = torch.float64

# (registry name, test options): moderate length scales so f varies over the offsets used.
CASES = [
    ("gaussian_mixture", dict(components=2, length_scale=3.0, length_spread=2.0, mean_scale=0.05)),
    ("gaussian", dict(length_scale=3.0)),
    ("matern", dict(nu=0.5, length_scale=3.0)),
    ("matern", dict(nu=1.5, length_scale=3.0)),
    ("matern", dict(nu=2.5, length_scale=3.0)),
    ("local", dict(windows=2, window_sizes=(1.5, 4.0), smoothing=0.8)),
    ("neural", dict(hidden=8, length_scale=3.0)),
    ("discrete", dict(components=2, length_scale=3.0, length_spread=2.0)),
    ("radial", dict(length_scale=3.0, quadrature=4)),
]
IDS = [name + (f"-nu{opts['nu']}" if "nu" in opts else "") for name, opts in CASES]
# The families with a density, whose features estimate f by sampling it (the discrete family's
# frequencies are parameters and its features compute f exactly: tests/library/test_spectrum_discrete.py).
SAMPLED = [(case, i) for case, i in zip(CASES, IDS, strict=True) if not SPECTRA[case[0]].deterministic]
SAMPLED_CASES, SAMPLED_IDS = [c for c, _ in SAMPLED], [i for _, i in SAMPLED]
OPTIONS = {name: opts for name, opts in CASES}  # one case per name (the last Matern) where nu does not matter
# The families with components, each component moved by a learned shift (build() draws
# shifts of a few position units, so the masks are far from even).
SHIFTED = [
    ("gaussian_mixture", {**OPTIONS["gaussian_mixture"], "shift": True, "shift_scale": 2.0}),
    ("local", {**OPTIONS["local"], "smoothing": (0.8, 1.5), "shift": True, "shift_scale": 2.0}),
]
SHIFTED_IDS = [f"{name}-shifted" for name, _ in SHIFTED]
WITH_SHIFTED, WITH_SHIFTED_IDS = CASES + SHIFTED, IDS + SHIFTED_IDS
SAMPLED_WITH_SHIFTED, SAMPLED_WITH_SHIFTED_IDS = SAMPLED_CASES + SHIFTED, SAMPLED_IDS + SHIFTED_IDS


# Thousands of tiny tensor ops (quadrature, redraws): a second thread cannot speed them up.
pytestmark = pytest.mark.usefixtures("one_thread")


def build(name, options, *, P=1, R=16, H=2, perturb=0.15, **kwargs):
    """A float64 spectrum whose parameters are moved off their symmetric initialisation.

    Parameters do not depend on ``seed`` (which only seeds the frequency draws), so spectra
    with different seeds estimate the same ``f``.
    """
    torch.manual_seed(0)
    kwargs.setdefault("seed", 0)  # unseeded draws would consume the global generator first
    spec = SPECTRA[name](H, P, R, dtype=F64, **{**options, **kwargs})
    if perturb:
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for p in spec.parameters():
                p.add_(perturb * torch.randn(p.shape, generator=gen, dtype=F64))
            if spec.shift is not None:  # shifts of about shift_scale position units
                spec.shift.add_(torch.randn(spec.shift.shape, generator=gen, dtype=F64))
    return spec


def pair_products(a, c):
    """``a_i . c_j`` for every pair: ``[1, H, N, 2R] -> [N, N, H]``."""
    return torch.einsum("bhir,bhjr->ijh", a, c)


# Inner integrals (P = 2) run over the coordinate orthogonal to Delta with Gauss-Legendre
# after xi = _TAN_SCALE tan(theta): exact enough for Gaussian and algebraic (Matern) tails.
_TAN_SCALE = 0.1
_THETA, _THETA_W = np.polynomial.legendre.leggauss(200)
_THETA, _THETA_W = _THETA * math.pi / 2, _THETA_W * math.pi / 2


def ft_by_quadrature(spec, delta, head):
    """``int g(xi) cos(2 pi xi.Delta) dxi`` by adaptive quadrature, from ``spec.density`` only.

    In the rotated frame ``e1 = Delta / |Delta|``: ``f = int_0^inf (m(t) + m(-t)) cos(2 pi t |Delta|) dt``
    with the marginal ``m(t) = int g(t e1 + s e2) ds`` (``m = g`` for ``P = 1``); QUADPACK's
    QAWF handles the oscillatory half-line integral, including ``1/xi^2`` tails.
    """
    delta = np.asarray(delta, dtype=np.float64)
    P = delta.shape[0]
    norm = float(np.linalg.norm(delta))
    e1 = delta / norm if norm > 0 else np.eye(P)[0]

    def g(points):
        with torch.no_grad():
            return spec.density(torch.as_tensor(points, dtype=F64))[..., head].numpy()

    if P == 1:
        def marginal(t):
            return g(np.array([[t], [-t]])).sum()
    else:
        e2 = np.array([-e1[1], e1[0]])
        s = _TAN_SCALE * np.tan(_THETA)
        jac = _THETA_W * _TAN_SCALE / np.cos(_THETA) ** 2

        def marginal(t):
            pts = np.concatenate([t * e1 + s[:, None] * e2, -t * e1 + s[:, None] * e2])
            return (g(pts).reshape(2, -1) * jac).sum()

    if norm == 0:
        value, _ = integrate.quad(marginal, 0, np.inf, epsabs=1e-12, epsrel=1e-11, limit=400)
    else:
        value, _ = integrate.quad(marginal, 0, np.inf, weight="cos", wvar=2 * math.pi * norm, epsabs=1e-12, limlst=200)
    return value


def test_cases_cover_the_registry():
    assert {name for name, _ in CASES} == set(SPECTRA)


@pytest.mark.parametrize("P, deltas", [(1, [[0.0], [0.7], [2.3], [5.0]]), (2, [[0.0, 0.0], [0.8, -1.7], [2.5, 1.0]])])
@pytest.mark.parametrize("case", SAMPLED_CASES, ids=SAMPLED_IDS)
def test_mask_is_the_fourier_transform_of_the_density(case, P, deltas):
    name, options = case
    spec = build(name, options, P=P)
    with torch.no_grad():
        f = spec.mask(torch.tensor(deltas, dtype=F64))
    for i, d in enumerate(deltas):
        for h in range(spec.heads):
            ref = ft_by_quadrature(spec, d, h)
            # 1e-9 against values of order 0.1-1 (measured agreement: 2e-12 or better).
            assert abs(f[i, h].item() - ref) < 1e-9, (d, h, f[i, h].item(), ref)
    assert (f[:2].abs() > 0.05).all()  # the checked values are not trivially small


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("case", WITH_SHIFTED, ids=WITH_SHIFTED_IDS)
def test_features_reproduce_the_estimate_exactly(case, P):
    name, options = case
    spec = build(name, options, P=P, R=32, seed=3)
    pos = torch.randn(9, P, dtype=F64) * 4
    with torch.no_grad():
        a, c = spec.features(pos)
        est = spec.estimate(pos[:, None] - pos[None])
        _, w = spec.frequencies()
    assert a.shape == c.shape == (1, spec.heads, 9, 2 * spec.num_frequencies)
    scale = float(w.abs().sum(-1).max())
    torch.testing.assert_close(pair_products(a, c), est, rtol=0, atol=1e-12 * max(1.0, scale))


def _rmse(name, options, R, sampler, seeds, P=1):
    """Root mean square of f^ - f over offsets, seeds and heads."""
    if P == 1:
        grid = torch.linspace(-32, 32, 129, dtype=F64).view(-1, 1)
    else:
        axis = torch.linspace(-8, 8, 17, dtype=F64)
        grid = torch.cartesian_prod(axis, axis)
    with torch.no_grad():
        f = build(name, options, P=P, R=R).mask(grid)
        sq = [(build(name, options, P=P, R=R, sampler=sampler, seed=s).estimate(grid) - f).pow(2).mean() for s in seeds]
    return math.sqrt(float(torch.stack(sq).mean()))


_RS = (64, 256, 1024)


@pytest.mark.parametrize("case", SAMPLED_WITH_SHIFTED, ids=SAMPLED_WITH_SHIFTED_IDS)
def test_estimate_converges_at_the_monte_carlo_rate(case):
    name, options = case
    errs = [_rmse(name, options, R, "iid", range(12)) for R in _RS]
    slope = np.polyfit(np.log(_RS), np.log(errs), 1)[0]
    assert -0.75 < slope < -0.3, (errs, slope)


@pytest.mark.parametrize("name", ["gaussian", "gaussian_mixture"])
def test_qmc_beats_iid_for_smooth_spectra(name):
    seeds = range(8)
    iid = _rmse(name, OPTIONS[name], _RS[-1], "iid", seeds)
    qmc = _rmse(name, OPTIONS[name], _RS[-1], "qmc", seeds)
    assert qmc < 0.5 * iid, (qmc, iid)


def _unbiased(spec, deltas, draws=400):
    gen = torch.Generator().manual_seed(7)
    ests = []
    with torch.no_grad():
        f = spec.mask(deltas)
        for _ in range(draws):
            spec.redraw_frequencies(gen)
            ests.append(spec.estimate(deltas))
    ests = torch.stack(ests)
    err = (ests.mean(0) - f).abs()
    bound = 5 * ests.std(0) / math.sqrt(draws) + 1e-12
    assert (err <= bound).all(), (err, bound)


@pytest.mark.parametrize("case", SAMPLED_WITH_SHIFTED, ids=SAMPLED_WITH_SHIFTED_IDS)
def test_estimate_is_unbiased(case):
    name, options = case
    spec = build(name, options, P=1, R=4)
    _unbiased(spec, torch.tensor([[0.0], [1.3], [4.0]], dtype=F64))


@pytest.mark.parametrize("sampler", ["iid", "qmc", "orthogonal"])
def test_every_sampler_is_unbiased(sampler):
    spec = build("gaussian", OPTIONS["gaussian"], P=2, R=4, sampler=sampler)
    _unbiased(spec, torch.tensor([[0.0, 0.0], [1.3, -2.0], [4.0, 1.0]], dtype=F64))


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_zero_amplitude_is_exactly_zero_and_still_learns(case, P):
    name, options = case
    spec = build(name, {**options, "amplitude": 0.0}, P=P, perturb=0)
    pos = torch.randn(7, P, dtype=F64) * 3
    delta = pos[:, None] - pos[None]
    a, c = spec.features(pos)
    with torch.no_grad():
        assert torch.equal(spec.mask(delta), torch.zeros(7, 7, spec.heads, dtype=F64))
        assert torch.equal(spec.estimate(delta), torch.zeros(7, 7, spec.heads, dtype=F64))
        assert torch.equal(spec.frequencies()[1], torch.zeros(spec.heads, spec.num_frequencies, dtype=F64))
    assert torch.equal(a, torch.zeros_like(a))
    # Learning from f = 0: finite gradients, a nonzero one, and one step makes f nonzero.
    target = torch.exp(-delta.square().sum(-1, keepdim=True))
    (pair_products(a, c) - target).square().sum().backward()
    grads = {n: p.grad for n, p in spec.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), grads
    assert any(g.abs().sum() > 0 for g in grads.values())
    with torch.no_grad():
        for p in spec.parameters():
            p -= 0.1 * p.grad
        assert spec.mask(delta).abs().max() > 1e-3


@pytest.mark.parametrize("amplitude", [1.0, -0.5, 2.5])
@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_amplitude_is_f_at_zero(case, P, amplitude):
    name, options = case
    spec = build(name, {**options, "amplitude": amplitude}, P=P, perturb=0)
    zero = torch.zeros(1, P, dtype=F64)
    with torch.no_grad():
        assert_close(spec.mask(zero), torch.full((1, spec.heads), amplitude, dtype=F64), scale=0.01)
        if name != "local":  # equal weights at initialisation: sum_k w_k = f(0) exactly
            assert_close(spec.estimate(zero), torch.full((1, spec.heads), amplitude, dtype=F64), scale=0.01)


def test_neural_amplitude_zero_reaches_the_inner_layers_after_one_step():
    spec = build("neural", {**OPTIONS["neural"], "amplitude": 0.0}, perturb=0)
    pos = torch.randn(6, 1, dtype=F64) * 3
    target = torch.exp(-(pos[:, None] - pos[None]).square().sum(-1, keepdim=True))

    def step():
        spec.zero_grad()
        a, c = spec.features(pos)
        (pair_products(a, c) - target).square().sum().backward()
        return {n: float(p.grad.abs().sum()) for n, p in spec.named_parameters()}

    first = step()
    assert first["out_weight"] > 0 and first["out_bias"] > 0 and first["in_weight"] == 0
    with torch.no_grad():
        for p in spec.parameters():
            p -= 0.1 * p.grad
    second = step()
    assert all(v > 0 for v in second.values()), second


class _Method(nn.Module):
    """Exposes one method of a spectrum as ``forward``, for ``torch.func.functional_call``."""

    def __init__(self, spec, method):
        super().__init__()
        self.spec, self.method = spec, method

    def forward(self, x):
        return getattr(self.spec, self.method)(x)


def _gradcheck_parameters(spec, method, x):
    wrapper = _Method(spec, method)
    names = [f"spec.{n}" for n, _ in spec.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for p in spec.parameters())
    return torch.autograd.gradcheck(lambda *ps: torch.func.functional_call(wrapper, dict(zip(names, ps)), (x,)), params)


def _small(name, options):
    return {**options, "hidden": 3, "quadrature_points": 96} if name == "neural" else options


@pytest.mark.parametrize("amplitude", [None, 0.0])
@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("case", WITH_SHIFTED, ids=WITH_SHIFTED_IDS)
def test_gradcheck_features_wrt_parameters(case, P, amplitude):
    """Frequencies are reparameterised: a and c are differentiable in every parameter
    (also at amplitude = 0, where the weight floor of Spectrum.features applies)."""
    name, options = case
    if amplitude is None:
        spec = build(name, _small(name, options), P=P, R=4, H=1)
    else:
        spec = build(name, {**_small(name, options), "amplitude": amplitude}, P=P, R=4, H=1, perturb=0)
    assert _gradcheck_parameters(spec, "features", torch.randn(3, P, dtype=F64) * 2)


@pytest.mark.parametrize("case", WITH_SHIFTED, ids=WITH_SHIFTED_IDS)
def test_gradcheck_mask_wrt_parameters(case):
    name, options = case
    spec = build(name, _small(name, options), R=4, H=1)
    delta = torch.tensor([[0.0], [0.6], [-2.1]], dtype=F64)  # 0 included: Matern's sqrt
    assert _gradcheck_parameters(spec, "mask", delta)


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("case", WITH_SHIFTED, ids=WITH_SHIFTED_IDS)
def test_translating_positions_changes_nothing(case, P):
    name, options = case
    spec = build(name, options, P=P, R=32, seed=5)
    pos = torch.randn(8, P, dtype=F64) * 4
    shift = torch.tensor([41.3, -17.9][:P], dtype=F64)
    with torch.no_grad():
        base = pair_products(*spec.features(pos))
        moved = pair_products(*spec.features(pos + shift))
    torch.testing.assert_close(moved, base, rtol=0, atol=1e-10)


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("case", SHIFTED, ids=SHIFTED_IDS)
def test_a_shift_moves_each_component_of_the_mask(case, P):
    """``f(Delta) = sum_c f_c(Delta - delta_c)``: one component at a time (the others'
    amplitudes zeroed), the shifted spectrum equals its unshifted twin (the same
    parameters, no shift) evaluated at ``Delta - delta_c``; the mask is then not even."""
    name, options = case
    spec = build(name, options, P=P)
    twin = build(name, {k: v for k, v in options.items() if k not in ("shift", "shift_scale")}, P=P)
    twin.load_state_dict({k: v for k, v in spec.state_dict().items() if k != "shift"})
    amp = "alpha" if name == "gaussian_mixture" else "amplitude"
    delta = torch.randn(11, P, dtype=F64, generator=torch.Generator().manual_seed(2)) * 4
    shifts = spec.shifts().detach()  # [H, C, P]
    H, C, _ = shifts.shape
    assert (shifts.abs() > 0.05).any()
    full = 0
    with torch.no_grad():
        for comp in range(C):
            keep = torch.zeros(H, C, dtype=F64)
            keep[:, comp] = 1
            one, one_twin = build(name, options, P=P), build(name, {k: v for k, v in options.items() if k not in ("shift", "shift_scale")}, P=P)
            one.load_state_dict(spec.state_dict())
            one_twin.load_state_dict(twin.state_dict())
            getattr(one, amp).mul_(keep)
            getattr(one_twin, amp).mul_(keep)
            got = one.mask(delta)
            for h in range(H):
                expected = one_twin.mask(delta - shifts[h, comp])[:, h]
                torch.testing.assert_close(got[:, h], expected, rtol=0, atol=1e-13)
            full = full + got
        torch.testing.assert_close(spec.mask(delta), full, rtol=0, atol=1e-13)
        assert (spec.mask(delta) - spec.mask(-delta)).abs().max() > 0.05  # not even


@pytest.mark.parametrize("case", SHIFTED, ids=SHIFTED_IDS)
def test_shifts_start_at_zero_and_learn_a_one_sided_target(case):
    """A fresh shifted spectrum is its unshifted family exactly; a target on one side of
    the origin gives the shifts a gradient through the features, and gradient steps on the
    shifts alone move the mask towards it."""
    name, options = case
    spec = build(name, options, perturb=0, R=64)
    plain = build(name, {k: v for k, v in options.items() if k not in ("shift", "shift_scale")}, perturb=0, R=64)
    pos = torch.arange(24, dtype=F64).view(-1, 1)
    delta = pos[:, None] - pos[None]
    with torch.no_grad():
        assert torch.equal(spec.shift, torch.zeros_like(spec.shift))
        # The unshifted mask contracts P by matrix products, the shifted one by sums over a
        # broadcast: the same terms, added in another order (float64 rounding apart).
        torch.testing.assert_close(spec.mask(delta), plain.mask(delta), rtol=0, atol=1e-15)
        torch.testing.assert_close(pair_products(*spec.features(pos)), pair_products(*plain.features(pos)), rtol=0, atol=0)
    target = ((delta > 2) & (delta < 9)).to(F64).expand(-1, -1, spec.heads)  # keys 3 to 8 tokens to the left

    def loss():
        return (pair_products(*spec.features(pos)) - target).square().mean()

    before = float(loss().detach())
    opt = torch.optim.Adam([spec.shift], lr=0.5)
    for _ in range(40):
        opt.zero_grad()
        loss().backward()
        opt.step()
    after = float(loss().detach())
    assert after < 0.8 * before, (before, after)
    assert (spec.shifts().detach().mean(dim=(1, 2)) > 0.5).all()  # towards the target's side, in every head


def test_shift_options_are_checked():
    with pytest.raises(ValueError, match="shift: the GaussianKernelSpectrum family has no components"):
        SPECTRA["gaussian"](2, 1, 8, shift=True)
    for bad in (0.0, -3.0, float("inf"), True):
        with pytest.raises(ValueError, match="shift_scale must be a positive finite number"):
            LocalSpectrum(2, 1, 8, windows=2, shift=True, shift_scale=bad)
    with pytest.raises(ValueError, match="shift must be True or False"):
        LocalSpectrum(2, 1, 8, windows=2, shift="yes")
    spec = LocalSpectrum(2, 1, 8, windows=2, shift=True)
    with pytest.raises(ValueError, match="density of a shifted spectrum is complex"):
        spec.density(torch.zeros(1, 1))
    assert LocalSpectrum(2, 1, 8, windows=2).shift is None and LocalSpectrum(2, 1, 8, windows=2).phases(torch.zeros(2, 8, 1)) is None


@pytest.mark.parametrize("name", sorted(n for n in SPECTRA if not SPECTRA[n].deterministic))
def test_frequencies_are_a_fixed_buffer_unless_redrawn(name):
    options = OPTIONS[name]
    pos = torch.randn(5, 1, dtype=F64)
    fixed = build(name, options, seed=11)
    with torch.no_grad():
        first, again = fixed.features(pos), fixed.features(pos)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert torch.equal(fixed.eps, build(name, options, seed=11).eps)
    # The buffer is saved: a spectrum with other draws reproduces the features after loading.
    other = build(name, options, seed=12)
    assert not torch.equal(other.eps, fixed.eps)
    other.load_state_dict(fixed.state_dict())
    with torch.no_grad():
        assert torch.equal(other.features(pos)[0], first[0])

    # Every spectrum can be redrawn (the old redraw=True flag is accepted and ignored).
    redrawn = build(name, options, seed=11)
    eps, mask = redrawn.eps.clone(), redrawn.mask(pos)
    redrawn.redraw_random_features(torch.Generator().manual_seed(3))
    assert not torch.equal(redrawn.eps, eps) and redrawn.eps.shape == eps.shape
    again = build(name, options, seed=11, redraw=True)
    again.redraw_frequencies(torch.Generator().manual_seed(3))
    assert torch.equal(again.eps, redrawn.eps)  # a function of the generator
    with torch.no_grad():
        assert not torch.equal(redrawn.features(pos)[0], first[0])
        assert torch.equal(redrawn.mask(pos), mask)  # f itself does not depend on the draws


@pytest.mark.parametrize("case", WITH_SHIFTED, ids=WITH_SHIFTED_IDS)
def test_mask_runs_in_float32_under_autocast(case):
    """Autocast lowers matrix products (einsum included) to bfloat16; the mask's phases and
    decays are contracted over P = 2 coordinates of offsets of up to ~50 units and must
    stay in float32 (a bfloat16 phase is off by a large fraction of a turn)."""
    name, options = case
    spec = build(name, options, P=2).float()
    delta = torch.randn(40, 7, 2, generator=torch.Generator().manual_seed(5)) * 20
    with torch.no_grad():
        plain = spec.mask(delta)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lowered = spec.mask(delta)
    assert lowered.dtype == torch.float32
    torch.testing.assert_close(lowered, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SPECTRA))
def test_registry_signature_and_dtypes(name):
    multiple = {"local": {"windows": 2}, "gaussian_mixture": {"components": 2}}.get(name, {})
    spec = SPECTRA[name](heads=3, pos_dim=2, num_frequencies=8, amplitude=0.5, **multiple)
    a, c = spec.features(torch.randn(2, 5, 2))
    assert a.shape == c.shape == (2, 3, 5, 16) and a.dtype == c.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in spec.parameters())
    a64, _ = spec.features(torch.randn(5, 2, dtype=F64))
    assert a64.dtype == F64 and a64.shape == (1, 3, 5, 16)


def test_per_axis_length_scales_scale_each_coordinate():
    for name, options in [("gaussian", {}), ("matern", {"nu": 0.5}), ("matern", {"nu": 2.5})]:
        spec = SPECTRA[name](1, 2, 8, length_scale=(1.5, 4.0), dtype=F64, **options)
        with torch.no_grad():
            f = spec.mask(torch.tensor([[3.0, 0.0], [0.0, 8.0], [3.0 / math.sqrt(2), 8.0 / math.sqrt(2)]], dtype=F64))
        assert_close(f[1], f[0])
        assert_close(f[2], f[0])  # isotropic in the scaled offset Delta / l


@pytest.mark.parametrize("nu", [0.5, 1.5, 2.5])
def test_matern_mask_is_the_standard_bessel_form(nu):
    spec = MaternSpectrum(1, 1, 8, nu=nu, length_scale=2.0, amplitude=1.0, dtype=F64)
    assert spec.eps.shape == (1, 8, 1 + round(2 * nu))  # the chi-square's 2 nu extra normals
    r = np.linspace(0.05, 6, 40)
    arg = math.sqrt(2 * nu) * r
    ref = 2 ** (1 - nu) / special.gamma(nu) * arg**nu * special.kv(nu, arg)
    with torch.no_grad():
        f = spec.mask(torch.as_tensor(2.0 * r, dtype=F64).view(-1, 1))[:, 0]
    assert_close(f, torch.as_tensor(ref))


def test_local_weights_are_the_bounded_importance_ratio():
    """w_k = g(xi_k) / (R p(xi_k)) with p = N(0, (2 pi tau)^-2) per axis (one window)."""
    for P in (1, 2):
        spec = build("local", dict(windows=1, window_sizes=(3.0,), smoothing=0.7), P=P, R=64, H=2, seed=2)
        with torch.no_grad():
            xi, w = spec.frequencies()
            sigma = 1 / (2 * math.pi * spec.smoothings()[:, 0])  # [H, P]
            log_p = (-0.5 * (xi / sigma[:, None]) ** 2 - torch.log(sigma[:, None]) - 0.5 * math.log(2 * math.pi)).sum(-1)
            g = torch.stack([spec.density(xi[h])[:, h] for h in range(spec.heads)])
            bound = (math.sqrt(2 / math.pi) * spec.half_widths()[:, 0] / spec.smoothings()[:, 0]).prod(-1)
        assert_close(w, g / (spec.num_frequencies * torch.exp(log_p)))
        assert (w.abs() <= spec.amplitude.abs() * bound[:, None] / spec.num_frequencies + 1e-15).all()


def test_unsmoothed_box_window_has_unbounded_variance():
    """docs/math.md vs the FLT paper: the paper's box window (tau -> 0) has g = a sin(2 pi w xi) / (pi xi)
    and infinite importance-sampling variance; the second moment int g^2 / p grows like
    sqrt(2/pi) w / tau, which is why the library smooths the box."""
    w = 4.0
    moments = []
    for tau in (1.0, 0.1, 0.01):
        spec = LocalSpectrum(1, 1, 8, windows=1, window_sizes=(w,), smoothing=tau, dtype=F64)
        sigma = 1 / (2 * math.pi * tau)
        xi = torch.linspace(-12 * sigma, 12 * sigma, 400_001, dtype=F64).view(-1, 1)
        with torch.no_grad():
            g = spec.density(xi)[:, 0] / spec.amplitude[0, 0]
        p = torch.exp(-0.5 * (xi[:, 0] / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
        moments.append(float(torch.trapezoid(g * g / p, xi[:, 0])))
    assert 8 < moments[1] / moments[0] < 12 and 9 < moments[2] / moments[1] < 11, moments
    assert abs(moments[2] * 0.01 / w / math.sqrt(2 / math.pi) - 1) < 0.05, moments


def test_neural_weights_are_the_importance_ratio_and_g_is_even():
    spec = build("neural", {**OPTIONS["neural"], "proposal_ratio": 1.3}, P=2, R=64, seed=4)
    with torch.no_grad():
        xi, w = spec.frequencies()
        s_p = 1.3 / (2 * math.pi * spec.lengths())  # [H, P]
        log_p = (-0.5 * (xi / s_p[:, None]) ** 2 - torch.log(s_p[:, None]) - 0.5 * math.log(2 * math.pi)).sum(-1)
        g = torch.stack([spec.density(xi[h])[:, h] for h in range(spec.heads)])
        assert_close(w, g / (spec.num_frequencies * torch.exp(log_p)))
        pts = torch.randn(20, 2, dtype=F64) * 0.1
        assert_close(spec.density(-pts), spec.density(pts))


@pytest.mark.parametrize("P, fine_points", [(1, 801), (2, 401)])
def test_neural_quadrature_is_converged_up_to_its_limit(P, fine_points):
    spec = build("neural", OPTIONS["neural"], P=P)
    fine = build("neural", {**OPTIONS["neural"], "quadrature_points": fine_points}, P=P)
    reach = spec.quadrature_limit() * float(spec.lengths().detach().min())
    delta = (torch.rand(40, P, dtype=F64) * 2 - 1) * reach
    with torch.no_grad():
        assert_close(spec.mask(delta), fine.mask(delta), scale=10)  # 1e-9


_BAD = [
    (lambda: SPECTRA["gaussian"](2, 1, 8, sampler="sobol"), ValueError, "sampler must be one of"),
    (lambda: SPECTRA["gaussian"](0, 1, 8), ValueError, "heads must be a positive integer"),
    (lambda: MaternSpectrum(2, 1, 8, nu=1.0), ValueError, "nu must be one of"),
    (lambda: MaternSpectrum(2, 1, 8, nu=3.5), ValueError, "nu must be one of"),
    (lambda: SPECTRA["gaussian_mixture"](2, 1, 10, components=4), ValueError, "multiple of components"),
    (lambda: LocalSpectrum(2, 1, 10, windows=4), ValueError, "multiple of windows"),
    (lambda: LocalSpectrum(2, 1, 8, windows=4, window_sizes=(1.0, 2.0)), ValueError, "window_sizes must be .* length windows = 4"),
    (lambda: LocalSpectrum(2, 1, 8, windows=2, smoothing=0.0), ValueError, "smoothing must be positive"),
    (lambda: LocalSpectrum(2, 1, 8, windows=2, smoothing=(1.0, 2.0, 3.0)), ValueError, "smoothing must be .* length windows = 2"),
    (lambda: LocalSpectrum(2, 1, 8, windows=2, smoothing="wide"), ValueError, "smoothing must be a positive finite number or 2"),
    (lambda: SPECTRA["gaussian"](2, 2, 8, length_scale=(1.0, 2.0, 3.0)), ValueError, "length_scale must be .* length P = 2"),
    (lambda: SPECTRA["matern"](2, 1, 8, length_scale=-1.0), ValueError, "length_scale must be positive"),
    (lambda: SPECTRA["gaussian"](2, 1, 8, amplitude=float("nan")), ValueError, "amplitude must be a finite number"),
    (lambda: NeuralSpectrum(2, 1, 8, proposal_ratio=0.7), ValueError, "proposal_ratio"),
    (lambda: NeuralSpectrum(2, 1, 8, quadrature_points=64), ValueError, "quadrature_points must be at least"),
    (lambda: NeuralSpectrum(2, 3, 8).mask(torch.zeros(1, 3)), NotImplementedError, "pos_dim <= 2"),
    (lambda: NeuralSpectrum(2, 1, 8, length_scale=1.0).mask(torch.full((1, 1), 500.0)), ValueError, "quadrature_points"),
]


@pytest.mark.parametrize("make, err, match", _BAD)
def test_bad_options_are_rejected(make, err, match):
    with pytest.raises(err, match=match):
        make()


@pytest.mark.parametrize("name", sorted(SPECTRA))
def test_bad_points_are_rejected(name):
    spec = build(name, OPTIONS[name], P=1, perturb=0)
    with pytest.raises(ValueError, match=r"pos must have last dimension P = 1"):
        spec.features(torch.randn(5, 2))
    with pytest.raises(ValueError, match=r"pos must have rank 2 or 3"):
        spec.features(torch.randn(5))
    checked = [(spec.mask, "delta"), (spec.estimate, "delta")] + ([] if spec.deterministic else [(spec.density, "xi")])
    for method, arg in checked:
        with pytest.raises(ValueError, match=rf"{arg} must have last dimension P = 1"):
            method(torch.randn(5, 2))
        with pytest.raises(TypeError, match=rf"{arg} must have a floating-point dtype"):
            method(torch.ones(5, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="pos contains 1 non-finite"):
        spec.features(torch.tensor([[0.0], [float("nan")]]))
    with pytest.raises(TypeError, match="pos must have a floating-point dtype"):
        spec.features(torch.arange(4).view(4, 1))
