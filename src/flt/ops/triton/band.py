"""FLT's banded estimator (:func:`flt.ops.band.band_attention`) on Triton kernels, with the
FAVOR+ features of the far field computed inside them.

:func:`band_attention` takes what the features are made of: the scaled queries and keys
(the exact band uses ``exp(x_q.x_k + b)``), the spectral features ``a(r), c(r)`` joined to
them for the far field's FAVOR+ (logit coupling) and the projection. It is one kernel
(:mod:`flt.ops.triton.kernels`, band and far field in one program per head); its gradients
are those of :func:`band_attention_torch`, the same computation by the PyTorch ops,
recomputed in the backward pass.

:func:`band_attention_split` (layers: ``backend="triton-split"``) computes the same function
from the feature-split kernels (:mod:`flt.ops.triton.split`, forward and backward) and
the PyTorch blocked band of :mod:`flt.ops.band`, composed here: the far field's sums and
their row level by :func:`flt.ops.triton.split.favor_sums_split` (causal: keys, values and
``extra_k`` delayed by ``w + 1`` tokens, so the scan never sees a band pair;
bidirectional: the estimate over all keys less its band part), the exact band by
:func:`flt.ops.band._exact_band`, added at a common row level, then divided.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from flt._checks import check_positive_int, check_tensor
from flt._dtype import compute_dtype
from flt.ops import band as torch_band
from flt.ops._common import safe_divide
from flt.ops.features import favor_plus_features_split
from flt.ops.triton.favor import _check
from flt.ops.triton.launch import (
    TRITON_CHUNK,
    _kernels,
    check_device,
    combine_segments,
    launch_fitted,
    segment_count,
    tile_candidates,
)


def _check_band(xq, band_bias, width) -> None:
    check_positive_int("width", width)
    B, H, N, _ = xq.shape
    check_tensor("band_bias", band_bias, ndim=4, layout="[B or 1, H, N, 2w + 1]")
    if band_bias.shape[0] not in (1, B) or band_bias.shape[1:] != (H, N, 2 * width + 1):
        raise ValueError(f"band_bias must be [B or 1, H, N, 2w + 1] = [{B} or 1, {H}, {N}, {2 * width + 1}], got {tuple(band_bias.shape)}")


def band_attention(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, band_bias: torch.Tensor, *, width: int, extra_q: torch.Tensor, extra_k: torch.Tensor,
                   causal: bool = False, key_mask: torch.Tensor | None = None, chunk_size: int = TRITON_CHUNK,
                   segments: int | None = None) -> torch.Tensor:
    """Exact weights on the band ``|i - j| <= width``, FAVOR+ estimates elsewhere, by the kernel.

    Args:
        xq, xk: ``[B, H, N, D]`` scaled queries and keys (exact kernel ``exp(x_q.x_k)``).
        v: ``[B, H, N, Dv]``.
        projection: ``[m, D + E]``, FAVOR+ on ``[x, extra]``.
        band_bias: ``[B or 1, H, N, 2w + 1]``, the logit bias of query ``i`` and key
            ``i + o``, ``o = -w .. w`` (:func:`flt.ops.band.band_offsets`).
        width: ``w >= 1``.
        extra_q, extra_k: ``[B or 1, H, N, E]``, the far field's spectral features.
        causal, key_mask: as :func:`flt.ops.band.band_attention`.
        chunk_size: tokens per kernel step, a power of two >= 16 (raised to ``w`` if smaller).
        segments: as :func:`flt.ops.triton.favor_attention`.

    Returns:
        ``[B, H, N, Dv]`` in float32 (float64 for float64 inputs).
    """
    _check(xq, xk, v, projection, extra_q, extra_k, None, None, key_mask)
    _check_band(xq, band_bias, width)
    if extra_q is None:
        raise ValueError("extra_q and extra_k are required: the band is FLT's logit coupling")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 (the kernels' tile), got {chunk_size}")
    if segments is not None:
        check_positive_int("segments", segments)
    check_device(xq.device)
    return _BandAttention.apply(xq, xk, v, projection, band_bias, extra_q, extra_k, key_mask, width, causal, chunk_size, segments)


def band_attention_torch(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, band_bias: torch.Tensor, *, width: int, extra_q: torch.Tensor,
                         extra_k: torch.Tensor, causal: bool = False, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`band_attention` by the PyTorch ops (features by
    :func:`flt.ops.features.favor_plus_features_split`, sums by :func:`flt.ops.band.band_attention`)."""
    _check(xq, xk, v, projection, extra_q, extra_k, None, None, key_mask)
    _check_band(xq, band_bias, width)
    cdt = compute_dtype(xq, xk, v, extra_q)
    xq, xk = xq.to(cdt), xk.to(cdt)
    qf, q_shift = favor_plus_features_split(xq, extra_q.to(cdt), projection)
    kf, k_shift = favor_plus_features_split(xk, extra_k.to(cdt), projection)
    out = torch_band.band_attention(xq, xk, v, qf, kf, q_shift, k_shift, band_bias, width=width, causal=causal, key_mask=key_mask)
    return out.to(cdt)


def _launch(xq, xk, v, projection, band_bias, extra_q, extra_k, key_mask, width, causal, chunk_size, segments):
    kernels = _kernels()
    B, H, N, D = xq.shape
    Dv, m = v.shape[-1], projection.shape[0]
    acc = compute_dtype(xq, xk, v, extra_q)
    out = torch.empty(B, H, N, Dv + 1, device=xq.device, dtype=acc)
    xq, xk, v, w = (t.contiguous() for t in (xq, xk, v, projection.to(acc)))
    eq, ek = extra_q.contiguous(), extra_k.contiguous()
    if eq.shape[0] != ek.shape[0]:
        eq, ek = eq.expand(B, -1, -1, -1).contiguous(), ek.expand(B, -1, -1, -1).contiguous()
    bias = band_bias.contiguous()
    e_dim = eq.shape[-1]
    keep = xq if key_mask is None else key_mask.to(acc).contiguous()
    pow2 = lambda n: max(16, 1 << max(0, n - 1).bit_length())  # noqa: E731
    tf32 = acc == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    flags = {"CAUSAL": bool(causal), "HAS_EXTRA": True, "HAS_KEEP": key_mask is not None, "PREC": "tf32" if tf32 else "ieee",
                 "BD": pow2(D), "BE": pow2(e_dim), "BM": pow2(m)}

    def attempt(chunk, bv, stages):
        n_vb = math.ceil(Dv / bv)
        n_seg_wanted = segments or segment_count(B * H * n_vb, N, chunk, xq.device)
        seg_len = chunk * math.ceil(N / (n_seg_wanted * chunk))
        n_seg = math.ceil(N / seg_len)

        def launch(states, levels, states_only, has_init):
            kernels.band_attention_kernel[(B * H, 1, n_vb * n_seg)](
                xq, xk, eq, ek, v, w, bias, keep, out, states, levels,
                H, N, D, e_dim, m, Dv, width,
                0 if eq.shape[0] == 1 else H * N * e_dim,
                0 if bias.shape[0] == 1 else H * N * (2 * width + 1),
                seg_len, n_seg, n_vb,
                STATES_ONLY=states_only, HAS_INIT=has_init, BC=chunk, BV=bv, **flags,
                **({} if stages is None else {"num_stages": stages}),
            )

        if n_seg == 1:
            launch(xq, xq, False, False)
        else:
            states = torch.empty(B * H, 1, n_seg, m, Dv + 1, device=xq.device, dtype=acc)
            levels = torch.empty(B * H, 1, n_seg, device=xq.device, dtype=acc)
            launch(states, levels, True, False)
            states, levels = combine_segments(states, levels, causal)
            launch(states.contiguous(), levels.contiguous(), False, True)

    key = ("band", acc, xq.device, width, tuple(sorted(flags.items())))
    # A window spans at most the chunk before and after it: no tile has fewer tokens than w.
    tiles = list(dict.fromkeys((max(c, pow2(width)), bv, stages) for c, bv, stages in tile_candidates(chunk_size, min(64, pow2(Dv)), flags["BM"], xq.device)))
    launch_fitted(key, tiles, attempt, hint=f" or a narrower band (near_field={width} keeps {max(16, pow2(width))} tokens a step)")
    return safe_divide(out[..., :-1], out[..., -1:])


class _BandAttention(torch.autograd.Function):
    """Forward: the kernel. Backward: the gradient of :func:`band_attention_torch`, recomputed."""

    @staticmethod
    def forward(ctx, xq, xk, v, projection, band_bias, extra_q, extra_k, key_mask, width, causal, chunk_size, segments):
        ctx.save_for_backward(xq, xk, v, projection, band_bias, extra_q, extra_k, key_mask)
        ctx.width, ctx.causal = width, causal
        return _launch(xq, xk, v, projection, band_bias, extra_q, extra_k, key_mask, width, causal, chunk_size, segments)

    @staticmethod
    def backward(ctx, grad):
        xq, xk, v, projection, band_bias, extra_q, extra_k, key_mask = ctx.saved_tensors
        inputs = [xq, xk, v, band_bias, extra_q, extra_k]
        needs = ctx.needs_input_grad
        wanted = [needs[0], needs[1], needs[2], needs[4], needs[5], needs[6]]
        leaves = [t.detach().requires_grad_(w) for t, w in zip(inputs, wanted, strict=True)]
        with torch.enable_grad(), torch.autocast(grad.device.type, enabled=False):
            out = band_attention_torch(leaves[0], leaves[1], leaves[2], projection, leaves[3], width=ctx.width,
                                       extra_q=leaves[4], extra_k=leaves[5], causal=ctx.causal, key_mask=key_mask)
            sources = [t for t, w in zip(leaves, wanted, strict=True) if w]
            grads = iter(torch.autograd.grad(out, sources, grad.to(out.dtype)) if sources else ())
        g = [next(grads) if w else None for w in wanted]
        return g[0], g[1], g[2], None, g[3], g[4], g[5], None, None, None, None, None


def band_attention_split(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, band_bias: torch.Tensor, *, width: int,
                         extra_q: torch.Tensor, extra_k: torch.Tensor, causal: bool = False, key_mask: torch.Tensor | None = None,
                         chunk_size: int | None = None, feature_block: int | None = None, value_block: int | None = None,
                         segments: int | None = None, block_size: int | None = None) -> torch.Tensor:
    """:func:`band_attention` with the far field on the feature-split kernels (module docstring).

    Every part is a sum of nonnegative weights times ``[v, 1]`` relative to its own row
    level: the exact band relative to ``exp(d_i + c_i)`` (``d_i = x_q.x_k + b`` of the
    diagonal pair, ``c_i >= 0`` the band's largest exponent above it), the kernel's far
    sums relative to ``exp(level_i)`` (:func:`flt.ops.triton.split.favor_sums_split`: the
    true FAVOR+ scale, that of ``exp(x_q.x_k)``), and bidirectionally the band part of the
    estimate (PyTorch features, :func:`flt.ops.band._band_estimate`) relative to
    ``exp(q_shift_i + max_j k_shift_j)``. They are added at the largest of the levels, so
    every factor is at most 1; the levels are detached (the common factor cancels). The
    diagonal's exponent is taken even where its key is padded (its values are zero): a
    row whose other band keys lie more than ~80 below it (float32) would lose them.
    Bidirectionally the band part of the estimate needs the ``[B, H, N, m]`` features in
    PyTorch, as :func:`flt.ops.band.band_attention` does; causally nothing of size ``m``
    per token is stored.

    Args:
        xq, xk, v, projection, band_bias, width, extra_q, extra_k, causal, key_mask, segments:
            as :func:`band_attention`.
        chunk_size, feature_block, value_block: the far field's tile, as
            :func:`flt.ops.triton.split.favor_attention_split` (None: its defaults).
        block_size: ``T >= w``, the exact band's query blocks (default ``max(w, 16)``,
            :func:`flt.ops.band.band_attention`).

    Returns:
        ``[B, H, N, Dv]`` in float32 (float64 when an input is float64); rows without any
        valid key are zeros.
    """
    from flt.ops.triton.split import favor_sums_split

    _check(xq, xk, v, projection, extra_q, extra_k, None, None, key_mask)
    _check_band(xq, band_bias, width)
    if extra_q is None:
        raise ValueError("extra_q and extra_k are required: the band is FLT's logit coupling")
    T = max(width, 16) if block_size is None else block_size
    check_positive_int("block_size", T)
    if T < width:
        raise ValueError(f"block_size ({T}) must be at least width ({width})")
    B, N = xq.shape[0], xq.shape[2]
    cdt = compute_dtype(xq, xk, v, extra_q)
    xq, xk, bias = xq.to(cdt), xk.to(cdt), band_bias.to(cdt)
    valid = torch.ones(B, N, dtype=torch.bool, device=xq.device) if key_mask is None else key_mask
    vaug = torch.cat([v.to(cdt), v.new_ones(*v.shape[:-1], 1).to(cdt)], dim=-1) * valid[:, None, :, None].to(cdt)
    tile: dict[str, Any] = {"chunk_size": chunk_size, "feature_block": feature_block, "value_block": value_block, "segments": segments}

    # The diagonal pair is in every row's band: its exponent is on the band's scale even
    # where the far field has no key (its level is then about -1e30, too far for float32).
    diagonal = ((xq * xk).sum(dim=-1) + bias[..., width]).detach()
    near, c, windows = torch_band._exact_band(xq, xk, vaug, bias, diagonal, valid, width, T, causal)
    parts = [(near, diagonal + c)]
    if causal and width + 1 < N:
        shift = width + 1

        def delay(t: torch.Tensor) -> torch.Tensor:  # key j enters at token j + w + 1
            return F.pad(t, (0, 0, shift, -shift))

        keep = torch.zeros_like(valid)
        keep[:, shift:] = valid[:, :-shift]  # the filler keys are padding
        parts.append(favor_sums_split(xq, delay(xk), delay(v), projection, causal=True, extra_q=extra_q, extra_k=delay(extra_k),
                                      key_mask=keep, **tile))
    elif not causal:
        parts.append(favor_sums_split(xq, xk, v, projection, extra_q=extra_q, extra_k=extra_k, key_mask=key_mask, **tile))
        qf, q_shift = favor_plus_features_split(xq, extra_q.to(cdt), projection)
        kf, k_shift = favor_plus_features_split(xk, extra_k.to(cdt), projection)
        top = k_shift.masked_fill(~valid[:, None, :], -float("inf")).amax(dim=-1, keepdim=True)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # no valid key at all
        key_weight = torch.exp(torch.where(valid[:, None, :], k_shift, top) - top)  # <= 1; padded keys are masked in the band
        estimate = torch_band._band_estimate(qf, kf * key_weight.unsqueeze(-1), vaug, windows, T)
        parts.append((-estimate, q_shift + top))
    level = torch.stack([lev for _, lev in parts]).amax(dim=0)
    sums = near * torch.exp(diagonal + c - level).unsqueeze(-1)
    for part, lev in parts[1:]:
        sums = sums + part * torch.exp(lev - level).unsqueeze(-1)
    return safe_divide(sums[..., :-1], sums[..., -1:])
