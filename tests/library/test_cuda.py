"""The GPU: float64 identities of every ATTENTION entry on CUDA tensors, bfloat16 within its
tolerance, decoding, the Triton kernels compiled for the GPU and FlexAttention with the
relative terms' ``score_mod`` (compiled, forward and backward). Marked ``cuda`` and skipped
without a CUDA device; run them with ``pytest -m cuda`` on a machine with one."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from conftest import assert_close
from flt import ATTENTION
from flt.relative import build_relative

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

F64 = torch.float64
NAMES = sorted(ATTENTION)
OPTIONS = {
    "softmax": [dict(relative_bias="spectrum", amplitude=0.5), dict(relative_bias="t5")],
    "toeplitz": [dict(block_size=4, dense_below=0)],
    "flt": [dict(amplitude=0.5), dict(coupling="multiplicative", num_features=32, amplitude=0.5), dict(near_field=3)],
    "performer": [dict(rope=True)],
}
CASES = [(name, i) for name in NAMES for i in range(len(OPTIONS.get(name, [{}])))]


def build(name, i, causal, dtype=F64):
    torch.manual_seed(0)
    layer = ATTENTION[name].from_options(32, 2, causal=causal, device="cuda", dtype=dtype, **OPTIONS.get(name, [{}])[i])
    with torch.no_grad():  # give zero-initialised relative terms something to do
        for p in layer.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.3)
    return layer


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,i", CASES)
def test_float64_fast_path_equals_reference_on_gpu(name, i, causal):
    assert_fast_path_equals_reference(build(name, i, causal))


def assert_fast_path_equals_reference(layer):
    """Outputs and input gradients of the layer's fast path and its O(N^2) reference, float64."""
    x = torch.randn(2, 67, 32, device="cuda", dtype=F64, requires_grad=True)
    up = torch.randn_like(x)
    fast, ref = layer(x), layer.reference(x)
    (g_fast,) = torch.autograd.grad((fast * up).sum(), x)
    (g_ref,) = torch.autograd.grad((ref * up).sum(), x)
    assert_close(fast, ref, scale=100)
    assert_close(g_fast, g_ref, scale=100)


@pytest.mark.parametrize("options", [dict(near_neighbors=4),
                                     dict(near_neighbors=4, coupling="multiplicative", feature_map="hedgehog", num_features=16, check_condition=False)])
def test_near_neighbors_equal_reference_on_gpu(options):
    """The near-neighbour sets (bidirectional only) through the sparse pair products of
    flt.ops.pairs on CUDA (cuSPARSE's sampled product, embedding_bag), forward and input
    gradients, in float64."""
    layer = ATTENTION["flt"].from_options(32, 2, causal=False, device="cuda", dtype=F64, **options)
    with torch.no_grad():
        for p in layer.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.3)
    assert_fast_path_equals_reference(layer)


@pytest.mark.parametrize("name,i", CASES)
def test_bfloat16_autocast_within_tolerance(name, i):
    """A causal forward under bfloat16 autocast against the same layer in float32: within
    bfloat16's tolerance, or (the multiplicative coupling's signed row sums) the layer
    warned that rounding changes its outputs."""
    from flt.layers.flt import ConditioningWarning

    layer = build(name, i, True, dtype=torch.float32).eval()
    x = torch.randn(2, 200, 32, device="cuda")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = layer(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = layer(x)
    err = float((got.float() - want).norm() / want.norm())
    warned = any(issubclass(w.category, ConditioningWarning) for w in caught)
    assert err < 3e-2 or warned, f"relative error {err:.2e} under bfloat16 autocast, and no ConditioningWarning"


@pytest.mark.parametrize("name,i", [c for c in CASES if ATTENTION[c[0]].supports_decoding])
def test_decoding_on_gpu_matches_the_causal_forward(name, i):
    layer = build(name, i, True)
    if not layer.supports_decoding:
        pytest.skip("this configuration does not decode")
    x = torch.randn(2, 12, 32, device="cuda", dtype=F64)
    y, state = layer.prefill(x[:, :5])
    outs = [y]
    for t in range(5, 12):
        step, state = layer.step(x[:, t], state)
        outs.append(step.unsqueeze(1))
    assert_close(torch.cat(outs, 1), layer(x))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,options", [("performer", {}), ("flt", {"num_frequencies": 8}),
                                          ("flt", {"coupling": "multiplicative", "num_frequencies": 8, "check_condition": False}),
                                          ("flt", {"num_frequencies": 8, "near_field": 16, "near_relative": "clipped"}),
                                          ("flt", {"num_frequencies": 8, "near_field": 16, "far_field": "positive"})])
def test_triton_backend_on_gpu(name, options, causal, dtype):
    pytest.importorskip("triton", reason="the triton extra is not installed")
    from flt.ops.triton import interpreted

    if interpreted():
        pytest.skip("the kernels were built for the interpreter (TRITON_INTERPRET=1)")
    kw = dict(causal=causal, num_features=64, device="cuda", dtype=dtype, seed=3, **options)
    torch_layer = ATTENTION[name].from_options(64, 2, **kw)
    triton_layer = ATTENTION[name].from_options(64, 2, backend="triton", **kw)
    triton_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(2, 333, 64, device="cuda", dtype=dtype, requires_grad=True)
    out, ref = triton_layer(x), torch_layer(x)
    scale = 1 if dtype == torch.float64 else 10
    assert_close(out, ref, scale=scale)
    (g_out,) = torch.autograd.grad(out.sum(), x)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    assert_close(g_out, g_ref, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name, options", [("performer", {}), ("flt", {"num_frequencies": 8}),
                                           ("flt", {"num_frequencies": 8, "near_field": 8}),
                                           ("flt", {"num_frequencies": 8, "coupling": "multiplicative", "length_scale": 64.0,
                                                    "check_condition": False})],
                         ids=["performer", "flt", "flt-band8", "flt-mult"])
def test_triton_split_backend_on_gpu(name, options, causal, dtype):
    """The feature-split kernel (``backend="triton-split"``) at its GPU tile: m = 256 in four
    blocks of 64 features, head dim 64, chunks of 64, 1000 tokens (segments), padded keys
    bidirectionally; Performer, FLT, FLT's band (``near_field=8``,
    :func:`flt.ops.triton.band.band_attention_split`) and FLT's multiplicative coupling
    (:func:`flt.ops.triton.split.favor_attention_split_kronecker`: 2R = 16, so 1040 widened
    value columns in 17 groups of 64): forward and gradients equal the PyTorch layer's.
    The multiplicative case has a broad mask (``length_scale=64``), whose row sums are well
    conditioned, so two float32 orders of summation agree to float32's tolerance; at the
    default start they cancel so much at N = 1000 that the float32 PyTorch layer is itself
    2e-4 of the largest output off float64 bidirectionally, 2e-3 causally (on a CPU)."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    from flt.ops.triton import interpreted

    if interpreted():
        pytest.skip("the kernels were built for the interpreter (TRITON_INTERPRET=1)")
    kw = dict(causal=causal, num_features=256, device="cuda", dtype=dtype, seed=3, **options)
    torch_layer = ATTENTION[name].from_options(128, 2, **kw)
    split_layer = ATTENTION[name].from_options(128, 2, backend="triton-split", **kw)
    split_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(2, 1000, 128, device="cuda", dtype=dtype, requires_grad=True)
    pad = None if causal else torch.zeros(2, 1000, dtype=torch.bool, device="cuda").index_fill_(1, torch.arange(990, 1000, device="cuda"), True)
    out, ref = split_layer(x, key_padding_mask=pad), torch_layer(x, key_padding_mask=pad)
    scale = 1 if dtype == torch.float64 else 10
    assert_close(out, ref, scale=scale)
    (g_out,) = torch.autograd.grad(out.sum(), x)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    assert_close(g_out, g_ref, scale=scale)


@pytest.mark.parametrize("causal", [False, True])
def test_triton_segments_on_gpu(causal):
    """The sequence cut into segments (two launches and their combination) gives the
    one-segment result, in float64."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    from flt.ops.features import gaussian_orthogonal_random_matrix
    from flt.ops.triton import favor_attention

    xq, xk = (0.5 * torch.randn(1, 2, 1000, 32, device="cuda", dtype=F64) for _ in range(2))
    v = torch.randn(1, 2, 1000, 32, device="cuda", dtype=F64)
    a, c = (0.5 + 0.2 * torch.randn(1, 2, 1000, 8, device="cuda", dtype=F64) for _ in range(2))
    w = gaussian_orthogonal_random_matrix(64, 40, device="cuda", dtype=F64)
    one = favor_attention(xq, xk, v, w, causal=causal, extra_q=a, extra_k=c, segments=1)
    assert_close(favor_attention(xq, xk, v, w, causal=causal, extra_q=a, extra_k=c, segments=5), one)
    from flt.ops.triton.band import band_attention

    bias = torch.randn(1, 2, 1000, 33, device="cuda", dtype=F64)
    one = band_attention(xq, xk, v, w, bias, width=16, extra_q=a, extra_k=c, causal=causal, segments=1)
    assert_close(band_attention(xq, xk, v, w, bias, width=16, extra_q=a, extra_k=c, causal=causal, segments=5), one)


@pytest.mark.parametrize("backend", ["triton", "triton-split"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["performer", "flt"])
def test_triton_backend_under_bfloat16_autocast(name, causal, backend):
    """bfloat16 inputs, 1000 tokens (several segments on a GPU): bidirectional, bfloat16
    operands in the kernel's products (positive weights); causal, float32 operands. Within
    bfloat16's tolerance of the float32 layer."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    torch_layer = ATTENTION[name].from_options(64, 2, causal=causal, num_features=64, device="cuda", seed=3)
    triton_layer = ATTENTION[name].from_options(64, 2, causal=causal, num_features=64, device="cuda", seed=3, backend=backend)
    triton_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(2, 1000, 64, device="cuda")
    with torch.no_grad():
        want = torch_layer(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = triton_layer(x)
    err = float((got.float() - want).norm() / want.norm())
    assert err < 3e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("term", ["t5", "alibi", "gaussian_mixture"])
def test_compiled_flex_score_mod_matches_dense_bias(term):
    """FlexAttention compiled with a term's score_mod: forward and gradients equal the
    dense-bias softmax (float32), and the term's parameters get their gradient."""
    from torch.nn.attention.flex_attention import flex_attention

    options = {"num_frequencies": 8, "amplitude": 1.0} if term == "gaussian_mixture" else {}
    rel = build_relative(term, heads=4, pos_dim=1, device="cuda", **options)
    with torch.no_grad():
        for p in rel.parameters():
            p.add_(0.3 * torch.randn_like(p))
    pos = torch.arange(256, device="cuda", dtype=torch.float32).view(1, 256, 1)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", requires_grad=True) for _ in range(3))
    out = torch.compile(flex_attention)(q, k, v, score_mod=rel.score_mod(pos))
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(64) + rel.bias(pos), dim=-1) @ v
    assert_close(out, ref, scale=10)
    params = [p for p in rel.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.square().sum(), [q, *params])
    grads_ref = torch.autograd.grad(ref.square().sum(), [q, *params])
    for a, b in zip(grads, grads_ref):
        assert_close(a, b, scale=100)
