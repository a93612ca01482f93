"""FAVOR+ attention (Performer, FLT logit coupling) by the feature-split kernels
(:mod:`flt.ops.triton.split_kernels`): the ``m`` features in blocks of ``feature_block``
over programs, each program an ``[feature_block, value_block]`` slice of the state, chunks of
``chunk_size`` tokens; the parts of the feature blocks are added here in PyTorch.

Chosen by ``favor_attention(..., split_features=True)`` (layers: ``backend="triton-split"``)
or called directly as :func:`favor_attention_split`. Same function and arguments as
:func:`flt.ops.triton.favor_attention` without the multiplicative coupling (``a, c``), which
:func:`favor_attention_split_kronecker` computes from the same kernels: the FAVOR+ sums of
the values widened by ``c`` (:func:`favor_sums_split`), read with ``a``.

Gradients by two backward kernels over the same feature blocks and chunks (queries in the
forward's order; keys and values from the last chunk), from the forward's added numerators
and denominators and its row levels per block (``[B H, F, N]``, saved); or, with
``backward="torch"``, those of :func:`flt.ops.triton.favor_attention_torch`, recomputed.
The backward cuts the sequence into segments as the forward does (each segment's key state
and query state in a first launch, combined here). Written for speed on GPUs and not yet
timed on one (docs/performance.md, "GPU (CUDA)").
"""

from __future__ import annotations

import math

import torch

from flt._checks import check_positive_int
from flt._dtype import compute_dtype
from flt.ops._common import safe_divide
from flt.ops.triton.favor import _check, _FavorAttention
from flt.ops.triton.launch import (
    check_device,
    combine_segments,
    interpreted,
    launch_fitted,
    segment_count,
)

#: Default tile on a GPU: features per program, tokens per chunk, value columns per program.
SPLIT_FEATURE_BLOCK = 64
SPLIT_CHUNK = 64
SPLIT_VALUE_BLOCK = 64


def _pow2(n: int) -> int:
    """The next power of two ``>= max(n, 16)`` (triton's smallest dot operand)."""
    return max(16, 1 << max(0, n - 1).bit_length())


def _tf32(acc: torch.dtype, *inputs: torch.Tensor) -> bool:
    """Whether the kernels' float32 products run in TF32: where torch's matmuls do, and for
    bfloat16 / float16 inputs (whose 8 or 11 significant bits TF32's 11 keep). Otherwise
    float32 products are IEEE, which Triton computes without tensor cores: the causal pass
    of bfloat16 inputs (no bfloat16 operands there, see :func:`_launch_split`) would then
    run at a fraction of the GPU's speed."""
    if acc != torch.float32:
        return False
    return bool(torch.backends.cuda.matmul.allow_tf32) or any(t.dtype in (torch.bfloat16, torch.float16) for t in inputs)


def split_tile_candidates(chunk: int, bv: int, device: torch.device) -> list[tuple[int, int, int | None]]:
    """Tiles ``(tokens per chunk, value columns, pipeline stages)`` to try, largest first
    (:func:`flt.ops.triton.launch_fitted`). Compiled for sm_90 (triton 3.9, no GPU), the
    causal kernel at the default tile (64 tokens, 64 features, 64 value columns, head dim
    and spectral width 64) needs 147,712 bytes of shared memory at 2 stages in float32
    (229,632 at 3, 82,176 at 1) and 163,840 at 1 stage in float64 (262,656 at 2), against
    232,448 a block on an H100/H200; the bidirectional one less. So: 2 stages, then 1,
    then 32 tokens and 32 value columns (which of the first two is faster is untimed). The
    backward kernels take the same list with all value columns in one program (up to
    181,248 bytes in float32 at 2 stages, 229,888 in float64 at 1). Off CUDA (the
    interpreter) only the given tile."""
    if device.type != "cuda":
        return [(chunk, bv, None)]
    tiles: list[tuple[int, int, int | None]] = [(chunk, bv, 2), (chunk, bv, 1), (min(chunk, 32), min(bv, 32), 1)]
    return list(dict.fromkeys(tiles))


def favor_attention_split(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *, causal: bool = False,
                          extra_q: torch.Tensor | None = None, extra_k: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                          chunk_size: int | None = None, feature_block: int | None = None, value_block: int | None = None,
                          segments: int | None = None, backward: str = "kernel") -> torch.Tensor:
    """FAVOR+ attention by the feature-split kernel (module docstring).

    Args:
        xq, xk, v, projection, causal, extra_q, extra_k, key_mask, segments: as
            :func:`flt.ops.triton.favor_attention`.
        chunk_size: tokens per step, a power of two >= 16; None: :data:`SPLIT_CHUNK`
            on a GPU, 16 under the interpreter.
        feature_block: features per program, a power of two >= 16; None:
            :data:`SPLIT_FEATURE_BLOCK` on a GPU, 16 under the interpreter (both at most
            the next power of two of ``m``).
        value_block: value columns per program, a power of two >= 16; None:
            :data:`SPLIT_VALUE_BLOCK` on a GPU, 16 under the interpreter (both at most the
            next power of two of ``Dv``).
        backward: ``"kernel"``: the gradients by the split backward kernels (same feature
            blocks, chunks and segments; all value columns per program); ``"torch"``:
            :func:`flt.ops.triton.favor_attention_torch`'s, recomputed.

    Returns:
        ``[B, H, N, Dv]`` in float32 (float64 when an input is float64); rows with a zero
        denominator are zeros.
    """
    _check(xq, xk, v, projection, extra_q, extra_k, None, None, key_mask)
    tile = _tile(xq, v.shape[-1], projection, extra_q, chunk_size, feature_block, value_block, segments)
    if backward not in ("kernel", "torch"):
        raise ValueError(f"backward must be 'kernel' or 'torch', got {backward!r}")
    return _FavorSplit.apply(xq, xk, v, projection, extra_q, extra_k, None, None, key_mask, causal, tile, segments,
                             backward == "torch")


def favor_sums_split(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *, causal: bool = False,
                     extra_q: torch.Tensor | None = None, extra_k: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                     chunk_size: int | None = None, feature_block: int | None = None, value_block: int | None = None,
                     segments: int | None = None, signed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The FAVOR+ numerators and denominators by the feature-split kernel, unnormalised, with
    their row level: what a caller adds other weights to (:func:`flt.ops.triton.band.band_attention_split`).

    ``total * exp(level)`` are the true sums ``sum_j phi(q_i).phi(k_j) [v_j, 1]`` (``j <= i``
    when causal, valid keys only), on the scale of ``exp(q.k)``: every factor the kernel
    takes out of the features (each block's shift, the ``m^(-1/2)``, ``-|x|^2 / 2`` of
    queries and keys) is in ``level``. ``level`` is detached (a stabiliser: the largest of
    the feature blocks' levels, :func:`add_feature_blocks`); ``total``'s gradient is that
    of the true sums divided by ``exp(level)``, by the split backward kernels. Those drop
    the query's ``-|x|^2 / 2`` (it cancels in ``num / den``, not in a sum); here it is put
    back as the factor ``exp(h - h)`` of value 1, ``h = -|[x_q, extra_q]|^2 / 2`` with the
    second ``h`` detached, whose gradient autograd adds.

    Args:
        As :func:`favor_attention_split` (no ``backward``: the kernels'), and
        signed: the values carry weights of both signs whose sums may cancel (the
            multiplicative coupling's ``c_j [v_j, 1]``, :func:`favor_attention_split_kronecker`):
            every product of the kernels in IEEE float32 (or float64), never TF32 nor
            bfloat16 operands, as the one-program kernel does for that coupling
            (docs/math.md section 4, "Conditioning"). Pass such values in float32 or
            better.

    Returns:
        ``(total [B, H, N, Dv + 1], level [B, H, N])``, the denominators last, in float32
        (float64 when an input is float64). A row without any valid key (causal: before
        the first) has ``total = 0`` and a level near ``-1e30``.
    """
    _check(xq, xk, v, projection, extra_q, extra_k, None, None, key_mask)
    tile = _tile(xq, v.shape[-1], projection, extra_q, chunk_size, feature_block, value_block, segments)
    total, level = _FavorSums.apply(xq, xk, v, projection, extra_q, extra_k, key_mask, causal, tile, segments, signed)
    acc = total.dtype
    half = 0.5 * xq.to(acc).square().sum(dim=-1)
    if extra_q is not None:
        half = half + 0.5 * extra_q.to(acc).square().sum(dim=-1)
    return total * torch.exp(half.detach() - half).unsqueeze(-1), level


def favor_attention_split_kronecker(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, a: torch.Tensor, c: torch.Tensor, *,
                                   causal: bool = False, key_mask: torch.Tensor | None = None, chunk_size: int | None = None,
                                   feature_block: int | None = None, value_block: int | None = None,
                                   segments: int | None = None) -> torch.Tensor:
    """FLT's multiplicative coupling by the feature-split kernels, composed in PyTorch (no
    kernel of its own): ``out_i = sum_j (a_i.c_j) phi_i.phi_j v_j / sum_j (a_i.c_j) phi_i.phi_j``,
    ``phi`` the FAVOR+ features of ``xq``, ``xk`` (docs/math.md section 4).

    The mask factors over the keys: ``sum_j (a_i.c_j) phi_i.phi_j [v_j, 1] = sum_r a_ir
    sum_j phi_i.phi_j c_jr [v_j, 1]``. So the FAVOR+ sums of the widened values ``c_j (x)
    [v_j, 1]`` (``2R (Dv + 1)`` columns) by :func:`favor_sums_split`, read with ``a_i``, give
    the numerator and the signed denominator; the kernel's own column of plain denominators
    is not used. Those sums are relative to ``exp`` of their row level, which cancels in
    the ratio (a detached per-row factor). Rows without any valid key (causal: before the
    first) get sums of 0 and outputs of 0; so do rows whose signed denominator cancels to
    zero (:func:`flt.ops._common.safe_divide`). The state is ``2R`` times wider than
    Performer's, as the Kronecker state of :func:`flt.ops.linear.flt_attention` is.

    The split backward kernels hold all value columns of a feature block in one program,
    so the widened values go through in groups of ``value_block`` columns, one
    :func:`favor_sums_split` call each (each group's tile is Performer's at
    ``Dv = value_block``, which fits the GPU's shared memory; its 32-bit index check is per
    group); the groups' sums share their row level (it does not depend on the values).

    The signed sums cancel, so rounding is amplified (docs/math.md section 4,
    "Conditioning"): they are computed in float32 or better whatever the inputs' dtype
    and autocast, with IEEE products (``signed=True``), as :func:`flt.ops.linear.flt_attention`
    does (:func:`flt.ops.linear.full_precision`) and the one-program kernel.

    A function of its own rather than options of :func:`favor_attention_split`: it is a
    composition whose gradients autograd takes through :func:`favor_sums_split` (the split
    backward kernels) and the PyTorch steps, not one autograd function with a choice of
    backward; ``a, c`` are required here.

    Args:
        xq, xk, v, projection, causal, key_mask, chunk_size, feature_block, segments: as
            :func:`favor_attention_split` (``projection`` ``[m, D]``).
        a, c: ``[B or 1, H, N, 2R]``, the mask's factors: ``a_i.c_j = f^(r_i - r_j)``, of
            either sign.
        value_block: widened value columns per :func:`favor_sums_split` call and per
            program, a power of two >= 16; None: :data:`SPLIT_VALUE_BLOCK` on a GPU, 16
            under the interpreter (both at most the next power of two of ``2R (Dv + 1)``).

    Returns:
        ``[B, H, N, Dv]`` in float32 (float64 when an input is float64).
    """
    _check(xq, xk, v, projection, None, None, a, c, key_mask)
    if a is None or c is None:
        raise ValueError("a and c ([B or 1, H, N, 2R], the multiplicative coupling's mask factors) are required")
    check_device(xq.device, "triton-split")
    width = a.shape[-1] * (v.shape[-1] + 1)
    if value_block is None:
        value_block = min(16 if xq.device.type != "cuda" or interpreted() else SPLIT_VALUE_BLOCK, _pow2(width))
    else:
        _check_block("value_block", value_block)
    # The tile and the 32-bit index check of the widest group, before the widened values are made.
    _tile(xq, min(value_block, width), projection, None, chunk_size, feature_block, value_block, segments)
    acc = compute_dtype(xq, xk, v, a, c)
    with torch.autocast(xq.device.type, enabled=False):  # the signed sums and their reading in `acc`
        xq, xk, v, a, c = (t.to(acc) for t in (xq, xk, v, a, c))
        vaug = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        wide = (c.unsqueeze(-1) * vaug.unsqueeze(-2)).flatten(-2)  # [B, H, N, 2R (Dv + 1)]
        parts = [favor_sums_split(xq, xk, group, projection, causal=causal, key_mask=key_mask, chunk_size=chunk_size,
                                  feature_block=feature_block, value_block=value_block, segments=segments, signed=True)
                 for group in wide.split(value_block, dim=-1)]
        # One scale for all groups: a row's level depends on the queries, keys, mask and tile,
        # not on the values, so every group's is the same.
        sums = torch.cat([total[..., :-1] for total, _ in parts], dim=-1)
        sums = (a.unsqueeze(-2) @ sums.unflatten(-1, (a.shape[-1], -1))).squeeze(-2)  # [B, H, N, Dv + 1]
        return safe_divide(sums[..., :-1], sums[..., -1:])


def _check_block(name: str, given: object) -> None:
    """``ValueError`` unless ``given`` is a power of two >= 16 (a tile of the kernels)."""
    if isinstance(given, bool) or not isinstance(given, int) or given < 16 or given & (given - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (a tile of the kernel), got {given}")


def _tile(xq, dv, projection, extra_q, chunk_size, feature_block, value_block, segments) -> tuple[int, int, int]:
    """The checked tile ``(chunk_size, feature_block, value_block)`` (defaults filled in) for
    ``dv`` value columns."""
    check_device(xq.device, "triton-split")
    small = xq.device.type != "cuda" or interpreted()
    tile = []
    for name, given, default, size in (("chunk_size", chunk_size, SPLIT_CHUNK, None), ("feature_block", feature_block, SPLIT_FEATURE_BLOCK, projection.shape[0]),
                                       ("value_block", value_block, SPLIT_VALUE_BLOCK, dv)):
        if given is None:
            given = 16 if small else default
            given = given if size is None else min(given, _pow2(size))
        else:
            _check_block(name, given)
        tile.append(given)
    if segments is not None:
        check_positive_int("segments", segments)
    B, H, N, D = xq.shape
    width = max(dv + 1, D, 0 if extra_q is None else extra_q.shape[-1])
    if B * H * math.ceil(projection.shape[0] / tile[1]) * N * width >= 2**31:
        raise ValueError(f"the feature-split kernels index their per-block parts [B H, m / {tile[1]}, N, {width}] with 32-bit "
                         f"integers: at B = {B}, H = {H}, N = {N} that is 2^31 elements or more; pass fewer sequences at a time")
    return tile[0], tile[1], tile[2]


def _launch_split(xq, xk, v, projection, extra_q, extra_k, key_mask, causal, tile, segments, signed=False):
    """``(total [B H, N, Dv + 1], lev [B H, F, N])``: the numerators and denominators, the
    feature blocks added (:func:`add_feature_blocks`), and each block's row levels.
    ``signed``: IEEE products only (:func:`favor_sums_split`)."""
    from flt.ops.triton import split_kernels

    chunk_size, bm, value_block = tile
    B, H, N, D = xq.shape
    Dv, m = v.shape[-1], projection.shape[0]
    acc = compute_dtype(*(t for t in (xq, xk, v, extra_q) if t is not None))
    # bfloat16 operands as the one-program kernel (flt.ops.triton.favor._launch): only in the
    # bidirectional pass, never under the interpreter. TF32: _tf32. Neither for signed values.
    low = not signed and v.dtype in (torch.bfloat16, torch.float16) and acc == torch.float32 and xq.device.type == "cuda" and not causal
    tf32 = not signed and _tf32(acc, xq, xk, v)
    xq, xk, v, w = (t.contiguous() for t in (xq, xk, v, projection.to(acc)))
    dummy = xq  # a pointer for the inputs a case does not have (never read)
    eq, ek = (dummy, dummy) if extra_q is None else (extra_q.contiguous(), extra_k.contiguous())
    if extra_q is not None and eq.shape[0] != ek.shape[0]:
        eq, ek = eq.expand(B, -1, -1, -1).contiguous(), ek.expand(B, -1, -1, -1).contiguous()
    e_dim = 0 if extra_q is None else eq.shape[-1]
    keep = dummy if key_mask is None else key_mask.to(acc).contiguous()
    n_fb = math.ceil(m / bm)
    flags = {"CAUSAL": bool(causal), "HAS_EXTRA": extra_q is not None, "HAS_KEEP": key_mask is not None, "LOW": low,
             "PREC": "tf32" if tf32 else "ieee", "BD": _pow2(D), "BE": _pow2(e_dim), "BM": bm}
    part = torch.empty(B * H, n_fb, N, Dv + 1, device=xq.device, dtype=acc)
    lev = torch.empty(B * H, n_fb, N, device=xq.device, dtype=acc)

    def attempt(chunk, bv, stages):
        n_vb = math.ceil(Dv / bv)
        n_seg_wanted = segments or segment_count(B * H * n_fb * n_vb, N, chunk, xq.device)
        seg_len = chunk * math.ceil(N / (n_seg_wanted * chunk))
        n_seg = math.ceil(N / seg_len)

        def launch(states, levels, states_only, has_init):
            split_kernels.favor_split_kernel[(B * H, n_fb, n_vb * n_seg)](
                xq, xk, eq, ek, v, w, keep, part, lev, states, levels,
                H, N, D, e_dim, m, Dv, 0 if extra_q is None or eq.shape[0] == 1 else H * N * e_dim,
                seg_len, n_seg, n_vb, n_fb,
                STATES_ONLY=states_only, HAS_INIT=has_init, BC=chunk, BV=bv, **flags,
                **({} if stages is None else {"num_stages": stages}),
            )

        if n_seg == 1:
            launch(dummy, dummy, False, False)
        else:
            states = torch.empty(B * H, n_fb, n_seg, bm, Dv + 1, device=xq.device, dtype=acc)
            levels = torch.empty(B * H, n_fb, n_seg, device=xq.device, dtype=acc)
            launch(states, levels, True, False)
            states, levels = combine_segments(states, levels, causal)
            launch(states.contiguous(), levels.contiguous(), False, True)

    key = ("split", acc, xq.device, tuple(sorted(flags.items())))
    launch_fitted(key, split_tile_candidates(chunk_size, value_block, xq.device), attempt,
                  hint=", a smaller feature_block or chunk_size")
    return add_feature_blocks(part, lev), lev


def add_feature_blocks(part: torch.Tensor, lev: torch.Tensor) -> torch.Tensor:
    """The sum of the feature blocks' parts ``[..., F, N, X]``, each relative to
    ``exp(lev [..., F, N])``, relative to the largest level of each row: ``[..., N, X]``.
    Every factor is ``exp(lev - max lev) <= 1``; the common factor cancels in the ratio."""
    if part.shape[-3] == 1:
        return part.squeeze(-3)
    top = lev.amax(dim=-2, keepdim=True)
    return (part * torch.exp(lev - top).unsqueeze(-1)).sum(dim=-3)


class _FavorSplit(torch.autograd.Function):
    """Forward: the feature-split kernel. Backward: the split backward kernels
    (:func:`_backward_split`), or, with ``torch_backward``,
    :class:`flt.ops.triton.favor._FavorAttention`'s (the gradient of
    :func:`flt.ops.triton.favor_attention_torch`, recomputed), which takes the same first
    nine inputs (``a, c`` None here)."""

    @staticmethod
    def forward(ctx, xq, xk, v, projection, extra_q, extra_k, a, c, key_mask, causal, tile, segments, torch_backward):
        # No autocast for the PyTorch steps between the launches (the segments' combination,
        # the addition of the parts): their sums stay in the accumulation type.
        with torch.autocast(xq.device.type, enabled=False):
            total, lev = _launch_split(xq, xk, v, projection, extra_q, extra_k, key_mask, causal, tile, segments)
        kept = (total, lev) if not torch_backward else ()  # _FavorAttention.backward reads nine tensors
        ctx.save_for_backward(xq, xk, v, projection, extra_q, extra_k, a, c, key_mask, *kept)
        ctx.causal, ctx.tile, ctx.segments, ctx.torch_backward = causal, tile, segments, torch_backward
        out = safe_divide(total[..., :-1], total[..., -1:])
        return out.view(*v.shape[:3], v.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        if ctx.torch_backward:
            return (*_FavorAttention.backward(ctx, grad), None)
        xq, xk, v, projection, extra_q, extra_k, _a, _c, key_mask, total, lev = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            g = upstream_gradient(grad.reshape(total.shape[0], total.shape[1], -1), total)
            grads = _backward_split(g, xq, xk, v, projection, extra_q, extra_k, key_mask, lev, ctx.causal, ctx.tile, ctx.segments)
        return (*grads[:3], None, *grads[3:], None, None, None, None, None, None, None)


class _FavorSums(torch.autograd.Function):
    """Forward: the feature-split kernel's added sums and their row levels, ``[B, H, N, Dv + 1]``
    and ``[B, H, N]`` (not differentiable). Backward: the split backward kernels, given the
    gradient of the sums directly (:func:`favor_sums_split` adds the query's norm)."""

    @staticmethod
    def forward(ctx, xq, xk, v, projection, extra_q, extra_k, key_mask, causal, tile, segments, signed):
        with torch.autocast(xq.device.type, enabled=False):
            total, lev = _launch_split(xq, xk, v, projection, extra_q, extra_k, key_mask, causal, tile, segments, signed)
        ctx.save_for_backward(xq, xk, v, projection, extra_q, extra_k, key_mask, lev)
        ctx.causal, ctx.tile, ctx.segments, ctx.signed = causal, tile, segments, signed
        level = lev.amax(dim=1).view(xq.shape[:3])
        ctx.mark_non_differentiable(level)
        return total.view(*v.shape[:3], v.shape[-1] + 1), level

    @staticmethod
    def backward(ctx, grad_total, _grad_level):
        xq, xk, v, projection, extra_q, extra_k, key_mask, lev = ctx.saved_tensors
        with torch.autocast(grad_total.device.type, enabled=False):
            g = grad_total.reshape(lev.shape[0], lev.shape[-1], -1).to(lev.dtype).contiguous()
            grads = _backward_split(g, xq, xk, v, projection, extra_q, extra_k, key_mask, lev, ctx.causal, ctx.tile, ctx.segments,
                                    ctx.signed)
        return (*grads[:3], None, *grads[3:], None, None, None, None, None)


def upstream_gradient(grad: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The gradient of the added numerators and denominators ``total [..., N, Dv + 1]`` from
    that of the output ``grad [..., N, Dv]`` (``out = num / den``): ``[g / den, -(g.out) / den]``,
    zeros where the row's denominator counts as zero (:func:`flt.ops._common.safe_divide`)."""
    num, den = total[..., :-1], total[..., -1:]
    out = safe_divide(num, den)
    inv = safe_divide(torch.ones_like(den), den)
    grad = grad.to(total.dtype)
    return torch.cat([grad * inv, -(grad * out).sum(dim=-1, keepdim=True) * inv], dim=-1)


def _backward_split(g, xq, xk, v, projection, extra_q, extra_k, key_mask, lev, causal, tile, segments, signed=False):
    """Gradients of ``xq, xk, v, extra_q, extra_k`` by :func:`flt.ops.triton.split_kernels.favor_split_dq_kernel`
    and :func:`flt.ops.triton.split_kernels.favor_split_dkv_kernel` (per feature block,
    added here), from ``g [B H, N, Dv + 1]``, the gradient of the forward's added sums
    (relative to ``exp`` of ``lev``'s largest block level; the query's ``-|x|^2 / 2`` held
    constant), and the forward's ``lev``. ``signed``: IEEE products only (:func:`favor_sums_split`)."""
    from flt.ops.triton import split_kernels

    chunk_size, bm, _ = tile
    B, H, N, D = xq.shape
    Dv, m = v.shape[-1], projection.shape[0]
    acc = g.dtype
    tf32 = not signed and _tf32(acc, xq, xk, v)
    xq_, xk_, v_, w = (t.contiguous() for t in (xq, xk, v, projection.to(acc)))
    dummy = xq_
    eq, ek = (dummy, dummy) if extra_q is None else (extra_q.contiguous(), extra_k.contiguous())
    if extra_q is not None and eq.shape[0] != ek.shape[0]:
        eq, ek = eq.expand(B, -1, -1, -1).contiguous(), ek.expand(B, -1, -1, -1).contiguous()
    e_dim = 0 if extra_q is None else eq.shape[-1]
    keep = dummy if key_mask is None else key_mask.to(acc).contiguous()
    n_fb = lev.shape[1]
    g = g.contiguous()
    top = lev.amax(dim=1).contiguous()
    flags = {"CAUSAL": bool(causal), "HAS_EXTRA": extra_q is not None, "HAS_KEEP": key_mask is not None,
             "PREC": "tf32" if tf32 else "ieee", "BD": _pow2(D), "BE": _pow2(e_dim), "BM": bm}
    bv = _pow2(Dv)
    e_stride = 0 if extra_q is None or eq.shape[0] == 1 else H * N * e_dim
    dxq = torch.empty(B * H, n_fb, N, D, device=xq.device, dtype=acc)
    dxk = torch.empty_like(dxq)
    deq = torch.empty(B * H, n_fb, N, e_dim, device=xq.device, dtype=acc)
    dek = torch.empty_like(deq)
    dv = torch.empty(B * H, n_fb, N, Dv, device=xq.device, dtype=acc)

    def attempt(chunk, _bv, stages):
        common = {"BC": chunk, "BV": bv, **flags, **({} if stages is None else {"num_stages": stages})}
        n_seg_wanted = segments or segment_count(B * H * n_fb, N, chunk, xq.device)
        seg_len = chunk * math.ceil(N / (n_seg_wanted * chunk))
        n_seg = math.ceil(N / seg_len)
        grid = (B * H, n_fb, n_seg)
        sizes = (H, N, D, e_dim, m, Dv, e_stride, seg_len, n_seg, n_fb)
        keys = queries = (dummy, dummy)
        if n_seg > 1:
            # Each segment's key state (the forward kernel's first launch) and query state,
            # combined into what each segment starts from: the keys before it and the rows
            # after it (all of either, bidirectionally). A query state is held at the least
            # row level, so it combines as a key state of the negated levels in reverse order.
            keys = (torch.empty(B * H, n_fb, n_seg, bm, Dv + 1, device=xq.device, dtype=acc),
                    torch.empty(B * H, n_fb, n_seg, device=xq.device, dtype=acc))
            split_kernels.favor_split_kernel[grid](
                xq_, xk_, eq, ek, v_, w, keep, dxq, lev, *keys, *sizes[:7], seg_len, n_seg, 1, n_fb,  # (dxq, lev: not written)
                STATES_ONLY=True, HAS_INIT=False, LOW=False, **common)
            state, level = combine_segments(*keys, causal)
            keys = (state.contiguous(), level.contiguous())
            queries = (torch.empty_like(keys[0]), torch.empty_like(keys[1]))
            split_kernels.favor_split_dkv_kernel[grid](
                xq_, xk_, eq, ek, v_, w, keep, g, lev, top, dxk, dek, dv, *queries, *sizes,  # (dxk, dek, dv: not written)
                STATES_ONLY=True, HAS_INIT=False, **common)
            state, level = combine_segments(queries[0].flip(2), -queries[1].flip(2), causal)
            queries = (state.flip(2).contiguous(), (-level).flip(2).contiguous())
        split_kernels.favor_split_dq_kernel[grid](
            xq_, xk_, eq, ek, v_, w, keep, g, lev, top, dxq, deq, *keys, *sizes, HAS_INIT=n_seg > 1, **common)
        split_kernels.favor_split_dkv_kernel[grid](
            xq_, xk_, eq, ek, v_, w, keep, g, lev, top, dxk, dek, dv, *queries, *sizes,
            STATES_ONLY=False, HAS_INIT=n_seg > 1, **common)

    candidates = split_tile_candidates(chunk_size, bv, xq.device)
    launch_fitted(("split-backward", acc, xq.device, tuple(sorted(flags.items()))), candidates, attempt,
                  hint=", a smaller feature_block or chunk_size")

    def added(parts, like):
        return parts.sum(dim=1).view(B, H, N, parts.shape[-1]).to(like.dtype)

    def shared(gradient, like):  # extra_q / extra_k given once for the batch: the batch's sum
        return gradient.sum(dim=0, keepdim=True) if like.shape[0] == 1 and B > 1 else gradient

    d_eq = None if extra_q is None else shared(added(deq, extra_q), extra_q)
    d_ek = None if extra_k is None else shared(added(dek, extra_k), extra_k)
    return added(dxq, xq), added(dxk, xk), added(dv, v), d_eq, d_ek
