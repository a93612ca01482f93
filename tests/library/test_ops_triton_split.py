"""The feature-split Triton kernel (:mod:`flt.ops.triton.split`) against the float64
quadratic references, on CPU tensors under triton's interpreter (``TRITON_INTERPRET=1``,
set by ``conftest.py`` without CUDA); tiny shapes. Skipped when triton is not installed."""

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
from flt.ops.triton.split import add_feature_blocks, favor_attention_split

B, H, N, D, E = 2, 2, 37, 8, 6  # N: two chunks of 16 and a tail


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    if not interpreted():
        pytest.skip("the triton kernels are compiled for the GPU in this process; run with TRITON_INTERPRET=1 to test them on CPU")


def _inputs(coupling, *, m=40, dv=5, n=N, dtype=torch.float64, pad=False, scale=0.5):
    """Scaled queries/keys, values, the projection and (logit) the joined features."""
    xq = scale * torch.randn(B, H, n, D, dtype=dtype)
    xk = scale * torch.randn(B, H, n, D, dtype=dtype)
    v = torch.randn(B, H, n, dv, dtype=dtype)
    extra = {}
    if coupling == "logit":
        extra = {"extra_q": 0.5 * torch.randn(1, H, n, E, dtype=dtype), "extra_k": 0.5 * torch.randn(1, H, n, E, dtype=dtype)}
    w = gaussian_orthogonal_random_matrix(m, D + (E if extra else 0), dtype=torch.float64).to(dtype)
    if pad:
        key_mask = torch.ones(B, n, dtype=torch.bool)
        key_mask[1, -7:] = False
        key_mask[0, :3] = False
        extra["key_mask"] = key_mask
    return xq, xk, v, w, extra


def _leaves(xq, xk, v, extra):
    return [t.requires_grad_() for t in (xq, xk, v)] + [extra[k].requires_grad_() for k in ("extra_q", "extra_k") if k in extra]


# (m, features per program, tokens per chunk): one block; three, the last ragged (40 = 16 + 16 + 8);
# two of 32 with chunks of 32; a block wider than m (its padded features carry nothing).
TILES = [(16, 16, 16), (40, 16, 16), (64, 32, 32), (24, 32, 16)]


@pytest.mark.parametrize("m,bm,chunk", TILES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("coupling", ["performer", "logit"])
def test_split_kernel_matches_reference_float64(coupling, causal, m, bm, chunk):
    xq, xk, v, w, extra = _inputs(coupling, m=m, pad=True)
    out = favor_attention_split(xq, xk, v, w, causal=causal, chunk_size=chunk, feature_block=bm, **extra)
    assert out.dtype == torch.float64 and out.shape == (B, H, N, 5)
    assert_close(out, _reference(xq, xk, v, w, causal, **extra))


# Bidirectional is marked slow: its segments are summed, as the causal ones are before their
# prefix is combined; test_ops_triton_split_kronecker.py::test_level_does_not_depend_on_the_values
# runs the same sums kernel bidirectionally in three segments of two value blocks.
@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_segments_and_value_blocks(causal):
    """Three segments combined, and 20 value columns in two blocks of 16; the backward
    (one segment) from that forward's levels."""
    xq, xk, v, w, extra = _inputs("logit", dv=20, n=50, pad=True)
    extra["key_mask"][0, :16] = False  # the first segment of sequence 0 has no key
    leaves = _leaves(xq, xk, v, extra)
    out = favor_attention_split(xq, xk, v, w, causal=causal, chunk_size=16, feature_block=16, value_block=16, segments=3, **extra)
    if causal:  # rows whose keys are all padding: zeros, as in the reference
        assert torch.equal(out[0, :, :16], torch.zeros_like(out[0, :, :16]))
    assert_same_gradients(out, _reference(xq, xk, v, w, causal, **extra), leaves, exact_dtype=True)


def test_blocks_far_apart_in_scale():
    """Inputs so large that the features of one token span up to 50 orders of magnitude and
    the largest features of its four blocks up to 16 (each block its own stabiliser): still
    the float64 reference."""
    xq, xk, v, w, _ = _inputs("performer", m=64, scale=4.0)
    xq, xk = xq * torch.linspace(0.2, 1.5, N, dtype=torch.float64)[:, None], xk * torch.linspace(1.5, 0.2, N, dtype=torch.float64)[:, None]
    for causal in (False, True):
        ref = _reference(xq, xk, v, w, causal)
        assert torch.isfinite(ref).all()
        assert_close(favor_attention_split(xq, xk, v, w, causal=causal, chunk_size=16, feature_block=16), ref)


def test_causal_rows_ignore_later_keys():
    """Changing the last keys (even to huge log scales) changes no earlier output, in any
    feature block: each block's running level never looks ahead."""
    xq, xk, v, w, extra = _inputs("logit", m=48)
    run = lambda xk, v: favor_attention_split(xq, xk, v, w, causal=True, chunk_size=16, feature_block=16, segments=3, **extra)  # noqa: E731
    out = run(xk, v)
    xk2, v2 = xk.clone(), v.clone()
    xk2[..., -3:, :] *= 6.0
    v2[..., -3:, :] = 1e6
    assert torch.equal(out[..., : N - 3, :], run(xk2, v2)[..., : N - 3, :])


def test_float32_ragged_and_one_chunk():
    """float32 inputs (float32 accumulation), a sequence shorter than one chunk."""
    xq, xk, v, w, extra = _inputs("logit", dtype=torch.float32, n=11)
    out = favor_attention_split(xq, xk, v, w, causal=True, chunk_size=16, feature_block=16, **extra)
    assert out.dtype == torch.float32
    ref = _reference(*(t.double() for t in (xq, xk, v, w)), True, **{k: t.double() for k, t in extra.items()})
    assert_close(out, ref, dtype=torch.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_option_of_favor_attention_and_gradients(causal):
    """``favor_attention(split_features=True)`` is this kernel (its default tiles, here
    16 under the interpreter) with the backward kernels' gradients, and
    ``backward="torch"`` gives the same by the PyTorch path."""
    xq, xk, v, w, extra = _inputs("logit", n=21)
    leaves = _leaves(xq, xk, v, extra)
    out = favor_attention(xq, xk, v, w, causal=causal, chunk_size=16, split_features=True, **extra)
    assert_same_gradients(out, _reference(xq, xk, v, w, causal, **extra), leaves, exact_dtype=True)
    out = favor_attention_split(xq, xk, v, w, causal=causal, backward="torch", **extra)
    assert_same_gradients(out, _reference(xq, xk, v, w, causal, **extra), leaves, exact_dtype=True)


# (m, features per program, tokens per chunk, value columns, keys padded): as TILES, with
# the padding of _inputs (the first 3 keys of sequence 0: causal rows with no key) and 20
# value columns (one program holds all of them in the backward: a tile of 32).
BACKWARD_TILES = [(16, 16, 16, 5, False), (40, 16, 16, 5, True), (64, 32, 32, 20, True), (24, 32, 16, 5, True)]


#: The default suite runs each tile once and each (coupling, causal) pair once, with one of the
#: tiles; the other twelve combinations are marked slow (scripts/test.sh -m slow runs them).
_BACKWARD_DEFAULT = {(16, False, "performer"), (40, True, "logit"), (64, True, "performer"), (24, False, "logit")}
BACKWARD_CASES = [
    pytest.param(coupling, causal, *tile, marks=() if (tile[0], causal, coupling) in _BACKWARD_DEFAULT else pytest.mark.slow)
    for coupling in ("performer", "logit") for causal in (False, True) for tile in BACKWARD_TILES
]


@pytest.mark.parametrize("coupling,causal,m,bm,chunk,dv,pad", BACKWARD_CASES)
def test_backward_kernels_match_reference_gradients_float64(coupling, causal, m, bm, chunk, dv, pad):
    """The backward kernels' gradients of ``xq, xk, v`` and (logit) of ``extra_q, extra_k``
    (given once for the batch: summed over it) equal autograd of the float64 reference."""
    xq, xk, v, w, extra = _inputs(coupling, m=m, dv=dv, pad=pad)
    leaves = _leaves(xq, xk, v, extra)
    out = favor_attention_split(xq, xk, v, w, causal=causal, chunk_size=chunk, feature_block=bm, **extra)
    assert_same_gradients(out, _reference(xq, xk, v, w, causal, **extra), leaves, exact_dtype=True)


@pytest.mark.slow  # the default suite: the batch-shared extra (test_backward_kernels_match_reference_gradients_float64) and these scales (test_blocks_far_apart_in_scale, test_keys_far_from_the_origin)
def test_backward_with_batched_extra_and_far_apart_scales():
    """``extra_q, extra_k`` per batch element, and inputs whose feature blocks have their
    largest features 16 orders of magnitude apart (test_blocks_far_apart_in_scale)."""
    xq, xk, v, w, extra = _inputs("logit", m=64, scale=4.0)
    extra = {k: t.expand(B, -1, -1, -1).clone() for k, t in extra.items()}
    leaves = _leaves(xq, xk, v, extra)
    for causal in (False, True):
        out = favor_attention_split(xq, xk, v, w, causal=causal, chunk_size=16, feature_block=16, **extra)
        assert_same_gradients(out, _reference(xq, xk, v, w, causal, **extra), leaves, exact_dtype=True)


def test_keys_far_from_the_origin():
    """Keys 40 times the usual size: their FAVOR+ log scales run from about -3800 to -150,
    so ``exp`` of one underflows even in float64 and every factor must be taken relative
    to a running level, in the backward's reverse walk too: still the reference's values
    and gradients."""
    xq, xk, v, w, _ = _inputs("performer", m=48)
    xk = 40 * xk
    leaves = _leaves(xq, xk, v, {})
    for causal in (False, True):
        out = favor_attention_split(xq, xk, v, w, causal=causal, chunk_size=16, feature_block=16)
        assert_same_gradients(out, _reference(xq, xk, v, w, causal), leaves, exact_dtype=True)


# Bidirectional is marked slow: the causal case runs the same segmented backward and combines
# the segments' states in prefix order besides.
@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_backward_in_segments(causal):
    """The backward cut into four segments (each segment's key and query states, combined
    in PyTorch, as the forward's): the reference's gradients, with ragged feature blocks
    and keys whose log scales span thousands."""
    xq, xk, v, w, extra = _inputs("logit", m=40, n=61, pad=True)
    xk = xk * torch.linspace(1.0, 30.0, 61, dtype=torch.float64)[:, None]
    leaves = _leaves(xq, xk, v, extra)
    out = favor_attention_split(xq, xk, v, w, causal=causal, chunk_size=16, feature_block=16, segments=4, **extra)
    assert_same_gradients(out, _reference(xq, xk, v, w, causal, **extra), leaves, exact_dtype=True)


def test_backward_float32():
    """float32 inputs: float32 gradients within float32's tolerance of the float64 reference's."""
    xq, xk, v, w, extra = _inputs("logit", dtype=torch.float32, n=27, pad=True)
    leaves = _leaves(xq, xk, v, extra)
    wide = {k: t.detach().double() if t.is_floating_point() else t for k, t in extra.items()}
    wide_leaves = _leaves(*(t.detach().double() for t in (xq, xk, v)), wide)
    out = favor_attention_split(xq, xk, v, w, causal=True, chunk_size=16, feature_block=16, **extra)
    ref = _reference(*wide_leaves[:3], w.double(), True, **wide)
    up = torch.randn_like(ref)
    got = torch.autograd.grad((out * up.float()).sum(), leaves)
    want = torch.autograd.grad((ref * up).sum(), wide_leaves)
    for g, g_ref in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        assert_close(g, g_ref, dtype=torch.float32)


def test_bfloat16_inputs():
    """bfloat16 inputs: float32 outputs and bfloat16 gradients, equal to the float64
    reference on the same rounded inputs within float32's tolerance (the interpreter
    computes the TF32 products such inputs get on a GPU in float32)."""
    xq, xk, v, w, extra = _inputs("logit", dtype=torch.float32, n=27)
    xq, xk, v = (t.bfloat16() for t in (xq, xk, v))
    leaves = _leaves(xq, xk, v, extra)
    out = favor_attention_split(xq, xk, v, w, causal=True, chunk_size=16, feature_block=16, **extra)
    assert out.dtype == torch.float32
    wide = {k: t.detach().double().requires_grad_() for k, t in extra.items()}
    wide_leaves = [t.detach().double().requires_grad_() for t in (xq, xk, v)] + list(wide.values())
    ref = _reference(*wide_leaves[:3], w.double(), True, **wide)
    assert_close(out, ref, dtype=torch.float32)
    up = torch.randn_like(ref)
    got = torch.autograd.grad((out * up.float()).sum(), leaves)
    want = torch.autograd.grad((ref * up).sum(), wide_leaves)
    for g, g_ref, leaf in zip(got, want, leaves, strict=True):
        assert g.dtype == leaf.dtype
        assert_close(g.float(), g_ref, dtype=torch.bfloat16 if leaf.dtype == torch.bfloat16 else torch.float32)


def test_autocast_leaves_the_combination_of_segments_alone():
    """Under bfloat16 autocast the PyTorch steps between the launches (the causal
    segments' combination is an einsum, which autocast would run in bfloat16: 9e-3 off
    here) stay in float32: the same result as without autocast."""
    xq, xk, v, w, extra = _inputs("logit", dtype=torch.float32, n=40)
    run = lambda: favor_attention_split(xq, xk, v, w, causal=True, chunk_size=16, feature_block=16, segments=3, **extra)  # noqa: E731
    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(run(), plain)


def test_add_feature_blocks_rescales_to_the_largest_level():
    part = torch.tensor([[[2.0, 1.0]], [[4.0, 2.0]]], dtype=torch.float64)  # [F = 2, N = 1, X = 2]
    lev = torch.tensor([[0.0], [-torch.log(torch.tensor(2.0)).item()]], dtype=torch.float64)
    assert torch.allclose(add_feature_blocks(part, lev), torch.tensor([[4.0, 2.0]], dtype=torch.float64))


def test_bad_arguments_are_named():
    xq, xk, v, w, extra = _inputs("logit")
    with pytest.raises(ValueError, match="feature_block"):
        favor_attention_split(xq, xk, v, w, feature_block=24, **extra)
    with pytest.raises(ValueError, match="chunk_size"):
        favor_attention_split(xq, xk, v, w, chunk_size=8, **extra)
    with pytest.raises(ValueError, match="chunk_size must be a power of two >= 16"):
        favor_attention_split(xq, xk, v, w, chunk_size=16.0, **extra)
    with pytest.raises(ValueError, match="value_block must be a power of two >= 16"):
        favor_attention_split(xq, xk, v, w, value_block=True, **extra)
    with pytest.raises(ValueError, match="backward must be 'kernel' or 'torch'"):
        favor_attention_split(xq, xk, v, w, backward="autograd", **extra)
    # Tensors the kernels cannot reach: the message names the backend that chose the kernels.
    meta = [t.to("meta") for t in (xq, xk, v, w[:, :D])]
    with pytest.raises(ValueError, match="backend='triton-split' runs Triton kernels on CUDA tensors; these are on meta"):
        favor_attention(*meta, split_features=True)
    with pytest.raises(ValueError, match="backend='triton' runs Triton kernels on CUDA tensors; these are on meta"):
        favor_attention(*meta)
    # 128 x 8 sequences of 65,536 tokens, 4 blocks of 16 features, 9 columns: 2.4e9 elements.
    big = torch.zeros(1, 1, 1, D, dtype=torch.float64).expand(128, 8, 2**16, D)  # no memory: a stride-0 view
    with pytest.raises(ValueError, match="32-bit"):
        favor_attention_split(big, big, big, gaussian_orthogonal_random_matrix(64, D, dtype=torch.float64), feature_block=16)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,options", [("performer", {}), ("flt", {"coupling": "logit", "num_frequencies": 4})], ids=["performer", "flt-logit"])
def test_layer_backend_triton_split_matches_torch(name, options, causal):
    """``backend="triton-split"`` computes the same forward and gradients as the PyTorch
    ops, with padded keys (bidirectional) and in float64 (the band:
    tests/library/test_ops_triton_split_band.py; the multiplicative coupling:
    tests/library/test_ops_triton_split_kronecker.py)."""
    from flt.layers.registry import ATTENTION

    kw = dict(pos_dim=1, causal=causal, num_features=40, dtype=torch.float64, seed=1, **options)
    torch_layer = ATTENTION[name].from_options(16, 2, **kw)
    split_layer = ATTENTION[name].from_options(16, 2, backend="triton-split", **kw)
    split_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(2, 19, 16, dtype=torch.float64, requires_grad=True)
    pad = None if causal else torch.zeros(2, 19, dtype=torch.bool).index_fill_(1, torch.tensor([17, 18]), True)
    ref = torch_layer(x, key_padding_mask=pad)
    out = split_layer(x, key_padding_mask=pad)
    assert_close(out, ref)
    up = torch.randn_like(out)
    (g_out,) = torch.autograd.grad((out * up).sum(), x)
    (g_ref,) = torch.autograd.grad((ref * up).sum(), x)
    assert_close(g_out, g_ref)
