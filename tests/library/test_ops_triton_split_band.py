"""FLT's band on the feature-split kernels (:func:`flt.ops.triton.band.band_attention_split`,
:func:`flt.ops.triton.split.favor_sums_split`) against the float64 quadratic references, on
CPU tensors under triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``
without CUDA); tiny shapes. Skipped when triton is not installed."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close

from flt.ops.band import band_attention_reference
from flt.ops.features import favor_plus_features_split, gaussian_orthogonal_random_matrix

pytest.importorskip("triton", reason="triton is not installed (the optional extra 'triton')")

# The kernels run under Triton's interpreter here: minutes on a CPU, so they are left out of
# the default run (-m interpreter runs them; CI does, with the slow tests).
pytestmark = pytest.mark.interpreter

from flt.ops.triton import interpreted  # noqa: E402
from flt.ops.triton.band import band_attention_split  # noqa: E402
from flt.ops.triton.split import favor_sums_split  # noqa: E402

B, H, N, D, E, DV, M = 2, 2, 37, 8, 4, 5, 24  # N: two chunks of 16 and a tail; m: a block of 16 and a ragged one


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    if not interpreted():
        pytest.skip("the triton kernels are compiled for the GPU in this process; run with TRITON_INTERPRET=1 to test them on CPU")


def _inputs(width, *, n=N, extra_batch=1, dtype=torch.float64):
    """Scaled queries/keys, values, projection, the band's bias and the far field's
    spectral features, all leaves that require gradients."""
    xq, xk = (0.5 * torch.randn(B, H, n, D, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, n, DV, dtype=dtype)
    w = gaussian_orthogonal_random_matrix(M, D + E, dtype=torch.float64).to(dtype)
    bias = torch.randn(1, H, n, 2 * width + 1, dtype=dtype)
    a, c = (0.5 * torch.randn(extra_batch, H, n, E, dtype=dtype) for _ in range(2))
    leaves = [t.requires_grad_() for t in (xq, xk, v, bias, a, c)]
    return leaves, w


def _key_mask(n=N):
    """Padded keys at the start of sequence 0 (causal rows with no key at all) and at the
    end of sequence 1."""
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, -6:] = False
    return mask


def _reference(xq, xk, v, bias, a, c, w, width, causal, key_mask=None):
    """The O(N^2) formula on features made by :func:`flt.ops.features.favor_plus_features_split`."""
    qf, q_shift = favor_plus_features_split(xq, a, w)
    kf, k_shift = favor_plus_features_split(xk, c, w)
    return band_attention_reference(xq, xk, v, qf, kf, q_shift, k_shift, bias, width=width, causal=causal, key_mask=key_mask)


def _assert_gradients_match(out, ref, leaves, *, dtype=None):
    """Same values, and the same gradients of every leaf for a random upstream gradient (a
    leaf a side does not use has zeros)."""
    assert_close(out, ref, dtype=dtype)
    up = torch.randn_like(ref)
    got = torch.autograd.grad((out * up.to(out.dtype)).sum(), leaves, allow_unused=True, materialize_grads=True)
    want = torch.autograd.grad((ref * up).sum(), leaves, allow_unused=True, materialize_grads=True)
    for g, g_ref, leaf in zip(got, want, leaves, strict=True):
        assert g.shape == leaf.shape
        assert_close(g, g_ref, dtype=dtype)


# (width, extra_q/extra_k batch, keys padded, segments): a band narrower than the chunk of
# 16 tokens, with extra given once for the batch; wider than the chunk (blocks of 20), with
# extra per sequence and padded keys; a narrow band over the kernels' three segments.
CASES = [(3, 1, True, None), (20, B, True, None), (5, 1, False, 3)]


@pytest.mark.parametrize("width,extra_batch,pad,segments", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_band_split_matches_reference_float64(causal, width, extra_batch, pad, segments):
    """Values and the gradients of ``xq, xk, v, band_bias, extra_q, extra_k`` equal autograd of
    the O(N^2) formula, with a ragged N and m."""
    leaves, w = _inputs(width, extra_batch=extra_batch)
    key_mask = _key_mask() if pad else None
    out = band_attention_split(*leaves[:3], w, leaves[3], width=width, extra_q=leaves[4], extra_k=leaves[5], causal=causal,
                               key_mask=key_mask, segments=segments)
    assert out.dtype == torch.float64 and out.shape == (B, H, N, DV)
    _assert_gradients_match(out, _reference(*leaves, w, width, causal, key_mask), leaves)


@pytest.mark.parametrize("causal", [False, True])
def test_sums_are_the_true_favor_sums(causal):
    """``total * exp(level)`` is ``sum_j phi(q_i).phi(k_j) [v_j, 1]`` on the scale of
    ``exp(q.k)`` (the query's ``-|x|^2 / 2`` and ``m^(-1/2)`` in it), and so is its
    gradient: a sum, not a ratio, so nothing cancels."""
    leaves, w = _inputs(1, extra_batch=B)
    xq, xk, v, _, a, c = leaves
    key_mask = _key_mask()
    total, level = favor_sums_split(xq, xk, v, w, causal=causal, extra_q=a, extra_k=c, key_mask=key_mask)
    assert total.shape == (B, H, N, DV + 1) and level.shape == (B, H, N) and not level.requires_grad
    qf, q_shift = favor_plus_features_split(xq, a, w)
    kf, k_shift = favor_plus_features_split(xk, c, w)
    weights = (qf @ kf.transpose(-1, -2)) * torch.exp(q_shift.unsqueeze(-1) + k_shift.unsqueeze(-2)) * key_mask[:, None, None, :]
    if causal:
        weights = weights.tril()
    sums = weights @ torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    if causal:  # the rows before sequence 0's first valid key: nothing, at a level far below any other
        assert torch.equal(total[0, :, :3], torch.zeros_like(total[0, :, :3])) and (level[0, :, :3] < -1e29).all()
    _assert_gradients_match(total * torch.exp(level).unsqueeze(-1), sums, [xq, xk, v, a, c])


def test_band_wider_than_the_sequence_has_no_far_field():
    """``w + 1 >= N``: causal, every pair is in the band (the kernels are not launched);
    bidirectionally the far field is the estimate minus all of itself."""
    leaves, w = _inputs(12, n=13)
    for causal in (True, False):
        out = band_attention_split(*leaves[:3], w, leaves[3], width=12, extra_q=leaves[4], extra_k=leaves[5], causal=causal)
        _assert_gradients_match(out, _reference(*leaves, w, 12, causal), leaves)


def test_float32_rows_without_far_keys():
    """float32 inputs: a causal row with no far key has a far level near -1e30, which must not
    reach the band's exponents (it would round them all to one value): the float64
    reference within float32's tolerance."""
    leaves, w = _inputs(4, n=21, dtype=torch.float32)
    key_mask = _key_mask(21)
    wide = [t.detach().double().requires_grad_() for t in leaves]
    out = band_attention_split(*leaves[:3], w, leaves[3], width=4, extra_q=leaves[4], extra_k=leaves[5], causal=True,
                               key_mask=key_mask)
    assert out.dtype == torch.float32
    ref = _reference(*wide, w.double(), 4, True, key_mask)
    assert_close(out, ref, dtype=torch.float32)


def test_bad_arguments_are_named():
    leaves, w = _inputs(3)
    xq, xk, v, bias, a, c = (t.detach() for t in leaves)
    with pytest.raises(ValueError, match="extra_q and extra_k are required"):
        band_attention_split(xq, xk, v, w[:, :D], bias, width=3, extra_q=None, extra_k=None)
    with pytest.raises(ValueError, match="band_bias must be"):
        band_attention_split(xq, xk, v, w, bias, width=4, extra_q=a, extra_k=c)
    with pytest.raises(ValueError, match=r"block_size \(2\) must be at least width \(3\)"):
        band_attention_split(xq, xk, v, w, bias, width=3, extra_q=a, extra_k=c, block_size=2)
    with pytest.raises(ValueError, match="feature_block must be a power of two"):
        band_attention_split(xq, xk, v, w, bias, width=3, extra_q=a, extra_k=c, feature_block=24)


@pytest.mark.parametrize("far_field", [True, "constant"])
@pytest.mark.parametrize("causal", [False, True])
def test_layer_band_backend_triton_split_matches_torch(causal, far_field, monkeypatch):
    """``FLTAttention`` with ``near_field`` and ``backend="triton-split"`` computes the PyTorch
    layer's forward and the gradients of its input and parameters in float64, with padded
    keys bidirectionally; beyond the band the far field's random features, or the learnt
    constant (its constant features go through the same kernels). (Its queries are L2-normalised, so only the parameters' gradients,
    the temperature's, see the query's ``-|x|^2 / 2``.)"""
    from flt.layers.registry import ATTENTION
    from flt.ops.triton import split

    calls = []
    monkeypatch.setattr(split, "favor_sums_split", lambda *args, **kw: calls.append(1) or favor_sums_split(*args, **kw))

    kw = dict(causal=causal, num_features=24, num_frequencies=4, near_field=4, near_relative="clipped", far_field=far_field,
              dtype=torch.float64, seed=2)
    torch_layer = ATTENTION["flt"].from_options(16, 2, **kw)
    split_layer = ATTENTION["flt"].from_options(16, 2, backend="triton-split", **kw)
    with torch.no_grad():
        for p in torch_layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    split_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(2, 29, 16, dtype=torch.float64, requires_grad=True)
    pad = None if causal else torch.zeros(2, 29, dtype=torch.bool).index_fill_(1, torch.tensor([26, 27, 28]), True)
    out, ref = split_layer(x, key_padding_mask=pad), torch_layer(x, key_padding_mask=pad)
    assert calls == [1]  # the far field ran on the split kernels
    assert_close(out, ref)
    up = torch.randn_like(out)
    names = [name for name, p in torch_layer.named_parameters() if p.requires_grad]
    g_out = torch.autograd.grad((out * up).sum(), [x, *(dict(split_layer.named_parameters())[n] for n in names)], allow_unused=True,
                                materialize_grads=True)
    g_ref = torch.autograd.grad((ref * up).sum(), [x, *(dict(torch_layer.named_parameters())[n] for n in names)], allow_unused=True,
                                materialize_grads=True)
    for got, want in zip(g_out, g_ref, strict=True):
        assert_close(got, want)
