"""The banded estimator (exact near field, FAVOR+ far field) against its O(N^2) formula,
and FLTAttention.from_options(near_field=w) against the attention it claims to be."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close, assert_same_gradients
from flt import FLTAttention
from flt.layers.base import batch_shared
from flt.ops import favor_plus_features, gaussian_orthogonal_random_matrix
from flt.ops.band import band_attention, band_attention_reference

F64 = torch.float64


def inputs(B=2, H=2, N=37, D=4, m=8, Dv=3, w=3, dtype=F64, scale=0.5):
    xq = (torch.randn(B, H, N, D, dtype=dtype) * scale).requires_grad_()
    xk = (torch.randn(B, H, N, D, dtype=dtype) * scale).requires_grad_()
    v = torch.randn(B, H, N, Dv, dtype=dtype).requires_grad_()
    bias = torch.randn(1, H, N, 2 * w + 1, dtype=dtype).requires_grad_()
    return xq, xk, v, bias


def run(fn, xq, xk, v, bias, proj, **kw):
    qf, sq = favor_plus_features(xq, proj)
    kf, sk = favor_plus_features(xk, proj)
    return fn(xq, xk, v, qf, kf, sq, sk, bias, **kw)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N, w, block", [(1, 1, None), (5, 3, None), (37, 3, 8), (37, 8, 8), (130, 5, 16), (130, 1, 64)])
@pytest.mark.parametrize("padded", [False, True])
def test_band_attention_equals_reference_forward_and_backward(causal, N, w, block, padded):
    xq, xk, v, bias = inputs(N=N, w=w)
    proj = gaussian_orthogonal_random_matrix(8, 4, dtype=F64)
    key_mask = (torch.rand(2, N) > 0.3) if padded else None
    kw = dict(width=w, causal=causal, key_mask=key_mask)
    out = run(band_attention, xq, xk, v, bias, proj, block_size=block, **kw)
    ref = run(band_attention_reference, xq, xk, v, bias, proj, **kw)
    assert_close(out, ref)
    up = torch.randn_like(out)
    g_out = torch.autograd.grad((out * up).sum(), (xq, xk, v, bias), retain_graph=True)
    g_ref = torch.autograd.grad((ref * up).sum(), (xq, xk, v, bias))
    for a, b in zip(g_out, g_ref):
        assert_close(a, b)


# The causal far field is the chunked linear scan with keys delayed by w + 1 tokens: chunks
# shorter than the band, equal to it, longer, and one chunk for the whole sequence.
@pytest.mark.parametrize("chunk_size", [2, 6, 16, 500])
@pytest.mark.parametrize("N, w, block", [(130, 5, None), (70, 9, 12)])
def test_causal_far_field_scan_equals_reference_for_any_chunk_size(chunk_size, N, w, block):
    xq, xk, v, bias = inputs(N=N, w=w)
    proj = gaussian_orthogonal_random_matrix(8, 4, dtype=F64)
    key_mask = torch.rand(2, N) > 0.2
    kw = dict(width=w, causal=True, key_mask=key_mask)
    out = run(band_attention, xq, xk, v, bias, proj, block_size=block, chunk_size=chunk_size, **kw)
    ref = run(band_attention_reference, xq, xk, v, bias, proj, **kw)
    assert_same_gradients(out, ref, (xq, xk, v, bias))


def test_reference_is_exact_on_the_band_and_the_favor_estimate_off_it():
    # Width >= N: every pair is near, so the op is exact softmax with the bias.
    N, w = 9, 9
    xq, xk, v, bias = inputs(N=N, w=w)
    proj = gaussian_orthogonal_random_matrix(8, 4, dtype=F64)
    i = torch.arange(N)
    full = bias.gather(-1, (i.view(1, -1) - i.view(-1, 1) + w).expand(1, 2, N, N))
    expected = torch.softmax(xq @ xk.transpose(-1, -2) + full, dim=-1) @ v
    assert_close(run(band_attention, xq, xk, v, bias, proj, width=w), expected)
    # Width 1 with a huge m: off-band weights converge to exp(xq.xk).
    xq, xk, v, bias = inputs(N=N, w=1)
    proj = gaussian_orthogonal_random_matrix(200_000, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    near = (i.view(1, -1) - i.view(-1, 1)).abs() <= 1
    full = torch.where(near, bias.gather(-1, (i.view(1, -1) - i.view(-1, 1)).clamp(-1, 1).add(1).expand(1, 2, N, N)), torch.zeros(()))
    expected = torch.softmax(xq @ xk.transpose(-1, -2) + full, dim=-1) @ v
    got = run(band_attention, xq, xk, v, bias, proj, width=1)
    assert ((got - expected).norm() / expected.norm()).item() < 0.02


def test_causal_band_outputs_ignore_future_keys_even_extreme_ones():
    N, w, t = 70, 4, 40
    xq, xk, v, bias = inputs(N=N, w=w, dtype=torch.float32)
    proj = gaussian_orthogonal_random_matrix(8, 4)
    with torch.no_grad():
        before = run(band_attention, xq, xk, v, bias, proj, width=w, causal=True, block_size=8)
        xk2 = xk.clone()
        xk2[:, :, t + 1:] *= 40.0
        after = run(band_attention, xq, xk2, v, bias, proj, width=w, causal=True, block_size=8)
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after[:, :, : t + 1], before[:, :, : t + 1], rtol=1e-6, atol=1e-6)


def test_band_row_sums_stay_positive_with_a_huge_bias():
    # Exact near weights are positive and far weights are FAVOR+ (nonnegative): no cancellation.
    xq, xk, v, bias = inputs(N=50, w=4, dtype=torch.float32)
    proj = gaussian_orthogonal_random_matrix(8, 4)
    with torch.no_grad():
        out = run(band_attention, xq, xk, torch.ones_like(v), bias * 0 + 60.0, proj, width=4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.ones_like(out))  # values of 1 average to 1: positive row sums


@pytest.mark.parametrize("bad, match", [
    (dict(width=0), "width"),
    (dict(block_size=2, width=3), "block_size"),
    (dict(key_mask=torch.ones(2, 5)), "key_mask"),
])
def test_band_attention_rejects_bad_arguments(bad, match):
    xq, xk, v, bias = inputs(N=5, w=3)
    proj = gaussian_orthogonal_random_matrix(8, 4, dtype=F64)
    kw = dict(width=3)
    kw.update(bad)
    if kw["width"] != 3:
        bias = torch.randn(1, 2, 5, 2 * max(kw["width"], 0) + 1, dtype=F64)
    with pytest.raises((ValueError, TypeError), match=match):
        run(band_attention, xq, xk, v, bias, proj, **kw)


# -- FLTAttention(near_field=w) ----------------------------------------------------------------


def strong_layer(causal=False, near=16, amplitude=3.5, spectrum="local", **kw):
    layer = FLTAttention.from_options(64, 2, spectrum=spectrum, num_features=32, num_frequencies=8, causal=causal, near_field=near, **kw).double()
    with torch.no_grad():
        for module in (layer.spectrum, layer.near_spectrum):
            for name, p in module.named_parameters():
                if name in ("amplitude", "alpha"):
                    p.add_(torch.rand_like(p) * amplitude / p.shape[-1])
    return layer


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spectrum", ["local", "gaussian_mixture"])
def test_near_field_layer_forward_equals_reference_forward_and_backward(causal, spectrum):
    layer = strong_layer(causal, near=5, spectrum=spectrum)
    x = torch.randn(2, 41, 64, dtype=F64, requires_grad=True)
    pad = torch.zeros(2, 41, dtype=torch.bool)
    pad[1, -6:] = True
    out, ref = layer(x, key_padding_mask=pad), layer.reference(x, key_padding_mask=pad)
    g_out = assert_same_gradients(out, ref, [x] + list(layer.parameters()))
    # The near spectrum learns through the band.
    assert any(g is not None and g.abs().sum() > 0 for g in g_out[1:] if g is not None)


@pytest.mark.parametrize("causal", [False, True])
def test_band_bias_of_token_indices_is_computed_once_and_equals_the_per_row_one(causal, monkeypatch):
    """Equally spaced 1-D positions: the band's f is evaluated on its 2w + 1 offsets and
    broadcast over the rows; outputs and every gradient equal the per-row computation."""
    import flt.layers.near as flt_layer
    from flt.layers.base import regular_step

    assert regular_step(torch.arange(6, dtype=F64).view(1, 6, 1) * 0.5 + 3).item() == 0.5
    assert regular_step(torch.tensor([0.0, 1.0, 3.0]).view(1, 3, 1)) is None
    assert regular_step(torch.arange(6, dtype=F64).view(1, 3, 2)) is None  # 2-D positions
    assert regular_step(torch.arange(6, dtype=F64).view(2, 3, 1)) is None  # not batch-shared
    assert regular_step(torch.arange(3, dtype=F64).view(1, 3, 1).requires_grad_()) is None
    layer = strong_layer(causal, near=4, spectrum="local", near_relative="clipped")
    x = torch.randn(2, 23, 64, dtype=F64)
    pos = (torch.arange(23, dtype=F64) + 2.0).view(1, 23, 1).expand(2, 23, 1)
    once = layer.near.bias(layer.core, pos[:1])
    assert once.stride(2) == 0  # a view over the rows, not N copies
    results = []
    for patched in (False, True):
        if patched:
            monkeypatch.setattr(flt_layer, "regular_step", lambda pos: None)
        xg = x.clone().requires_grad_(True)
        out = layer(xg, pos)
        grads = torch.autograd.grad(out.square().sum(), [xg] + list(layer.parameters()), allow_unused=True)
        results.append((out, grads, layer.near.bias(layer.core, pos[:1])))
    (out, grads, _), (out_rows, grads_rows, per_row) = results
    w = 4
    assert torch.allclose(once[:, :, w:-w], per_row[:, :, w:-w], atol=1e-12)  # interior rows (the ends hold junk)
    assert torch.allclose(out, out_rows, atol=1e-12)
    for g, h in zip(grads, grads_rows):
        assert (g is None) == (h is None) and (g is None or torch.allclose(g, h, atol=1e-10))


def test_near_field_layer_converges_to_exact_and_is_exact_when_the_band_covers_everything():
    layer = strong_layer(near=40)
    x = torch.randn(1, 33, 64, dtype=F64)
    with torch.no_grad():
        assert_close(layer(x), layer.exact(x))  # every pair is in the band, so nothing is estimated
    # A strong local mask held by the near spectrum: the error is FAVOR+'s on the far field.
    torch.manual_seed(1)
    strong = strong_layer(near=16, amplitude=0.0)
    from flt.bench.approx import _set_local_amplitude

    _set_local_amplitude(strong.near_spectrum, 3.5)
    x = torch.randn(2, 128, 64, dtype=F64)
    plain = FLTAttention.from_options(64, 2, spectrum="local", num_features=32, num_frequencies=8).double()
    plain.load_state_dict({k: v for k, v in strong.state_dict().items() if not k.startswith("core.near_spectrum")})
    _set_local_amplitude(plain.spectrum, 3.5)
    with torch.no_grad():
        band_err = ((strong(x) - strong.exact(x)).norm() / strong.exact(x).norm()).item()
        concat_err = ((plain(x) - plain.exact(x)).norm() / plain.exact(x).norm()).item()
    assert band_err < 0.15
    assert concat_err > 2 * band_err


@pytest.mark.parametrize("causal", [False, True])
def test_shifted_spectra_in_the_band_keep_the_sign_of_the_offsets(causal):
    """Far and near spectra with shifts (masks that are not even): the band op equals its
    quadratic reference forward and backward, and a band covering every pair equals the
    exact attention, whose offsets are r_i - r_j: the band's signed offsets agree."""
    def shifted(near):
        layer = strong_layer(causal, near=near, windows=2, shift=True, shift_scale=3.0)
        with torch.no_grad():
            for module in (layer.spectrum, layer.near_spectrum):
                module.shift.copy_(torch.tensor([2.0, -1.0], dtype=F64).view(1, 2, 1).expand(2, 2, 1))
        return layer

    layer = shifted(40)
    with torch.no_grad():
        row = layer.near.bias(layer.core, torch.arange(9, dtype=F64).view(1, 9, 1))[0, :, 4]  # offsets +40 .. -40
        assert (row - row.flip(-1)).abs().max() > 0.1  # the mask is not even
        x = torch.randn(2, 33, 64, dtype=F64)
        assert_close(layer(x), layer.exact(x))  # every pair is in the band
        # Positions that are not equally spaced take the per-row band offsets.
        pos = torch.sort(torch.rand(2, 33, 1, dtype=F64) * 40, dim=1).values
        assert_close(layer(x, pos), layer.exact(x, pos))
    short = shifted(5)
    xs = torch.randn(2, 41, 64, dtype=F64, requires_grad=True)
    grads = assert_same_gradients(short(xs), short.reference(xs), [xs] + list(short.parameters()))
    shift_grads = [g for (n, _), g in zip(short.named_parameters(), grads[1:]) if n.endswith("shift")]
    assert len(shift_grads) == 2 and all(g is not None and g.abs().sum() > 0 for g in shift_grads)


def test_near_field_exact_applies_the_near_spectrum_only_inside_the_band():
    layer = strong_layer(near=2)
    with torch.no_grad():
        layer.spectrum.amplitude.zero_()
    x = torch.randn(1, 12, 64, dtype=F64)
    p = layer.prepare(x, None, None)
    xq, xk = layer.core.scaled_qk(p.q, p.k, p.pos)
    i = torch.arange(12, dtype=F64)
    delta = (i.view(-1, 1) - i.view(1, -1)).unsqueeze(-1)
    f = layer.near_spectrum.mask(delta).permute(2, 0, 1) * ((i.view(-1, 1) - i.view(1, -1)).abs() <= 2)
    expected = torch.softmax(xq @ xk.transpose(-1, -2) + f, dim=-1) @ p.v
    assert_close(layer.exact(x), layer.finish(expected, x))


@pytest.mark.parametrize("causal", [False, True])
def test_near_field_with_a_table_term_equals_reference_and_exact_is_direct(causal):
    # f_near may be any offset term of flt.relative: a clipped table, one entry per offset.
    layer = FLTAttention.from_options(64, 2, spectrum="local", num_features=32, num_frequencies=8, causal=causal, near_field=3,
                         near_relative="clipped").double()
    assert type(layer.near_spectrum).__name__ == "ClippedBias" and layer.near_spectrum.max_distance == 3
    with torch.no_grad():
        for p in layer.near_spectrum.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    x = torch.randn(2, 19, 64, dtype=F64, requires_grad=True)
    out, ref = layer(x), layer.reference(x)
    g_out = assert_same_gradients(out, ref, [x] + list(layer.parameters()))
    table = dict(zip([n for n, _ in layer.named_parameters()], g_out[1:]))
    assert any(g is not None and g.abs().sum() > 0 for n, g in table.items() if n.startswith("core.near_spectrum"))
    with torch.no_grad():
        p = layer.prepare(x, None, None)
        xq, xk = layer.core.scaled_qk(p.q, p.k, p.pos)
        i = torch.arange(19, dtype=F64)
        d = i.view(-1, 1) - i.view(1, -1)
        f = layer.spectrum.mask(d.unsqueeze(-1)).permute(2, 0, 1)
        near = layer.near_spectrum.of_offsets(d.unsqueeze(-1)).permute(2, 0, 1) * (d.abs() <= 3)
        logits = xq @ xk.transpose(-1, -2) + f + near
        if causal:
            logits = logits.masked_fill(d < 0, -float("inf"))
        expected = torch.softmax(logits, dim=-1) @ p.v
        assert_close(layer.exact(x), layer.finish(expected, x))


def test_near_field_option_errors():
    with pytest.raises(ValueError, match="near_field"):
        FLTAttention.from_options(64, 2, near_field=-1)
    with pytest.raises(TypeError, match="near_field.*must be an int"):
        FLTAttention.from_options(64, 2, near_field=2.5)
    with pytest.raises(ValueError, match="coupling='logit'"):
        FLTAttention.from_options(64, 2, near_field=4, coupling="multiplicative")
    with pytest.raises(ValueError, match="near_relative .* needs near_field or near_neighbors"):
        FLTAttention.from_options(64, 2, near_relative="clipped")
    with pytest.raises(ValueError, match="near_relative_options need near_relative"):
        FLTAttention.from_options(64, 2, near_field=2, near_relative_options={"max_distance": 2})
    with pytest.raises(ValueError, match="relative term"):
        FLTAttention.from_options(64, 2, near_field=2, near_relative="nope")
    # A spectrum of its own options as the near term starts at f_near = 0 like the default one.
    other = FLTAttention.from_options(64, 2, spectrum="local", near_field=2, near_relative="gaussian", near_relative_options={"length_scale": 3.0})
    assert type(other.near_spectrum).__name__ == "GaussianKernelSpectrum"
    assert float(other.near_spectrum.amplitude.abs().max()) == 0.0 and other.near_spectrum.has_random_features is False
    assert FLTAttention.from_options(64, 2, near_field=4, causal=True).supports_decoding is True  # flt.layers.band_decode
    assert FLTAttention.from_options(64, 2, near_neighbors=4).supports_decoding is False


def test_band_bias_of_batch_shared_positions_is_computed_once_and_equals_the_full_one():
    layer = FLTAttention.from_options(16, 2, near_field=3, spectrum="local", amplitude=1.0).double()
    with torch.no_grad():
        for p in layer.near_spectrum.parameters():
            p.add_(0.3)
    grid = torch.arange(10, dtype=torch.float64).view(1, 10, 1)
    shared = grid.expand(4, 10, 1)
    assert batch_shared(shared).shape[0] == 1
    full = layer.near.bias(layer.core, shared.contiguous())
    assert full.shape[0] == 4
    # Interior rows (the first and last w rows hold junk the band op ignores; token indices
    # take the once-per-offset path, the batch of 4 the per-row one).
    assert torch.equal(layer.near.bias(layer.core, batch_shared(shared)).expand_as(full)[:, :, 3:-3], full[:, :, 3:-3])
    distinct = shared + torch.arange(4, dtype=torch.float64).view(4, 1, 1) * torch.linspace(0, 1, 10, dtype=torch.float64).view(1, 10, 1)
    assert batch_shared(distinct) is distinct
    x = torch.randn(4, 10, 16, dtype=torch.float64)
    # each sample attended alone gives the rows of the batch
    alone = torch.cat([layer(x[i : i + 1], grid) for i in range(4)])
    assert_close(layer(x, shared), alone)
