"""Every ATTENTION entry through the same layer tests, parametrised from the registry."""

import pytest
import torch

from conftest import assert_close
from flt import ATTENTION, FLTAttention
from flt.layers import SoftmaxAttention, ToeplitzAttention
from flt.layers.upgrade import upgrade_state_dict
from flt.relative import alibi_slopes

F64 = torch.float64
NAMES = sorted(ATTENTION)
RELATIVE = {
    "softmax": dict(relative_bias="spectrum", amplitude=0.5),
    "toeplitz": dict(block_size=4, dense_below=0),  # the FFT routes; causal: dense 4-token blocks and FFT levels
    "flt": dict(amplitude=0.5),
    "performer": dict(rope=True),
}


def build(name, causal=False, **kw):
    return ATTENTION[name].from_options(16, 2, causal=causal, **kw).double()


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
    lay = ATTENTION[name].from_options(16, 2)
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
        lay = build(name, causal, coupling="multiplicative", amplitude=0.5)  # exact per draw; logit: tests/library/test_layers_flt.py
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
    assert_close(lay(x)[:, :8], lay(x2)[:, :8])


def test_softmax_with_spectrum_bias_is_the_exact_counterpart_of_flt():
    torch.manual_seed(0)
    for coupling in ("logit", "multiplicative"):
        flt_layer = FLTAttention.from_options(16, 2, coupling=coupling, qk_norm=False, amplitude=0.7, mean_scale=0.05).double()
        soft = SoftmaxAttention.from_options(16, 2, relative_bias="spectrum", coupling=coupling).double()
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
    layer = SoftmaxAttention.from_options(16, 2, relative_bias=bias, causal=True, **opts).double()
    x = torch.randn(3, 9, 16, dtype=F64, requires_grad=True)
    shared = torch.arange(9, dtype=F64).view(1, 9, 1)
    params = [p for p in layer.parameters() if p.requires_grad]
    for pos in (shared.expand(3, -1, -1), shared.repeat(3, 1, 1)):
        assert layer.core.positional_term(pos, F64).shape[0] == 1
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
    assert layer.core.positional_term(distinct, F64).shape[0] == 3
    # Positions that need a gradient keep one term per sequence, so each gets its own gradient.
    learned = shared.repeat(3, 1, 1).requires_grad_()
    if bias != "t5":
        layer(x, learned).pow(2).sum().backward()
        assert learned.grad is not None and torch.count_nonzero(learned.grad[1:]) > 0


def test_alibi_and_table_biases_against_hand_built_matrices():
    soft = SoftmaxAttention.from_options(16, 2, relative_bias="alibi").double()
    pos = torch.tensor([0.0, 1.0, 3.0], dtype=F64).view(1, 3, 1)
    slopes = alibi_slopes(2).double()
    dist = torch.tensor([[0, 1, 3], [1, 0, 2], [3, 2, 0]], dtype=F64)
    assert_close(soft.core.positional_term(pos, F64)[0], -slopes.view(2, 1, 1) * dist)
    t5 = SoftmaxAttention.from_options(16, 2, relative_bias="clipped", max_distance=1).double()
    with torch.no_grad():
        t5.table.table.copy_(torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]], dtype=F64))  # offsets -1, 0, +1
    pos = torch.arange(3, dtype=F64).view(1, 3, 1)
    expected_h0 = torch.tensor([[2, 3, 3], [1, 2, 3], [1, 1, 2]], dtype=F64)  # offset = key - query, clipped
    assert_close(t5.core.positional_term(pos, F64)[0, 0], 16.0 * expected_h0)  # default table_scale = 16
    bare = SoftmaxAttention.from_options(16, 2, relative_bias="clipped", max_distance=1, table_scale=1.0, learn_table_scale=False).double()
    bare.table.table.data.copy_(t5.table.table)
    assert_close(bare.core.positional_term(pos, F64)[0, 0], expected_h0)
    assert "relative.scale" not in dict(bare.core.named_parameters()) and "relative.scale" in dict(t5.core.named_parameters())


@pytest.mark.parametrize("relative_bias", ["t5", "clipped"])
def test_softmax_table_scale_multiplies_the_bias_and_learns(relative_bias):
    torch.manual_seed(0)
    layers = [
        SoftmaxAttention.from_options(16, 2, relative_bias=relative_bias, max_distance=20, table_scale=s).double() for s in (1.0, 4.0)
    ]
    with torch.no_grad():
        for lay in layers:
            lay.table.table.copy_(torch.linspace(-1, 1, lay.table.table.numel(), dtype=F64).view_as(lay.table.table))
    pos = torch.arange(12, dtype=F64).view(1, 12, 1)
    assert_close(layers[1].core.positional_term(pos, F64), 4.0 * layers[0].core.positional_term(pos, F64))
    x = torch.randn(2, 12, 16, dtype=F64)
    layers[1](x, pos).square().sum().backward()
    grad = layers[1].table.scale.grad
    assert grad is not None and bool(torch.all(grad != 0))


def test_softmax_alibi_distance_unit_and_learnable_slopes():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 16, dtype=F64)
    grid = torch.stack(torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1).view(1, 16, 2).double()
    patches = -0.75 + 0.5 * grid  # the 4 x 4 patch centres on [-1, 1]^2, spacing 0.5
    per_token = SoftmaxAttention.from_options(16, 2, pos_dim=2, relative_bias="alibi").double()
    per_patch = SoftmaxAttention.from_options(16, 2, pos_dim=2, relative_bias="alibi", alibi_unit=0.5).double()
    per_patch.load_state_dict(per_token.state_dict())
    # Measured in patch spacings, the patch centres are the integer grid.
    assert_close(per_patch.core.positional_term(patches, F64), per_token.core.positional_term(grid, F64))
    assert_close(per_patch(x, patches), per_token(x, grid))
    assert_close(per_patch(x, patches), per_patch(x, patches + 3.0))  # still relative
    # Learnable slopes: start at ALiBi's, stored as logs, trained.
    learned = SoftmaxAttention.from_options(16, 2, pos_dim=2, relative_bias="alibi", alibi_unit=0.5, alibi_learnable=True).double()
    learned.load_state_dict(per_patch.state_dict(), strict=False)
    # (built in float32 and converted: the logs are float32-accurate)
    assert_close(learned.relative.log_slopes.exp(), alibi_slopes(2).double(), dtype=torch.float32)
    assert_close(learned(x, patches), per_patch(x, patches), dtype=torch.float32)
    learned(x, patches).square().sum().backward()
    assert learned.relative.log_slopes.grad is not None and bool(torch.all(learned.relative.log_slopes.grad != 0))
    with pytest.raises(ValueError, match="alibi_unit"):
        SoftmaxAttention.from_options(16, 2, relative_bias="alibi", alibi_unit=0.0)


def test_toeplitz_bias_is_the_shared_clipped_table():
    torch.manual_seed(0)
    for causal in (False, True):
        lay = ToeplitzAttention.from_options(16, 2, causal=causal, max_distance=3, table_scale=2.0).double()
        assert lay.table.mode == "clipped" and lay.table.bidirectional is (not causal)
        with torch.no_grad():
            lay.table.table.normal_()
        n = 6
        bias = lay.core.bias(n)  # [H, 2n - 1], entry t + n - 1 for t = i - j
        for t in range(-(n - 1), n):
            key_minus_query = max(-3, min(-t, 0 if causal else 3))
            assert_close(bias[:, t + n - 1], 2.0 * lay.table.table[key_minus_query + 3])


@pytest.mark.parametrize("causal", [False, True])
def test_toeplitz_loads_state_dicts_from_before_the_shared_table(causal):
    """The old layout ``bias_table [H, 2M + 1]`` (entry ``t + M`` for ``t = i - j``, no scale)
    loads as the same function."""
    torch.manual_seed(0)
    m_dist, n = 3, 9
    lay = ToeplitzAttention.from_options(16, 2, causal=causal, max_distance=m_dist).double()
    old = {k: v for k, v in lay.state_dict().items() if not k.startswith("core.table.")}
    old["bias_table"] = torch.randn(2, 2 * m_dist + 1, dtype=F64)
    lay.load_state_dict(upgrade_state_dict(lay, old))
    t = torch.arange(-(n - 1), n).clamp(-m_dist, m_dist)
    expected = old["bias_table"][:, t + m_dist]
    live = slice(n - 1, None) if causal else slice(None)  # causal: only t >= 0 is ever read
    assert_close(lay.core.bias(n)[:, live], expected[:, live])
    assert_close(lay.table.scale, torch.ones(2, dtype=F64))


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_toeplitz_causal_outputs_ignore_huge_future_keys(dtype):
    """qk_norm=False: later tokens whose FAVOR+ key scale is the largest possible (the
    scaled key equal to the longest projection row, log scale |w|^2 / 2, about 50 here,
    against about 2 for the others) leave every earlier output unchanged. One key shift
    shared by the whole sequence (the layer's old stabiliser) underflowed the earlier keys
    and changed those outputs completely."""
    torch.manual_seed(0)
    dim, heads, n, past = 128, 2, 16, 10
    lay = ToeplitzAttention.from_options(dim, heads, causal=True, qk_norm=False, num_features=32, block_size=4, dense_below=0).to(dtype)
    hd = dim // heads
    with torch.no_grad():  # keys = the input itself (no bias), so the test can place a key anywhere
        lay.to_qkv.weight[dim : 2 * dim] = torch.eye(dim, dtype=dtype)
    proj = lay.feature_map.projection
    longest = proj[proj.norm(dim=-1).argmax()]  # [head_dim]
    x = torch.randn(1, n, dim, dtype=dtype)
    x2 = x.clone()
    x2[:, past:] = (hd**0.25 * longest).repeat(heads)  # scaled key = longest row in every head
    prepared = lay.prepare(x2, None, None)
    kls = lay.core.features(prepared.q, prepared.k, prepared.pos).key_log_scale
    assert float(kls[..., past:].min()) > float(kls[..., :past].max()) + 30
    out, out2 = lay(x), lay(x2)
    tol = 1e-12 if dtype == F64 else 1e-6
    assert (out2[:, :past] - out[:, :past]).abs().max() <= tol
    assert_close(out, lay.reference(x), scale=100)
    assert_close(out2, lay.reference(x2), scale=100)


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
    soft = SoftmaxAttention.from_options(16, 2, relative_bias="alibi", backend="flex")
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        soft(torch.randn(1, 5, 16))
    with torch.no_grad():
        reference = SoftmaxAttention.from_options(16, 2, relative_bias="alibi", backend="reference")
        reference.load_state_dict(soft.state_dict())
        x = torch.randn(1, 5, 16)
        torch.testing.assert_close(soft(x), reference(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda: ToeplitzAttention.from_options(16, 2, pos_dim=2), ValueError, "1-D regular grid"),
        (lambda: ToeplitzAttention.from_options(16, 2, dense_below=-1), ValueError, "dense_below must be a nonnegative int"),
        (lambda: ToeplitzAttention.from_options(16, 2)(torch.randn(1, 4, 16), torch.tensor([[0.0], [1.0], [3.0], [4.0]])), ValueError, "regular 1-D grid"),
        (lambda: ToeplitzAttention.from_options(16, 2, causal=True).step(torch.randn(1, 16)), NotImplementedError, "recurrent state"),
        (lambda: SoftmaxAttention.from_options(16, 2, relative_bias="t5", pos_dim=2), ValueError, "1-D integer offsets"),
        (lambda: SoftmaxAttention.from_options(16, 2, relative_bias="rotary"), ValueError, "relative_bias must be one of"),
        (lambda: SoftmaxAttention.from_options(16, 2, amplitude=1.0), ValueError, "spectrum options need relative_bias='spectrum'"),
        (lambda: SoftmaxAttention.from_options(16, 2, coupling="multiplicative"), ValueError, "relative_bias='spectrum' only"),
        (lambda: SoftmaxAttention.from_options(16, 2, backend="cuda"), ValueError, "backend must be one of"),
        (lambda: ATTENTION["performer"].from_options(16, 2, rope=True, pos_dim=3), ValueError, "rope needs head_dim"),
        (lambda: ATTENTION["performer"].from_options(16, 2)(torch.randn(1, 4, 16), torch.randn(1, 5, 1)), ValueError, "pos has 5 positions"),
    ],
)
def test_bad_input_is_rejected(call, err, match):
    with pytest.raises(err, match=match):
        call()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_float32(name, dtype):
    torch.manual_seed(0)
    lay = ATTENTION[name].from_options(16, 2, causal=True)
    x = torch.randn(2, 9, 16)
    ref = lay(x)
    out = lay.to(dtype)(x.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()) < 0.05


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_has_reference_and_exact_and_exact_is_what_the_fast_path_estimates(name):
    """``reference``: the same computation by the O(N^2) formula; ``exact``: the attention
    it estimates. Toeplitz and the kernel layers approximate theirs, the softmax layer is it."""
    torch.manual_seed(0)
    lay = build(name, **RELATIVE[name])
    x = torch.randn(2, 6, 16, dtype=F64)
    assert_close(lay.reference(x), lay(x))
    exact = lay.exact(x)
    assert exact.shape == x.shape and bool(torch.isfinite(exact).all())
    if name == "softmax":
        assert_close(exact, lay(x))
