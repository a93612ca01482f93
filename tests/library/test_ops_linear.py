import itertools

import pytest
import torch

from conftest import assert_close
from flt.ops import (
    favor_plus_features,
    flt_attention,
    flt_attention_reference,
    gaussian_orthogonal_random_matrix,
    linear_attention,
    linear_attention_reference,
    recurrent_step,
)

F64 = torch.float64


def inputs(B=2, H=3, N=29, m=6, Dv=5, R2=8, signed=False):
    qf = torch.rand(B, H, N, m, dtype=F64) + 0.05
    kf = torch.rand(B, H, N, m, dtype=F64) + 0.05
    v = torch.randn(B, H, N, Dv, dtype=F64)
    a = torch.rand(1, H, N, R2, dtype=F64)
    c = torch.rand(1, H, N, R2, dtype=F64)
    if signed:
        a, c = a - 0.3, c - 0.3
    kls = torch.randn(B, H, N, dtype=F64) * 4
    return qf, kf, v, a, c, kls


def quadratic_flt(qf, kf, v, a, c, causal, kls=None):
    """((a c^T) * (qf kf^T)) v / row sums, written out directly."""
    w = (a @ c.transpose(-1, -2)) * (qf @ kf.transpose(-1, -2))
    if kls is not None:
        w = w * torch.exp(kls).unsqueeze(-2)
    if causal:
        w = w.tril()
    return (w @ v) / w.sum(-1, keepdim=True)


def naive_prefix_sum(qf, kf, v, a, c):
    """Causal Kronecker attention by explicit per-token prefix sums (small sizes only)."""
    psi = torch.einsum("bhnk,bhns->bhnks", c.expand(qf.shape[0], -1, -1, -1), kf).flatten(-2)
    phi = torch.einsum("bhnk,bhns->bhnks", a.expand(qf.shape[0], -1, -1, -1), qf).flatten(-2)
    s = torch.cumsum(psi.unsqueeze(-1) * v.unsqueeze(-2), dim=2)
    z = torch.cumsum(psi, dim=2)
    return (phi.unsqueeze(-1) * s).sum(-2) / (phi * z).sum(-1, keepdim=True)


def grads(fn, tensors, upstream):
    out = fn(*tensors)
    return out, torch.autograd.grad((out * upstream).sum(), tensors)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 29, 64])  # N = 29: chunked, then one [N, N] block
def test_flt_attention_equals_quadratic_formula_forward_and_backward(causal, chunk_size):
    qf, kf, v, a, c, kls = inputs()
    tensors = [t.requires_grad_() for t in (qf, kf, v, a, c, kls)]
    upstream = torch.randn(2, 3, 29, 5, dtype=F64)
    fast, g_fast = grads(lambda *t: flt_attention(*t[:5], causal=causal, key_log_scale=t[5], chunk_size=chunk_size), tensors, upstream)
    slow, g_slow = grads(lambda *t: quadratic_flt(*t[:5], causal, t[5]), tensors, upstream)
    assert_close(fast, slow)
    for gf, gs in zip(g_fast, g_slow):
        assert_close(gf, gs)


# The key state is written two ways (ops.linear._write): kf^T vaug when the features are
# no wider than the values with their column of ones (m = 6, Dv + 1 = 6), (vaug^T kf)^T
# when they are wider (m = 16, Dv + 1 = 4).
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("m, Dv", [(6, 5), (16, 3)])
def test_linear_attention_equals_reference_forward_and_backward(causal, m, Dv):
    qf, kf, v, _, _, kls = inputs(N=31, m=m, Dv=Dv)
    tensors = [t.requires_grad_() for t in (qf, kf, v, kls)]
    upstream = torch.randn(2, 3, 31, Dv, dtype=F64)
    fast, g_fast = grads(lambda *t: linear_attention(*t[:3], causal=causal, key_log_scale=t[3], chunk_size=8), tensors, upstream)
    slow, g_slow = grads(lambda *t: linear_attention_reference(*t[:3], causal=causal, key_log_scale=t[3]), tensors, upstream)
    assert_close(fast, slow)
    for gf, gs in zip(g_fast, g_slow):
        assert_close(gf, gs)
    ones = torch.ones(1, 3, 31, 1, dtype=F64)
    assert_close(fast, flt_attention(qf, kf, v, ones, ones, causal=causal, key_log_scale=kls))


# Chunks of the causal scan (ops.linear._scan, two levels: blocks of ceil(sqrt(G)) <= 32
# chunks): plain, 256 / 4 = 64 chunks in one group, 8 full blocks of 8; 300 / 4 = 75 chunks
# in 9 blocks of 9, the last padded. Kronecker (2R = 8): 400 chunks in
# groups of 33 (6 blocks of 6, the last padded), a state carried from group to group, and
# a short last group. m = 16 wider than Dv + 1 = 6: the chunks' states are written
# transposed (ops.linear._write).
@pytest.mark.parametrize("N, chunk_size, kronecker, m", [(256, 4, False, 6), (300, 4, False, 6), (300, 4, False, 16), (800, 2, True, 6)])
def test_causal_scan_over_several_blocks_and_groups_equals_quadratic_formula(N, chunk_size, kronecker, m):
    qf, kf, v, a, c, kls = inputs(B=1, H=2, N=N, m=m, R2=8)
    kls = kls + torch.linspace(0, 60, N, dtype=F64)  # the running max climbs across blocks: every rescale is used
    if not kronecker:
        a = c = torch.ones(1, 2, N, 1, dtype=F64)
    tensors = [t.requires_grad_() for t in (qf, kf, v, a, c, kls)]
    upstream = torch.randn(1, 2, N, 5, dtype=F64)
    fast, g_fast = grads(lambda *t: flt_attention(*t[:5], causal=True, key_log_scale=t[5], chunk_size=chunk_size), tensors, upstream)
    slow, g_slow = grads(lambda *t: quadratic_flt(*t[:5], True, t[5]), tensors, upstream)
    assert_close(fast, slow)
    for gf, gs in zip(g_fast, g_slow):
        assert_close(gf, gs)
    if not kronecker:  # the plain path (no a, c), with and without key scales
        assert_close(linear_attention(qf, kf, v, causal=True, key_log_scale=kls, chunk_size=chunk_size), slow)
        plain = linear_attention(qf, kf, v, causal=True, chunk_size=chunk_size)
        assert_close(plain, linear_attention_reference(qf, kf, v, causal=True))


def test_chunked_causal_equals_naive_prefix_sum_and_recurrent_decoding():
    qf, kf, v, a, c, _ = inputs(N=23)
    chunked = flt_attention(qf, kf, v, a, c, causal=True, chunk_size=5)
    assert_close(chunked, naive_prefix_sum(qf, kf, v, a, c))
    state, outs = None, []
    for t in range(23):
        out, state = recurrent_step(qf[:, :, t], kf[:, :, t], v[:, :, t], state, a=a[:, :, t], c=c[:, :, t])
        outs.append(out)
    assert_close(torch.stack(outs, dim=2), chunked)
    assert state.position == 23 and state.kv.shape == (2, 3, 8, 6 * 5)


def test_recurrent_decoding_with_key_log_scale_matches_chunked():
    qf, kf, v, _, _, kls = inputs(N=19)
    state, outs = None, []
    for t in range(19):
        out, state = recurrent_step(qf[:, :, t], kf[:, :, t], v[:, :, t], state, key_log_scale=kls[:, :, t])
        outs.append(out)
    assert_close(torch.stack(outs, dim=2), linear_attention(qf, kf, v, causal=True, key_log_scale=kls, chunk_size=4))


def test_gradcheck_small():
    qf, kf, v, a, c, kls = inputs(B=1, H=1, N=5, m=2, Dv=2, R2=2)
    # chunk_size 2: chunks and the streamed Kronecker state; 8 > N: one block of [N, N] weights.
    for causal, chunk_size in itertools.product((False, True), (2, 8)):
        fn = lambda *t: flt_attention(*t[:5], causal=causal, key_log_scale=t[5], chunk_size=chunk_size)  # noqa: E731
        assert torch.autograd.gradcheck(fn, [t.clone().requires_grad_() for t in (qf, kf, v, a, c, kls)])


def test_huge_key_log_scales_stay_finite_and_exact():
    qf, kf, v, a, c, kls = inputs(N=17)
    kls = kls * 300  # exp(kls) overflows float64 unless the ops rescale
    for causal, chunk_size in itertools.product((False, True), (4, 32)):
        out = flt_attention(qf, kf, v, a, c, causal=causal, key_log_scale=kls, chunk_size=chunk_size)
        assert torch.isfinite(out).all()
        assert_close(out, flt_attention_reference(qf, kf, v, a, c, causal=causal, key_log_scale=kls))


def test_causal_outputs_ignore_future_keys_even_extreme_ones():
    torch.manual_seed(1)
    B, H, N, D, m = 1, 2, 40, 8, 32
    proj = gaussian_orthogonal_random_matrix(m, D, dtype=torch.float32)
    q, k, v = (torch.randn(B, H, N, D) * 0.5 for _ in range(3))
    k2 = k.clone()
    k2[:, :, 25:] *= 40.0  # future keys with enormous norms: a global max would wipe out the past
    cut = 25
    for chunk_size in (16, 64):  # chunks with a carried state; one chunk of N <= 64 tokens
        outs = []
        for keys in (k, k2):
            qf, _ = favor_plus_features(q, proj)
            kf, kls = favor_plus_features(keys, proj)
            outs.append(linear_attention(qf, kf, v, causal=True, key_log_scale=kls, chunk_size=chunk_size))
        torch.testing.assert_close(outs[0][:, :, :cut], outs[1][:, :, :cut], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(outs[0][:, :, cut:], outs[1][:, :, cut:])


def test_signed_mask_zero_row_sum_is_guarded():
    qf, kf, v, a, c, _ = inputs(B=1, H=1, N=6, R2=2)
    c = c.clone()
    c[..., :] = 0.0  # every a_i.c_j = 0: all rows vanish
    out = flt_attention(qf, kf, v, a, c)
    assert torch.equal(out, torch.zeros_like(out))
    qf, kf, v, a, c, _ = inputs(N=13, signed=True)
    assert torch.isfinite(flt_attention(qf, kf, v, a, c, causal=True, chunk_size=4)).all()


@pytest.mark.parametrize(
    "mutate, err, match",
    [
        (lambda t: t.update(qf=t["qf"][0]), ValueError, "q_feat must have rank 4"),
        (lambda t: t.update(kf=t["kf"].long()), TypeError, "k_feat must have a floating-point dtype"),
        (lambda t: t.update(v=t["v"][:, :, :5]), ValueError, "v must be"),
        (lambda t: t.update(c=None), ValueError, "a and c must be given together"),
        (lambda t: t.update(c=t["c"][..., :3]), ValueError, "same number of spectral features"),
        (lambda t: t.update(a=t["a"][:, :, :4]), ValueError, "a must be"),
        (lambda t: t.update(kls=t["kls"][..., :2]), ValueError, "key_log_scale must be"),
    ],
)
def test_bad_input_is_rejected(mutate, err, match):
    qf, kf, v, a, c, kls = inputs()
    t = dict(qf=qf, kf=kf, v=v, a=a, c=c, kls=kls)
    mutate(t)
    with pytest.raises(err, match=match):
        flt_attention(t["qf"], t["kf"], t["v"], t["a"], t["c"], key_log_scale=t["kls"])


def test_bad_chunk_size_is_rejected():
    qf, kf, v, *_ = inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        linear_attention(qf, kf, v, causal=True, chunk_size=0)
