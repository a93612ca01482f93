"""Numerical conditioning of FLT: float32 against float64, bfloat16 and float16 autocast
against float32, at raw token positions (docs/math.md section 4, "Conditioning").

The multiplicative coupling's row sums cancel (its random-feature mask oscillates around 0
far from the query), so past a few thousand tokens rounding is amplified by the rows'
condition numbers; there the layer must say so (``ConditioningWarning``) instead of
returning a silently different answer.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from flt.layers.flt import ConditioningWarning, FLTAttention
from flt.ops.linear import kronecker_condition
from flt.relative.spectra import SPECTRA
from conftest import assert_close


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def layer_and_input(n: int, *, coupling="multiplicative", qk_norm=None, scale=1.0, **options):
    layer = FLTAttention.from_options(64, 2, coupling=coupling, qk_norm=qk_norm, seed=0, **options)
    x = torch.randn(1, n, 64, generator=torch.Generator().manual_seed(1)) * scale
    return layer, x


def run(layer, x, pos=None, autocast=None):
    """``layer(x, pos)`` (under ``autocast``, a dtype) and the ConditioningWarnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if autocast is None:
            y = layer(x, pos)
        else:
            with torch.autocast("cpu", dtype=autocast):
                y = layer(x, pos)
    return y, [w for w in caught if issubclass(w.category, ConditioningWarning)]


@pytest.mark.parametrize("spectrum", sorted(SPECTRA))
def test_float32_spectral_features_match_float64_at_large_positions(spectrum):
    # In float32 a phase 2 pi xi.r of ~5000 radians (r ~ 16384) was off by ~3e-4.
    options = {"shift": True} if SPECTRA[spectrum].supports_shift else {}
    spec = SPECTRA[spectrum](heads=2, pos_dim=1, num_frequencies=32, seed=0, **options)
    if spec.shift is not None:
        with torch.no_grad():
            spec.shift.normal_(0, 100.0)
    pos = torch.arange(16384, dtype=torch.float32).view(1, -1, 1) + 1e5
    a32, c32 = spec.features(pos)
    a64, c64 = copy.deepcopy(spec).double().features(pos.double())
    assert relative(a32, a64) < 3e-7 and relative(c32, c64) < 3e-7


def test_frequency_gradients_stay_finite_in_a_half_layer(one_thread):
    # sum_n 2 pi r_n dL/dphase_n exceeds float16's range at ~1000 tokens: the spectrum keeps
    # float32 parameters when the layer is cast to float16.
    layer, x = layer_and_input(1024)
    layer = layer.half()
    assert layer.spectrum.mu.dtype == torch.float32 and layer.to_qkv.weight.dtype == torch.float16
    y, _ = run(layer, x.half())
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    for name, p in layer.named_parameters():
        assert torch.isfinite(p.grad).all(), name


def test_float32_matches_float64_far_from_the_origin(one_thread):
    # Only r_i - r_j matters: positions 10^6 + n give the float64 result to 1e-4.
    layer, x = layer_and_input(1024)
    pos = (1e6 + torch.arange(1024, dtype=torch.float32)).view(1, -1, 1)
    y, warned = run(layer, x, pos)
    ref, _ = run(copy.deepcopy(layer).double(), x.double(), pos.double())
    assert not warned
    assert relative(y, ref) < 1e-4


def check_or_warned(n: int, *, fp32_tol=1e-4, bf16_tol=0.02):
    """float32 within ``fp32_tol`` of float64 and bfloat16 autocast within ``bf16_tol`` of
    float32, each unless a ConditioningWarning said it cannot be."""
    layer, x = layer_and_input(n)
    with torch.no_grad():
        y, warned32 = run(layer, x)
        ref, _ = run(copy.deepcopy(layer).double(), x.double())
        ybf, warned16 = run(layer, x, autocast=torch.bfloat16)
    err32, err16 = relative(y, ref), relative(ybf, y)
    assert err32 < fp32_tol or warned32, f"float32 off by {err32:.2e} at N = {n} without a warning"
    assert err16 < bf16_tol or warned16, f"bfloat16 off by {err16:.2e} at N = {n} without a warning"
    return err32, err16, warned32, warned16


def test_short_sequences_are_accurate_without_a_warning(one_thread):
    err32, err16, warned32, warned16 = check_or_warned(1024)
    assert not warned32 and not warned16
    assert err32 < 1e-6 and err16 < 0.02


def test_long_sequences_are_accurate_or_warned(one_thread):
    err32, err16, warned32, warned16 = check_or_warned(2048)
    # At this length the row sums already cancel: bfloat16 is not within 2%, and says so.
    assert warned16 and "bfloat16" in str(warned16[0].message)


@pytest.mark.slow
@pytest.mark.parametrize("n", [4096, 16384])
def test_very_long_sequences_are_accurate_or_warned(n, one_thread):
    check_or_warned(n)


def test_logit_coupling_in_bfloat16_needs_no_warning(one_thread):
    layer, x = layer_and_input(2048, coupling="logit")
    with torch.no_grad():
        y, _ = run(layer, x)
        ybf, warned = run(layer, x, autocast=torch.bfloat16)
    assert not warned and relative(ybf, y) < 0.02


@pytest.mark.parametrize("coupling, qk_norm", [("multiplicative", None), ("logit", False), ("logit", None)])
def test_float16_autocast_with_large_inputs_has_finite_gradients_or_warns(coupling, qk_norm, one_thread):
    # The sums over keys overflowed float16 (65504); they now run in float32 under float16 autocast.
    layer, x = layer_and_input(2048, coupling=coupling, qk_norm=qk_norm, scale=100.0)
    x.requires_grad_(True)
    y, warned = run(layer, x, autocast=torch.float16)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = [x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]
    finite = bool(torch.isfinite(y).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    assert finite or warned
    if coupling == "logit":
        assert finite and not warned


@pytest.mark.parametrize("causal", [False, True])
def test_kronecker_condition_bounds_the_exact_condition_number(causal):
    B, H, N, m, R2 = 2, 2, 37, 5, 6
    g = torch.Generator().manual_seed(3)
    qf, kf = (torch.rand(B, H, N, m, generator=g, dtype=torch.float64) for _ in range(2))
    a, c = (torch.randn(1, H, N, R2, generator=g, dtype=torch.float64) for _ in range(2))
    kls = torch.randn(B, H, N, generator=g, dtype=torch.float64)
    W = (qf @ kf.transpose(-1, -2)) * (a @ c.transpose(-1, -2)) * torch.exp(kls).unsqueeze(-2)
    if causal:
        W = W.tril()
    exact = W.abs().sum(-1) / W.sum(-1).abs()
    kappa = kronecker_condition(qf, kf, a, c, causal=causal, key_log_scale=kls, chunk_size=8)
    assert (kappa >= exact * (1 - 1e-12)).all()
    # The bound is |a_i| |c_j| in place of |a_i . c_j|: exact for a positive rank-one mask.
    ones = torch.ones(1, H, N, 1, dtype=torch.float64)
    assert_close(kronecker_condition(qf, kf, ones, ones, causal=causal, key_log_scale=kls), torch.ones(B, H, N, dtype=torch.float64))


def test_check_condition_false_silences_the_warning(one_thread):
    layer, x = layer_and_input(2048, check_condition=False)
    with torch.no_grad():
        _, warned = run(layer, x, autocast=torch.bfloat16)
    assert not warned


def test_kronecker_condition_of_rows_without_keys_is_one():
    qf = torch.rand(1, 1, 4, 3, dtype=torch.float64)
    kf = torch.zeros(1, 1, 4, 3, dtype=torch.float64)  # every key padded (zero features)
    a = c = torch.randn(1, 1, 4, 2, dtype=torch.float64)
    assert_close(kronecker_condition(qf, kf, a, c), torch.ones(1, 1, 4, dtype=torch.float64))


def test_the_warning_comes_once_per_layer_and_precision(one_thread):
    # A training run calls forward every step: it is told once, and the check then stops.
    layer, x = layer_and_input(2048)
    fresh = copy.deepcopy(layer)
    with torch.no_grad():
        _, first = run(layer, x, autocast=torch.bfloat16)
        _, second = run(layer, x, autocast=torch.bfloat16)
    assert first and not second
    with torch.no_grad():
        _, again = run(fresh, x, autocast=torch.bfloat16)
    assert again


def test_training_mode_checks_the_first_call_only(one_thread, monkeypatch):
    # A training step pays for no host synchronisation after the first; eval mode checks again.
    import flt.layers.flt as flt_module

    calls = []
    real = flt_module.kronecker_condition
    monkeypatch.setattr(flt_module, "kronecker_condition", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer, x = layer_and_input(1024)
    layer.train()
    with torch.no_grad():
        run(layer, x)
        run(layer, x)
    assert len(calls) == 1
    layer.eval()
    with torch.no_grad():
        run(layer, x)
    assert len(calls) == 2
