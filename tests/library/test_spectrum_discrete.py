"""The discrete spectrum (learned frequencies and weights): exact features, its start, its
gradients, and that nothing redraws it (docs/math.md section 3.1, "A discrete spectrum")."""

from __future__ import annotations

import math

import pytest
import torch

from flt import FLTAttention
from flt.layers.draws import redraw
from flt.relative.spectra import SPECTRA, DiscreteSpectrum, GaussianMixtureSpectrum

F64 = torch.float64
OPTIONS = {"components": 2, "length_scale": 2.5, "length_spread": 4.0}


def moved(spec: DiscreteSpectrum, scale: float = 0.3) -> DiscreteSpectrum:
    """The spectrum with every parameter moved off its start (weights of both signs)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in spec.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return spec


@pytest.mark.parametrize("sampler", ["iid", "qmc"])
@pytest.mark.parametrize("P", [1, 3])
def test_starts_as_the_mixture_estimate_with_the_same_draws(P, sampler):
    disc = DiscreteSpectrum(3, P, 16, seed=4, sampler=sampler, amplitude=0.8, dtype=F64, **OPTIONS)
    mix = GaussianMixtureSpectrum(3, P, 16, seed=4, sampler=sampler, amplitude=0.8, dtype=F64, **OPTIONS)
    delta = torch.randn(40, P, dtype=F64) * 4
    with torch.no_grad():
        torch.testing.assert_close(disc.mask(delta), mix.estimate(delta), rtol=0, atol=1e-14)
        xi_d, w_d = disc.frequencies()
        xi_m, w_m = mix.frequencies()
    torch.testing.assert_close(xi_d, xi_m, rtol=1e-15, atol=0)
    torch.testing.assert_close(w_d, w_m, rtol=1e-15, atol=0)
    assert math.isclose(float(w_d.sum(-1)[0]), 0.8, rel_tol=1e-12)  # amplitude is f(0)


@pytest.mark.parametrize("P", [1, 2, 3])
def test_features_compute_the_mask_exactly(P):
    spec = moved(DiscreteSpectrum(2, P, 24, components=3, seed=1, dtype=F64))
    pos = torch.randn(2, 9, P, dtype=F64) * 5
    delta = pos[:, :, None] - pos[:, None]  # [B, N, N, P]
    with torch.no_grad():
        a, c = spec.features(pos)
        f = spec.mask(delta).permute(0, 3, 1, 2)  # [B, H, N, N]
        # The formula itself, written out.
        xi, w = spec.frequencies()
        direct = (w[None, None, None] * torch.cos(2 * math.pi * torch.einsum("bijp,hrp->bijhr", delta, xi))).sum(-1)
        torch.testing.assert_close(f, direct.permute(0, 3, 1, 2), rtol=0, atol=1e-12)
        torch.testing.assert_close(a @ c.transpose(-1, -2), f, rtol=0, atol=1e-12)
        torch.testing.assert_close(spec.estimate(delta).permute(0, 3, 1, 2), f, rtol=0, atol=1e-12)
        torch.testing.assert_close(spec.pairwise(pos, pos), f, rtol=0, atol=1e-12)
        torch.testing.assert_close(spec.bias(pos[:1], pos[:1]), f[:1], rtol=0, atol=1e-12)
    assert (w < 0).any(), "the moved weights cover both signs"


def test_per_score_value_equals_the_mask():
    spec = moved(DiscreteSpectrum(2, 2, 8, components=2, seed=0, dtype=F64))
    d = torch.tensor([1.7, -0.4], dtype=F64)
    with torch.no_grad():
        f = spec.mask(d.view(1, 2))[0]
        for h in range(2):
            value = spec.head_value([d[0], d[1]], torch.tensor(h))
            assert math.isclose(float(value), float(f[h]), rel_tol=0, abs_tol=1e-13)


def test_gradients_reach_every_frequency_and_weight():
    # (gradcheck of mask() in its parameters: tests/library/test_spectra.py, every family)
    spec = moved(DiscreteSpectrum(2, 3, 8, components=2, seed=0, dtype=F64))
    pos = torch.randn(6, 3, dtype=F64) * 3
    a, c = spec.features(pos)
    (a @ c.transpose(-1, -2)).square().sum().backward()
    assert spec.theta.grad is not None and bool((spec.theta.grad != 0).all())
    assert spec.beta.grad is not None and bool((spec.beta.grad != 0).all())


def test_a_frequency_moves_to_fit_a_cosine_the_start_lacks():
    """One frequency, one weight: gradient descent finds the target's frequency, which a
    mixture with fixed draws could only reach by changing its length (all frequencies at once)."""
    spec = DiscreteSpectrum(1, 1, 1, components=1, length_scale=4.0, seed=0, dtype=F64)
    with torch.no_grad():
        target_xi = float(spec.frequencies()[0].item()) * 1.3 + 0.01
    delta = torch.linspace(-6, 6, 49, dtype=F64).view(-1, 1)
    target = 0.7 * torch.cos(2 * math.pi * target_xi * delta[:, 0])
    opt = torch.optim.Adam(spec.parameters(), lr=2e-2)
    with torch.no_grad():
        start = float((spec.mask(delta)[:, 0] - target).square().mean())
    for _ in range(600):
        opt.zero_grad()
        loss = (spec.mask(delta)[:, 0] - target).square().mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        xi, w = spec.frequencies()
    assert float(loss.detach()) < 1e-4 * start
    assert math.isclose(abs(float(xi.item())), target_xi, rel_tol=1e-3) and math.isclose(float(w.item()), 0.7, rel_tol=1e-2)


def test_nothing_redraws_it():
    layer = FLTAttention.from_options(16, 2, pos_dim=3, spectrum="discrete", coupling="multiplicative", num_frequencies=8,
                                      num_features=8, near_neighbors=4, seed=0).double()
    spec = layer.spectrum
    assert isinstance(spec, DiscreteSpectrum) and not spec.has_random_features and spec.random_feature_buffers == ()
    before = {k: v.clone() for k, v in spec.state_dict().items()}
    kernel = layer.feature_map.projection.clone()
    redraw(layer, torch.Generator().manual_seed(9))
    assert not torch.equal(layer.feature_map.projection, kernel), "the kernel features are redrawn"
    spec.redraw_random_features(torch.Generator().manual_seed(3))
    for k, v in spec.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_saved_and_loaded_with_its_parameters():
    one = moved(DiscreteSpectrum(2, 3, 8, components=2, seed=0))
    two = DiscreteSpectrum(2, 3, 8, components=2, seed=1)
    assert set(one.state_dict()) == {"eps", "theta", "beta"}  # the spread is derived from the options
    two.load_state_dict(one.state_dict())
    delta = torch.randn(5, 3)
    with torch.no_grad():
        assert torch.equal(two.mask(delta), one.mask(delta))


def test_flt_layer_with_a_discrete_far_term_matches_its_reference():
    torch.manual_seed(0)
    layer = FLTAttention.from_options(16, 2, pos_dim=3, spectrum="discrete", coupling="multiplicative", num_frequencies=8,
                                      num_features=8, near_neighbors=4, seed=0).double()
    moved(layer.spectrum, 0.2)
    x, pos = torch.randn(2, 11, 16, dtype=F64, requires_grad=True), torch.randn(2, 11, 3, dtype=F64) * 2
    fast, ref = layer(x, pos), layer.reference(x, pos)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    # Backward as well: the input and every frequency and weight get the reference's gradient.
    cot = torch.randn_like(fast)
    wrt = (x, layer.spectrum.theta, layer.spectrum.beta)
    for g_fast, g_ref in zip(torch.autograd.grad(fast, wrt, cot), torch.autograd.grad(ref, wrt, cot), strict=True):
        assert g_fast.abs().max() > 0
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-9, atol=1e-11)


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"num_frequencies \(6\) must be a multiple of components \(4\)"):
        DiscreteSpectrum(2, 1, 6)
    with pytest.raises(ValueError, match="shift: the discrete family has no components to shift"):
        DiscreteSpectrum(2, 1, 8, shift=True)
    with pytest.raises(ValueError, match="length_spread must be a positive finite number"):
        DiscreteSpectrum(2, 1, 8, length_spread=0.0)
    with pytest.raises(ValueError, match="a discrete spectrum has no density"):
        DiscreteSpectrum(2, 1, 8).density(torch.zeros(1, 1))
    assert SPECTRA["discrete"] is DiscreteSpectrum


@pytest.mark.parametrize("cast", [torch.nn.Module.half, torch.nn.Module.bfloat16])
@pytest.mark.parametrize("family", [DiscreteSpectrum, GaussianMixtureSpectrum])
def test_a_half_cast_keeps_the_float32_values(family, cast):
    """Cast to a half type, a spectrum keeps its parameters, draws and (discrete) spreads in
    float32 with their values unrounded: a frequency rounded to float16 moves a phase at
    r = 10^4 by about a tenth of a turn."""
    spec = moved(family(2, 2, 8, components=2, seed=0, length_scale=3.0))
    first = next(spec.parameters())
    first.grad = torch.randn_like(first)
    before = {k: v.clone() for k, v in [*spec.named_parameters(), *spec.named_buffers()]}
    grad = first.grad.clone()
    pos = torch.randn(7, 2) * 1e3
    with torch.no_grad():
        mask = spec.mask(pos)
        cast(spec)
        for k, v in [*spec.named_parameters(), *spec.named_buffers()]:
            assert v.dtype == torch.float32 and torch.equal(v, before[k]), k
        assert torch.equal(spec.mask(pos), mask)
    first = next(spec.parameters())
    assert first.grad is not None and first.grad.dtype == torch.float32 and torch.equal(first.grad, grad)


def test_a_default_near_term_starts_at_zero_and_learns():
    """A near set's default term copies the far family at amplitude 0: for this family all
    weights 0, so the near mask is 0 at the start; the gradients are finite and reach the
    weights (the frequencies get theirs once a weight moves off 0)."""
    layer = FLTAttention.from_options(16, 2, pos_dim=2, spectrum="discrete", coupling="multiplicative", num_frequencies=8,
                                      num_features=8, near_neighbors=4, seed=0).double()
    near = layer.core.near_spectrum
    assert isinstance(near, DiscreteSpectrum) and not near.has_random_features
    delta = torch.randn(5, 2, dtype=F64)
    with torch.no_grad():
        assert torch.equal(near.mask(delta), torch.zeros(5, 2, dtype=F64))
    x, pos = torch.randn(2, 11, 16, dtype=F64), torch.randn(2, 11, 2, dtype=F64) * 2
    layer(x, pos).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
    assert bool((near.beta.grad != 0).any())
