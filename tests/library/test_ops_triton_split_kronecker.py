"""FLT's multiplicative coupling on the feature-split Triton kernels
(:func:`flt.ops.triton.split.favor_attention_split_kronecker`: their sums of the values
widened by ``c``, read with ``a``) against the float64 quadratic reference
(:func:`flt.ops.linear.flt_attention_reference` on the FAVOR+ features), forward and
gradients, on CPU tensors under triton's interpreter (``TRITON_INTERPRET=1``, set by
``conftest.py`` without CUDA); tiny shapes. Skipped when triton is not installed."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, assert_same_gradients

from flt.ops.features import gaussian_orthogonal_random_matrix

pytest.importorskip("triton", reason="triton is not installed (the optional extra 'triton')")

# The kernels run under Triton's interpreter here: minutes on a CPU, so they are left out of
# the default run (-m interpreter runs them; CI does, with the slow tests).
pytestmark = pytest.mark.interpreter

from test_ops_triton import _reference

from flt.ops.triton import favor_attention, interpreted
from flt.ops.triton.split import favor_attention_split_kronecker, favor_sums_split

B, H, N, D, DV, R2, M = 2, 2, 37, 8, 5, 4, 24  # N: two chunks of 16 and a tail; 2R (Dv + 1) = 24 widened columns


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    if not interpreted():
        pytest.skip("the triton kernels are compiled for the GPU in this process; run with TRITON_INTERPRET=1 to test them on CPU")


def _inputs(*, batch_ac=1, n=N, dv=DV, dtype=torch.float64):
    """Scaled queries/keys, values, the projection, mask factors ``a, c`` whose products
    ``a_i.c_j`` take both signs (about a quarter negative) and padded keys: the first 3 of
    sequence 0 (causal rows with no key) and the last 5 of sequence 1."""
    xq, xk = (0.5 * torch.randn(B, H, n, D, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, n, dv, dtype=dtype)
    a, c = (0.4 + 0.5 * torch.randn(batch_ac, H, n, R2, dtype=dtype) for _ in range(2))
    w = gaussian_orthogonal_random_matrix(M, D, dtype=torch.float64).to(dtype)
    key_mask = torch.ones(B, n, dtype=torch.bool)
    key_mask[0, :3] = False
    key_mask[1, -5:] = False
    return xq, xk, v, w, a, c, key_mask


# (a, c per sequence or shared, widened columns per kernel call, segments): two groups (16 and
# 8 columns) with a and c shared by the batch, one group of 32 (8 columns of padding) per
# sequence, and three segments combined in each launch.
# The segmented case is marked slow: test_level_does_not_depend_on_the_values (three segments,
# both directions) and test_float32_bfloat16_and_autocast (two, causal) run the same segmented
# sums in the default suite.
CASES = [(1, 16, 1), (B, 32, 1), pytest.param(B, 16, 3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("batch_ac,value_block,segments", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_float64(causal, batch_ac, value_block, segments):
    """Values and the gradients of ``xq, xk, v, a, c`` (``a, c`` given once for the batch:
    summed over it) equal the float64 reference's, with signed weights, padded keys and a
    ragged last chunk; causal rows without any key are zeros."""
    xq, xk, v, w, a, c, key_mask = _inputs(batch_ac=batch_ac)
    assert ((a[0] @ c[0].transpose(-1, -2)) < 0).any()  # weights of both signs
    leaves = [t.requires_grad_() for t in (xq, xk, v, a, c)]
    out = favor_attention_split_kronecker(xq, xk, v, w, a, c, causal=causal, key_mask=key_mask, chunk_size=16,
                                          feature_block=16, value_block=value_block, segments=segments)
    assert out.dtype == torch.float64 and out.shape == (B, H, N, DV)
    if causal:
        assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    assert_same_gradients(out, _reference(xq, xk, v, w, causal, a=a, c=c, key_mask=key_mask), leaves, exact_dtype=True)


@pytest.mark.parametrize("causal", [False, True])
def test_level_does_not_depend_on_the_values(causal):
    """What lets the groups of widened columns share one scale: :func:`favor_sums_split`'s
    row level is the same for other values (here of another width, in three segments)."""
    xq, xk, v, w, _, _, key_mask = _inputs()
    run = lambda v: favor_sums_split(xq, xk, v, w, causal=causal, key_mask=key_mask, segments=3, value_block=16)[1]  # noqa: E731
    assert torch.equal(run(v), run(100 * torch.randn(B, H, N, 11, dtype=torch.float64)))


@pytest.mark.parametrize("causal", [False, True])
def test_option_of_favor_attention(causal):
    """``favor_attention(a=a, c=c, split_features=True)`` is this composition (default tiles,
    16 under the interpreter): the reference's values and gradients at N = 21 (a chunk
    and a tail)."""
    xq, xk, v, w, a, c, key_mask = _inputs(n=21)
    leaves = [t.requires_grad_() for t in (xq, xk, v, a, c)]
    out = favor_attention(xq, xk, v, w, a=a, c=c, causal=causal, key_mask=key_mask, chunk_size=16, split_features=True)
    assert_same_gradients(out, _reference(xq, xk, v, w, causal, a=a, c=c, key_mask=key_mask), leaves, exact_dtype=True)


def test_cancelled_denominators_are_zeros():
    """``c = 0``: every signed denominator is exactly 0, so every row is 0 (as the
    reference's), with finite gradients."""
    xq, xk, v, w, a, c, key_mask = _inputs(n=20)
    c = torch.zeros_like(c).requires_grad_()
    out = favor_attention_split_kronecker(xq, xk, v, w, a, c, key_mask=key_mask)
    assert torch.equal(out, torch.zeros_like(out))
    assert_close(out, _reference(xq, xk, v, w, False, a=a, c=c, key_mask=key_mask))
    (g,) = torch.autograd.grad(out.sum(), c)
    assert torch.isfinite(g).all()


def test_float32_bfloat16_and_autocast():
    """float32 inputs: within float32's tolerance of the float64 reference; under bfloat16
    autocast the signed sums stay in float32 (the same result, bit for bit); bfloat16
    inputs give float32 outputs, and bfloat16 gradients."""
    xq, xk, v, w, a, c, key_mask = _inputs(n=20, dtype=torch.float32)  # two segments of one chunk each
    run = lambda *t: favor_attention_split_kronecker(*t[:3], w, *t[3:], causal=True, key_mask=key_mask, segments=2)  # noqa: E731
    out = run(xq, xk, v, a, c)
    assert out.dtype == torch.float32
    wide = [t.double() for t in (xq, xk, v, w, a, c)]
    assert_close(out, _reference(*wide[:4], True, a=wide[4], c=wide[5], key_mask=key_mask), dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(run(xq, xk, v, a, c), out)
    low = [t.bfloat16().requires_grad_() for t in (xq, xk, v)]
    out = run(*low, a, c)
    assert out.dtype == torch.float32
    rounded = [t.detach().double() for t in low]
    assert_close(out, _reference(*rounded, w.double(), True, a=wide[4], c=wide[5], key_mask=key_mask), dtype=torch.float32)
    assert all(g.dtype == torch.bfloat16 for g in torch.autograd.grad(out.sum(), low))


def test_bad_arguments_are_named():
    xq, xk, v, w, a, c, _ = _inputs()
    with pytest.raises(ValueError, match="value_block must be a power of two >= 16"):
        favor_attention_split_kronecker(xq, xk, v, w, a, c, value_block=24)
    with pytest.raises(ValueError, match="a and c must be given together"):
        favor_attention(xq, xk, v, w, a=a, split_features=True)
    with pytest.raises(ValueError, match="c must be"):
        favor_attention_split_kronecker(xq, xk, v, w, a, c[..., :2])
    # The kernels' 32-bit index check, per group of widened columns: 128 x 8 sequences of
    # 65,536 tokens, 4 blocks of 16 features, 17 columns (a group of 16 and its denominator).
    big = torch.zeros(1, 1, 1, D, dtype=torch.float64).expand(128, 8, 2**16, D)  # no memory: stride-0 views
    ones = torch.ones(1, 1, 1, R2, dtype=torch.float64).expand(1, 8, 2**16, R2)
    with pytest.raises(ValueError, match="32-bit"):
        favor_attention_split_kronecker(big, big, big[..., :DV], gaussian_orthogonal_random_matrix(64, D, dtype=torch.float64),
                                        ones, ones, feature_block=16)


@pytest.mark.parametrize("causal", [False, True])
def test_layer_backend_triton_split_matches_torch(causal, monkeypatch):
    """``FLTAttention(coupling="multiplicative", backend="triton-split")`` computes the same
    forward, input gradient and parameter gradients as ``backend="torch"``, in float64,
    with padded keys bidirectionally, and it does so by the split kernels' signed sums."""
    from flt.layers.registry import ATTENTION
    from flt.ops.triton import split

    calls = []
    monkeypatch.setattr(split, "favor_sums_split", lambda *args, **kw: calls.append(kw) or favor_sums_split(*args, **kw))

    kw = {"pos_dim": 1, "causal": causal, "coupling": "multiplicative", "num_frequencies": 4, "num_features": 24,
          "check_condition": False, "dtype": torch.float64, "seed": 1}
    torch_layer = ATTENTION["flt"].from_options(16, 2, **kw)
    split_layer = ATTENTION["flt"].from_options(16, 2, backend="triton-split", **kw)
    split_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(2, 19, 16, dtype=torch.float64, requires_grad=True)
    pad = None if causal else torch.zeros(2, 19, dtype=torch.bool).index_fill_(1, torch.tensor([17, 18]), True)
    ref = torch_layer(x, key_padding_mask=pad)
    out = split_layer(x, key_padding_mask=pad)
    assert calls and all(kw["signed"] for kw in calls)  # the signed sums' IEEE products
    assert_close(out, ref)
    up = torch.randn_like(out)
    params = [p for p in split_layer.parameters() if p.requires_grad]
    params_ref = [p for p in torch_layer.parameters() if p.requires_grad]
    got = torch.autograd.grad((out * up).sum(), [x, *params], allow_unused=True)
    want = torch.autograd.grad((ref * up).sum(), [x, *params_ref], allow_unused=True)
    assert len(params) > 0
    for g, g_ref in zip(got, want, strict=True):
        assert (g is None) == (g_ref is None)
        if g is not None:
            assert_close(g, g_ref)
