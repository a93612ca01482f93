"""ALiBi, T5 buckets and learned relative bias tables."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close

from flt.posenc import patch_grid
from flt.relative import RelativeBiasTable, alibi_bias, alibi_slopes, clipped_relative_indices, t5_relative_buckets


def _t5_reference(offset: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """The T5 bucket formula evaluated term by term for one integer offset (key - query)."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if offset > 0:
            bucket += num_buckets
        dist = abs(offset)
    else:
        dist = max(-offset, 0)
    exact = num_buckets // 2
    if dist < exact:
        return bucket + dist
    v = math.log(dist / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    if abs(v - round(v)) < 1e-9:  # exact boundary (e.g. dist = 16 with the defaults): the true value is an integer
        v = round(v)
    return bucket + min(exact + math.floor(v), num_buckets - 1)


def test_alibi_slopes_hand_values():
    assert alibi_slopes(8, dtype=torch.float64).tolist() == [2.0**-k for k in range(1, 9)]
    assert alibi_slopes(2, dtype=torch.float64).tolist() == [2.0**-4, 2.0**-8]
    assert alibi_slopes(1, dtype=torch.float64).tolist() == [2.0**-8]
    # Not a power of two: the 4-head slopes, then every other 8-head slope.
    assert alibi_slopes(6, dtype=torch.float64).tolist() == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]
    twelve = alibi_slopes(12, dtype=torch.float64).tolist()
    assert twelve[:8] == [2.0**-k for k in range(1, 9)]
    assert twelve[8:] == pytest.approx([2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5], rel=1e-15)
    with pytest.raises(ValueError, match="heads"):
        alibi_slopes(0)


def test_alibi_bias_hand_built():
    pos = torch.tensor([[[0.0], [1.0], [3.0]]], dtype=torch.float64)
    slopes = torch.tensor([1 / 16, 1 / 256], dtype=torch.float64)
    dist = torch.tensor([[0, 1, 3], [1, 0, 2], [3, 2, 0]], dtype=torch.float64)
    expected = torch.stack((-dist / 16, -dist / 256)).unsqueeze(0)
    assert_close(alibi_bias(pos, pos, slopes), expected)
    # Rectangular, 2-D (Euclidean): (0,0)-(3,4) is 5 apart, (0,0)-(1,0) is 1.
    q = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    k = torch.tensor([[3.0, 4.0], [1.0, 0.0]], dtype=torch.float64)
    expected = torch.tensor([[[[-2.5, -0.5]]]], dtype=torch.float64)
    assert_close(alibi_bias(q, k, torch.tensor([0.5], dtype=torch.float64)), expected)


def test_alibi_bias_is_relative_and_differentiable():
    pos = (5 * torch.randn(2, 6, 3, dtype=torch.float64)).requires_grad_()
    slopes = alibi_slopes(4, dtype=torch.float64)
    bias = alibi_bias(pos, pos, slopes)
    assert bias.shape == (2, 4, 6, 6)
    assert_close(alibi_bias(pos + 11.0, pos + 11.0, slopes), bias)
    (bias * torch.randn_like(bias)).sum().backward()  # zero distances on the diagonal
    assert bool(torch.isfinite(pos.grad).all())


def test_alibi_bad_inputs():
    s = alibi_slopes(2)
    with pytest.raises(ValueError, match="pos_k"):
        alibi_bias(torch.zeros(1, 3, 2), torch.zeros(1, 3, 1), s)
    with pytest.raises(ValueError, match="non-finite"):
        alibi_bias(torch.full((1, 3, 1), float("nan")), torch.zeros(1, 3, 1), s)
    with pytest.raises(ValueError, match="slopes"):
        alibi_bias(torch.zeros(1, 3, 1), torch.zeros(1, 3, 1), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="batch"):
        alibi_bias(torch.zeros(2, 3, 1), torch.zeros(3, 3, 1), s)


def test_t5_buckets_hand_computed():
    # Defaults, bidirectional: 16 buckets per direction, 8 exact; beyond, 8 + floor(log(d/8)/log(16) * 8).
    offsets = torch.tensor([0, -1, -7, -8, -11, -12, -16, -20, -32, -64, -100, -127, -128, -5000, 3, 8, 5000])
    expected = [0, 1, 7, 8, 8, 9, 10, 10, 12, 14, 15, 15, 15, 15, 19, 24, 31]
    assert t5_relative_buckets(offsets, bidirectional=True).tolist() == expected
    # Unidirectional: 32 buckets for the past, 16 exact; future offsets share bucket 0.
    offsets = torch.tensor([5, 0, -5, -15, -16, -20, -127, -128])
    assert t5_relative_buckets(offsets, bidirectional=False).tolist() == [0, 0, 5, 15, 16, 17, 31, 31]


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (16, 64), (10, 50), (64, 1000)])
def test_t5_buckets_match_the_formula(bidirectional, num_buckets, max_distance):
    offsets = torch.arange(-3 * max_distance, 3 * max_distance + 1)
    got = t5_relative_buckets(offsets.double(), bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    expected = [_t5_reference(int(o), bidirectional, num_buckets, max_distance) for o in offsets]
    assert got.tolist() == expected
    assert int(got.min()) == 0 and int(got.max()) == num_buckets - 1  # every bucket is reachable at the ends


def test_clipped_indices():
    offsets = torch.tensor([-10, -3, -1, 0, 2, 3, 10])
    assert clipped_relative_indices(offsets, max_distance=3, bidirectional=True).tolist() == [0, 0, 2, 3, 5, 6, 6]
    assert clipped_relative_indices(offsets, max_distance=3, bidirectional=False).tolist() == [0, 0, 2, 3, 3, 3, 3]


@pytest.mark.parametrize("mode, bidirectional", [("t5", True), ("t5", False), ("clipped", True), ("clipped", False)])
def test_relative_bias_table_lookup(mode, bidirectional):
    heads, max_distance = 3, 6
    kwargs = {"num_buckets": 8} if mode == "t5" else {}
    layer = RelativeBiasTable(
        heads, mode=mode, max_distance=max_distance, bidirectional=bidirectional, dtype=torch.float64, **kwargs
    )
    assert bool((layer(torch.arange(5.0).reshape(5, 1)) == 0).all())  # zero init: no bias
    assert_close(layer.scale, torch.full((heads,), 16.0, dtype=torch.float64))  # the default table_scale
    with torch.no_grad():
        layer.table.copy_(torch.randn_like(layer.table))
        layer.scale.copy_(torch.tensor([0.5, 3.0, -2.0]))
    pos_q = torch.tensor([[0.0, 3.0, 4.0, 20.0], [5.0, 6.0, 7.0, 8.0]]).unsqueeze(-1)
    pos_k = torch.tensor([[0.0, 1.0, 2.0], [9.0, 0.0, 30.0]]).unsqueeze(-1)
    bias = layer(pos_q, pos_k)
    assert bias.shape == (2, heads, 4, 3)
    for b in range(2):
        for i in range(4):
            for j in range(3):
                offset = int(pos_k[b, j, 0] - pos_q[b, i, 0])
                if mode == "t5":
                    row = _t5_reference(offset, bidirectional, 8, max_distance)
                else:
                    row = max(-max_distance, min(offset, max_distance if bidirectional else 0)) + max_distance
                assert_close(bias[b, :, i, j], layer.scale * layer.table[row])
    assert_close(layer(pos_q + 17, pos_k + 17), bias)  # relative: integer translations change nothing
    bias.sum().backward()
    assert layer.table.grad is not None and bool(layer.table.grad.abs().sum() > 0)
    assert layer.scale.grad is not None and bool(layer.scale.grad.abs().sum() > 0)


@pytest.mark.parametrize("mode", ["t5", "clipped"])
def test_relative_bias_table_scale_semantics(mode):
    """``bias = scale * table``: the scale multiplies the bias and the table's gradient (the
    effective learning rate), and receives ``sum(grad_bias * table)`` itself."""
    pos = torch.arange(40.0).reshape(1, 40, 1)
    bare = RelativeBiasTable(3, mode=mode, max_distance=20, table_scale=1.0, learn_scale=False, dtype=torch.float64)
    scaled = RelativeBiasTable(3, mode=mode, max_distance=20, table_scale=16.0, dtype=torch.float64)
    assert [n for n, _ in bare.named_parameters()] == ["table"] and "scale" in dict(bare.named_buffers())
    assert sorted(n for n, _ in scaled.named_parameters()) == ["scale", "table"]
    with torch.no_grad():
        bare.table.normal_()
        scaled.table.copy_(bare.table)
    upstream = torch.randn(1, 3, 40, 40, dtype=torch.float64)
    b_bare, b_scaled = bare(pos), scaled(pos)
    assert_close(b_scaled, 16.0 * b_bare)
    (b_bare * upstream).sum().backward()
    (b_scaled * upstream).sum().backward()
    assert_close(scaled.table.grad, 16.0 * bare.table.grad)
    # d bias[h] / d scale[h] = table[:, h] gathered: the scale's gradient is <upstream, bias / scale>.
    assert_close(scaled.scale.grad, (upstream * b_bare).sum(dim=(0, 2, 3)))
    # lookup() is the same function of offsets.
    offsets = torch.tensor([-30, -2, 0, 5, 30])
    assert_close(scaled.lookup(offsets), 16.0 * bare.table[bare.indices(offsets)])


def test_relative_bias_table_loads_state_dicts_without_scale():
    """A state dict saved before the scale existed holds ``bias = table``: it loads with scale 1."""
    old = RelativeBiasTable(2, mode="clipped", max_distance=4, table_scale=1.0, learn_scale=False)
    with torch.no_grad():
        old.table.normal_()
    new = RelativeBiasTable(2, mode="clipped", max_distance=4)
    new.load_state_dict({"table": old.table.detach().clone()})
    pos = torch.arange(7.0).reshape(7, 1)
    assert_close(new(pos), old(pos))
    assert isinstance(new.scale, torch.nn.Parameter) and new.scale.tolist() == [1.0, 1.0]
    # A current state dict keeps its scale.
    again = RelativeBiasTable(2, mode="clipped", max_distance=4, table_scale=3.0)
    again.load_state_dict(new.state_dict() | {"scale": torch.tensor([5.0, 6.0])})
    assert again.scale.tolist() == [5.0, 6.0]


def test_alibi_distance_unit():
    """``-slope |r_i - r_j| / unit``: scaling positions and unit together changes nothing, and
    the patch spacing as unit makes patch centres the integer grid ALiBi was designed for."""
    slopes = alibi_slopes(4, dtype=torch.float64)
    pos = torch.randn(2, 7, 2, dtype=torch.float64)
    bias = alibi_bias(pos, pos, slopes, unit=0.3)
    assert_close(bias, alibi_bias(pos, pos, slopes) / 0.3)
    for a in (1e-3, 0.5, 7.0, 1e4):
        assert_close(alibi_bias(a * pos, a * pos, slopes, unit=0.3 * a), bias)
    n = 4
    ij = torch.stack(torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij"), -1).reshape(1, n * n, 2).double()
    centres = patch_grid(n, dtype=torch.float64).unsqueeze(0)  # spacing 2 / n = 0.5, same order as ij
    assert_close(centres, -1 + (2 * ij + 1) / n)
    assert_close(alibi_bias(centres, centres, slopes, unit=2 / n), alibi_bias(ij, ij, slopes))
    # Neighbouring patches get -slope (with unit 1: -slope / 2, and the far corners -2.12 slope).
    assert_close(alibi_bias(centres[:, :2], centres[:, :2], slopes, unit=0.5)[0, :, 0, 1], -slopes)
    # Learnable slopes: the gradient reaches them.
    log_slopes = slopes.log().requires_grad_()
    alibi_bias(centres, centres, log_slopes.exp(), unit=0.5).sum().backward()
    assert bool((log_slopes.grad < 0).all())
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="unit"):
            alibi_bias(pos, pos, slopes, unit=bad)


def test_relative_bias_table_bad_inputs():
    layer = RelativeBiasTable(2, max_distance=16)
    with pytest.raises(ValueError, match="integer-valued"):
        layer(torch.tensor([[[0.5]]]))
    with pytest.raises(ValueError, match="1-D"):
        layer(torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match="non-finite"):
        layer(torch.tensor([[[float("nan")]]]))
    with pytest.raises(ValueError, match="num_buckets"):
        RelativeBiasTable(2, mode="clipped", num_buckets=8)
    with pytest.raises(ValueError, match="num_buckets"):
        RelativeBiasTable(2, num_buckets=7)
    with pytest.raises(ValueError, match="max_distance"):
        RelativeBiasTable(2, num_buckets=32, max_distance=8)
    with pytest.raises(ValueError, match="mode"):
        RelativeBiasTable(2, mode="rotary")
    with pytest.raises(ValueError, match="table_scale"):
        RelativeBiasTable(2, table_scale=0.0)
    with pytest.raises(TypeError, match="learn_scale"):
        RelativeBiasTable(2, learn_scale=1)
    with pytest.raises(TypeError, match="bidirectional"):
        t5_relative_buckets(torch.zeros(3), bidirectional=1)


def test_agrees_with_x_transformers():
    # Peer check. x-transformers takes rel_pos = key - query like us and `causal = not bidirectional`;
    # it evaluates the log in float32, so it may differ exactly at integer boundary distances,
    # which are skipped here.
    xt = pytest.importorskip("x_transformers.x_transformers")
    for heads in (1, 2, 5, 8, 12, 16, 24):
        theirs = torch.tensor(xt.AlibiPositionalBias._get_slopes(heads), dtype=torch.float64)
        assert_close(alibi_slopes(heads, dtype=torch.float64), theirs)
    offsets = torch.arange(-300, 301)
    for bidirectional in (True, False):
        ours = t5_relative_buckets(offsets, bidirectional=bidirectional)
        theirs = xt.RelativePositionBias._relative_position_bucket(offsets, causal=not bidirectional)
        dist = offsets.abs().double() if bidirectional else (-offsets).clamp(min=0).double()
        exact = 8 if bidirectional else 16
        v = torch.log(dist / exact) / math.log(128 / exact) * exact
        interior = (v - v.round()).abs() > 1e-6
        assert torch.equal(ours[interior], theirs[interior])
