import math

import pytest
import torch

from conftest import assert_close
from flt.ops import rpe_attention_reference

F64 = torch.float64


def hand_softmax(q, k, v, mask, bias, causal, scale):
    B, H, N, D = q.shape
    out = torch.zeros(B, H, N, v.shape[-1], dtype=F64)
    for b in range(B):
        for h in range(H):
            for i in range(N):
                ws = []
                for j in range(k.shape[2]):
                    if causal and j > i:
                        ws.append(torch.zeros((), dtype=F64))
                        continue
                    logit = (q[b, h, i] @ k[b, h, j]) * scale + bias[b, h, i, j]
                    ws.append(mask[b, h, i, j] * torch.exp(logit))
                w = torch.stack(ws)
                out[b, h, i] = (w[:, None] * v[b, h]).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_hand_written_softmax_with_mask_and_bias(causal):
    B, H, N, D = 2, 2, 7, 5
    q, k, v = (torch.randn(B, H, N, D, dtype=F64) for _ in range(3))
    mask = torch.rand(B, H, N, N, dtype=F64) + 0.1
    bias = torch.randn(B, H, N, N, dtype=F64)
    scale = 0.3
    out = rpe_attention_reference(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale)
    assert_close(out, hand_softmax(q, k, v, mask, bias, causal, scale))


def test_default_scale_is_inverse_sqrt_d():
    q, k, v = (torch.randn(1, 1, 5, 9, dtype=F64) for _ in range(3))
    expected = torch.softmax(q @ k.transpose(-1, -2) / 3.0, dim=-1) @ v
    assert_close(rpe_attention_reference(q, k, v), expected)


def test_mask_and_bias_broadcast_and_large_logits_stay_finite():
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=F64) for _ in range(3))
    bias = torch.randn(6, 6, dtype=F64) * 800  # exp would overflow without the row max
    out = rpe_attention_reference(q, k, v, bias=bias)
    assert torch.isfinite(out).all()
    expected = torch.softmax(q @ k.transpose(-1, -2) / 2.0 + bias, dim=-1) @ v
    assert_close(out, expected)


def test_fully_masked_row_returns_zeros():
    q, k, v = (torch.randn(1, 1, 4, 3, dtype=F64) for _ in range(3))
    mask = torch.ones(4, 4, dtype=F64)
    mask[2] = 0.0
    bias = torch.zeros(4, 4, dtype=F64)
    bias[1] = -math.inf
    out = rpe_attention_reference(q, k, v, mask=mask, bias=bias)
    assert torch.equal(out[0, 0, 2], torch.zeros(3, dtype=F64))
    assert torch.equal(out[0, 0, 1], torch.zeros(3, dtype=F64))
    assert torch.isfinite(out).all() and out[0, 0, 0].abs().sum() > 0


def test_signed_mask_is_allowed():
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=F64) for _ in range(3))
    mask = torch.randn(5, 5, dtype=F64)
    out = rpe_attention_reference(q, k, v, mask=mask)
    w = mask * torch.exp(q @ k.transpose(-1, -2) / math.sqrt(3))
    assert_close(out, (w @ v) / w.sum(-1, keepdim=True))


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(q=torch.randn(2, 3, 4)), ValueError, "q must have rank 4"),
        (dict(q=torch.randint(0, 3, (1, 1, 4, 3))), TypeError, "q must have a floating-point dtype"),
        (dict(k=torch.randn(1, 1, 4, 5)), ValueError, "last dimension"),
        (dict(v=torch.randn(1, 1, 3, 3)), ValueError, "same length"),
        (dict(mask=torch.ones(3, 3)), ValueError, "mask of shape"),
        (dict(bias=torch.ones(1, 2, 4, 4)), ValueError, "bias of shape"),
    ],
)
def test_bad_input_is_rejected(kwargs, err, match):
    args = dict(q=torch.randn(1, 1, 4, 3), k=torch.randn(1, 1, 4, 3), v=torch.randn(1, 1, 4, 3))
    extra = {key: kwargs.pop(key) for key in ("mask", "bias") if key in kwargs}
    args.update(kwargs)
    with pytest.raises(err, match=match):
        rpe_attention_reference(args["q"], args["k"], args["v"], **extra)
