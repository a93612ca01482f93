"""The entry of the FAVOR+ kernels, :func:`favor_attention`: FAVOR+ linear attention and the
FLT couplings as Triton kernels, a fast path of :func:`flt.ops.linear.linear_attention` /
:func:`flt.ops.linear.flt_attention` with the FAVOR+ features
(:func:`flt.ops.features.favor_plus_features`) computed inside the kernel. It runs the
one-program kernel (:mod:`flt.ops.triton.favor`) or, with ``split_features=True``, the
feature-split kernels (:mod:`flt.ops.triton.split`).

:func:`favor_attention` takes what the features are made of, not the features:

* Performer: ``extra_q = extra_k = a = c = None``;
* FLT, logit coupling: ``extra_q = a(r)``, ``extra_k = c(r)``: FAVOR+ of ``[x_q, a]`` and
  ``[x_k, c]`` (:func:`flt.ops.features.favor_plus_features_split`);
* FLT, multiplicative coupling: ``a, c``: weights ``(a_i.c_j) phi(x_q).phi(x_k)``.

so the ``[B, H, N, m]`` features never reach memory (kernel in :mod:`flt.ops.triton.kernels`).
:func:`~flt.ops.triton.favor.favor_attention_torch` computes the same function with the
PyTorch ops; it is the kernel's backward pass (recomputed from the inputs, linear memory) and its reference.
The kernels are tested against the float64 quadratic references on CPU tensors under
``TRITON_INTERPRET=1`` (``tests/library/test_ops_triton.py``) and on CUDA by ``pytest -m cuda``.
They are correct, not fast: on an H200 at m = 256 (a fallback tile of 16 tokens) the forward
took 10-18x the PyTorch path's time (docs/performance.md, "GPU (CUDA)"). The feature-split
kernels (:mod:`flt.ops.triton.split`, ``split_features=True``) split the ``m`` features over
programs (64 features x 64 tokens x 64 value columns a program) and have a backward kernel;
Performer and the logit coupling run on them directly, the multiplicative coupling as their
sums of values widened by ``c`` read with ``a``
(:func:`flt.ops.triton.split.favor_attention_split_kronecker`). They are written for speed
and not yet timed.
Triton is the optional extra ``triton``.
"""

from __future__ import annotations

import torch

from flt._checks import check_positive_int
from flt.ops.triton.favor import _check, _FavorAttention
from flt.ops.triton.launch import TRITON_CHUNK, check_device
from flt.ops.triton.split import favor_attention_split, favor_attention_split_kronecker


def favor_attention(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *, causal: bool = False, extra_q: torch.Tensor | None = None,
                    extra_k: torch.Tensor | None = None, a: torch.Tensor | None = None, c: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                    chunk_size: int = TRITON_CHUNK, segments: int | None = None, split_features: bool = False) -> torch.Tensor:
    """FAVOR+ attention by the Triton kernel (module docstring for the three cases).

    Args:
        xq, xk: ``[B, H, N, D]``, scaled so that the kernel is ``exp(x_q.x_k)``.
        v: ``[B, H, N, Dv]``.
        projection: ``[m, D + E]``, the FAVOR+ projection (``E`` = width of ``extra_q``, else 0).
        extra_q, extra_k: ``[B or 1, H, N, E]``, joined to ``xq``, ``xk`` (logit coupling).
        a, c: ``[B or 1, H, N, 2R]`` (multiplicative coupling).
        key_mask: bool ``[B, N]``, True for a real key (padded keys carry no weight).
        causal: token ``i`` attends to ``j <= i``.
        chunk_size: tokens per kernel step, a power of two >= 16.
        segments: cut the sequence into this many segments processed in parallel (two
            launches; :func:`~flt.ops.triton.launch.combine_segments`); None: from the GPU's
            size (:func:`~flt.ops.triton.launch.segment_count`; 1 off CUDA).
        split_features: run the feature-split kernels instead, forward and backward
            (:func:`flt.ops.triton.split.favor_attention_split`, its default tile;
            ``chunk_size`` is then its chunk); with ``a, c``
            :func:`flt.ops.triton.split.favor_attention_split_kronecker`, the same kernels
            on values widened by ``c``.

    Returns:
        ``[B, H, N, Dv]`` in float32 (float64 when an input is float64). Rows with a zero
        denominator are zeros. Gradients: :func:`~flt.ops.triton.favor.favor_attention_torch`'s, recomputed
        (``split_features``: the split backward kernels').
    """
    _check(xq, xk, v, projection, extra_q, extra_k, a, c, key_mask)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 (the kernels' tile), got {chunk_size}")
    if segments is not None:
        check_positive_int("segments", segments)
    check_device(xq.device, "triton-split" if split_features else "triton")
    if split_features:
        if a is not None:
            assert c is not None  # given together with a (_check)
            return favor_attention_split_kronecker(xq, xk, v, projection, a, c, causal=causal, key_mask=key_mask,
                                                   chunk_size=chunk_size, segments=segments)
        return favor_attention_split(xq, xk, v, projection, causal=causal, extra_q=extra_q, extra_k=extra_k, key_mask=key_mask,
                                     chunk_size=chunk_size, segments=segments)
    return _FavorAttention.apply(xq, xk, v, projection, extra_q, extra_k, a, c, key_mask, causal, chunk_size, segments)
