"""Every ATTENTION entry through the same layer tests, parametrised from the registry."""

import pytest
import torch

from conftest import assert_close
from flt import ATTENTION, FLTAttention
from flt.layers import SoftmaxAttention, ToeplitzAttention
from flt.posenc.bias import alibi_slopes

F64 = torch.float64
NAMES = sorted(ATTENTION)
RELATIVE = {"softmax": dict(relative_bias="spectrum", amplitude=0.5), "toeplitz": {}, "flt": dict(amplitude=0.5), "performer": dict(rope=True)}


def build(name, causal=False, **kw):
    return ATTENTION[name](16, 2, causal=causal, **kw).double()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [False, True])
def test_fast_path_equals_its_reference_forward_and_backward(name, causal):
    lay = build(name, causal, **RELATIVE[name])
    with torch.no_grad():  # give the relative terms something to do
        for p in lay.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.3)
    x = torch.randn(2, 13, 16, dtype=F64, requires_grad=True)
    pad = torch.zeros(2, 13, dtype=torch.bool)
    pad[1, 10:] = True
    up = torch.randn(2, 13, 16, dtype=F64)
    fast = lay(x, key_padding_mask=pad)
    (gx_fast,) = torch.autograd.grad((fast * up).sum(), x)
    ref = lay.reference(x, key_padding_mask=pad)
    (gx_ref,) = torch.autograd.grad((ref * up).sum(), x)
    assert_close(fast, ref, scale=100)
    assert_close(gx_fast, gx_ref, scale=100)


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_trains(name):
    lay = ATTENTION[name](16, 2)
    x = torch.randn(2, 9, 16, requires_grad=True)
    lay(x).square().mean().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lay.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [False, True])
def test_relative_mechanisms_ignore_translations(name, causal):
    lay = build(name, causal, **RELATIVE[name])
    x = torch.randn(2, 11, 16, dtype=F64)
    pos = torch.arange(11, dtype=F64).view(1, 11, 1)
    shifted = pos + 37.0
    if name == "flt":
        lay = build(name, causal, coupling="multiplicative", amplitude=0.5)  # exact per draw; logit: tests/test_layers_flt.py
    if name == "performer":  # RoPE + FAVOR+: relative in expectation; its exact target exactly
        assert_close(lay.exact(x, shifted), lay.exact(x, pos))
        return
    assert_close(lay(x, shifted), lay(x, pos), scale=1000)


@pytest.mark.parametrize("name", [n for n in NAMES if ATTENTION[n].supports_decoding])
def test_decoding_matches_causal_forward(name):
    lay = build(name, causal=True, **RELATIVE[name])
    x = torch.randn(2, 9, 16, dtype=F64)
    state, outs = None, []
    for t in range(9):
        y, state = lay.step(x[:, t], state)
        outs.append(y)
    assert_close(torch.stack(outs, 1), lay(x))


@pytest.mark.parametrize("name", NAMES)
def test_causal_outputs_do_not_see_the_future(name):
    lay = build(name, causal=True, **RELATIVE[name])
    x = torch.randn(1, 12, 16, dtype=F64)
    x2 = x.clone()
    x2[:, 8:] = torch.randn(1, 4, 16, dtype=F64) * 5
    # FFT Toeplitz mixes all positions at the rounding level (documented in flt.ops.toeplitz).
    assert_close(lay(x)[:, :8], lay(x2)[:, :8], scale=1e4 if name == "toeplitz" else 1)


def test_softmax_with_spectrum_bias_is_the_exact_counterpart_of_flt():
    torch.manual_seed(0)
    for coupling in ("logit", "multiplicative"):
        flt_layer = FLTAttention(16, 2, coupling=coupling, qk_norm=False, amplitude=0.7, mean_scale=0.05).double()
        soft = SoftmaxAttention(16, 2, relative_bias="spectrum", coupling=coupling).double()
        soft.to_qkv.load_state_dict(flt_layer.to_qkv.state_dict())
        soft.to_out.load_state_dict(flt_layer.to_out.state_dict())
        soft.spectrum.load_state_dict(flt_layer.spectrum.state_dict())
        x = torch.randn(2, 10, 16, dtype=F64)
        assert_close(soft(x), flt_layer.exact(x))


@pytest.mark.parametrize("bias", ["spectrum", "alibi", "t5"])
def test_shared_positions_give_one_term_and_the_same_outputs(bias):
    """Positions equal across the batch: the bias is computed once, outputs and gradients unchanged."""
    torch.manual_seed(0)
    opts = {"amplitude": 0.5} if bias == "spectrum" else {}
    layer = SoftmaxAttention(16, 2, relative_bias=bias, causal=True, **opts).double()
    x = torch.randn(3, 9, 16, dtype=F64, requires_grad=True)
    shared = torch.arange(9, dtype=F64).view(1, 9, 1)
    params = [p for p in layer.parameters() if p.requires_grad]
    for pos in (shared.expand(3, -1, -1), shared.repeat(3, 1, 1)):
        assert layer.positional_term(pos, F64).shape[0] == 1
        out = layer(x, pos)
        rows = torch.cat([layer(x[b : b + 1], pos[b : b + 1]) for b in range(3)])
        assert_close(out, rows)
        upstream = torch.randn_like(out)
        g_once = torch.autograd.grad((out * upstream).sum(), [x, *params], allow_unused=True)
        g_rows = torch.autograd.grad((rows * upstream).sum(), [x, *params], allow_unused=True)
        for a, b in zip(g_once, g_rows):
            assert (a is None) == (b is None)
            if a is not None:
                assert_close(a, b)
    distinct = shared.repeat(3, 1, 1) * torch.tensor([1.0, 2.0, 3.0], dtype=F64).view(3, 1, 1)  # integer, unequal
    assert layer.positional_term(distinct, F64).shape[0] == 3
    # Positions that need a gradient keep one term per sequence, so each gets its own gradient.
    learned = shared.repeat(3, 1, 1).requires_grad_()
    if bias != "t5":
        layer(x, learned).pow(2).sum().backward()
        assert learned.grad is not None and torch.count_nonzero(learned.grad[1:]) > 0


def test_alibi_and_table_biases_against_hand_built_matrices():
    soft = SoftmaxAttention(16, 2, relative_bias="alibi").double()
    pos = torch.tensor([0.0, 1.0, 3.0], dtype=F64).view(1, 3, 1)
    slopes = alibi_slopes(2).double()
    dist = torch.tensor([[0, 1, 3], [1, 0, 2], [3, 2, 0]], dtype=F64)
    assert_close(soft.positional_term(pos, F64)[0], -slopes.view(2, 1, 1) * dist)
    t5 = SoftmaxAttention(16, 2, relative_bias="clipped", max_distance=1).double()
    with torch.no_grad():
        t5.table.table.copy_(torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]], dtype=F64))  # offsets -1, 0, +1
    pos = torch.arange(3, dtype=F64).view(1, 3, 1)
    expected_h0 = torch.tensor([[2, 3, 3], [1, 2, 3], [1, 1, 2]], dtype=F64)  # offset = key - query, clipped
    assert_close(t5.positional_term(pos, F64)[0, 0], expected_h0)


@pytest.mark.parametrize("name", ["softmax", "performer", "flt"])
def test_rope_option_makes_scores_relative(name):
    lay = build(name, rope=True)
    x = torch.randn(1, 8, 16, dtype=F64)
    pos = torch.randn(1, 8, 1, dtype=F64) * 4
    out1, out2 = lay(x, pos), lay(x, pos + 11.0)
    if name == "softmax":
        assert_close(out1, out2)
    else:  # RoPE rotations change FAVOR+'s inputs per draw; the exact target is relative
        assert_close(lay.exact(x, pos), lay.exact(x, pos + 11.0))
    assert not torch.allclose(lay(x, pos), lay(x, pos * 3))


def test_flex_backend_says_it_cannot_train_on_cpu():
    soft = SoftmaxAttention(16, 2, relative_bias="alibi", backend="flex")
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        soft(torch.randn(1, 5, 16))
    with torch.no_grad():
        reference = SoftmaxAttention(16, 2, relative_bias="alibi", backend="reference")
        reference.load_state_dict(soft.state_dict())
        x = torch.randn(1, 5, 16)
        torch.testing.assert_close(soft(x), reference(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda: ToeplitzAttention(16, 2, pos_dim=2), ValueError, "1-D regular grid"),
        (lambda: ToeplitzAttention(16, 2)(torch.randn(1, 4, 16), torch.tensor([[0.0], [1.0], [3.0], [4.0]])), ValueError, "regular 1-D grid"),
        (lambda: ToeplitzAttention(16, 2, causal=True).step(torch.randn(1, 16)), NotImplementedError, "recurrent state"),
        (lambda: SoftmaxAttention(16, 2, relative_bias="t5", pos_dim=2), ValueError, "1-D integer offsets"),
        (lambda: SoftmaxAttention(16, 2, relative_bias="rotary"), ValueError, "relative_bias must be one of"),
        (lambda: SoftmaxAttention(16, 2, amplitude=1.0), ValueError, "spectrum options need relative_bias='spectrum'"),
        (lambda: SoftmaxAttention(16, 2, coupling="multiplicative"), ValueError, "relative_bias='spectrum' only"),
        (lambda: SoftmaxAttention(16, 2, backend="cuda"), ValueError, "backend must be one of"),
        (lambda: ATTENTION["performer"](16, 2, rope=True, pos_dim=3), ValueError, "rope needs head_dim"),
        (lambda: ATTENTION["performer"](16, 2)(torch.randn(1, 4, 16), torch.randn(1, 5, 1)), ValueError, "pos has 5 positions"),
    ],
)
def test_bad_input_is_rejected(call, err, match):
    with pytest.raises(err, match=match):
        call()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_float32(name, dtype):
    torch.manual_seed(0)
    lay = ATTENTION[name](16, 2, causal=True)
    x = torch.randn(2, 9, 16)
    ref = lay(x)
    out = lay.to(dtype)(x.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()) < 0.05
