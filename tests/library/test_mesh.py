"""The mesh sum (flt.ops.mesh) and the long-range block's mesh engine, against their float64
O(N^2) references and the exact kernels."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close, assert_same_gradients, random_rotation

from flt._limits import MemoryLimitError
from flt.layers.longrange import LongRangeBlock, coulomb_tail
from flt.ops.mesh import (
    bspline_weights,
    mesh_kernel,
    mesh_sum,
    mesh_sum_reference,
    spline_transform,
)

DIM, HEADS = 8, 2


def tail_kernel(scale: torch.Tensor, alpha: float = 0.4):
    """``scale_h erf(alpha |r|) / |r|``: ``[..., P] -> [..., H]``, smooth on a unit mesh."""
    return lambda d: scale * coulomb_tail(d.norm(dim=-1, keepdim=True), alpha)


def cubic(y: float) -> float:
    """The centred cubic B-spline, written out."""
    y = abs(y)
    return 2 / 3 - y * y + y ** 3 / 2 if y < 1 else ((2 - y) ** 3 / 6 if y < 2 else 0.0)


@pytest.mark.parametrize("order", [2, 3, 4, 5, 6])
def test_bspline_weights_are_a_partition_of_unity_that_reproduces_lines(order):
    u = torch.tensor([-3.7, -0.5, 0.0, 0.25, 0.5, 0.999, 7.5], dtype=torch.float64)
    first, w = bspline_weights(u, order)
    node = first[:, None] + torch.arange(order)
    assert_close(w.sum(-1), torch.ones_like(u))
    assert_close((w * node).sum(-1), u)
    assert (w >= 0).all()
    assert ((u[:, None] - node).abs() <= order / 2 + 1e-12).all()  # every node within the support


def test_cubic_weights_are_the_written_out_spline():
    u = torch.linspace(-2.3, 3.1, 41, dtype=torch.float64)
    first, w = bspline_weights(u, 4)
    expected = torch.tensor([[cubic(float(x) - (int(f) + k)) for k in range(4)] for x, f in zip(u, first, strict=True)], dtype=torch.float64)
    assert_close(w, expected)


def test_spline_transform_is_the_splines_dft_squared():
    """The influence function's denominator: the DFT of the cubic spline at the nodes
    (1/6, 2/3, 1/6), squared, on each axis: no zero, its least value (1/3)^2 per axis at the
    Nyquist frequency."""
    b = spline_transform(4, [8, 6], dtype=torch.float64)
    k0 = torch.arange(8, dtype=torch.float64)[:, None]
    k1 = torch.arange(4, dtype=torch.float64)[None, :]
    expected = ((2 + torch.cos(2 * math.pi * k0 / 8)) / 3) ** 2 * ((2 + torch.cos(2 * math.pi * k1 / 6)) / 3) ** 2
    assert_close(b, expected)
    assert b.min() == pytest.approx((1 / 9) ** 2)


@pytest.mark.parametrize("sharpen", [False, True])
@pytest.mark.parametrize("order", [2, 3, 4])
@pytest.mark.parametrize("pos_dim", [1, 2, 3])
def test_mesh_sum_is_its_pair_by_pair_form_forward_and_backward(pos_dim, order, sharpen):
    """The FFT, the pruned transforms and the sparse stencils against the O(N^2 p^2P) sum
    over stencil nodes with dense solves for the sharpening: values, positions and the
    kernel's parameters, odd N, one set with points that send nothing."""
    torch.manual_seed(pos_dim * 10 + order)
    B, N, D = 2, 7, 3
    pos = (1.7 * torch.randn(B, N, pos_dim, dtype=torch.float64)).requires_grad_()
    v = torch.randn(B, HEADS, N, D, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([1.0, -0.6], dtype=torch.float64, requires_grad=True)
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, :2] = False
    options = {"spacing": 0.7, "order": order, "sharpen": sharpen, "keep": keep}
    out = mesh_sum(pos, v, tail_kernel(scale), **options)
    ref = mesh_sum_reference(pos, v, tail_kernel(scale), **options)
    assert_same_gradients(out, ref, [pos, v, scale])


def test_isotropic_lookup_is_the_kernel_at_every_offset():
    block = LongRangeBlock(DIM, heads=HEADS, frequencies="radial", num_radii=3, dtype=torch.float64)
    like = torch.zeros((), dtype=torch.float64)
    direct = mesh_kernel(block.kernel.exact_mask, 0.8, [9, 10, 12], HEADS, like)
    looked_up = mesh_kernel(block.kernel.exact_mask, 0.8, [9, 10, 12], HEADS, like, isotropic=True)
    assert_close(looked_up, direct)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize(("order", "bound"), [(3, 1e-3), (4, 3e-4), (6, 1e-5)])
def test_sharpened_mesh_is_the_exact_sum_to_its_stated_error(order, bound):
    """``erf(0.4 r) / r`` on a mesh of 0.7 (``alpha spacing = 0.28``), 3-D: the sharpened
    mesh is the exact pair sum to the bound of docs/longrange.md, and the unsharpened one is
    not (so the bound is the sharpening's)."""
    torch.manual_seed(3)
    pos = 2 * torch.randn(2, 40, 3, dtype=torch.float64)
    v = torch.randn(2, HEADS, 40, 3, dtype=torch.float64)
    kernel = tail_kernel(torch.tensor([1.0, -0.5], dtype=torch.float64))
    exact = kernel(pos[:, :, None] - pos[:, None]).permute(0, 3, 1, 2) @ v
    sharp = _relative(mesh_sum(pos, v, kernel, spacing=0.7, order=order), exact)
    blunt = _relative(mesh_sum(pos, v, kernel, spacing=0.7, order=order, sharpen=False), exact)
    assert sharp < bound < blunt


def make_block(frequencies: str, *, normalised: bool = False, **options) -> LongRangeBlock:
    torch.manual_seed(1)
    block = LongRangeBlock(DIM, heads=HEADS, frequencies=frequencies, normalised=normalised, engine="mesh",
                           mesh_spacing=0.8, dtype=torch.float64, **options)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return block


def inputs(B: int = 2, N: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = torch.randn(B, N, DIM, dtype=torch.float64, requires_grad=True)
    pos = (2 * torch.randn(B, N, 3, dtype=torch.float64)).requires_grad_()
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[B - 1, N - 2:] = True
    return h, pos, pad


@pytest.mark.parametrize("normalised", [False, True])
@pytest.mark.parametrize("frequencies", ["radial", "coulomb", "discrete"])
def test_mesh_engine_is_its_reference_forward_and_backward(frequencies, normalised):
    block = make_block(frequencies, normalised=normalised)
    h, pos, pad = inputs()
    params = [p for p in block.parameters() if p.requires_grad]
    assert_same_gradients(block(h, pos, pad), block.reference(h, pos, pad), [h, pos, *params])


@pytest.mark.parametrize(("frequencies", "options", "bound"), [
    ("radial", {"shared": True, "num_radii": 16}, 2e-3),
    ("coulomb", {"heads": 1, "alpha": 0.3, "num_radii": 4, "width": 0.05}, 5e-3),
])
def test_mesh_engine_is_the_exact_sum_to_its_stated_error(frequencies, options, bound):
    """The configurations of docs/longrange.md on a unit mesh, 300 points at unit density:
    the block's update is the exact kernels' pair sum to the stated error."""
    torch.manual_seed(2)
    options = {"heads": HEADS, **options}
    block = LongRangeBlock(16, frequencies=frequencies, neutral=True, engine="mesh", dtype=torch.float64, **options)
    with torch.no_grad():
        block.out.weight.normal_()
    h = torch.randn(1, 300, 16, dtype=torch.float64)
    pos = torch.rand(1, 300, 3, dtype=torch.float64) * 300 ** (1 / 3)
    error = _relative(block(h, pos) - h, block.reference(h, pos, kernel="exact") - h)
    assert error < bound


def test_mesh_engine_is_translation_invariant_and_rotation_invariant_to_its_error():
    """A shift changes nothing (the mesh is anchored at the set's centre); a rotation changes
    the update by no more than the mesh's stated error."""
    block = make_block("radial")
    h, pos, pad = inputs(N=30)
    h, pos = h.detach(), pos.detach()
    out = block(h, pos, pad)
    assert_close(block(h, pos + torch.tensor([3.3, -7.1, 0.45], dtype=torch.float64), pad), out)
    rotated = block(h, pos @ random_rotation(4).T, pad)
    assert _relative(rotated - h, out - h) < 2e-3


def test_padding_neither_sends_nor_receives_through_the_mesh():
    block = make_block("coulomb")
    h, pos, pad = inputs()
    h, pos = h.detach(), pos.detach()
    out = block(h, pos, pad)
    moved_pos, moved_h = pos.clone(), h.clone()
    moved_pos[pad] = float("nan")
    moved_h[pad] = 5.0
    again = block(moved_h, moved_pos, pad)
    assert_close(again[~pad], out[~pad])
    assert_close(again[pad], moved_h[pad])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"engine": "fft"}, "engine"),
    ({"engine": "mesh", "content": "favor+"}, "content must be 'none'"),
    ({"engine": "mesh", "mesh_spacing": 0.0}, "mesh_spacing must be a finite number > 0"),
    ({"engine": "mesh", "mesh_order": 1}, "mesh_order must be at least 2"),
])
def test_bad_mesh_options_are_refused_with_their_name(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        LongRangeBlock(DIM, heads=HEADS, **kwargs)


def test_a_mesh_too_large_is_refused_before_it_is_allocated(monkeypatch):
    monkeypatch.setenv("FLT_MEMORY_LIMIT", "1MB")
    block = make_block("radial")
    h, pos, _ = inputs(N=50)
    with pytest.raises(MemoryLimitError, match=r"long-range block's mesh \(\d+x\d+x\d+ nodes"):
        block(h, 10 * pos)


@pytest.mark.parametrize("engine", ["features", "mesh"])
def test_a_narrower_value_is_summed_as_the_reference_sums_it(engine):
    """``value_dim`` sets each head's value width apart from ``d / H``: the projections change
    shape, and either engine still matches its pair-by-pair reference, forward and backward."""
    torch.manual_seed(5)
    block = LongRangeBlock(DIM, heads=HEADS, frequencies="radial", value_dim=3, engine=engine, mesh_spacing=0.8,
                           dtype=torch.float64)
    with torch.no_grad():
        block.out.weight.normal_()
    assert block.value.weight.shape == (HEADS * 3, DIM) and block.out.weight.shape == (DIM, HEADS * 3)
    h, pos, pad = inputs()
    assert_same_gradients(block(h, pos, pad), block.reference(h, pos, pad), [h, pos, block.value.weight])


def test_value_dim_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="value_dim must be a positive integer"):
        LongRangeBlock(DIM, heads=HEADS, value_dim=0)


def test_float_positions_of_another_dtype_than_the_values_are_rounded_once():
    """A float64 position just below a node that rounds onto it in float32: the mesh's extent
    and the stencils come from the same rounded positions (no stencil past the mesh)."""
    pos = torch.tensor([[[0.0], [2.99999999]]], dtype=torch.float64)
    v = torch.ones(1, 1, 2, 1, dtype=torch.float32, requires_grad=True)
    kernel = tail_kernel(torch.tensor([1.0]))
    for order in (2, 4):
        out = mesh_sum(pos, v, kernel, order=order)
        out.sum().backward()
        assert out.dtype == torch.float32
        assert_close(out, mesh_sum(pos.float(), v.detach(), kernel, order=order))


def test_float32_mesh_block_matches_its_float64_copy():
    block = make_block("coulomb")
    h, pos, pad = inputs(N=40)
    single = make_block("coulomb").float()
    assert_close(single(h.float(), pos.float(), pad), block(h, pos, pad).detach(), dtype=torch.float32, scale=10)


def test_a_second_derivative_is_refused_not_wrong():
    """The stencils' backward holds constant matrices; differentiating it again would drop
    the weights' terms, so it raises instead."""
    pos = torch.randn(1, 3, 1, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 3, 1, dtype=torch.float64)
    out = mesh_sum(pos, v, tail_kernel(torch.tensor([1.0], dtype=torch.float64)), order=3)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), pos, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.pow(2).sum().backward()


@pytest.mark.parametrize(("call", "message"), [
    (lambda p, v, k: mesh_sum(p[0], v, k), r"pos must have rank 3 \[B, N, P\]"),
    (lambda p, v, k: mesh_sum(p, v[0], k), r"v must have rank 4 \[B, H, N, Dv\]"),
    (lambda p, v, k: mesh_sum(p[:, :3], v, k), "pos .* and v .* must share B and N"),
    (lambda p, v, k: mesh_sum(p.long(), v, k), "pos must have a floating-point dtype"),
    (lambda p, v, k: mesh_sum(p.index_fill(1, torch.tensor([2]), float("nan")), v, k), "pos contains .*non-finite"),
    (lambda p, v, k: mesh_sum(p, v, k, keep=torch.ones(2, 5)), r"keep must be a bool tensor \[B, N\] = \[2, 5\]"),
    (lambda p, v, k: mesh_sum(p, v, k, keep=torch.ones(2, 4, dtype=torch.bool)), "keep must be a bool tensor"),
    (lambda p, v, k: mesh_sum(p, v, k, spacing=0.0), "spacing must be a finite number > 0"),
    (lambda p, v, k: mesh_sum(p, v, lambda d: d.norm(dim=-1, keepdim=True).expand(*d.shape[:-1], 3)), "kernel must map"),
])
def test_mesh_sum_refuses_bad_input_naming_the_argument(call, message):
    pos = torch.randn(2, 5, 3, dtype=torch.float64)
    v = torch.randn(2, HEADS, 5, 3, dtype=torch.float64)
    with pytest.raises((ValueError, TypeError), match=message):
        call(pos, v, tail_kernel(torch.tensor([1.0, 2.0], dtype=torch.float64)))


def test_an_empty_batch_sums_to_nothing():
    v = torch.randn(0, HEADS, 5, 3)
    assert mesh_sum(torch.randn(0, 5, 3), v, tail_kernel(torch.tensor([1.0, 2.0]))).shape == v.shape
