"""The attention weights that attention transfer matches: a core's N x N weights
(:meth:`flt.functional.AttentionCore.weights`) are the ones its output is made of, and the
softmax teacher's weights (eager attention) are the ones its layer's output is made of."""

from __future__ import annotations

import pytest
import torch

from flt.functional import AttentionCore

F64 = torch.float64
HEADS, HEAD_DIM, N = 2, 8, 13

#: (mechanism, options) whose weights form a distribution over the keys (causal): FLT's
#: logit coupling without and with its band (and a non-zero f, RoPE), Performer with each
#: feature map, Toeplitz, softmax with a relative term.
CASES = [
    ("flt", {"qk_norm": True}),
    ("flt", {"qk_norm": False, "amplitude": 0.7}),
    ("flt", {"qk_norm": False, "near_field": 3, "amplitude": 0.7}),
    ("flt", {"near_field": 4, "rope": True, "amplitude": 0.7}),
    ("performer", {}),
    ("performer", {"feature_map": "hedgehog", "num_features": 8}),
    ("performer", {"feature_map": "relu"}),
    ("performer", {"feature_map": "elu"}),
    ("performer", {"feature_map": "taylor"}),
    ("toeplitz", {}),
    ("softmax", {"relative_bias": "alibi"}),
]


def case_id(case) -> str:
    mechanism, options = case
    return "-".join([mechanism, *(f"{k}={v}" for k, v in options.items())])


def make_core(mechanism, options):
    seed = {} if mechanism == "softmax" else {"seed": 1}
    return AttentionCore(mechanism, heads=HEADS, head_dim=HEAD_DIM, causal=True, dtype=F64, **seed, **options)


def qkv(batch=2, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, HEADS, n, HEAD_DIM, dtype=F64, generator=g) for _ in range(3)]


@pytest.mark.parametrize("path", ["forward", "exact"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_weights_times_values_are_the_cores_output(case, path):
    core = make_core(*case)
    q, k, v = qkv()
    pos = (torch.arange(N) + 5).view(1, N).expand(2, N)  # position ids (Toeplitz needs a unit step), not token indices
    w = core.weights(q, k, pos, path=path)
    assert w.shape == (2, HEADS, N, N)
    torch.testing.assert_close(w @ v, getattr(core, path)(q, k, v, pos), rtol=0, atol=1e-10)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, HEADS, N, dtype=F64), rtol=0, atol=1e-12)
    assert torch.equal(w.triu(1), torch.zeros_like(w)), "a causal core gives no weight to later keys"
    assert bool((w >= 0).all())


def test_weights_of_the_last_queries_are_the_last_rows():
    core = make_core("flt", {"qk_norm": False, "near_field": 3, "amplitude": 0.7})
    q, k, _ = qkv()
    full = core.weights(q, k)
    torch.testing.assert_close(core.weights(q[:, :, -4:], k), full[:, :, -4:], rtol=0, atol=1e-12)


def test_weights_leave_padded_keys_out():
    core = make_core("performer", {})
    q, k, v = qkv()
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[1, :3] = True
    w = core.weights(q, k, key_padding_mask=pad)
    assert torch.equal(w[1, :, :, :3], torch.zeros_like(w[1, :, :, :3]))
    torch.testing.assert_close(w @ v, core(q, k, v, key_padding_mask=pad), rtol=0, atol=1e-10)


def test_flt_band_with_f_zero_gives_the_softmax_weights():
    """With f = 0, no query-key normalisation and a band covering every causal pair, FLT's
    estimator is exact: its weights are softmax(q.k / sqrt(D)) with the causal mask."""
    core = make_core("flt", {"qk_norm": False, "near_field": N})
    q, k, _ = qkv()
    logits = (q @ k.transpose(-1, -2)) / HEAD_DIM**0.5
    logits = logits.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(core.weights(q, k), logits.softmax(-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("mechanism", "options"), [("flt", {"coupling": "multiplicative"}),
                                                    ("softmax", {"relative_bias": "spectrum", "coupling": "multiplicative"})])
def test_signed_masks_are_refused(mechanism, options):
    core = make_core(mechanism, options)
    q, k, _ = qkv()
    with pytest.raises(ValueError, match="multiplicative"):
        core.weights(q, k)


def test_an_unknown_path_is_refused():
    core = make_core("performer", {})
    q, k, _ = qkv()
    with pytest.raises(ValueError, match="path"):
        core.weights(q, k, path="fast")
