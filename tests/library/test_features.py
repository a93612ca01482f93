import math

import pytest
import torch

from flt.layers import FeatureMap
from flt.ops import elu_features, favor_plus_features, gaussian_orthogonal_random_matrix, relu_features

F64 = torch.float64


def kernel_estimates(x, y, m, draws, orthogonal):
    gen = torch.Generator().manual_seed(123)
    est = []
    for _ in range(draws):
        w = gaussian_orthogonal_random_matrix(m, x.shape[-1], orthogonal=orthogonal, generator=gen, dtype=F64)
        fx, sx = favor_plus_features(x, w)
        fy, sy = favor_plus_features(y, w)
        est.append((fx * fy).sum(-1) * torch.exp(sx + sy))
    return torch.stack(est)


@pytest.mark.parametrize("orthogonal", [False, True])
def test_favor_plus_is_unbiased(orthogonal):
    x = torch.randn(6, 8, dtype=F64) * 0.4
    y = torch.randn(6, 8, dtype=F64) * 0.4
    est = kernel_estimates(x, y, m=16, draws=3000, orthogonal=orthogonal)
    truth = torch.exp((x * y).sum(-1))
    stderr = est.std(0) / math.sqrt(est.shape[0])
    # A 5-sigma band: a biased estimator (e.g. a wrong |x|^2/2 term) lands far outside it.
    assert ((est.mean(0) - truth).abs() < 5 * stderr + 1e-12).all()
    assert (stderr < 0.05 * truth).all()


def test_orthogonal_rows_and_chi_norms():
    w = gaussian_orthogonal_random_matrix(20, 8, generator=torch.Generator().manual_seed(0), dtype=F64)
    block = w[:8] / w[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(8, dtype=F64), atol=1e-12, rtol=0)
    big = gaussian_orthogonal_random_matrix(4000, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    assert abs((big.norm(dim=1) ** 2).mean().item() - 8.0) < 0.3  # E|w|^2 = D for N(0, I) rows


def test_orthogonal_features_have_lower_variance():
    x = torch.randn(4, 16, dtype=F64) * 0.3
    y = torch.randn(4, 16, dtype=F64) * 0.3
    var_iid = kernel_estimates(x, y, 16, 600, orthogonal=False).var(0).mean()
    var_ort = kernel_estimates(x, y, 16, 600, orthogonal=True).var(0).mean()
    assert var_ort < var_iid


def test_favor_plus_error_explodes_with_query_key_norm():
    """The failure mode that makes qk-normalisation the default of FAVOR+-based layers."""
    D, m = 64, 4096
    gen = torch.Generator().manual_seed(0)
    w = gaussian_orthogonal_random_matrix(m, D, generator=gen, dtype=F64)
    q, k = torch.randn(2, 64, D, dtype=F64)

    def rel_err(xq, xk):
        fq, _ = favor_plus_features(xq, w)
        fk, sk = favor_plus_features(xk, w)
        kf = fk * torch.exp(sk - sk.max()).unsqueeze(-1)
        est = fq @ kf.T
        est = est / est.sum(-1, keepdim=True)
        exact = torch.softmax(xq @ xk.T, dim=-1)
        return ((est - exact).norm() / exact.norm()).item()

    raw = rel_err(q / D**0.25, k / D**0.25)  # unit-variance q, k: |x|^2 = sqrt(D) = 8
    normed = rel_err(torch.nn.functional.normalize(q, dim=-1) * 2**0.5, torch.nn.functional.normalize(k, dim=-1) * 2**0.5)
    assert raw > 0.5
    assert normed < 0.2
    assert raw > 5 * normed


def test_deterministic_maps_are_nonnegative_and_shaped():
    x = torch.randn(2, 3, 5, 4)
    w = torch.randn(7, 4)
    assert relu_features(x, w).shape == (2, 3, 5, 7) and (relu_features(x, w) >= 0).all()
    assert (elu_features(x) > 0).all() and elu_features(x).shape == x.shape


def test_feature_map_projection_is_fixed_until_redrawn():
    """No forward call redraws the projection; only ``redraw_random_features`` (the
    protocol of flt.layers.draws) does, and it is saved with the module."""
    fm = FeatureMap(4, 8, seed=0)
    before = fm.projection.clone()
    fm.train()
    for _ in range(3):
        fm(torch.randn(2, 4))
    assert torch.equal(fm.projection, before)
    fm.redraw_random_features(torch.Generator().manual_seed(1))
    assert not torch.equal(fm.projection, before) and fm.projection.shape == before.shape
    assert "projection" in fm.state_dict() and "calls" not in fm.state_dict()


def test_feature_map_projection_stays_float32_in_half_modules():
    fm = FeatureMap(4, 8).to(torch.bfloat16)
    assert fm.projection.dtype == torch.float32
    feat, shift = fm(torch.randn(1, 1, 3, 4, dtype=torch.bfloat16))
    assert feat.dtype == torch.float32 and torch.isfinite(feat).all()


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda: favor_plus_features(torch.randn(2, 3), torch.randn(4, 5)), ValueError, "projection has D = 5"),
        (lambda: favor_plus_features(torch.ones(2, 3, dtype=torch.long), torch.randn(4, 3)), TypeError, "x must have a floating-point"),
        (lambda: gaussian_orthogonal_random_matrix(0, 3), ValueError, "num_features"),
        (lambda: FeatureMap(4, 8, kind="cosine"), ValueError, "feature_map must be one of"),
    ],
)
def test_bad_input_is_rejected(call, err, match):
    with pytest.raises(err, match=match):
        call()


@pytest.mark.parametrize("requires_grad", [False, True])
def test_favor_plus_fused_features_equal_the_plain_formula_with_gradients(requires_grad):
    """The in-place fused computation equals ``m^(-1/2) exp(W x - |x|^2 / 2 - s)`` with the
    shift ``s`` a constant, in value and in the gradient of ``x`` (float64)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 5, dtype=torch.float64, requires_grad=requires_grad)
    w = torch.randn(11, 5, dtype=torch.float64)
    feat, shift = favor_plus_features(x, w)
    logits = x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True)
    expected_shift = logits.amax(-1).detach()
    expected = torch.exp(logits - expected_shift.unsqueeze(-1)) / 11**0.5
    torch.testing.assert_close(shift, expected_shift, rtol=0, atol=1e-13)
    torch.testing.assert_close(feat, expected, rtol=1e-13, atol=1e-15)
    assert not shift.requires_grad
    if requires_grad:
        g = torch.randn_like(feat)
        (got,) = torch.autograd.grad(feat, x, g)
        (want,) = torch.autograd.grad(expected, x, g)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("batch, extra_batch", [(1, 1), (3, 1), (3, 3)])
def test_split_features_equal_the_features_of_the_concatenation(batch, extra_batch):
    from flt.ops.features import favor_plus_features_split

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(batch, 2, 9, 4, generator=gen, dtype=F64).requires_grad_()
    extra = torch.randn(extra_batch, 2, 9, 6, generator=gen, dtype=F64).requires_grad_()
    w = gaussian_orthogonal_random_matrix(12, 10, generator=gen, dtype=F64).requires_grad_()
    ref, ref_shift = favor_plus_features(torch.cat([x, extra.expand(batch, 2, 9, 6)], dim=-1), w)
    up = torch.randn(ref.shape, generator=gen, dtype=F64)
    ref_grads = torch.autograd.grad((ref * up).sum(), [x, extra, w])
    feat, shift = favor_plus_features_split(x, extra, w)
    grads = torch.autograd.grad((feat * up).sum(), [x, extra, w])
    assert feat.shape == ref.shape and feat.dtype == F64
    torch.testing.assert_close(feat, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(shift, ref_shift, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "x, extra, w, match",
    [
        ((1, 2, 5, 4), (1, 3, 5, 2), (8, 6), "extra must be"),
        ((2, 2, 5, 4), (1, 2, 5, 2), (8, 7), "projection has 7 columns"),
        ((2, 5, 4), (1, 2, 5, 2), (8, 6), "x must"),
    ],
)
def test_split_features_reject_mismatched_shapes_by_name(x, extra, w, match):
    from flt.ops.features import favor_plus_features_split

    with pytest.raises(ValueError, match=match):
        favor_plus_features_split(torch.randn(x), torch.randn(extra), torch.randn(w))


@pytest.mark.parametrize("split", [False, True])
def test_features_under_bf16_autocast_exponentiate_in_float32(split):
    from flt.ops.features import favor_plus_features_split

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, 64, 8, generator=gen) * 0.5
    extra = torch.randn(1, 2, 64, 4, generator=gen) * 0.5
    w = gaussian_orthogonal_random_matrix(32, 12, generator=gen)
    ref, _ = favor_plus_features(torch.cat([x, extra.expand(2, 2, 64, 4)], -1).double(), w.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feat, shift = favor_plus_features_split(x, extra, w) if split else favor_plus_features(torch.cat([x, extra.expand(2, 2, 64, 4)], -1), w)
    assert feat.dtype == torch.float32 and shift.dtype == torch.float32
    # The product is rounded to bfloat16 (8 bits), the exponential is not: a relative error
    # of a few 2^-8 on features of order one, not the 2^-8 * |exponent| of a bf16 exp.
    rel = ((feat.double() - ref).abs() / ref).max().item()
    assert 1e-5 < rel < 0.05


def test_feature_map_forward_split_equals_forward_of_the_concatenation():
    fmap = FeatureMap(10, 12, seed=3, dtype=F64)
    x, extra = torch.randn(2, 2, 5, 4, dtype=F64), torch.randn(1, 2, 5, 6, dtype=F64)
    feat, shift = fmap.forward_split(x, extra)
    ref, ref_shift = fmap(torch.cat([x, extra.expand(2, 2, 5, 6)], dim=-1))
    torch.testing.assert_close(feat, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(shift, ref_shift, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="forward_split needs feature_map='favor\\+'"):
        FeatureMap(10, 12, kind="relu").forward_split(x.float(), extra.float())


def test_relu_kernel_is_the_mean_of_relu_features():
    from flt.ops import relu_kernel

    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    exact = relu_kernel(x, y)
    # On the diagonal of relu_kernel(x, x): E[relu(w.x)^2] = |x|^2 / 2 exactly.
    assert torch.allclose(torch.diagonal(relu_kernel(x, x)), 0.5 * (x * x).sum(-1), rtol=1e-6)
    w = torch.randn(400_000, 4, generator=gen, dtype=torch.float64)
    mc = relu_features(x, w) @ relu_features(y, w).T
    assert torch.allclose(mc, exact, rtol=0.02, atol=0.01), (mc - exact).abs().max()
    assert (exact >= 0).all()
    # Opposite vectors share no half-space: the kernel vanishes.
    assert relu_kernel(x[:1], -x[:1]).abs().item() < 1e-5


def test_taylor_features_give_the_second_order_expansion_of_exp():
    from flt.layers.features import FeatureMap
    from flt.ops import taylor_features, taylor_kernel

    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(2, 3, 6, 5, generator=gen, dtype=torch.float64)
    fx, fy = taylor_features(x), taylor_features(y)
    assert fx.shape == (3, 6, 1 + 5 + 15)
    u = x @ y.transpose(-1, -2)
    assert torch.allclose(fx @ fy.transpose(-1, -2), 1 + u + u * u / 2, atol=1e-12)
    assert torch.allclose(taylor_kernel(x, y), 1 + u + u * u / 2, atol=1e-12)
    assert (taylor_kernel(x, y) >= 0.5 - 1e-12).all()  # ((u + 1)^2 + 1) / 2
    fm = FeatureMap(5, kind="taylor")
    assert fm.num_features == 21 and not fm.has_random_features
    assert torch.equal(fm(x)[0], fx) and fm(x)[1] is None


def test_hedgehog_features_are_two_softmax_halves_of_a_learned_map():
    from flt.layers.features import FeatureMap
    from flt.ops import hedgehog_features

    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 3, 6, 4, generator=gen, dtype=torch.float64)
    w = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    fx = hedgehog_features(x, w)
    assert fx.shape == (3, 6, 14) and (fx > 0).all()
    assert torch.allclose(fx[..., :7].sum(-1), torch.ones(3, 6, dtype=torch.float64))
    assert torch.allclose(fx[..., 7:], torch.softmax(-(x @ w.T), dim=-1))
    # Sharpness grows with the scale of W: the kernel tends to "same arg max in each half".
    big = hedgehog_features(x, 1e3 * w) @ hedgehog_features(y, 1e3 * w).transpose(-1, -2)
    pw, nw = x @ w.T, y @ w.T
    same = (pw.argmax(-1)[..., :, None] == nw.argmax(-1)[..., None, :]).double()
    same = same + (pw.argmin(-1)[..., :, None] == nw.argmin(-1)[..., None, :]).double()
    assert torch.allclose(big, same, atol=1e-6)
    fm = FeatureMap(4, 8, kind="hedgehog", dtype=torch.float64)
    assert fm.num_features == 8 and not fm.has_random_features
    assert torch.equal(fm.weight.detach(), torch.eye(4, dtype=torch.float64))  # m = 2D: the identity
    assert isinstance(fm.weight, torch.nn.Parameter) and fm(x)[1] is None
    assert torch.allclose(fm.exact_kernel(x, y), fm(x)[0] @ fm(y)[0].transpose(-1, -2))
    wide = FeatureMap(4, 12, kind="hedgehog", seed=0)
    assert wide.weight.shape == (6, 4) and torch.allclose(wide.weight.norm(dim=-1), torch.ones(6))
    with pytest.raises(ValueError, match="num_features must be even"):
        FeatureMap(4, 7, kind="hedgehog")
    with pytest.raises(ValueError, match="weight must be"):
        hedgehog_features(x, torch.randn(3, 5, dtype=torch.float64))


@pytest.mark.parametrize("dim", [3, 5, 8, 16])
def test_orthogonal_draw_is_the_block_by_block_draw(dim):
    # The projection is drawn as one batch of blocks: for every D a seed must still give the
    # matrix that drawing and factoring its blocks one after the other gives, bit for bit.
    gen = torch.Generator().manual_seed(7)
    blocks = []
    for _ in range(3):
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=F64))
        blocks.append((q * torch.sign(torch.diagonal(r))).T)
    expected = torch.cat(blocks)[: 3 * dim - 1] * torch.randn(3 * dim - 1, dim, generator=gen, dtype=F64).norm(dim=1, keepdim=True)
    got = gaussian_orthogonal_random_matrix(3 * dim - 1, dim, generator=torch.Generator().manual_seed(7), dtype=F64)
    assert torch.equal(got, expected)
