"""``GaussianMixtureSpectrum(min_length=...)``: a floor on the component lengths (a far
field restricted to smooth components), its closed form, its random-feature estimate and
the near-set layer that uses it, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_close, assert_same_gradients
from flt import FLTAttention
from flt.relative.spectra import GaussianMixtureSpectrum

F64 = torch.float64


def spectrum(min_length=3.0, **kw):
    options = {"components": 2, "length_scale": 4.0, "length_spread": 4.0, "seed": 0, **kw}
    return GaussianMixtureSpectrum(2, 3, options.pop("num_frequencies", 8), min_length=min_length, **options).double()


def test_initial_lengths_are_the_configured_ones():
    spec = spectrum(min_length=3.0)
    assert_close(spec.lengths()[0, :, 0], torch.tensor([4.0, 16.0], dtype=F64), dtype=torch.float32)  # built in float32
    assert_close(spectrum(min_length=0.0).lengths()[0, :, 0], torch.tensor([4.0, 16.0], dtype=F64), dtype=torch.float32)


@pytest.mark.parametrize("raw", [-30.0, 0.0, 30.0])
def test_lengths_never_fall_below_the_floor(raw):
    spec = spectrum(min_length=3.0)
    with torch.no_grad():
        spec.log_scale.fill_(raw)  # s' from 1e-13 to 1e13: l' from huge to ~0
    lengths = spec.lengths()
    assert bool((lengths >= 3.0).all())
    if raw == 30.0:
        assert_close(lengths, torch.full_like(lengths, 3.0))  # the floor, not below it
    xi, _ = spec.frequencies()
    assert bool(torch.isfinite(xi).all())
    assert float(xi.detach().abs().max()) <= 8 / (2 * math.pi * 3.0)  # draws within 8 sigma of the widest component


def test_mask_is_the_closed_form_with_the_floored_lengths():
    spec = spectrum(min_length=2.0)
    with torch.no_grad():
        spec.log_scale.copy_(torch.randn_like(spec.log_scale))
        spec.alpha.copy_(torch.randn_like(spec.alpha))
    delta = torch.randn(7, 3, dtype=F64) * 4
    l = spec.lengths()  # [H, C, P]
    expected = (spec.alpha[None] * torch.exp(-(delta[:, None, None] ** 2 / (2 * l * l)).sum(-1))).sum(-1)
    assert_close(spec.mask(delta), expected)
    assert_close(spec.pairwise(delta[None, :3], delta[None, 3:])[0].permute(1, 2, 0), spec.mask(delta[:3, None] - delta[None, 3:]))


def test_features_are_the_estimate_and_converge_to_the_mask():
    """``a . c`` is the estimate exactly for the draws at hand, and the estimate converges to
    ``f`` as ``R`` grows (QMC), with the floored lengths in both."""
    spec = spectrum(min_length=2.0, num_frequencies=2 ** 14, sampler="qmc")
    with torch.no_grad():
        spec.log_scale.add_(1.0)  # a learned part well below the floor's length
    pos = torch.randn(9, 3, dtype=F64) * 3
    a, c = spec.features(pos)
    delta = pos[:, None] - pos[None]
    assert_close((a[0] @ c[0].transpose(-1, -2)).permute(1, 2, 0), spec.estimate(delta))
    assert (spec.estimate(delta) - spec.mask(delta)).abs().max() < 0.01


def test_gradients_reach_the_learned_part_through_the_floor():
    spec = spectrum(min_length=3.0)
    delta = torch.randn(5, 3, dtype=F64) * 3
    (spec.mask(delta).sum() + spec.estimate(delta).sum()).backward()
    assert spec.log_scale.grad is not None and spec.log_scale.grad.abs().sum() > 0


@pytest.mark.parametrize("coupling", ["logit", "multiplicative"])
def test_near_set_layer_with_a_smooth_far_field_equals_its_reference(coupling):
    """The layer the nbody task uses: exact near set with a sharp ``f_near`` of its own
    (``near_relative``) and a far field floored at ``min_length``; the fast path equals the
    O(N^2) reference with the same draws, forward and backward, in float64."""
    layer = FLTAttention.from_options(32, 2, pos_dim=3, coupling=coupling, num_features=16, num_frequencies=8, near_neighbors=5,
                         components=2, length_scale=4.0, length_spread=4.0, min_length=3.0,
                         near_relative="gaussian_mixture", near_relative_options={"components": 2, "length_scale": 0.5,
                                                                                  "length_spread": 4.0}).double()
    with torch.no_grad():
        layer.near_spectrum.alpha.fill_(0.7)
    assert layer.near_spectrum.min_length == 0.0 and layer.spectrum.min_length == 3.0
    x = torch.randn(2, 19, 32, dtype=F64, requires_grad=True)
    pos = torch.randn(2, 19, 3, dtype=F64) * 2
    out, ref = layer(x, pos), layer.reference(x, pos)
    assert_same_gradients(out, ref, [x] + list(layer.parameters()))


@pytest.mark.parametrize("value", [-1.0, float("nan"), True, "3"])
def test_min_length_is_checked_by_name(value):
    with pytest.raises(ValueError, match="min_length"):
        spectrum(min_length=value)


def test_initial_lengths_must_exceed_the_floor():
    with pytest.raises(ValueError, match="must exceed min_length"):
        spectrum(min_length=4.0)
