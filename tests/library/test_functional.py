"""flt.functional: a core on the caller's queries, keys and values equals the layer it
comes from (same weights), and its exact path equals the O(N^2) formula written out here."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close
from einops import rearrange

from flt.functional import AttentionCore, attention
from flt.layers import ATTENTION

DIM, HEADS = 16, 2
F64 = torch.float64

#: (mechanism, options): FLT in both couplings with its near sets, Performer, softmax with a relative term.
CASES = [
    ("flt", {"causal": True}),
    ("flt", {"coupling": "multiplicative"}),
    ("flt", {"causal": True, "near_field": 3}),
    ("flt", {"near_neighbors": 4}),
    ("flt", {"coupling": "multiplicative", "near_neighbors": 4}),
    ("performer", {"causal": True}),
    ("softmax", {"causal": True, "relative_bias": "alibi"}),
    ("softmax", {"relative_bias": "spectrum", "amplitude": 0.7}),
]


def split_heads(layer, x):
    return rearrange(layer.to_qkv(x), "b n (three h d) -> three b h n d", three=3, h=HEADS)


def through_out(layer, out):
    return layer.to_out(rearrange(out, "b h n d -> b n (h d)"))


@pytest.mark.parametrize("method", ["forward", "reference", "exact"])
@pytest.mark.parametrize(("mechanism", "options"), CASES, ids=[f"{m}-{'-'.join(map(str, o.values()))}" for m, o in CASES])
def test_core_equals_its_layer(mechanism, options, method):
    layer = ATTENTION[mechanism].from_options(DIM, HEADS, dtype=F64, seed=1, **options) if mechanism != "softmax" else \
        ATTENTION[mechanism].from_options(DIM, HEADS, dtype=F64, **options)
    x = torch.randn(2, 11, DIM, dtype=F64)
    pos = torch.randn(2, 11, 1, dtype=F64).cumsum(1)
    core = AttentionCore.from_layer(layer)
    q, k, v = split_heads(layer, x)
    expected = getattr(layer, method)(x, pos)
    assert_close(through_out(layer, getattr(core, method)(q, k, v, pos)), expected)


def test_core_holds_no_projections_and_shares_the_layers_parameters():
    layer = ATTENTION["flt"].from_options(DIM, HEADS, dtype=F64, near_field=2)
    core = AttentionCore.from_layer(layer)
    assert not any(name.startswith(("attention.to_qkv", "attention.to_out")) for name in core.state_dict())
    assert "to_qkv.weight" in layer.state_dict()  # the layer keeps them
    with torch.no_grad():
        layer.spectrum.mu.add_(0.5)
    assert torch.equal(core.attention.spectrum.mu, layer.spectrum.mu)
    built = AttentionCore("flt", heads=HEADS, head_dim=DIM // HEADS, dtype=F64, near_field=2)
    assert sorted(built.state_dict()) == sorted(core.state_dict())


def softmax_with_bias(q, k, v, bias, causal):
    """``softmax(q.k / sqrt(D) + bias) v`` written out."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    if causal:
        n = q.shape[2]
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return logits.softmax(-1) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_flt_exact_is_softmax_with_the_spectrums_bias(causal):
    core = AttentionCore("flt", heads=HEADS, head_dim=8, causal=causal, qk_norm=False, amplitude=0.8, dtype=F64)
    q, k, v = (torch.randn(2, HEADS, 10, 8, dtype=F64) for _ in range(3))
    pos = torch.randn(1, 10, 1, dtype=F64) * 3
    f = core.attention.spectrum.mask(pos.unsqueeze(2) - pos.unsqueeze(1))  # [1, N, N, H]
    assert f.abs().max() > 0.1  # a real bias, not the zero one
    expected = softmax_with_bias(q, k, v, rearrange(f, "b i j h -> b h i j"), causal)
    assert_close(core.exact(q, k, v, pos), expected)


def test_flt_exact_with_zero_spectrum_and_no_qk_norm_is_plain_softmax():
    q, k, v = (torch.randn(1, HEADS, 7, 8, dtype=F64) for _ in range(3))
    out = attention(q, k, v, core="flt", causal=True, qk_norm=False)  # amplitude 0: f = 0
    assert_close(AttentionCore("flt", heads=HEADS, head_dim=8, causal=True, qk_norm=False, dtype=F64).exact(q, k, v),
                 softmax_with_bias(q, k, v, 0.0, True))
    assert out.shape == v.shape


def test_fewer_queries_than_keys_are_the_last_rows():
    core = AttentionCore("flt", heads=HEADS, head_dim=8, causal=True, dtype=F64, seed=0, amplitude=0.5)
    q, k, v = (torch.randn(2, HEADS, 9, 8, dtype=F64) for _ in range(3))
    full = core(q, k, v)
    assert_close(core(q[:, :, -2:], k, v), full[:, :, -2:])
    with pytest.raises(ValueError, match="causal core"):
        AttentionCore("flt", heads=HEADS, head_dim=8, dtype=F64)(q[:, :, -2:], k, v)


def test_position_ids_are_one_dimensional_positions():
    core = AttentionCore("softmax", heads=HEADS, head_dim=8, causal=True, relative_bias="alibi", dtype=F64)
    q, k, v = (torch.randn(2, HEADS, 6, 8, dtype=F64) for _ in range(3))
    ids = torch.arange(3, 9).expand(2, 6)
    assert_close(core(q, k, v, ids), core(q, k, v, ids.unsqueeze(-1).to(F64)))


def test_functional_call_checks_its_arguments():
    q = torch.randn(1, HEADS, 5, 8)
    with pytest.raises(ValueError, match="heads=2, head_dim=4"):
        AttentionCore("performer", heads=HEADS, head_dim=4)(q, q, q)
    with pytest.raises(ValueError, match="mechanism must be one of"):
        AttentionCore("nope", heads=HEADS, head_dim=8)
    core = AttentionCore("performer", heads=HEADS, head_dim=8)
    with pytest.raises(ValueError, match="built with its own"):
        attention(q, q, q, core=core, causal=True)


@pytest.mark.parametrize(("mechanism", "options"), [
    ("flt", {"amplitude": 0.5}),
    ("flt", {"near_field": 2, "amplitude": 0.5}),
    ("flt", {"coupling": "multiplicative"}),
    ("performer", {}),
    ("softmax", {"relative_bias": "alibi"}),
])
def test_prefill_then_steps_equal_the_causal_forward(mechanism, options):
    extra = {} if mechanism == "softmax" else {"seed": 0, "num_features": 16}
    core = AttentionCore(mechanism, heads=HEADS, head_dim=8, causal=True, dtype=F64, **extra, **options)
    q, k, v = (torch.randn(2, HEADS, 9, 8, dtype=F64) for _ in range(3))
    full = core(q, k, v)
    out, state = core.prefill(q[:, :, :5], k[:, :, :5], v[:, :, :5])
    assert_close(out, full[:, :, :5])
    for t in range(5, 9):
        row, state = core.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state, pos=torch.tensor([[t]]))
        assert_close(row, full[:, :, t:t + 1])


def test_non_finite_positions_are_refused_for_every_mechanism():
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    pos = torch.rand(1, 8, 2, dtype=torch.float64)
    pos[0, 3, 1] = float("nan")
    for core in ("flt", "softmax", "performer"):
        with pytest.raises(ValueError, match="pos contains 1 non-finite value"):
            attention(q, q, q, pos=pos, core=core, pos_dim=2)


def test_the_core_is_named_by_every_call():
    """No default mechanism: neither softmax (what flt replaces) nor a fresh FLT estimator is every caller's."""
    q = torch.randn(1, HEADS, 5, 8)
    with pytest.raises(TypeError, match="core"):
        attention(q, q, q)


@pytest.mark.parametrize("mechanism", sorted(ATTENTION))
def test_a_core_built_from_a_name_gives_the_same_output_every_call(mechanism):
    q, k, v = (torch.randn(2, HEADS, 7, 8, dtype=F64) for _ in range(3))
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = attention(q, k, v, core=mechanism, causal=True)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is left alone
    assert torch.equal(attention(q, k, v, core=mechanism, causal=True), first)
    if mechanism != "softmax":  # an explicit seed still chooses the draws
        assert not torch.equal(attention(q, k, v, core=mechanism, causal=True, seed=7), first)


def test_positions_of_another_dimension_name_pos_dim():
    q = torch.randn(1, HEADS, 5, 8)
    pos = torch.rand(1, 5, 2)
    with pytest.raises(ValueError, match=r"pos has position dimension P = 2 .* built for pos_dim = 1; pass pos_dim=2"):
        attention(q, q, q, pos=pos, core="flt")
    with pytest.raises(ValueError, match="pass pos_dim=2"):
        AttentionCore("softmax", heads=HEADS, head_dim=8)(q, q, q, pos[0])
    assert attention(q, q, q, pos=pos, core="flt", pos_dim=2).shape == q.shape


@pytest.mark.parametrize(("mechanism", "options"), [*CASES, ("toeplitz", {"causal": True}), ("toeplitz", {}),
                                                    ("performer", {}), ("softmax", {})])
def test_no_tokens_give_an_empty_output(mechanism, options):
    """N = 0 was an IndexError (FLT), a ZeroDivisionError (causal Performer) or a RuntimeError (Toeplitz)."""
    q, k = torch.randn(2, HEADS, 0, 8), torch.randn(2, HEADS, 0, 8)
    v = torch.randn(2, HEADS, 0, 5)
    out = attention(q, k, v, core=mechanism, **options)
    assert out.shape == (2, HEADS, 0, 5) and out.dtype == v.dtype
    core = AttentionCore(mechanism, heads=HEADS, head_dim=8, **options)
    for method in ("forward", "reference", "exact"):
        assert getattr(core, method)(q, k, v).shape == (2, HEADS, 0, 5)
    if options.get("causal"):  # no new query against cached keys: no row either
        keys = torch.randn(2, HEADS, 4, 8)
        assert core(q, keys, torch.randn(2, HEADS, 4, 5)).shape == (2, HEADS, 0, 5)
        if core.attention.supports_decoding:
            with pytest.raises(ValueError, match="at least one token"):
                core.prefill(q, k, v)


def test_the_module_declares_its_public_names():
    import flt.functional

    assert set(flt.functional.__all__) == {"AttentionCore", "attention", "DEFAULT_SEED"}
