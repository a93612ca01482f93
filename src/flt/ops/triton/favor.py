"""The one-program FAVOR+ kernel (:mod:`flt.ops.triton.kernels`): its launch, its autograd
Function and :func:`favor_attention_torch`, the same function by the PyTorch ops, which is
the kernel's backward pass (recomputed from the inputs, linear memory) and its reference.
:func:`flt.ops.triton.dispatch.favor_attention` is the entry that runs it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flt._checks import check_tensor
from flt._dtype import compute_dtype
from flt.ops._common import safe_divide
from flt.ops.features import favor_plus_features, favor_plus_features_split
from flt.ops.linear import flt_attention, linear_attention
from flt.ops.triton.launch import (
    _kernels,
    combine_segments,
    launch_fitted,
    segment_count,
    tile_candidates,
)


def _check(xq, xk, v, projection, extra_q, extra_k, a, c, key_mask) -> None:
    check_tensor("xq", xq, ndim=4, layout="[B, H, N, D]")
    check_tensor("xk", xk, ndim=4, layout="[B, H, N, D]")
    check_tensor("v", v, ndim=4, layout="[B, H, N, Dv]")
    check_tensor("projection", projection, ndim=2, layout="[m, D + E]")
    if xq.shape != xk.shape or v.shape[:3] != xq.shape[:3]:
        raise ValueError(f"xq, xk must be [B, H, N, D] and v [B, H, N, Dv] alike, got {tuple(xq.shape)}, {tuple(xk.shape)}, {tuple(v.shape)}")
    B, H, N, D = xq.shape
    for pair, names in (((extra_q, extra_k), ("extra_q", "extra_k")), ((a, c), ("a", "c"))):
        if (pair[0] is None) != (pair[1] is None):
            raise ValueError(f"{names[0]} and {names[1]} must be given together")
        for name, t in zip(names, pair, strict=True):
            if t is None:
                continue
            check_tensor(name, t, ndim=4, layout="[B or 1, H, N, F]")
            if t.shape[0] not in (1, B) or t.shape[1:3] != (H, N) or t.shape[-1] != pair[0].shape[-1]:
                raise ValueError(f"{name} must be [B or 1, H, N, F] = [{B} or 1, {H}, {N}, {pair[0].shape[-1]}], got {tuple(t.shape)}")
    if extra_q is not None and a is not None:
        raise ValueError("extra_q/extra_k (logit coupling) and a/c (multiplicative coupling) are exclusive")
    width = D + (0 if extra_q is None else extra_q.shape[-1])
    if projection.shape[1] != width:
        raise ValueError(f"projection must be [m, D + E] with D + E = {width}, got {tuple(projection.shape)}")
    if key_mask is not None and (key_mask.dtype != torch.bool or key_mask.shape != (B, N)):
        raise ValueError(f"key_mask must be a bool [B, N] = [{B}, {N}] tensor (True: a real key), got {key_mask.dtype} {tuple(key_mask.shape)}")


def favor_attention_torch(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *, causal: bool = False, extra_q: torch.Tensor | None = None,
                          extra_k: torch.Tensor | None = None, a: torch.Tensor | None = None, c: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                          chunk_size: int | None = None) -> torch.Tensor:
    """:func:`favor_attention` by the PyTorch ops (features by :mod:`flt.ops.features`, sums by
    :mod:`flt.ops.linear`); same arguments and result."""
    _check(xq, xk, v, projection, extra_q, extra_k, a, c, key_mask)
    if extra_q is None:
        qf, _ = favor_plus_features(xq, projection)
        kf, kls = favor_plus_features(xk, projection)
    else:
        assert extra_k is not None  # given together with extra_q (_check)
        qf, _ = favor_plus_features_split(xq, extra_q, projection)
        kf, kls = favor_plus_features_split(xk, extra_k, projection)
    if key_mask is not None:
        kf = kf * key_mask[:, None, :, None]
        kls = torch.where(key_mask[:, None, :], kls, kls.detach().amin(dim=-1, keepdim=True))
    if a is None:
        out = linear_attention(qf, kf, v, causal=causal, key_log_scale=kls, chunk_size=chunk_size)
    else:
        assert c is not None  # given together with a (_check)
        out = flt_attention(qf, kf, v, a, c, causal=causal, key_log_scale=kls, chunk_size=chunk_size)
    return out.to(compute_dtype(*(t for t in (xq, xk, v, extra_q, a) if t is not None)))


def _launch(xq, xk, v, projection, extra_q, extra_k, a, c, key_mask, causal, chunk_size, segments):
    kernels = _kernels()
    B, H, N, D = xq.shape
    Dv, m = v.shape[-1], projection.shape[0]
    acc = compute_dtype(*(t for t in (xq, xk, v, extra_q, a) if t is not None))
    # bfloat16 operands (float32 accumulation) for half inputs and positive weights; not in
    # triton's CPU interpreter, whose bfloat16 dot returns garbage (triton 3.9), and not in
    # the causal pass, whose bfloat16 products gave infinite outputs (one segment) and an
    # illegal memory access (three) on an H200 with triton 3.6; the bidirectional pass
    # agreed with float32 to 3.8e-3 there.
    low = v.dtype in (torch.bfloat16, torch.float16) and a is None and acc == torch.float32 and xq.device.type == "cuda" and not causal
    # float32 products in TF32 only where torch's own matmuls use it, and never for the
    # multiplicative coupling's signed sums (docs/math.md section 4, "Conditioning").
    tf32 = acc == torch.float32 and a is None and torch.backends.cuda.matmul.allow_tf32
    r2 = 1 if a is None else a.shape[-1]
    xq, xk, v, w = (t.contiguous() for t in (xq, xk, v, projection.to(acc)))
    dummy = xq  # a pointer for the inputs a case does not have (never read)
    eq, ek = (dummy, dummy) if extra_q is None else (extra_q.contiguous(), extra_k.contiguous())
    a_, c_ = (dummy, dummy) if a is None else (a.contiguous(), c.contiguous())
    if extra_q is not None and eq.shape[0] != ek.shape[0]:
        eq, ek = eq.expand(B, -1, -1, -1).contiguous(), ek.expand(B, -1, -1, -1).contiguous()
    if a is not None and a_.shape[0] != c_.shape[0]:
        a_, c_ = a_.expand(B, -1, -1, -1).contiguous(), c_.expand(B, -1, -1, -1).contiguous()
    e_dim = 0 if extra_q is None else eq.shape[-1]
    keep = dummy if key_mask is None else key_mask.to(acc).contiguous()
    pow2 = lambda n: max(16, 1 << max(0, n - 1).bit_length())  # noqa: E731
    flags = {"CAUSAL": bool(causal), "HAS_EXTRA": extra_q is not None, "HAS_MASK": a is not None, "HAS_KEEP": key_mask is not None,
                 "ATOMIC": r2 > 1, "LOW": low, "PREC": "tf32" if tf32 else "ieee", "BD": pow2(D), "BE": pow2(e_dim), "BM": pow2(m)}
    out = torch.zeros(B, H, N, Dv + 1, device=xq.device, dtype=acc)

    def attempt(chunk, bv, stages):
        n_vb = math.ceil(Dv / bv)
        n_seg_wanted = segments or segment_count(B * H * r2 * n_vb, N, chunk, xq.device)
        seg_len = chunk * math.ceil(N / (n_seg_wanted * chunk))
        n_seg = math.ceil(N / seg_len)

        def launch(states, levels, states_only, has_init):
            kernels.favor_attention_kernel[(B * H, r2, n_vb * n_seg)](
                xq, xk, eq, ek, a_, c_, v, w, keep, out, states, levels,
                H, N, D, e_dim, m, Dv, r2,
                0 if extra_q is None or eq.shape[0] == 1 else H * N * e_dim,
                0 if a is None or a_.shape[0] == 1 else H * N * r2,
                seg_len, n_seg, n_vb,
                STATES_ONLY=states_only, HAS_INIT=has_init, BC=chunk, BV=bv, **flags,
                **({} if stages is None else {"num_stages": stages}),
            )

        if n_seg == 1:
            launch(dummy, dummy, False, False)
        else:
            states = torch.empty(B * H, r2, n_seg, m, Dv + 1, device=xq.device, dtype=acc)
            levels = torch.empty(B * H, r2, n_seg, device=xq.device, dtype=acc)
            launch(states, levels, True, False)
            states, levels = combine_segments(states, levels, causal)
            launch(states.contiguous(), levels.contiguous(), False, True)

    key = ("favor", acc, xq.device, tuple(sorted(flags.items())))
    launch_fitted(key, tile_candidates(chunk_size, min(64, pow2(Dv)), flags["BM"], xq.device), attempt)
    return safe_divide(out[..., :-1], out[..., -1:])


class _FavorAttention(torch.autograd.Function):
    """Forward: the kernel. Backward: the gradient of :func:`favor_attention_torch`,
    recomputed from the saved inputs (the kernel has no backward of its own yet)."""

    @staticmethod
    def forward(ctx, xq, xk, v, projection, extra_q, extra_k, a, c, key_mask, causal, chunk_size, segments):
        ctx.save_for_backward(xq, xk, v, projection, extra_q, extra_k, a, c, key_mask)
        ctx.causal = causal
        return _launch(xq, xk, v, projection, extra_q, extra_k, a, c, key_mask, causal, chunk_size, segments)

    @staticmethod
    def backward(ctx, grad):
        xq, xk, v, projection, extra_q, extra_k, a, c, key_mask = ctx.saved_tensors
        inputs = [xq, xk, v, extra_q, extra_k, a, c]
        wanted = [t is not None and need for t, need in zip(inputs, ctx.needs_input_grad[:3] + ctx.needs_input_grad[4:8], strict=True)]
        leaves: list[Any] = [t.detach().requires_grad_(w) if t is not None else None for t, w in zip(inputs, wanted, strict=True)]
        with torch.enable_grad(), torch.autocast(grad.device.type, enabled=False):
            out = favor_attention_torch(leaves[0], leaves[1], leaves[2], projection, causal=ctx.causal,
                                        extra_q=leaves[3], extra_k=leaves[4], a=leaves[5], c=leaves[6], key_mask=key_mask)
            sources = [t for t, w in zip(leaves, wanted, strict=True) if w and t is not None]
            grads = iter(torch.autograd.grad(out, sources, grad.to(out.dtype)) if sources else ())
        g = [next(grads) if w else None for w in wanted]
        return g[0], g[1], g[2], None, g[3], g[4], g[5], g[6], None, None, None, None
