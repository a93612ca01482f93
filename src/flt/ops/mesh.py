"""A sum over all points through a mesh: ``out_i ~ sum_j f(r_i - r_j) v_j`` in
``O(N p^P Dv + M log M Dv)`` per head, for any kernel ``f`` that can be evaluated at offsets.

The particle-mesh method of molecular dynamics (Hockney and Eastwood; the reciprocal part of
particle-mesh Ewald), here without periodic boundaries:

1. **spread**: every point's value goes to the ``p^P`` mesh nodes around it, weighed by the
   cardinal B-spline of order ``p`` (:func:`bspline_weights`);
2. **convolve**: the mesh is convolved with ``f`` sampled at the mesh's offsets, by FFT on a
   mesh padded to twice its size (a linear convolution, no images);
3. **gather**: every point reads the convolved mesh back with the same weights.

So the sum is exactly ``sum_j F(r_i, r_j) v_j`` with the mesh kernel ``F(r_i, r_j) = sum_a
sum_b W(r_i - g_a) f(g_a - g_b) W(r_j - g_b)`` (:func:`mesh_sum_reference`, its O(N^2)
form), which is ``f`` smoothed by the B-spline twice, and nearly translation invariant:
``F`` depends on where the points sit between the nodes by an amount that falls with the
order and with the kernel's smoothness on the mesh's scale. For a kernel smooth on that
scale (a ``1 / r`` tail ``erf(alpha r) / r`` with ``alpha spacing`` at most about 0.5, sincs
of radii well below ``1 / (2 spacing)``) ``F`` is ``f`` to about a percent; near ``r = 0``
and for kernels with structure finer than the mesh it is not (docs/longrange.md states the
measured errors). The cost does not depend on the kernel: a kernel that holds to any reach
costs the same, where a cosine sum needs more frequencies for a larger reach.

Shapes: positions ``pos [B, N, P]``, values ``v [B, H, N, Dv]``, the kernel a callable
``offsets [..., P] -> [..., H]``; ``out [B, H, N, Dv]``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from einops import rearrange
from torch.autograd.function import once_differentiable

from flt._checks import check_finite, check_positive_float, check_positive_int, check_tensor
from flt.ops.toeplitz import fft_length

#: A kernel evaluated at offsets: ``[..., P] -> [..., H]``.
Kernel = Callable[[torch.Tensor], torch.Tensor]


def bspline_weights(u: torch.Tensor, order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first [...] long, w [..., order])``: the nodes ``first + k`` (``k < order``) whose
    centred cardinal B-spline of order ``order`` (degree ``order - 1``, support ``order``
    nodes wide) is nonzero at the mesh coordinates ``u`` (in node units), and its values
    ``w_k = M(u - first - k)``. The weights sum to 1 and, for ``order >= 2``, reproduce
    ``u`` itself (``sum_k w_k (first + k) = u``). Differentiable in ``u``."""
    check_positive_int("order", order)
    first = torch.floor(u - order / 2).long() + 1
    # The uncentred spline N_order at x_k = u - first - k + order / 2, built up from N_1 by
    # the recurrence N_q(x) = (x N_{q-1}(x) + (q - x) N_{q-1}(x - 1)) / (q - 1).
    x = (u - first.to(u.dtype) + order / 2).unsqueeze(-1) - torch.arange(order, device=u.device, dtype=u.dtype)
    # At level q, values[i] = N_q(x - i) for the shifts i = 0 .. order - q still needed.
    values = [((x - i >= 0) & (x - i < 1)).to(u.dtype) for i in range(order)]
    for q in range(2, order + 1):
        values = [((x - i) * values[i] + (q - x + i) * values[i + 1]) / (q - 1) for i in range(order - q + 1)]
    return first, values[0]


def mesh_shape(pos: torch.Tensor, spacing: float, order: int) -> tuple[list[int], list[int]]:
    """``(low, size)``: the mesh that holds every stencil of the positions ``pos [B, N, P]``
    (one mesh for the whole batch, so that its FFTs run together), per axis its first node's
    index ``low`` (node ``k`` sits at ``k spacing``) and its node count ``size``. One host
    synchronisation."""
    u = pos.detach() / spacing
    lo = torch.floor(u.amin((0, 1)) - order / 2).long() + 1
    hi = torch.floor(u.amax((0, 1)) - order / 2).long() + order
    low, high = torch.stack([lo, hi]).tolist()
    return low, [b - a + 1 for a, b in zip(low, high, strict=True)]


def _stencils(pos: torch.Tensor, spacing: float, order: int, low: list[int],
              size: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [B, N, p^P], weight [B, N, p^P])``: each point's stencil on the flattened mesh."""
    dims = pos.shape[-1]
    index = torch.zeros(pos.shape[:2], dtype=torch.long, device=pos.device)
    weight = torch.ones(pos.shape[:2], dtype=pos.dtype, device=pos.device)
    steps = torch.arange(order, device=pos.device)
    for axis in range(dims):
        first, w = bspline_weights(pos[..., axis] / spacing, order)
        node = first.unsqueeze(-1) + steps - low[axis]  # [B, N, p], inside [0, size)
        index = (index.unsqueeze(-1) * size[axis] + node.reshape(*node.shape[:2], *[1] * (index.dim() - 2), order)
                 ).reshape(*pos.shape[:2], -1)
        weight = (weight.unsqueeze(-1) * w.reshape(*w.shape[:2], *[1] * (weight.dim() - 2), order)).reshape(*pos.shape[:2], -1)
    return index, weight


def padded_size(n: int, order: int) -> int:
    """The FFT length for a mesh axis of ``n`` nodes: room for the linear convolution
    (``2 n - 1``) and a margin of ``2 order`` nodes, over which the sharpening filter of
    :func:`spline_transform` (which decays like ``0.27^m`` for cubic splines) forgets where
    the circular kernel wraps."""
    return fft_length(2 * n - 1 + 2 * order)


def spline_nodes(order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m [order] long, M(m) [order] float64)``: the integer offsets where the centred
    B-spline of ``order`` is nonzero, and its values there (the weights a point sitting on a
    node gives its stencil)."""
    first, w = bspline_weights(torch.zeros((), dtype=torch.float64), order)
    return first + torch.arange(order), w


def spline_transform(order: int, padded: list[int], *, device: torch.device | None = None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``prod_a B_a(k_a)^2`` on the half spectrum of :func:`torch.fft.rfftn` of a mesh of
    shape ``padded``: ``B(k) = sum_m M(m) cos(2 pi k m / L)``, the DFT of the centred
    B-spline of ``order`` at the integer nodes. Dividing the kernel's transform by it
    undoes the smoothing of spreading and gathering for the modes the mesh resolves (the
    influence function of smooth particle-mesh Ewald); it has no zero for any order."""
    m, w = spline_nodes(order)
    total = None
    for axis, length in enumerate(padded):
        k = torch.arange(length // 2 + 1 if axis == len(padded) - 1 else length, dtype=torch.float64)
        b = (w * torch.cos(2 * math.pi * k[:, None] * m / length)).sum(-1) ** 2
        b = b.reshape(*[1] * axis, -1, *[1] * (len(padded) - axis - 1))
        total = b if total is None else total * b
    assert total is not None
    return total.to(device=device, dtype=dtype)


def wrapped_offsets(length: int, device: torch.device) -> torch.Tensor:
    """``[length]`` long: the node offset each entry of a circular axis of ``length`` stands
    for, ``m`` for ``m <= length / 2`` and ``m - length`` past it."""
    m = torch.arange(length, device=device)
    return torch.where(m <= length // 2, m, m - length)


def mesh_kernel(kernel: Kernel, spacing: float, padded: list[int], heads: int, like: torch.Tensor, *,
                isotropic: bool = False) -> torch.Tensor:
    """``f`` at the mesh's offsets laid out for a circular convolution of the padded mesh:
    ``[H, *padded]``, entry ``m`` (per axis) the offset ``m spacing`` for ``m <= L / 2`` and
    ``(m - L) spacing`` past it (the sum reads offsets below the mesh's size; the rest keeps
    the layout smooth for the sharpening filter). ``isotropic``: ``f`` depends on ``|r|``
    alone, so it is evaluated once per distinct ``|m|^2`` (along the first axis) and looked
    up: a few thousand evaluations instead of one per node."""
    axes = [wrapped_offsets(total, like.device) for total in padded]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)
    if isotropic:
        distinct, inverse = torch.unique((grid * grid).sum(-1), return_inverse=True)
        along = torch.zeros(len(distinct), len(padded), device=like.device, dtype=like.dtype)
        along[:, 0] = distinct.to(like.dtype).sqrt() * spacing
        values = kernel(along)[inverse]
    else:
        values = kernel(grid.to(like.dtype) * spacing)
    if values.shape != (*padded, heads):
        raise ValueError(f"kernel must map offsets [..., P] to [..., H] with H = {heads}, got shape {tuple(values.shape)} "
                         f"for offsets {tuple(grid.shape)}")
    return rearrange(values.to(like.dtype), "... h -> h ...")


class _Stencils:
    """Every point's stencil as two sparse matrices over a batch's meshes laid end to end:
    ``spread [B cells, B N]`` (CSR, rows sorted by node) and ``gather [B N, B cells]`` (its
    transpose, CSR, a row per point). A spread or gather is then one sparse product, without
    an ``[N, p^P, C]`` tensor of weighted values."""

    def __init__(self, index: torch.Tensor, weight: torch.Tensor, cells: int) -> None:
        B, N, S = index.shape
        self.shape = (B, N, S, cells)
        #: Each stencil entry's node on the batch's meshes laid end to end, ``[B N S]``.
        self.node = node = (index + cells * torch.arange(B, device=index.device)[:, None, None]).reshape(-1)
        w = weight.detach().reshape(-1)
        rows = torch.arange(0, B * N * S + 1, S, device=index.device)
        with warnings.catch_warnings():  # CSR is "beta" in torch; its products here are tested against the reference
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            self.gather = torch.sparse_csr_tensor(rows, node, w, size=(B * N, B * cells), check_invariants=False)
        order = torch.argsort(node, stable=True)
        counts = torch.bincount(node, minlength=B * cells)
        crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        point = torch.arange(B * N, device=index.device).repeat_interleave(S)
        self.spread = torch.sparse_csr_tensor(crow, point[order], w[order], size=(B * cells, B * N), check_invariants=False)

    def weight_grad(self, points: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """``d/dw_ns`` of ``sum`` (points ``[B N, C]``) . (nodes ``[B cells, C]`` at the stencil):
        ``[B, N, S]``, the gradient that reaches the positions through the weights."""
        B, N, S, _ = self.shape
        return (nodes[self.node].reshape(B * N, S, -1) * points[:, None, :]).sum(-1).reshape(B, N, S)


class _StencilProduct(torch.autograd.Function):
    """One sparse product with the stencils, differentiable in its input and the weights:
    ``spread @ x`` (points ``[B N, C]`` to nodes ``[B cells, C]``), or with ``to_points``
    ``gather @ x`` (nodes to points). Each one's backward is the other's product."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, stencils: _Stencils, to_points: bool) -> torch.Tensor:
        ctx.stencils, ctx.to_points = stencils, to_points
        ctx.save_for_backward(x)
        return (stencils.gather if to_points else stencils.spread) @ x

    @staticmethod
    @once_differentiable  # its matrices are constants: a second derivative would drop the weights' terms
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        (x,) = ctx.saved_tensors
        stencils, to_points = ctx.stencils, ctx.to_points
        grad_x = (stencils.spread if to_points else stencils.gather) @ grad if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = stencils.weight_grad(grad, x) if to_points else stencils.weight_grad(x, grad)
        return grad_x, grad_weight, None, None


def sharpened_kernel(kernel: Kernel, spacing: float, size: list[int], heads: int, like: torch.Tensor, *,
                     order: int, isotropic: bool = False) -> torch.Tensor:
    """The kernel :func:`mesh_sum` convolves with, ``[H, *L]`` in the layout of
    :func:`mesh_kernel` on ``L = fft_length(2 size - 1)`` per axis: ``f`` at the mesh's offsets,
    divided in Fourier space by :func:`spline_transform` on a mesh padded by a margin
    (:func:`padded_size`), so that the filter's wrap-around falls outside the offsets read."""
    wide = [padded_size(n, order) for n in size]
    dims = tuple(range(-len(size), 0))
    table = mesh_kernel(kernel, spacing, wide, heads, like, isotropic=isotropic)
    table = torch.fft.irfftn(torch.fft.rfftn(table, s=wide, dim=dims)
                             / spline_transform(order, wide, device=like.device, dtype=like.dtype), s=wide, dim=dims)
    for axis, (n, total) in enumerate(zip(size, wide, strict=True)):
        table = table.index_select(axis + 1, wrapped_offsets(fft_length(2 * n - 1), like.device) % total)
    return table


def _convolve(grid: torch.Tensor, f_hat: torch.Tensor, size: list[int], lengths: list[int]) -> torch.Tensor:
    """The linear convolution of ``grid [B, H, Dv, *size]`` with a kernel whose transform is
    ``f_hat [H, *lengths[:-1], lengths[-1] // 2 + 1]``, one axis at a time so that the
    zero padding is never transformed and the padded output never transformed back."""
    dims = len(size)
    x = torch.fft.rfft(grid, n=lengths[-1], dim=-1)
    for axis in range(dims - 2, -1, -1):
        x = torch.fft.fft(x, n=lengths[axis], dim=axis - dims)
    x = x * f_hat[None, :, None]
    for axis in range(dims - 1):
        x = torch.fft.ifft(x, dim=axis - dims).narrow(axis - dims, 0, size[axis])
    return torch.fft.irfft(x, n=lengths[-1], dim=-1).narrow(-1, 0, size[-1])


def mesh_bytes(size: list[int], *, sets: int, channels: int, points: int, order: int, item: int,
               kernel_bytes: int = 0) -> int:
    """The estimated peak bytes of :func:`mesh_sum` on a mesh of ``size`` nodes: the meshes
    of ``sets`` sets of ``channels`` value channels padded for the FFT, with their
    transforms; every point's stencil; and the kernel's table on the sharpening's wider mesh
    (its integer offsets, and ``kernel_bytes`` per offset for the kernel's own evaluation)."""
    cells = math.prod(fft_length(2 * n - 1) for n in size)
    wide = math.prod(padded_size(n, order) for n in size)
    dims = len(size)
    meshes = (6 * cells + 3 * points * order ** dims) * sets * channels * item
    return meshes + wide * (3 * 8 * dims + 4 * item + kernel_bytes)


def mesh_sum(pos: torch.Tensor, v: torch.Tensor, kernel: Kernel, *, spacing: float = 1.0, order: int = 4,
             sharpen: bool = True, isotropic: bool = False, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``out_i = sum_j F(r_i, r_j) v_j`` with ``F`` the mesh kernel of ``f`` (module
    docstring): positions ``pos [B, N, P]`` (position units; the mesh's nodes sit at the
    multiples of ``spacing``, so positions relative to a set's centre make the sum exactly
    translation invariant), values ``v [B, H, N, Dv]``, ``kernel`` ``[..., P] -> [..., H]``,
    ``keep [B, N]`` (False for points that send nothing) or None -> ``[B, H, N, Dv]``, in the
    dtype of ``v``. B-splines of ``order`` (4, cubic, by default); ``sharpen`` divides the
    kernel's transform by :func:`spline_transform` (without it ``F`` is ``f`` smoothed twice
    by the spline); ``isotropic`` says ``f`` depends on ``|r|`` alone (:func:`mesh_kernel`).
    Differentiable in ``v``, the kernel's parameters and ``pos``.

    Positions must be finite (the mesh is built around them). The op allocates what
    :func:`mesh_bytes` estimates without checking it against a limit (a layer does,
    :class:`flt.layers.LongRangeBlock`): points spread far apart make a large mesh."""
    check_tensor("pos", pos, ndim=3, layout="[B, N, P]")
    check_tensor("v", v, ndim=4, layout="[B, H, N, Dv]")
    spacing = check_positive_float("spacing", spacing)
    check_positive_int("order", order)
    B, N, dims = pos.shape
    heads, width = v.shape[1], v.shape[-1]
    if v.shape[0] != B or v.shape[2] != N:
        raise ValueError(f"pos [B, N, P] and v [B, H, N, Dv] must share B and N; got pos {tuple(pos.shape)}, v {tuple(v.shape)}")
    if keep is not None:
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != (B, N):
            got = f"{tuple(keep.shape)} {keep.dtype}" if isinstance(keep, torch.Tensor) else type(keep).__name__
            raise ValueError(f"keep must be a bool tensor [B, N] = [{B}, {N}] (False: the point sends nothing), got {got}")
        v = v * keep[:, None, :, None].to(v.dtype)
    if B == 0 or N == 0:
        return v.clone()
    check_finite("pos", pos)
    pos = pos.to(v.dtype)  # the mesh's extent and the stencils from the same rounded positions
    low, size = mesh_shape(pos, spacing, order)
    lengths = [fft_length(2 * n - 1) for n in size]
    index, weight = _stencils(pos, spacing, order, low, size)
    cells = math.prod(size)
    stencils = _Stencils(index, weight, cells)
    values = rearrange(v, "b h n d -> (b n) (h d)")
    grid = _StencilProduct.apply(values, weight, stencils, False)  # [B cells, H Dv]
    grid = rearrange(grid, "(b x) (h d) -> b h d x", b=B, h=heads).reshape(B, heads, width, *size)
    if sharpen:
        table = sharpened_kernel(kernel, spacing, size, heads, v, order=order, isotropic=isotropic)
    else:
        table = mesh_kernel(kernel, spacing, lengths, heads, v, isotropic=isotropic)
    f_hat = torch.fft.rfftn(table, s=lengths, dim=tuple(range(-dims, 0)))
    conv = _convolve(grid, f_hat, size, lengths)
    nodes = rearrange(conv.reshape(B, heads, width, cells), "b h d x -> (b x) (h d)")
    out = _StencilProduct.apply(nodes, weight, stencils, True)  # [B N, H Dv]
    return rearrange(out, "(b n) (h d) -> b h n d", b=B, h=heads)


def mesh_sum_reference(pos: torch.Tensor, v: torch.Tensor, kernel: Kernel, *, spacing: float = 1.0, order: int = 4,
                       sharpen: bool = True, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The O(N^2 p^(2P)) form of :func:`mesh_sum`, pair by pair with no FFT: ``F(r_i, r_j) =
    sum_a sum_b W_ia K(g_a - g_b) W_jb`` over the two points' stencil nodes. Without
    ``sharpen`` ``K`` is ``kernel`` at the nodes' offsets; with it, ``K`` is the kernel on
    the padded mesh with the inverse of the circulant spline matrix (``C[i, j] = M(i - j mod
    L)``) applied twice along each axis by dense solves. For tests, on small sets."""
    check_tensor("pos", pos, ndim=3, layout="[B, N, P]")
    check_tensor("v", v, ndim=4, layout="[B, H, N, Dv]")
    dims, heads = pos.shape[-1], v.shape[1]
    if keep is not None:
        v = v * keep[:, None, :, None].to(v.dtype)
    pos = pos.to(v.dtype)
    steps = torch.arange(order, device=pos.device)
    nodes, weights = [], []
    for axis in range(dims):
        first, w = bspline_weights(pos[..., axis] / spacing, order)
        nodes.append(first.unsqueeze(-1) + steps)  # [B, N, p]
        weights.append(w)
    flat = [g.reshape(-1) for g in torch.meshgrid(*[steps] * dims, indexing="ij")]
    node = torch.stack([nodes[a][..., flat[a]] for a in range(dims)], dim=-1)  # [B, N, S, P]
    weight = math.prod(weights[a][..., flat[a]] for a in range(dims))  # [B, N, S]
    diff = node[:, :, None, :, None, :] - node[:, None, :, None, :, :]  # [B, N, N, S, S, P]
    if not sharpen:
        f = kernel(diff.to(v.dtype) * spacing)  # [B, N, N, S, S, H]
    else:
        _, size = mesh_shape(pos, spacing, order)
        padded = [padded_size(n, order) for n in size]
        table = mesh_kernel(kernel, spacing, padded, heads, v)  # [H, *padded]
        m, w = spline_nodes(order)
        for axis, length in enumerate(padded):
            steps_l = torch.arange(length, device=v.device)
            lag = (steps_l[:, None] - steps_l[None, :]) % length
            circulant = torch.zeros(length, length, dtype=v.dtype, device=v.device)
            for offset, value in zip(m.tolist(), w.tolist(), strict=True):
                circulant[lag == offset % length] += value
            moved = table.movedim(axis + 1, 0)
            flat_table = moved.reshape(length, -1)
            flat_table = torch.linalg.solve(circulant, torch.linalg.solve(circulant, flat_table))
            table = flat_table.reshape(moved.shape).movedim(0, axis + 1)
        # Each pair of stencil nodes reads the table at their offset, wrapped as the layout is.
        flat_index = torch.zeros_like(diff[..., 0])
        for a in range(dims):
            flat_index = flat_index * padded[a] + diff[..., a] % padded[a]
        f = table.reshape(heads, -1)[:, flat_index].movedim(0, -1)  # [B, N, N, S, S, H]
    pair = torch.einsum("bis,bjt,bijsth->bhij", weight, weight, f)
    return pair @ v


__all__ = [
    "Kernel",
    "bspline_weights",
    "mesh_bytes",
    "mesh_kernel",
    "mesh_shape",
    "mesh_sum",
    "mesh_sum_reference",
    "padded_size",
    "spline_nodes",
    "spline_transform",
    "wrapped_offsets",
]
