"""The Triton kernels of :mod:`flt.ops.triton` against the float64 quadratic references,
on CPU tensors under triton's interpreter (``TRITON_INTERPRET=1``); tiny shapes, since the
interpreter runs every program in Python. Skipped when triton is not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_close

from flt.ops.features import (
    favor_plus_features,
    favor_plus_features_split,
    gaussian_orthogonal_random_matrix,
)
from flt.ops.reference import flt_attention_reference, linear_attention_reference

pytest.importorskip("triton", reason="triton is not installed (the optional extra 'triton')")

# The kernels run under Triton's interpreter here: minutes on a CPU, so they are left out of
# the default run (-m interpreter runs them; CI does, with the slow tests).
pytestmark = pytest.mark.interpreter

from flt.ops.triton import favor_attention, favor_attention_torch, interpreted

B, H, N, D, DV, M, R2 = 2, 2, 37, 8, 5, 16, 4  # N: two chunks of 16 and a tail
COUPLINGS = ("performer", "logit", "multiplicative")


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """Skip unless the kernels run under triton's interpreter: triton reads
    ``TRITON_INTERPRET`` when it is first imported, which ``conftest.py`` sets on machines
    without CUDA (on a GPU machine: ``TRITON_INTERPRET=1 pytest tests/library/test_ops_triton.py``)."""
    if not interpreted():
        pytest.skip("the triton kernels are compiled for the GPU in this process; run with TRITON_INTERPRET=1 to test them on CPU")


def _inputs(coupling, dtype=torch.float64, n=N, pad=False):
    """Scaled queries/keys, values, the projection and the coupling's extra tensors."""
    xq = 0.5 * torch.randn(B, H, n, D, dtype=dtype)
    xk = 0.5 * torch.randn(B, H, n, D, dtype=dtype)
    v = torch.randn(B, H, n, DV, dtype=dtype)
    # Mostly positive masks a.c (as a spectrum near f = 1 gives): well-conditioned row sums.
    a = 0.5 + 0.2 * torch.randn(1, H, n, R2, dtype=dtype)
    c = 0.5 + 0.2 * torch.randn(1, H, n, R2, dtype=dtype)
    extra = {"performer": {}, "logit": {"extra_q": a, "extra_k": c}, "multiplicative": {"a": a, "c": c}}[coupling]
    width = D + (R2 if coupling == "logit" else 0)
    w = gaussian_orthogonal_random_matrix(M, width, dtype=torch.float64).to(dtype)
    if pad:
        key_mask = torch.ones(B, n, dtype=torch.bool)
        key_mask[1, -7:] = False
        key_mask[0, :3] = False
        extra["key_mask"] = key_mask
    return xq, xk, v, w, extra


def _reference(xq, xk, v, w, causal, extra_q=None, extra_k=None, a=None, c=None, key_mask=None):
    """The quadratic formula on features made by :mod:`flt.ops.features`."""
    if extra_q is None:
        qf, _ = favor_plus_features(xq, w)
        kf, kls = favor_plus_features(xk, w)
    else:
        qf, _ = favor_plus_features_split(xq, extra_q, w)
        kf, kls = favor_plus_features_split(xk, extra_k, w)
    if key_mask is not None:
        kf = kf * key_mask[:, None, :, None]
        kls = torch.where(key_mask[:, None, :], kls, kls.detach().amin(dim=-1, keepdim=True))
    if a is None:
        return linear_attention_reference(qf, kf, v, causal=causal, key_log_scale=kls)
    return flt_attention_reference(qf, kf, v, a, c, causal=causal, key_log_scale=kls)


@pytest.mark.parametrize("segments", [1, 3])  # one program per sequence, or three segments combined
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("coupling", COUPLINGS)
def test_kernel_matches_reference_float64(coupling, causal, segments):
    xq, xk, v, w, extra = _inputs(coupling)
    out = favor_attention(xq, xk, v, w, causal=causal, chunk_size=16, segments=segments, **extra)
    assert out.dtype == torch.float64 and out.shape == (B, H, N, DV)
    assert_close(out, _reference(xq, xk, v, w, causal, **extra))


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_carry_no_weight(causal):
    xq, xk, v, w, extra = _inputs("multiplicative", pad=True)
    extra["key_mask"][0, :16] = False  # the whole first segment of sequence 0: a state with no key
    for segments in (1, 3):
        out = favor_attention(xq, xk, v, w, causal=causal, chunk_size=16, segments=segments, **extra)
        assert_close(out, _reference(xq, xk, v, w, causal, **extra))
        if causal:  # rows whose keys are all padding: zeros, as in the reference
            assert torch.equal(out[0, :, :16], torch.zeros_like(out[0, :, :16]))


def test_causal_rows_ignore_later_keys():
    """Changing the last keys (even to huge log scales) changes no earlier output: the
    running level never looks ahead."""
    xq, xk, v, w, extra = _inputs("logit")
    out = favor_attention(xq, xk, v, w, causal=True, chunk_size=16, segments=3, **extra)
    xk2, v2 = xk.clone(), v.clone()
    xk2[..., -3:, :] *= 6.0
    v2[..., -3:, :] = 1e6
    out2 = favor_attention(xq, xk2, v2, w, causal=True, chunk_size=16, segments=3, **extra)
    assert torch.equal(out[..., : N - 3, :], out2[..., : N - 3, :])


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_float32_and_one_chunk(coupling):
    """float32 inputs (float32 accumulation) and a sequence shorter than one chunk."""
    xq, xk, v, w, extra = _inputs(coupling, dtype=torch.float32, n=11)
    out = favor_attention(xq, xk, v, w, causal=True, chunk_size=16, **extra)
    assert out.dtype == torch.float32
    ref = _reference(*(t.double() for t in (xq, xk, v, w)), True, **{k: t.double() if t.is_floating_point() else t for k, t in extra.items()})
    assert_close(out, ref, dtype=torch.float32)


def test_bfloat16_inputs_accumulate_in_float32():
    """bfloat16 inputs: a float32 result equal to the reference on the same (rounded) inputs.
    (On the GPU their products run with bfloat16 operands: tests/library/test_cuda.py.)"""
    xq, xk, v, w, extra = _inputs("logit", dtype=torch.float32)
    xq, xk, v = (t.bfloat16() for t in (xq, xk, v))
    out = favor_attention(xq, xk, v, w, causal=True, chunk_size=16, **extra)
    assert out.dtype == torch.float32
    ref = _reference(*(t.double() for t in (xq, xk, v, w)), True, **{k: t.double() for k, t in extra.items()})
    assert_close(out, ref, dtype=torch.float32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("coupling", ["logit", "multiplicative"])
def test_gradients_match_reference(coupling, causal):
    """The backward pass (recomputed by the PyTorch path) gives the reference's gradients
    for every differentiable input, for a random upstream gradient."""
    xq, xk, v, w, extra = _inputs(coupling, n=21)
    leaves = [t.requires_grad_() for t in (xq, xk, v)] + [t.requires_grad_() for t in extra.values()]
    out = favor_attention(xq, xk, v, w, causal=causal, chunk_size=16, **extra)
    ref = _reference(xq, xk, v, w, causal, **extra)
    up = torch.randn_like(out)
    g_out = torch.autograd.grad((out * up).sum(), leaves)
    g_ref = torch.autograd.grad((ref * up).sum(), leaves)
    for got, want in zip(g_out, g_ref, strict=True):
        assert_close(got, want)


def test_torch_path_matches_reference():
    xq, xk, v, w, extra = _inputs("logit", pad=True)
    assert_close(favor_attention_torch(xq, xk, v, w, causal=True, **extra), _reference(xq, xk, v, w, True, **extra))


def test_bad_arguments_are_named():
    xq, xk, v, w, extra = _inputs("logit")
    with pytest.raises(ValueError, match="projection"):
        favor_attention(xq, xk, v, w[:, :D], **extra)
    with pytest.raises(ValueError, match="chunk_size"):
        favor_attention(xq, xk, v, w, chunk_size=24, **extra)
    with pytest.raises(ValueError, match="segments"):
        favor_attention(xq, xk, v, w, segments=0, **extra)
    with pytest.raises(ValueError, match="extra_q and extra_k"):
        favor_attention(xq, xk, v, w, extra_q=extra["extra_q"])


def test_cpu_without_interpreter_refuses():
    """Outside the interpreter, CPU tensors get a clear error instead of a crash, from the
    op and from a layer with ``backend="triton"``."""
    code = (
        "import torch\n"
        "from flt.ops.triton import favor_attention\n"
        "from flt.layers.registry import ATTENTION\n"
        "x = torch.randn(1, 1, 4, 4)\n"
        "for run in (lambda: favor_attention(x, x, x, torch.randn(16, 4)),\n"
        "            lambda: ATTENTION['flt'].from_options(8, 2, backend='triton')(torch.randn(1, 4, 8))):\n"
        "    try:\n"
        "        run()\n"
        "    except ValueError as err:\n"
        "        print(err)\n"
    )
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all("CUDA tensors" in line and "TRITON_INTERPRET=1" in line for line in lines), done.stdout + done.stderr


LAYERS = [
    ("performer", {}),
    ("flt", {"coupling": "logit", "num_frequencies": 4}),
    ("flt", {"coupling": "multiplicative", "num_frequencies": 4}),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,options", LAYERS, ids=["performer", "flt-logit", "flt-multiplicative"])
def test_layer_backend_triton_matches_torch(name, options, causal):
    """``backend="triton"`` computes the same forward and gradients as the PyTorch ops,
    with padded keys (bidirectional) and in float64."""
    from flt.layers.registry import ATTENTION

    kw = dict(pos_dim=1, causal=causal, num_features=16, dtype=torch.float64, seed=1, **options)
    torch_layer = ATTENTION[name].from_options(16, 2, **kw)
    triton_layer = ATTENTION[name].from_options(16, 2, backend="triton", **kw)
    triton_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(2, 19, 16, dtype=torch.float64, requires_grad=True)
    pad = None if causal else torch.zeros(2, 19, dtype=torch.bool).index_fill_(1, torch.tensor([17, 18]), True)
    ref = torch_layer(x, key_padding_mask=pad)
    out = triton_layer(x, key_padding_mask=pad)
    assert_close(out, ref)
    up = torch.randn_like(out)
    (g_out,) = torch.autograd.grad((out * up).sum(), x)
    (g_ref,) = torch.autograd.grad((ref * up).sum(), x)
    assert_close(g_out, g_ref)


def test_layer_backend_refusals():
    from flt.layers.registry import ATTENTION

    with pytest.raises(ValueError, match="feature_map='favor\\+'"):
        ATTENTION["performer"].from_options(16, 2, backend="triton", feature_map="relu")
    with pytest.raises(ValueError, match="near_neighbors"):
        ATTENTION["flt"].from_options(16, 2, backend="triton", near_neighbors=2)
    with pytest.raises(ValueError, match="backend"):
        ATTENTION["toeplitz"].from_options(16, 2, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        ATTENTION["flt"].from_options(16, 2, backend="cuda")


def _band_inputs(n=45, width=5):
    xq, xk, v, w, extra = _inputs("logit", n=n)
    bias = torch.randn(1, H, n, 2 * width + 1, dtype=torch.float64)
    return xq, xk, v, w, bias, extra["extra_q"], extra["extra_k"]


def _band_reference(xq, xk, v, w, bias, a, c, width, causal, key_mask=None):
    from flt.ops.band import band_attention_reference

    qf, q_shift = favor_plus_features_split(xq, a, w)
    kf, k_shift = favor_plus_features_split(xk, c, w)
    return band_attention_reference(xq, xk, v, qf, kf, q_shift, k_shift, bias, width=width, causal=causal, key_mask=key_mask)


@pytest.mark.parametrize("width", [5, 21])  # within one chunk of 16, and wider (chunks of 32); 2 segments of 32
@pytest.mark.parametrize("causal", [False, True])
def test_band_kernel_matches_reference_float64(causal, width):
    from flt.ops.triton.band import band_attention

    xq, xk, v, w, bias, a, c = _band_inputs(n=50, width=width)
    key_mask = torch.ones(B, 50, dtype=torch.bool)
    key_mask[1, -6:] = False
    key_mask[0, :2] = False
    for mask, segments in ((None, 1), (key_mask, 1), (key_mask, 2)):  # segments: see favor_attention
        out = band_attention(xq, xk, v, w, bias, width=width, extra_q=a, extra_k=c, causal=causal, key_mask=mask,
                             chunk_size=16, segments=segments)
        assert_close(out, _band_reference(xq, xk, v, w, bias, a, c, width, causal, mask))


def test_band_kernel_gradients_match_reference():
    """Every input's gradient, the band's bias included (it is learned)."""
    from flt.ops.triton.band import band_attention

    xq, xk, v, w, bias, a, c = _band_inputs(n=23, width=3)
    leaves = [t.requires_grad_() for t in (xq, xk, v, bias, a, c)]
    out = band_attention(xq, xk, v, w, bias, width=3, extra_q=a, extra_k=c, causal=True, chunk_size=16)
    ref = _band_reference(xq, xk, v, w, bias, a, c, 3, True)
    up = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad((out * up).sum(), leaves), torch.autograd.grad((ref * up).sum(), leaves), strict=True):
        assert_close(got, want)


@pytest.mark.parametrize("far_field", [True, "positive", "constant"])
@pytest.mark.parametrize("causal", [False, True])
def test_layer_band_backend_triton_matches_torch(causal, far_field):
    """The band kernel with the far field's random features, or with the learnt constant
    beyond the band (its constant features go through the same kernel), in float64."""
    from flt.layers.registry import ATTENTION

    kw = {"causal": causal, "num_features": 16, "num_frequencies": 4, "near_field": 4, "near_relative": "clipped",
          "far_field": far_field, "dtype": torch.float64, "seed": 2}
    torch_layer = ATTENTION["flt"].from_options(16, 2, **kw)
    triton_layer = ATTENTION["flt"].from_options(16, 2, backend="triton", **kw)
    with torch.no_grad():
        for p in torch_layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    triton_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(2, 29, 16, dtype=torch.float64, requires_grad=True)
    out, ref = triton_layer(x), torch_layer(x)
    assert_close(out, ref)
    (g_out,) = torch.autograd.grad(out.sum(), x)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    assert_close(g_out, g_ref)


def test_launch_tries_smaller_tiles_until_one_fits_and_remembers_it():
    """A tile that needs more shared memory than the GPU has fails at launch, before any
    work: the launcher tries the next smaller one, remembers which fitted, and names the
    way out when none does."""
    from triton.runtime.errors import OutOfResources

    from flt.ops.triton import launch_fitted, tile_candidates
    from flt.ops.triton.launch import _FITTED

    cuda = torch.device("cuda")
    assert tile_candidates(64, 64, 64, torch.device("cpu")) == [(64, 64, None)]
    assert tile_candidates(64, 64, 64, cuda)[0] == (64, 64, 3)
    assert tile_candidates(64, 64, 256, cuda) == [(16, 32, 1), (16, 16, 1)]  # m = 256: the default tile never fits
    assert tile_candidates(64, 16, 256, cuda) == [(16, 16, 1)]  # no repeats
    tried = []

    def attempt(chunk, bv, stages):
        tried.append((chunk, bv, stages))
        if bv > 16:
            raise OutOfResources(300_000, 232_448, "shared memory")

    tiles = [(64, 64, 3), (16, 32, 1), (16, 16, 1)]
    key = ("test", "fits at the last tile")
    launch_fitted(key, tiles, attempt)
    assert tried == tiles and _FITTED[(key, tuple(tiles))] == (16, 16, 1)
    tried.clear()
    launch_fitted(key, tiles, attempt)
    assert tried == [(16, 16, 1)]  # straight to the tile that fitted before
    tried.clear()
    launch_fitted(key, [*tiles[:2], (32, 16, 1)], attempt)  # other candidates: their own search
    assert tried == [(64, 64, 3), (16, 32, 1), (32, 16, 1)]
    with pytest.raises(ValueError, match=r"no tile of the Triton kernel fits.*\(16, 32, 1\): .*num_features.*float32"):
        launch_fitted(("test", "none fits"), tiles[:2], attempt)
    for k in [k for k in _FITTED if k[0][0] == "test"]:
        del _FITTED[k]


@pytest.mark.parametrize("coupling", ["multiplicative", "band"])
def test_a_tile_refused_at_the_second_launch_leaves_no_trace(monkeypatch, coupling):
    """Segments: the first launch of a tile fits, the second (HAS_INIT) is refused; the
    next tile's result equals the reference. The multiplicative coupling adds into its
    output atomically, so a refused tile must not have written it; Dv = 40 in value
    blocks of 16 (three programs per row)."""
    from triton.runtime.errors import OutOfResources

    from flt.ops.triton import band as tri_band, favor, kernels, launch

    name = "band_attention_kernel" if coupling == "band" else "favor_attention_kernel"
    real = getattr(kernels, name)
    refused = []

    class RefuseFirstSecondLaunch:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                if kw["HAS_INIT"] and not refused:
                    refused.append(kw["BC"])
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return real[grid](*args, **kw)
            return launch

    tiles = lambda chunk, bv, bm, device: [(32, 16, None), (16, 16, None)]  # noqa: E731
    monkeypatch.setattr(kernels, name, RefuseFirstSecondLaunch())
    monkeypatch.setattr(launch, "interpreted", lambda: True)  # it looks at the (now wrapped) kernel
    monkeypatch.setattr(favor, "tile_candidates", tiles)
    monkeypatch.setattr(tri_band, "tile_candidates", tiles)
    torch.manual_seed(0)
    n, dv = 40, 40  # two chunks of 32 (the first tile), one per segment; three of 16 (the second)
    xq, xk = (0.5 * torch.randn(1, 2, n, D, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, n, dv, dtype=torch.float64)
    if coupling == "band":
        from flt.ops.triton.band import band_attention, band_attention_torch

        a, c = (0.3 * torch.randn(1, 2, n, 4, dtype=torch.float64) for _ in range(2))
        w = gaussian_orthogonal_random_matrix(M, D + 4, dtype=torch.float64)
        bias = torch.randn(1, 2, n, 9, dtype=torch.float64)
        kw = {"width": 4, "extra_q": a, "extra_k": c, "causal": True}
        out = band_attention(xq, xk, v, w, bias, segments=2, **kw)
        ref = band_attention_torch(xq, xk, v, w, bias, **kw)
    else:
        a, c = (0.5 + 0.2 * torch.randn(1, 2, n, R2, dtype=torch.float64) for _ in range(2))
        w = gaussian_orthogonal_random_matrix(M, D, dtype=torch.float64)
        out = favor_attention(xq, xk, v, w, a=a, c=c, causal=True, segments=2)
        ref = favor_attention_torch(xq, xk, v, w, a=a, c=c, causal=True)
    assert refused == [32]  # the first tile's second launch was refused, the second tile ran
    assert_close(out, ref)
    for k in [k for k in launch._FITTED if k[1] == ((32, 16, None), (16, 16, None))]:
        del launch._FITTED[k]


def test_no_python_float_reaches_a_kernel(monkeypatch):
    """A Python float argument reaches a compiled kernel as float32 (the interpreter keeps
    it in float64, so the float64 tests here cannot see the rounding): the band kernel once
    took ``0.5 log m`` that way and differed from the PyTorch band by 1e-9 in float64 on a
    GPU. Every launch must pass tensors, integers and compile-time flags only."""
    from flt.ops.triton import band, kernels, launch

    monkeypatch.setattr(launch, "interpreted", lambda: True)  # the spies below are not InterpretedFunctions
    seen = []

    def spy(name):
        real = getattr(kernels, name)

        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    seen.append([type(a).__name__ for a in args if isinstance(a, float)])
                    return real[grid](*args, **kw)
                return launch

        monkeypatch.setattr(kernels, name, Launcher())

    spy("favor_attention_kernel")
    spy("band_attention_kernel")
    xq, xk, v, w, extra = _inputs("logit")
    favor_attention(xq, xk, v, w, causal=True, **extra)
    bias = torch.randn(1, H, N, 9, dtype=torch.float64)
    band.band_attention(xq, xk, v, w, bias, width=4, causal=True, **extra)
    assert len(seen) >= 2 and all(not floats for floats in seen), seen
