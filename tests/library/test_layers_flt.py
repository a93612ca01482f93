import math

import pytest
import torch

from conftest import assert_close
from flt import SPECTRA, FLTAttention
from flt.ops import favor_plus_features, linear_attention, rpe_attention_reference

F64 = torch.float64
COUPLINGS = ["logit", "multiplicative"]


def layer(coupling="logit", *, dim=16, heads=2, m=32, R=8, causal=False, pos_dim=1, **kw):
    return FLTAttention.from_options(dim, heads, coupling=coupling, num_features=m, num_frequencies=R, causal=causal, pos_dim=pos_dim, **kw).double()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def exact_with_estimated_mask(lay, x):
    """The O(N^2) attention with the exact kernel but the layer's random-feature mask a.c."""
    p = lay.prepare(x, None, None)
    xq, xk = lay.core.scaled_qk(p.q, p.k, p.pos)
    a, c = lay.spectrum.features(p.pos)
    f_hat = a @ c.transpose(-1, -2)
    if lay.coupling == "logit":
        return lay.finish(rpe_attention_reference(xq, xk, p.v, bias=f_hat, scale=1.0), x)
    return lay.finish(rpe_attention_reference(xq, xk, p.v, mask=f_hat, scale=1.0), x)


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_kernel_error_falls_at_the_monte_carlo_rate(coupling):
    """With the mask fixed, the FAVOR+ error falls like m^(-1/2) (moderate |q|^2 so the
    asymptotic regime starts early: FAVOR+'s variance grows like exp(|x + y|^2))."""
    ms, errs = [64, 512, 4096], []
    for m in ms:
        torch.manual_seed(0)
        lay = layer(coupling, m=m, R=16, amplitude=0.3, length_scale=3.0, temperature=0.5)
        x = torch.randn(2, 21, 16, dtype=F64)
        errs.append(rel(lay(x), exact_with_estimated_mask(lay, x)))
    slope = (math.log(errs[-1]) - math.log(errs[0])) / (math.log(ms[-1]) - math.log(ms[0]))
    assert -0.75 < slope < -0.35, (errs, slope)


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_converges_to_exact_as_m_and_r_grow(coupling):
    errs = []
    for m, R in [(32, 4), (256, 32), (2048, 256)]:
        torch.manual_seed(0)
        lay = layer(coupling, dim=8, heads=1, m=m, R=R, amplitude=0.5, length_scale=3.0, temperature=0.5)
        x = torch.randn(1, 21, 8, dtype=F64)
        errs.append(rel(lay(x), lay.exact(x)))
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[2] < 0.05, errs


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_shifted_spectra_converge_to_their_exact_attention(coupling):
    """With learned shifts the mask is not even; the estimate (query-side phases) still
    converges to the exact attention with the shifted mask, and the shift matters."""
    errs, gaps = [], []
    for m, R in [(32, 4), (256, 32), (2048, 256)]:
        torch.manual_seed(0)
        lay = layer(coupling, dim=8, heads=1, m=m, R=R, amplitude=0.8, length_scale=3.0, temperature=0.5,
                    components=2, shift=True, shift_scale=3.0)
        with torch.no_grad():
            lay.spectrum.shift.copy_(torch.tensor([[[2.0], [-1.5]]], dtype=F64))
        x = torch.randn(1, 21, 8, dtype=F64)
        exact = lay.exact(x)
        errs.append(rel(lay(x), exact))
        with torch.no_grad():
            lay.spectrum.shift.zero_()
            gaps.append(rel(lay.exact(x), exact))
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[2] < 0.05, errs
    assert gaps[-1] > 3 * errs[-1], (gaps, errs)  # the shifted exact attention is another attention


def test_fresh_logit_layer_is_a_performer():
    torch.manual_seed(0)
    lay = layer("logit", m=4096, R=8)
    x = torch.randn(2, 11, 16, dtype=F64)
    a, c = lay.spectrum.features(torch.arange(11, dtype=F64).view(1, 11, 1))
    assert torch.equal(a, torch.zeros_like(a))  # so a_i.c_j = f^ = 0 exactly
    assert c.norm(dim=-1).max() < 0.011  # only the weight floor (base.py) remains on the key side
    p = lay.prepare(x, None, None)
    xq, xk = lay.core.scaled_qk(p.q, p.k, p.pos)
    # The exact target is plain softmax attention ...
    exact_plain = lay.finish(rpe_attention_reference(xq, xk, p.v, scale=1.0), x)
    assert_close(lay.exact(x), exact_plain)
    # ... and the estimate is FAVOR+ with the first D columns of the projection, up to the
    # factor exp(W_u c - |c|^2/2) = 1 + O(|c|) that the key-side weight floor contributes.
    proj = lay.feature_map.projection[:, : lay.head_dim]
    qf, _ = favor_plus_features(xq, proj)
    kf, kls = favor_plus_features(xk, proj)
    performer = lay.finish(linear_attention(qf, kf, p.v, key_log_scale=kls), x)
    assert rel(lay(x), performer) < 0.02


def test_fresh_multiplicative_layer_starts_near_plain_attention():
    lay = layer("multiplicative", R=16, length_scale=1e4)
    delta = torch.arange(-20, 21, dtype=F64).view(-1, 1)
    f = lay.spectrum.mask(delta)
    assert ((f - 1).abs() < 1e-3).all()


@pytest.mark.parametrize("pos_dim", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_translating_positions_changes_nothing(pos_dim, causal):
    """Exact for the multiplicative coupling and for exact(); see the next test for logit."""
    for coupling in COUPLINGS:
        lay = layer(coupling, pos_dim=pos_dim, causal=causal, amplitude=0.8, mean_scale=0.1)
        x = torch.randn(2, 13, 16, dtype=F64)
        pos = torch.randn(2, 13, pos_dim, dtype=F64) * 3
        shift = torch.randn(1, 1, pos_dim, dtype=F64) * 50
        assert_close(lay.exact(x, pos + shift), lay.exact(x, pos), scale=100)
        if coupling == "multiplicative":
            assert_close(lay(x, pos + shift), lay(x, pos), scale=100)


def test_logit_coupling_is_translation_invariant_in_distribution():
    """A translation rotates each (cos, sin) pair of a and c alike: q~.k~ is unchanged, but a
    fixed FAVOR+ projection sees rotated inputs, so one draw is invariant only up to its
    Monte Carlo error, which vanishes as m grows."""
    diffs = []
    for m in (64, 4096):
        torch.manual_seed(0)
        lay = layer("logit", m=m, R=8, amplitude=0.5, temperature=0.5)
        x = torch.randn(2, 13, 16, dtype=F64)
        pos = torch.randn(2, 13, 1, dtype=F64) * 3
        diffs.append(rel(lay(x, pos + 17.0), lay(x, pos)))
    assert diffs[1] < diffs[0] / 3, diffs


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_chunked_causal_equals_token_by_token_decoding(coupling):
    lay = layer(coupling, causal=True, chunk_size=4, amplitude=0.7)
    x = torch.randn(3, 15, 16, dtype=F64)
    full = lay(x)
    state, outs = None, []
    for t in range(15):
        y, state = lay.step(x[:, t], state)
        outs.append(y)
    assert_close(torch.stack(outs, dim=1), full)
    assert state.position == 15


def test_decoding_state_has_constant_size():
    lay = layer("multiplicative", causal=True)
    x = torch.randn(1, 40, 16, dtype=F64)
    state, sizes = None, set()
    for t in range(40):
        _, state = lay.step(x[:, t], state)
        sizes.add(sum(t.numel() for t in (state.inner.kv, state.inner.z, state.inner.level)))
    assert len(sizes) == 1


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_causal_past_outputs_do_not_change_when_the_future_does(coupling):
    lay = FLTAttention.from_options(16, 2, coupling=coupling, num_features=32, num_frequencies=8, causal=True, chunk_size=8, qk_norm=False)
    x = torch.randn(1, 30, 16)
    x2 = x.clone()
    x2[:, 20:] = torch.randn(1, 10, 16) * 30  # large future tokens
    y1, y2 = lay(x), lay(x2)
    torch.testing.assert_close(y1[:, :20], y2[:, :20], rtol=1e-5, atol=1e-6)


def test_sqrt_weight_split_keeps_spectral_norms_independent_of_R():
    norms = []
    for R in (8, 64, 512):
        torch.manual_seed(0)
        lay = layer("logit", R=R, amplitude=1.0)
        a, c = lay.spectrum.features(torch.arange(5, dtype=F64).view(1, 5, 1))
        norms.append(c.norm(dim=-1).max().item())
        torch.testing.assert_close(a.norm(dim=-1), c.norm(dim=-1), rtol=1e-3, atol=0)
    assert max(norms) / min(norms) < 1.01  # |c|^2 = sum |w_k| = f(0) here, whatever R


def test_key_padding_mask_hides_padded_tokens():
    for coupling in COUPLINGS:
        lay = layer(coupling, amplitude=0.5)
        x = torch.randn(2, 9, 16, dtype=F64)
        pad = torch.zeros(2, 9, dtype=torch.bool)
        pad[0, 6:] = True
        x2 = x.clone()
        x2[0, 6:] = torch.randn(3, 16, dtype=F64) * 10
        assert_close(lay(x, key_padding_mask=pad)[0, :6], lay(x2, key_padding_mask=pad)[0, :6])
        assert_close(lay.exact(x, key_padding_mask=pad)[0, :6], lay.exact(x2, key_padding_mask=pad)[0, :6])
        # Same as running the unpadded prefix alone.
        assert_close(lay.exact(x, key_padding_mask=pad)[0, :6], lay.exact(x[:1, :6])[0])


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_gradcheck_layer(coupling):
    lay = layer(coupling, dim=4, heads=1, m=3, R=2, amplitude=0.5, components=2)
    x = torch.randn(1, 5, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: lay(t), [x])
    pos = torch.randn(1, 5, 1, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p: lay(x.detach(), p), [pos])


@pytest.mark.parametrize("name", sorted(SPECTRA))
@pytest.mark.parametrize("coupling", COUPLINGS)
def test_every_spectrum_trains_through_the_layer(name, coupling):
    options = {"components": 2} if name == "gaussian_mixture" else {}
    lay = FLTAttention.from_options(16, 2, pos_dim=2, spectrum=name, coupling=coupling, num_features=16, num_frequencies=8, amplitude=0.5, **options)
    x = torch.randn(2, 7, 16)
    pos = torch.randn(2, 7, 2)
    lay(x, pos).square().mean().backward()
    grads = [p.grad for p in lay.spectrum.parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("coupling", COUPLINGS)
def test_half_precision_runs_with_float32_exponentials(dtype, coupling):
    torch.manual_seed(0)
    lay = FLTAttention.from_options(16, 2, coupling=coupling, num_features=32, num_frequencies=8, amplitude=0.5)
    x = torch.randn(2, 12, 16)
    ref = lay(x)
    half = lay.to(dtype)
    out = half(x.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel(out.float(), ref) < 0.05


def test_float32_matches_float64_layer():
    torch.manual_seed(0)
    lay = layer("multiplicative", amplitude=0.5)
    x = torch.randn(2, 17, 16, dtype=F64)
    out64 = lay(x)
    out32 = lay.float()(x.float())
    assert_close(out32, out64, dtype=torch.float32, scale=10)


@pytest.mark.parametrize(
    "build, call, err, match",
    [
        (dict(spectrum="nope"), None, ValueError, "spectrum must be one of"),
        (dict(coupling="additive"), None, ValueError, "coupling must be one of"),
        (dict(feature_map="elu"), None, ValueError, "coupling='logit' needs feature_map='favor\\+'"),
        (dict(dim=10, heads=3), None, ValueError, "divisible by heads"),
        ({}, lambda l: l(torch.randn(2, 5)), ValueError, "x must have rank 3"),
        ({}, lambda l: l(torch.randn(2, 5, 8)), ValueError, "x has feature size = 8"),
        ({}, lambda l: l(torch.ones(2, 5, 16, dtype=torch.long)), TypeError, "x must have a floating-point"),
        ({}, lambda l: l(torch.randn(2, 5, 16), torch.randn(2, 4, 1)), ValueError, "pos has 4 positions"),
        ({}, lambda l: l(torch.randn(2, 5, 16), torch.randn(2, 5, 2)), ValueError, "P = 2, expected P = 1"),
        ({}, lambda l: l(torch.randn(2, 5, 16), torch.full((2, 5, 1), float("nan"))), ValueError, "pos contains"),
        ({}, lambda l: l(torch.randn(2, 5, 16), torch.ones(2, 5, 1, dtype=torch.long)), TypeError, "pos must have a floating-point"),
        ({}, lambda l: l(torch.randn(2, 5, 16), key_padding_mask=torch.ones(2, 5)), TypeError, "key_padding_mask must be a bool"),
        ({}, lambda l: l(torch.randn(2, 5, 16), key_padding_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, "key_padding_mask must have shape"),
        (dict(pos_dim=2), lambda l: l(torch.randn(2, 5, 16)), ValueError, "pos is required"),
        ({}, lambda l: l.step(torch.randn(2, 16)), ValueError, "causal=True"),
    ],
)
def test_bad_input_is_rejected(build, call, err, match):
    kwargs = dict(dim=16, heads=2, num_features=8, num_frequencies=4)
    kwargs.update(build)
    dim, heads = kwargs.pop("dim"), kwargs.pop("heads")
    with pytest.raises(err, match=match):
        lay = FLTAttention.from_options(dim, heads, **kwargs)
        call(lay)


@pytest.mark.parametrize("causal", [False, True])
def test_exact_uses_the_kernel_of_deterministic_and_relu_feature_maps(causal):
    """exact() is the attention the features estimate: elu's own kernel (equal to forward for
    Performer, and for FLT up to the mask's estimate, exact for a constant mask), the
    arc-cosine kernel for relu (close at many features)."""
    from flt.layers.performer import PerformerAttention

    torch.manual_seed(0)
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, -3:] = True
    pos = torch.arange(12, dtype=torch.float64).view(12, 1)
    perf = PerformerAttention.from_options(16, 2, causal=causal, feature_map="elu", dtype=torch.float64)
    kp = None if causal else pad
    assert torch.allclose(perf(x, key_padding_mask=kp), perf.exact(x, key_padding_mask=kp), atol=1e-12)
    for fm in ("elu", "taylor", "hedgehog"):
        flat = FLTAttention.from_options(16, 2, causal=causal, coupling="multiplicative", feature_map=fm, spectrum="gaussian",
                            length_scale=1e7, amplitude=1.5, dtype=torch.float64)  # f = 1.5 at every offset
        assert torch.allclose(flat(x, pos, kp), flat.exact(x, pos, kp), atol=1e-9), fm
    # hedgehog's W is learned: the linear path and the O(N^2) reference agree on its gradient too.
    xg = x.clone().requires_grad_(True)
    flat(xg, pos, kp).square().sum().backward()
    g_fast = (xg.grad.clone(), flat.feature_map.weight.grad.clone())
    xg.grad, flat.feature_map.weight.grad = None, None
    flat.exact(xg, pos, kp).square().sum().backward()
    assert torch.allclose(g_fast[0], xg.grad, atol=1e-9) and torch.allclose(g_fast[1], flat.feature_map.weight.grad, atol=1e-9)
    assert g_fast[1].abs().sum() > 0
    for fm in ("taylor", "hedgehog"):
        det = PerformerAttention.from_options(16, 2, causal=causal, feature_map=fm, num_features=16, dtype=torch.float64)
        assert torch.allclose(det(x, key_padding_mask=kp), det.exact(x, key_padding_mask=kp), atol=1e-12), fm
    relu = PerformerAttention.from_options(16, 2, causal=causal, feature_map="relu", num_features=8192, dtype=torch.float64)
    out, ref = relu(x), relu.exact(x)
    assert ((out - ref).norm() / ref.norm()).item() < 0.05
    with pytest.raises(ValueError, match="the band .* needs feature_map='favor\\+'"):
        FLTAttention.from_options(16, 2, coupling="multiplicative", feature_map="elu", near_field=4)
    FLTAttention.from_options(16, 2, coupling="multiplicative", feature_map="elu", near_neighbors=4)  # any map: the features' kernel
