"""Sparse pair products for near sets: ``k`` listed keys per query, without materialising them.

A near set lists ``k`` keys ``j = idx[i, t]`` per query. Gathering their rows as one
``[N, k, E]`` tensor costs ``k`` times the memory of the rows, and so does its gradient,
scattered back: for the ``m``-wide kernel features that is most of the cost of
:func:`flt.ops.neighbors.neighbor_attention`. These three products never form it: each is
one sparse kernel over the ``N k`` listed pairs (a sampled matrix product, or an
``embedding_bag`` sum over bags of rows), so their cost is ``O(N k E)`` time and ``O(N E)``
memory, and their number of operations does not depend on ``N`` (no Python loop over
chunks: on a GPU every operation is a launch). Their gradients are the same three products
(each one's backward calls the others), so nothing of size ``N k E`` is ever kept.

Rows are flattened: ``a, b, v [R, E]`` with ``R = B H N``, and ``index [R, k]`` holds the
row of each listed key in ``b`` or ``v`` (``(b H + h) N + j``).

* :func:`pair_dots`: ``out[r, t] = a[r] . b[index[r, t]]``, ``[R, k]``
  (``torch.sparse.sampled_addmm`` on the pattern of the listed pairs; the CUDA path is
  cuSPARSE's and has not been run yet);
* :func:`gather_sum`: ``out[r] = sum_t w[r, t] v[index[r, t]]``, ``[R, E]``
  (``embedding_bag``, one bag of ``k`` rows per query);
* :func:`scatter_sum`: ``out[index[r, t]] += w[r, t] a[r]``, ``[R, E]`` (``embedding_bag``
  over the pairs sorted by key: one bag of queries per key).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F


def flat_index(idx: torch.Tensor, B: int, H: int) -> torch.Tensor:
    """Row indices ``[B H N, k]`` of the listed keys ``idx [B or 1, N, k]`` in ``[B, H, N, E]``
    tensors flattened to ``[B H N, E]``."""
    N, k = idx.shape[1:]
    base = (torch.arange(B, device=idx.device).view(B, 1) * H + torch.arange(H, device=idx.device)) * N  # [B, H]
    return (base.view(B, H, 1, 1) + idx.expand(B, N, k).unsqueeze(1)).reshape(B * H * N, k)


def _pattern(index: torch.Tensor, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """The listed pairs as a sparse CSR matrix ``[R, columns]`` (values zero): row ``r``
    holds the columns ``index[r]`` (sorted within the row)."""
    R, k = index.shape
    crow = torch.arange(0, R * k + 1, k, device=index.device)
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the three calls used here are tested
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, index.reshape(-1), torch.zeros(R * k, dtype=dtype, device=index.device),
                                       (R, columns), check_invariants=False)


def _dots(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``a[r] . b[index[r, t]]``: ``[R, k]``, the product ``a b^T`` sampled at the pairs."""
    if index.shape[1] > b.shape[0]:  # rows repeat keys (a near set never does): more pairs than a dense row holds
        return (torch.index_select(b, 0, index.reshape(-1)).view(*index.shape, -1) * a.unsqueeze(1)).sum(-1)
    # Columns sorted within each row (a valid CSR pattern for every backend), then put back
    # in the listed order.
    cols, order = torch.sort(index, dim=-1)
    out = torch.sparse.sampled_addmm(_pattern(cols, b.shape[0], a.dtype), a, b.transpose(0, 1), beta=0.0)
    return torch.empty_like(out.values().view(index.shape)).scatter_(-1, order, out.values().view(index.shape))


def _gather(w: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``sum_t w[r, t] v[index[r, t]]``: ``[R, E]``."""
    return F.embedding_bag(index, v, per_sample_weights=w, mode="sum")


def _scatter(w: torch.Tensor, a: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """``out[j] = sum_(index[r, t] = j) w[r, t] a[r]``: ``[rows, E]``, the pairs sorted by key
    so that each key's queries form one bag."""
    keys = index.reshape(-1)
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=rows)
    offsets = torch.cumsum(counts, 0) - counts
    return F.embedding_bag(order // index.shape[1], a, offsets, mode="sum", per_sample_weights=w.reshape(-1)[order])


class _PairDots(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b, index)
        return _dots(a, b, index)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        a, b, index = ctx.saved_tensors
        ga = gather_sum(g, b, index) if ctx.needs_input_grad[0] else None
        gb = scatter_sum(g, a, index, b.shape[0]) if ctx.needs_input_grad[1] else None
        return ga, gb, None


class _GatherSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w, v, index)
        return _gather(w, v, index)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        w, v, index = ctx.saved_tensors
        gw = pair_dots(g, v, index) if ctx.needs_input_grad[0] else None
        gv = scatter_sum(w, g, index, v.shape[0]) if ctx.needs_input_grad[1] else None
        return gw, gv, None


class _ScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, a: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(w, a, index)
        return _scatter(w, a, index, rows)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
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
