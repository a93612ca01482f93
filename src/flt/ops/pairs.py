"""Sparse pair products for near sets: ``k`` listed keys per query, without materialising them.

A near set lists ``k`` keys ``j = idx[i, t]`` per query. Gathering their rows as one
``[N, k, E]`` tensor costs ``k`` times the memory of the rows, and so does its gradient,
scattered back: for the ``m``-wide kernel features that is most of the cost of
:func:`flt.ops.neighbors.neighbor_attention`. These three products take the rows in chunks
of queries instead, each chunk small enough to stay in cache, and their gradients are the
same three products (each one's backward calls the others), so nothing of size ``N k E``
is ever kept.

Rows are flattened: ``a, b, v [R, E]`` with ``R = B H N``, and ``index [R, k]`` holds the
row of each listed key in ``b`` or ``v`` (``(b H + h) N + j``).

* :func:`pair_dots`: ``out[r, t] = a[r] . b[index[r, t]]``, ``[R, k]``;
* :func:`gather_sum`: ``out[r] = sum_t w[r, t] v[index[r, t]]``, ``[R, E]``;
* :func:`scatter_sum`: ``out[index[r, t]] += w[r, t] a[r]``, ``[R, E]``.
"""

from __future__ import annotations

import torch

#: Gathered numbers per chunk of queries (about 2 MiB in float32).
_CHUNK_ELEMENTS = 1 << 19


def _rows(t, index):
    """``t[index]`` for ``index [C, k]``: ``[C, k, E]`` (index_select: several times faster
    than advanced indexing on CPU)."""
    return torch.index_select(t, 0, index.flatten()).view(*index.shape, t.shape[1])


def flat_index(idx: torch.Tensor, B: int, H: int) -> torch.Tensor:
    """Row indices ``[B H N, k]`` of the listed keys ``idx [B or 1, N, k]`` in ``[B, H, N, E]``
    tensors flattened to ``[B H N, E]``."""
    N, k = idx.shape[1:]
    base = (torch.arange(B, device=idx.device).view(B, 1) * H + torch.arange(H, device=idx.device)) * N  # [B, H]
    return (base.view(B, H, 1, 1) + idx.expand(B, N, k).unsqueeze(1)).reshape(B * H * N, k)


def _chunks(index: torch.Tensor, width: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, index.shape[1] * width))
    return [slice(s, s + step) for s in range(0, index.shape[0], step)]


class _PairDots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, index):
        ctx.save_for_backward(a, b, index)
        out = a.new_empty(index.shape)
        for s in _chunks(index, a.shape[1]):
            out[s] = (_rows(b, index[s]) * a[s].unsqueeze(1)).sum(-1)
        return out

    @staticmethod
    def backward(ctx, g):
        a, b, index = ctx.saved_tensors
        ga = gather_sum(g, b, index) if ctx.needs_input_grad[0] else None
        gb = scatter_sum(g, a, index, b.shape[0]) if ctx.needs_input_grad[1] else None
        return ga, gb, None


class _GatherSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, v, index):
        ctx.save_for_backward(w, v, index)
        out = v.new_empty(index.shape[0], v.shape[1])
        for s in _chunks(index, v.shape[1]):
            out[s] = (w[s].unsqueeze(1) @ _rows(v, index[s])).squeeze(1)
        return out

    @staticmethod
    def backward(ctx, g):
        w, v, index = ctx.saved_tensors
        gw = pair_dots(g, v, index) if ctx.needs_input_grad[0] else None
        gv = scatter_sum(w, g, index, v.shape[0]) if ctx.needs_input_grad[1] else None
        return gw, gv, None


class _ScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, a, index, rows):
        ctx.save_for_backward(w, a, index)
        out = a.new_zeros(rows, a.shape[1])
        for s in _chunks(index, a.shape[1]):
            out.index_add_(0, index[s].flatten(), (w[s].unsqueeze(-1) * a[s].unsqueeze(1)).flatten(0, 1))
        return out

    @staticmethod
    def backward(ctx, g):
        w, a, index = ctx.saved_tensors
        gw = pair_dots(a, g, index) if ctx.needs_input_grad[0] else None
        ga = gather_sum(w, g, index) if ctx.needs_input_grad[1] else None
        return gw, ga, None, None


def pair_dots(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``a [R, E], b [Rb, E], index [R, k] -> [R, k]``: ``a[r] . b[index[r, t]]``."""
    return _PairDots.apply(a.contiguous(), b.contiguous(), index)


def gather_sum(w: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``w [R, k], v [Rv, E], index [R, k] -> [R, E]``: ``sum_t w[r, t] v[index[r, t]]``."""
    return _GatherSum.apply(w.contiguous(), v.contiguous(), index)


def scatter_sum(w: torch.Tensor, a: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """``w [R, k], a [R, E], index [R, k] -> [rows, E]``: row ``index[r, t]`` gets ``w[r, t] a[r]``."""
    return _ScatterSum.apply(w.contiguous(), a.contiguous(), index, rows)
