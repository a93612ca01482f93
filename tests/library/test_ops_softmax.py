"""Exact softmax attention backends (sdpa, flex) against the O(N^2) reference."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from conftest import assert_close
from flt.ops.reference import rpe_attention_reference
from flt.ops.softmax import BACKENDS, flex_attention_available, softmax_attention

F64 = torch.float64
# Eager FlexAttention warns once that it is not compiled; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _qkv(B=2, H=3, N=7, Nk=None, D=4, Dv=5, dtype=F64, requires_grad=False):
    Nk = N if Nk is None else Nk
    q = torch.randn(B, H, N, D, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(B, H, Nk, D, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(B, H, Nk, Dv, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def _padding(B, Nk):
    keep = torch.ones(B, Nk, dtype=torch.bool)
    keep[1, -2:] = False  # the second sequence is two tokens shorter
    return keep


def _relative_bias(N, Nk, H):
    """A per-head function of i - j, as a relative encoding produces."""
    offsets = torch.arange(N).view(N, 1) - torch.arange(Nk).view(1, Nk)
    table = torch.randn(H, N + Nk - 1, dtype=F64)
    return table[:, offsets + Nk - 1]  # [H, N, Nk]


def _flex_forward_or_skip():
    ok, reason = flex_attention_available("cpu", requires_grad=False)
    if not ok:
        pytest.skip(reason)


CASES = [
    # (bias shape, causal, padding, Nk)
    pytest.param(None, False, False, None, id="plain"),
    pytest.param(None, True, False, None, id="causal"),
    pytest.param("H", False, False, None, id="bias"),
    pytest.param("H", True, True, None, id="bias-causal-padding"),
    pytest.param("B1", False, True, 9, id="bias-B1-padding-cross"),
    pytest.param("NN", True, False, None, id="bias-NN-causal"),
    pytest.param(None, False, True, 9, id="padding-cross"),
]


def _case(bias_kind, causal, padding, Nk, requires_grad):
    q, k, v = _qkv(Nk=Nk, requires_grad=requires_grad)
    B, H, N, _ = q.shape
    Nk = k.shape[2]
    bias = None
    if bias_kind == "H":
        bias = _relative_bias(N, Nk, H)[None]  # [1, H, N, Nk]
    elif bias_kind == "B1":
        bias = torch.randn(B, 1, N, Nk, dtype=F64)
    elif bias_kind == "NN":
        bias = _relative_bias(N, Nk, 1)[0]  # [N, Nk]
    if bias is not None:
        bias.requires_grad_(requires_grad)
    keep = _padding(B, Nk) if padding else None
    return q, k, v, bias, keep


@pytest.mark.parametrize("bias_kind, causal, padding, Nk", CASES)
def test_sdpa_equals_reference_forward_backward(bias_kind, causal, padding, Nk):
    q, k, v, bias, keep = _case(bias_kind, causal, padding, Nk, requires_grad=True)
    inputs = [t for t in (q, k, v, bias) if t is not None]
    kwargs = dict(bias=bias, causal=causal, key_padding_mask=None if keep is None else ~keep)
    out = softmax_attention(q, k, v, backend="sdpa", **kwargs)
    ref = softmax_attention(q, k, v, backend="reference", **kwargs)
    assert out.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[-1]) and out.dtype == F64
    assert_close(out, ref)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * g).sum(), inputs), torch.autograd.grad((ref * g).sum(), inputs)):
        assert_close(a, b)


def test_reference_backend_is_the_reference_formula():
    """Padding as a 0/1 multiplicative mask in the exact reference, scale honoured."""
    q, k, v = _qkv()
    keep = _padding(2, 7)
    bias = _relative_bias(7, 7, 3)
    out = softmax_attention(q, k, v, bias=bias, key_padding_mask=~keep, scale=0.3, backend="reference")
    logits = 0.3 * q @ k.transpose(-1, -2) + bias
    logits = logits.masked_fill(~keep[:, None, None, :], -math.inf)
    assert_close(out, torch.softmax(logits, dim=-1) @ v)
    expected = rpe_attention_reference(q, k, v, bias=bias, mask=keep[:, None, None, :].double(), scale=0.3)
    assert_close(out, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_is_honoured(backend):
    if backend == "flex":
        _flex_forward_or_skip()
    q, k, v = _qkv()
    expected = torch.softmax(0.3 * q @ k.transpose(-1, -2), dim=-1) @ v
    assert_close(softmax_attention(q, k, v, scale=0.3, backend=backend), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_zero(backend):
    """Row 0 is dead (causal, its only key is padding); row 3 of head 1 has an all -inf bias."""
    requires_grad = backend != "flex"  # FlexAttention has no CPU backward (tested below)
    if backend == "flex":
        _flex_forward_or_skip()
    q, k, v = _qkv(requires_grad=requires_grad)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[:, 0] = False
    bias = torch.zeros(1, 3, 7, 7, dtype=F64)
    bias[0, 1, 3] = -math.inf
    bias.requires_grad_(requires_grad)
    out = softmax_attention(q, k, v, bias=bias, causal=True, key_padding_mask=~keep, backend=backend)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert torch.equal(out[:, 1, 3], torch.zeros_like(out[:, 1, 3]))
    ref = rpe_attention_reference(q, k, v, bias=bias, mask=keep[:, None, None, :].double(), causal=True)
    assert_close(out, ref)
    if requires_grad:
        grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v, bias))
        assert all(bool(torch.isfinite(g).all()) for g in grads)
        assert torch.equal(grads[0][:, :, 0], torch.zeros_like(grads[0][:, :, 0]))
        assert torch.equal(grads[0][:, 1, 3], torch.zeros_like(grads[0][:, 1, 3]))


@pytest.mark.parametrize("bias_kind, causal, padding, Nk", CASES)
def test_flex_equals_reference_forward(bias_kind, causal, padding, Nk):
    _flex_forward_or_skip()
    q, k, v, bias, keep = _case(bias_kind, causal, padding, Nk, requires_grad=False)
    kwargs = dict(bias=bias, causal=causal, key_padding_mask=None if keep is None else ~keep)
    out = softmax_attention(q, k, v, backend="flex", **kwargs)
    assert out.dtype == F64
    assert_close(out, softmax_attention(q, k, v, backend="reference", **kwargs))


def test_flex_user_score_mod_composes_with_bias_and_masks():
    _flex_forward_or_skip()
    q, k, v = _qkv()
    keep = _padding(2, 7)
    bias = _relative_bias(7, 7, 3)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - 0.3 * ((h + 1) * (q_idx - kv_idx).abs()).to(score.dtype)

    distance = (torch.arange(7).view(7, 1) - torch.arange(7).view(1, 7)).abs()
    alibi_bias = -0.3 * torch.arange(1, 4, dtype=F64).view(3, 1, 1) * distance
    out = softmax_attention(q, k, v, bias=bias, causal=True, key_padding_mask=~keep, score_mod=alibi, backend="flex")
    expected = softmax_attention(q, k, v, bias=bias + alibi_bias, causal=True, key_padding_mask=~keep, backend="reference")
    assert_close(out, expected)


def test_flex_without_grad_mode_accepts_grad_tensors():
    """Under no_grad no backward can happen, so leaves with requires_grad are fine."""
    _flex_forward_or_skip()
    q, k, v = _qkv(requires_grad=True)
    with torch.no_grad():
        out = softmax_attention(q, k, v, causal=True, backend="flex")
        expected = softmax_attention(q, k, v, causal=True, backend="reference")
    assert_close(out, expected)


def test_flex_backward_on_cpu_is_detected_and_refused():
    ok, reason = flex_attention_available("cpu", requires_grad=True)
    if ok:  # a future torch with a CPU backward: then it must actually work
        q, k, v = _qkv(requires_grad=True)
        out = softmax_attention(q, k, v, backend="flex")
        ref = softmax_attention(q, k, v, backend="reference")
        g = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad((out * g).sum(), (q, k, v)), torch.autograd.grad((ref * g).sum(), (q, k, v))):
            assert_close(a, b)
        return
    assert "backward" in reason and "cpu" in reason
    q, k, v = _qkv(requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"backend='flex' cannot run here.*backward"):
        softmax_attention(q, k, v, backend="flex")
    # A bias that needs a gradient is a backward pass too.
    q, k, v = _qkv()
    bias = torch.zeros(7, 7, dtype=F64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward"):
        softmax_attention(q, k, v, bias=bias, backend="flex")


def test_flex_detection_is_lazy():
    """Importing the module must not probe FlexAttention (no import-time work)."""
    code = "import flt.ops.softmax as s; print(s._probe_flex.cache_info().currsize)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "0"


def test_bad_inputs_rejected():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend must be one of"):
        softmax_attention(q, k, v, backend="flash")
    with pytest.raises(ValueError, match="score_mod is only supported by backend='flex'"):
        softmax_attention(q, k, v, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(TypeError, match="score_mod must be callable"):
        softmax_attention(q, k, v, score_mod=3, backend="flex")
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        softmax_attention(q, k, v, key_padding_mask=torch.ones(2, 7))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[B, Nk\]"):
        softmax_attention(q, k, v, key_padding_mask=torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="bias of shape"):
        softmax_attention(q, k, v, bias=torch.zeros(3, 7, 6, dtype=F64))
    with pytest.raises(TypeError, match="bias must have a floating-point dtype"):
        softmax_attention(q, k, v, bias=torch.zeros(7, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="causal attention needs as many keys as queries"):
        softmax_attention(q, k[:, :, :5], v[:, :, :5], causal=True)
    with pytest.raises(TypeError, match="same dtype"):
        softmax_attention(q, k.float(), v)
    with pytest.raises(ValueError, match="q and k must share their last dimension"):
        softmax_attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="q must have rank 4"):
        softmax_attention(q[0], k, v)


def test_flex_probe_is_skipped_inside_torch_compile():
    """Traced by torch.compile, the layer gets the fused kernel, which the eager probe
    says nothing about (and whose tracing ran the probe with a head dim GPUs refuse):
    availability is then assumed, and outside compile the probe still answers."""
    eager = flex_attention_available("cpu", requires_grad=True)[0]

    def marked(x):
        return x + (1.0 if flex_attention_available(x.device, True)[0] else 0.0)

    x = torch.zeros(3)
    assert float(torch.compile(marked, backend="eager")(x)[0]) == 1.0
    assert float(marked(x)[0]) == (1.0 if eager else 0.0)
