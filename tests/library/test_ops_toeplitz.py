"""FFT Toeplitz attention (docs/math.md section 6) against its dense O(N^2) formula."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from conftest import assert_close
from flt.ops.reference import rpe_attention_reference
from flt.ops import toeplitz as T
from flt.ops.toeplitz import (
    fft_length,
    toeplitz_attention_reference,
    toeplitz_matrix,
    toeplitz_matvec,
)

F64 = torch.float64
#: The FFT routes, at every size (by default short sequences take the quadratic formula).
toeplitz_attention = functools.partial(T.toeplitz_attention, dense_below=0)


def _inputs(B=2, H=3, N=13, m=5, Dv=4, dtype=F64, bias_std=1.0):
    q_feat = torch.rand(B, H, N, m, dtype=dtype) + 0.05
    k_feat = torch.rand(B, H, N, m, dtype=dtype) + 0.05
    v = torch.randn(B, H, N, Dv, dtype=dtype)
    bias = torch.randn(H, 2 * N - 1, dtype=dtype) * bias_std
    return q_feat, k_feat, v, bias


def _bias_matrix(bias, n):
    """``[H, N, N]`` with entry ``bias[h, (i - j) + N - 1]``, written without the library."""
    i = torch.arange(n).view(n, 1)
    j = torch.arange(n).view(1, n)
    return bias[:, i - j + n - 1]


def _dense_attention(q_feat, k_feat, v, bias, causal, key_log_scale=None):
    """Weights ``exp(beta_(i-j) + s_j) * (qf_i . kf_j)``, normalised over ``j``."""
    n = q_feat.shape[2]
    logits = _bias_matrix(bias, n)
    if key_log_scale is not None:
        logits = logits + key_log_scale.unsqueeze(-2)
    w = torch.exp(logits) * (q_feat @ k_feat.transpose(-1, -2))
    if causal:
        w = w.tril()
    return (w @ v) / w.sum(dim=-1, keepdim=True)


def _smooth(x):
    for p in (2, 3, 5):
        while x % p == 0:
            x //= p
    return x == 1


def test_fft_length_is_smallest_smooth_number():
    for n in range(1, 600):
        expected = next(k for k in range(n, 2 * n + 1) if _smooth(k))
        assert fft_length(n) == expected, n
    with pytest.raises(ValueError, match="n must be"):
        fft_length(0)


def test_toeplitz_matrix_entries_and_structure():
    n = 5
    coeffs = torch.randn(2, 2 * n - 1, dtype=F64)
    t = toeplitz_matrix(coeffs, n)
    assert t.shape == (2, n, n)
    for i in range(n):
        for j in range(n):
            assert torch.equal(t[:, i, j], coeffs[:, i - j + n - 1])
    # Constant along diagonals: the defining property of a Toeplitz matrix.
    assert torch.equal(t[:, 1:, 1:], t[:, :-1, :-1])


@pytest.mark.parametrize("n", [1, 2, 7, 33])
@pytest.mark.parametrize("part", ["full", "lower", "upper"])
def test_fft_matvec_equals_dense_forward_backward(n, part):
    """Identity 10.4: FFT Toeplitz product == dense product, for offsets of both signs."""
    B, H, C = 2, 3, 4
    coeffs = torch.randn(H, 2 * n - 1, dtype=F64)
    # "lower" keeps t >= 0 only (causal), "upper" keeps t <= 0 only: both wrap directions.
    if part == "lower":
        coeffs[:, : n - 1] = 0
    elif part == "upper":
        coeffs[:, n:] = 0
    coeffs.requires_grad_()
    x = torch.randn(B, H, n, C, dtype=F64, requires_grad=True)
    g = torch.randn(B, H, n, C, dtype=F64)

    fast = toeplitz_matvec(coeffs, x)
    dense = torch.einsum("hij,bhjc->bhic", _bias_matrix(coeffs, n), x)
    assert_close(fast, dense)
    grads_fast = torch.autograd.grad((fast * g).sum(), (coeffs, x))
    grads_dense = torch.autograd.grad((dense * g).sum(), (coeffs, x))
    for a, b in zip(grads_fast, grads_dense):
        assert_close(a, b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 13])
@pytest.mark.parametrize("with_scale", [False, True])
def test_attention_equals_dense_formula_forward_backward(causal, n, with_scale):
    """Fast path (causal: every block size from all-FFT to all-dense) and reference against
    the formula, with and without per-key log scales, forward and backward."""
    q_feat, k_feat, v, bias = _inputs(N=n)
    kls = 3 * torch.randn(q_feat.shape[:3], dtype=F64) if with_scale else None
    inputs = tuple(t.requires_grad_() for t in (q_feat, k_feat, v, bias) + ((kls,) if with_scale else ()))
    g = torch.randn_like(v)

    expected = _dense_attention(q_feat, k_feat, v, bias, causal, kls)
    grads_expected = torch.autograd.grad((expected * g).sum(), inputs)
    fns = [toeplitz_attention_reference] + [
        functools.partial(toeplitz_attention, block_size=b) for b in ((1, 2, 3, 4, 64) if causal else (64,))
    ]
    for fn in fns:
        out = fn(q_feat, k_feat, v, bias, causal=causal, key_log_scale=kls)
        assert out.shape == v.shape and out.dtype == F64
        assert_close(out, expected, msg=f"{fn!r} forward")
        for a, b in zip(torch.autograd.grad((out * g).sum(), inputs), grads_expected):
            assert_close(a, b, msg=f"{fn!r} backward")


@pytest.mark.parametrize("causal", [False, True])
def test_attention_equals_rpe_reference(causal):
    """Same weights through the project's exact reference: mask qf.kf, bias beta_(i-j), q.k = 0."""
    q_feat, k_feat, v, bias = _inputs(N=11)
    B, H, N, _ = q_feat.shape
    zeros = torch.zeros(B, H, N, 2, dtype=F64)
    expected = rpe_attention_reference(
        zeros, zeros, v, mask=q_feat @ k_feat.transpose(-1, -2), bias=_bias_matrix(bias, N), causal=causal
    )
    assert_close(toeplitz_attention(q_feat, k_feat, v, bias, causal=causal), expected)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_tiny(causal):
    q_feat, k_feat, v, bias = _inputs(B=1, H=2, N=6, m=2, Dv=2)
    kls = torch.randn(1, 2, 6, dtype=F64)
    inputs = tuple(t.requires_grad_() for t in (q_feat, k_feat, v, bias, kls))
    # block_size=2: the causal path goes through two FFT levels and the dense blocks.
    fn = lambda q, k, v, b, s: toeplitz_attention(q, k, v, b, causal=causal, key_log_scale=s, block_size=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("block_size", [1, 4, 64])
def test_causal_outputs_ignore_huge_future_keys(dtype, block_size):
    """Past rows do not depend on later keys, values or key scales, not even by rounding.

    A key shift shared by all keys (one max over the sequence) cancels in exact arithmetic,
    but a later key 1e6 times larger with a log scale 300 above the rest underflows every
    earlier key to zero in float32; and one FFT over the whole sequence would mix the
    huge key into the early rows at the eps level. The blocked causal product does neither.
    """
    n, past = 21, 11
    q_feat, k_feat, v, bias = _inputs(N=n, dtype=dtype)
    kls = torch.randn(q_feat.shape[:3], dtype=dtype)
    out = toeplitz_attention(q_feat, k_feat, v, bias, causal=True, key_log_scale=kls, block_size=block_size)
    k2, v2, kls2 = k_feat.clone(), v.clone(), kls.clone()
    k2[:, :, past:] *= 1e6
    v2[:, :, past:] *= 1e6
    kls2[:, :, past:] += 300.0
    out2 = toeplitz_attention(q_feat, k2, v2, bias, causal=True, key_log_scale=kls2, block_size=block_size)
    assert bool(torch.isfinite(out2).all())
    tol = 1e-12 if dtype == F64 else 1e-6
    assert (out2[:, :, :past] - out[:, :, :past]).abs().max() <= tol
    # ... and the past is still right: against the float64 reference.
    args64 = [t.double() for t in (q_feat, k_feat, v, bias)]
    expected = toeplitz_attention_reference(*args64, causal=True, key_log_scale=kls.double())
    assert_close(out[:, :, :past], expected[:, :, :past], dtype=dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_translation_invariance(causal):
    """Shifting every token by s (padding with keyless tokens) leaves the outputs unchanged.

    The bias is one function of the offset, evaluated on a longer table for the longer
    sequence: the output may depend on positions only through ``i - j``, and the table
    must be read around its centre ``N - 1`` whatever ``N`` is. (The sign convention of
    ``t`` is pinned down by the dense-formula tests, not by this one.)
    """
    n, s, after = 9, 4, 3
    total = s + n + after
    q_feat, k_feat, v, _ = _inputs(N=n)
    big_table = torch.randn(3, 2 * total - 1, dtype=F64)
    centre = total - 1
    bias = big_table[:, centre - (n - 1) : centre + n]  # offsets -(n-1)..(n-1)
    out = toeplitz_attention(q_feat, k_feat, v, bias, causal=causal)

    def pad(x, keyless=False):
        shape = list(x.shape)
        shape[2] = s
        front = torch.rand(shape, dtype=F64) if not keyless else torch.zeros(shape, dtype=F64)
        shape[2] = after
        back = torch.rand(shape, dtype=F64) if not keyless else torch.zeros(shape, dtype=F64)
        return torch.cat([front, x, back], dim=2)

    out_big = toeplitz_attention(pad(q_feat), pad(k_feat, keyless=True), pad(v), big_table, causal=causal)
    assert_close(out_big[:, :, s : s + n], out)


def test_constant_bias_shift_changes_nothing():
    q_feat, k_feat, v, bias = _inputs()
    shift = torch.tensor([[-300.0], [0.5], [40.0]], dtype=F64)
    assert_close(toeplitz_attention(q_feat, k_feat, v, bias + shift), toeplitz_attention(q_feat, k_feat, v, bias))


def test_causal_ignores_future_offsets_entirely():
    """Future offsets may hold anything finite: no effect on values, no NaN in gradients."""
    q_feat, k_feat, v, bias = _inputs(N=9)
    wild = bias.clone()
    wild[:, :8] = 1e4  # offsets t < 0
    wild.requires_grad_()
    out = toeplitz_attention(q_feat, k_feat, v, wild, causal=True, block_size=2)
    assert_close(out, toeplitz_attention(q_feat, k_feat, v, bias, causal=True, block_size=2))
    (grad,) = torch.autograd.grad(out.sum(), wild)
    assert torch.equal(grad[:, :8], torch.zeros_like(grad[:, :8]))
    assert bool(torch.isfinite(grad).all())


def test_window_bias_with_minus_inf():
    n, w = 15, 2
    q_feat, k_feat, v, bias = _inputs(N=n)
    offsets = torch.arange(-(n - 1), n)
    bias = bias.masked_fill(offsets.abs() > w, -math.inf)
    for causal in (False, True):
        expected = _dense_attention(q_feat, k_feat, v, bias, causal)
        assert_close(toeplitz_attention(q_feat, k_feat, v, bias, causal=causal, block_size=2), expected)


def test_empty_rows_return_zeros():
    q_feat, k_feat, v, bias = _inputs(N=8)
    # Every offset removed: no row has any weight.
    out = toeplitz_attention(q_feat, k_feat, v, torch.full_like(bias, -math.inf))
    assert torch.equal(out, torch.zeros_like(out))
    # Causal with the first key featureless: row 0 is empty (exactly zero in the dense
    # formula); it must give zeros, the other rows stay exact.
    k_feat[:, :, 0] = 0
    for dtype in (F64, torch.float32):
        args = [t.to(dtype) for t in (q_feat, k_feat, v, bias)]
        ref = toeplitz_attention_reference(*args, causal=True)
        for block_size in (1, 3, 64):
            out = toeplitz_attention(*args, causal=True, block_size=block_size)
            assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
            assert_close(out, ref)
    # Row 3 empty behind an FFT level: keys 2, 3 featureless and only offsets 0, 1 live.
    # With block_size=1 the pair [0, 2) -> [2, 4) gives row 3 the key 1 through the
    # coefficient of offset 2, exactly zero but rounding noise after the FFT; the rounding
    # floor must recognise that noise as no weight.
    k_feat[:, :, 2:4] = 0
    offsets = torch.arange(-7, 8)
    bias = bias.masked_fill((offsets < 0) | (offsets > 1), -math.inf)
    for dtype in (F64, torch.float32):
        args = [t.to(dtype) for t in (q_feat, k_feat, v, bias)]
        out = toeplitz_attention(*args, causal=True, block_size=1)
        assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
        assert_close(out, toeplitz_attention_reference(*args, causal=True))


def test_float32_long_sequence_matches_float64_dense():
    n = 1001
    q_feat, k_feat, v, bias = _inputs(B=1, H=2, N=n, m=8, Dv=8, bias_std=2.0)
    # An ALiBi-like decay on top of noise: a wide dynamic range of coefficients.
    bias = bias - 0.02 * torch.arange(-(n - 1), n, dtype=F64).abs()
    args32 = [t.float() for t in (q_feat, k_feat, v, bias)]

    expected = toeplitz_attention_reference(q_feat, k_feat, v, bias)
    out = toeplitz_attention(*args32)
    assert out.dtype == torch.float32
    assert_close(out, expected, dtype=torch.float32)

    # Causal: each row's FFT products cover key blocks next to it, so the first rows are
    # as accurate as the last (one FFT over the whole sequence gave them errors of 3e-5,
    # relative to the largest, latest row sums).
    expected = toeplitz_attention_reference(q_feat, k_feat, v, bias, causal=True)
    for fft_dtype in (None, torch.float64):
        out = toeplitz_attention(*args32, causal=True, fft_dtype=fft_dtype)
        assert out.dtype == torch.float32
        assert_close(out, expected, dtype=torch.float32)


def test_half_inputs_are_upcast():
    q_feat, k_feat, v, bias = _inputs(N=31)
    expected = toeplitz_attention_reference(q_feat, k_feat, v, bias, causal=True)
    out = toeplitz_attention(*(t.to(torch.bfloat16) for t in (q_feat, k_feat, v, bias)), causal=True)
    assert out.dtype == torch.bfloat16
    assert_close(out, expected, dtype=torch.bfloat16, scale=2.0)


def test_bad_inputs_rejected():
    q_feat, k_feat, v, bias = _inputs(N=6)
    with pytest.raises(ValueError, match=r"bias must have 2N - 1 = 11 offsets"):
        toeplitz_attention(q_feat, k_feat, v, bias[:, :-1])
    with pytest.raises(ValueError, match=r"bias has 2 heads.*expected H = 3"):
        toeplitz_attention(q_feat, k_feat, v, bias[:2])
    with pytest.raises(ValueError, match=r"bias must have rank 2"):
        toeplitz_attention(q_feat, k_feat, v, bias[None])
    with pytest.raises(TypeError, match=r"bias must have a floating-point dtype"):
        toeplitz_attention(q_feat, k_feat, v, bias.long())
    with pytest.raises(TypeError, match=r"q_feat must be a torch.Tensor"):
        toeplitz_attention(q_feat.numpy(), k_feat, v, bias)
    with pytest.raises(ValueError, match=r"q_feat and k_feat must have the same shape"):
        toeplitz_attention(q_feat, k_feat[..., :-1], v, bias)
    with pytest.raises(ValueError, match=r"v must be \[B, H, N, Dv\]"):
        toeplitz_attention(q_feat, k_feat, v[:, :, :-1], bias)
    with pytest.raises(ValueError, match=r"k_feat must have rank 4"):
        toeplitz_attention(q_feat, k_feat[0], v, bias)
    with pytest.raises(ValueError, match=r"coeffs must have 2N - 1"):
        toeplitz_matvec(bias[:, 1:], v)
    with pytest.raises(ValueError, match=r"coeffs must have last dimension"):
        toeplitz_matrix(bias, 5)
    with pytest.raises(ValueError, match=r"fft_dtype must be"):
        toeplitz_attention(q_feat, k_feat, v, bias, fft_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"key_log_scale must be \[B, H, N\]"):
        toeplitz_attention(q_feat, k_feat, v, bias, key_log_scale=torch.zeros(2, 3, 5, dtype=F64))
    with pytest.raises(ValueError, match=r"block_size"):
        toeplitz_attention(q_feat, k_feat, v, bias, causal=True, block_size=0)


@pytest.mark.parametrize("causal", [False, True])
def test_short_sequences_take_the_exact_formula_and_agree_with_the_ffts(causal, monkeypatch):
    q_feat, k_feat, v, bias = _inputs(N=40)
    kls = torch.randn(2, 3, 40, dtype=F64) * 3
    tensors = [t.requires_grad_() for t in (q_feat, k_feat, v, bias)]
    seen = []
    real = T.toeplitz_attention_reference
    monkeypatch.setattr(T, "toeplitz_attention_reference", lambda *a, **k: seen.append(a[0].shape[2]) or real(*a, **k))
    short = T.toeplitz_attention(*tensors, causal=causal, key_log_scale=kls)  # N = 40 <= DEFAULT_DENSE_BELOW
    assert seen == [40]
    fft = T.toeplitz_attention(*tensors, causal=causal, key_log_scale=kls, dense_below=39)
    assert seen == [40]  # N > dense_below: the FFTs
    assert_close(short, fft)
    upstream = torch.randn_like(short)
    for g_short, g_fft in zip(torch.autograd.grad((short * upstream).sum(), tensors), torch.autograd.grad((fft * upstream).sum(), tensors)):
        assert_close(g_short, g_fft)
    with pytest.raises(ValueError, match="dense_below must be a nonnegative int"):
        T.toeplitz_attention(q_feat, k_feat, v, bias, dense_below=-1)


@pytest.mark.parametrize("n, block_size", [(5, 8), (8, 8), (16, 8), (17, 4), (40, 4), (45, 16)])
def test_causal_blocks_equal_reference_forward_backward(n, block_size):
    """The earlier-block product (one FFT length, a matmul over the block index) against the
    reference in float64: N below, at and above the block, multiples and not, up to 11
    blocks; key log scales and a decaying bias of wide range, every gradient."""
    q_feat, k_feat, v, bias = _inputs(B=2, H=2, N=n, m=3, Dv=2, bias_std=3.0)
    bias = bias - 0.3 * torch.arange(-(n - 1), n, dtype=F64).abs()
    kls = 4 * torch.randn(q_feat.shape[:3], dtype=F64)
    inputs = tuple(t.requires_grad_() for t in (q_feat, k_feat, v, bias, kls))
    g = torch.randn_like(v)
    expected = toeplitz_attention_reference(*inputs[:4], causal=True, key_log_scale=kls)
    out = toeplitz_attention(*inputs[:4], causal=True, key_log_scale=kls, block_size=block_size)
    assert_close(out, expected)
    for a, b in zip(torch.autograd.grad((out * g).sum(), inputs), torch.autograd.grad((expected * g).sum(), inputs)):
        assert_close(a, b)


def test_causal_block_distance_with_no_live_offset_sets_no_scale():
    """A key block whose distance to the row's block has every offset removed contributes
    nothing, however large its keys' log scale: it must not set the rescaling of the blocks
    that do reach the row (which would then vanish below the FFTs' rounding floor).

    Only block 3's rows are checked: rows of blocks 2 and 4 share a block distance with
    rows that block 1 does reach, so its scale sets theirs and their own weights sit
    below the rounding floor of its products (the accuracy limit of the module docstring).
    """
    n, block_size = 24, 4
    q_feat, k_feat, v, bias = _inputs(B=1, H=1, N=n)
    offsets = torch.arange(-(n - 1), n)
    bias = bias.masked_fill((offsets < 0) | ((offsets > 2) & (offsets < 13)), -math.inf)
    kls = torch.zeros(1, 1, n, dtype=F64)
    kls[:, :, 4:8] = 200.0  # block 1: distance 2 (offsets 5..11, all removed) from block 3
    expected = toeplitz_attention_reference(q_feat, k_feat, v, bias, causal=True, key_log_scale=kls)
    out = toeplitz_attention(q_feat, k_feat, v, bias, causal=True, key_log_scale=kls, block_size=block_size)
    assert bool(torch.isfinite(out).all())
    assert_close(out[:, :, 12:16], expected[:, :, 12:16])


@pytest.mark.parametrize("n", [1, 2, 7, 8])
def test_real_fft_backward_equals_autograd(n):
    x = torch.randn(3, 4, n, dtype=F64, requires_grad=True)
    g = torch.randn(3, 4, n // 2 + 1, dtype=torch.complex128)
    assert torch.equal(T._RealFFT.apply(x), torch.fft.rfft(x))
    (fast,) = torch.autograd.grad(T._RealFFT.apply(x), x, g)
    (slow,) = torch.autograd.grad(torch.fft.rfft(x), x, g)
    assert_close(fast, slow)


def _causal_aten_ops(n: int, block_size: int) -> int:
    from torch.profiler import ProfilerActivity, profile

    q_feat, k_feat, v, bias = (t.requires_grad_() for t in _inputs(B=1, H=2, N=n, m=3, Dv=2))
    kls = torch.randn(1, 2, n, dtype=F64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = toeplitz_attention(q_feat, k_feat, v, bias, causal=True, key_log_scale=kls, block_size=block_size)
        out.sum().backward()
    return sum(1 for event in prof.events() if event.name.startswith("aten::"))


def test_causal_operation_count_is_the_same_for_any_number_of_blocks():
    # 3 blocks and 32 blocks (both with a partial last block): the same operations, only
    # larger; a loop over blocks or levels would add operations per block or per doubling.
    assert _causal_aten_ops(4 * 32 - 1, 4) == _causal_aten_ops(4 * 3 - 1, 4)
