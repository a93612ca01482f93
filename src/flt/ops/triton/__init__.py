"""FAVOR+ linear attention and the FLT couplings as Triton kernels: a fast path of
:func:`flt.ops.linear.linear_attention` / :func:`flt.ops.linear.flt_attention` with the
FAVOR+ features (:func:`flt.ops.features.favor_plus_features`) computed inside the kernel.

:func:`favor_attention` takes what the features are made of, not the features:

* Performer: ``extra_q = extra_k = a = c = None``;
* FLT, logit coupling: ``extra_q = a(r)``, ``extra_k = c(r)``: FAVOR+ of ``[x_q, a]`` and
  ``[x_k, c]`` (:func:`flt.ops.features.favor_plus_features_split`);
* FLT, multiplicative coupling: ``a, c``: weights ``(a_i.c_j) phi(x_q).phi(x_k)``.

so the ``[B, H, N, m]`` features never reach memory (kernel in :mod:`flt.ops.triton.kernels`).
:func:`favor_attention_torch` computes the same function with the PyTorch ops; it is the
kernel's backward pass (recomputed from the inputs, linear memory) and its reference.
The kernels are tested against the float64 quadratic references on CPU tensors under
``TRITON_INTERPRET=1`` (``tests/test_ops_triton.py``) and on CUDA by ``pytest -m cuda``.
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

import importlib.util
import math
from collections.abc import Callable
from typing import Any

import torch

from flt._checks import check_positive_int, check_tensor
from flt._dtype import compute_dtype
from flt.ops._common import safe_divide
from flt.ops.features import favor_plus_features, favor_plus_features_split
from flt.ops.linear import flt_attention, linear_attention

#: Default chunk length of the kernels (tokens per step of a program; a power of two >= 16).
TRITON_CHUNK = 64


def triton_available() -> tuple[bool, str]:
    """``(True, "")`` when the triton package can be imported, else ``(False, how to get it)``."""
    if importlib.util.find_spec("triton") is None:
        from flt._extras import install_hint

        return False, f"the triton package is not installed ({install_hint('triton')})"
    return True, ""


def _kernels():
    ok, reason = triton_available()
    if not ok:
        raise ModuleNotFoundError(f"backend='triton' needs Triton: {reason}", name="triton")
    from flt.ops.triton import kernels

    return kernels


def interpreted() -> bool:
    """Whether the kernels were built for triton's CPU interpreter (``TRITON_INTERPRET=1``
    was set when :mod:`flt.ops.triton.kernels` was first imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernels().favor_attention_kernel, InterpretedFunction)


def check_device(device: torch.device, backend: str = "triton") -> None:
    """Refuse devices the kernels cannot run on (``ValueError``, naming ``backend``, the
    layers' option that chose them): CUDA always works; CPU tensors only under triton's
    interpreter (slow; for tests)."""
    device = torch.device(device)
    if device.type == "cuda":
        _kernels()
        return
    if device.type == "cpu" and interpreted():
        return
    raise ValueError(
        f"backend={backend!r} runs Triton kernels on CUDA tensors; these are on {device.type}. Use backend='torch' "
        "here, or, to test the kernels on CPU, set TRITON_INTERPRET=1 in the environment before flt imports "
        "them (triton's interpreter: slow)."
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
            launches; :func:`combine_segments`); None: from the GPU's size
            (:func:`segment_count`; 1 off CUDA).
        split_features: run the feature-split kernels instead, forward and backward
            (:func:`flt.ops.triton.split.favor_attention_split`, its default tile;
            ``chunk_size`` is then its chunk); with ``a, c``
            :func:`flt.ops.triton.split.favor_attention_split_kronecker`, the same kernels
            on values widened by ``c``.

    Returns:
        ``[B, H, N, Dv]`` in float32 (float64 when an input is float64). Rows with a zero
        denominator are zeros. Gradients: :func:`favor_attention_torch`'s, recomputed
        (``split_features``: the split backward kernels').
    """
    _check(xq, xk, v, projection, extra_q, extra_k, a, c, key_mask)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 (the kernels' tile), got {chunk_size}")
    if segments is not None:
        check_positive_int("segments", segments)
    check_device(xq.device, "triton-split" if split_features else "triton")
    if split_features:
        from flt.ops.triton.split import favor_attention_split, favor_attention_split_kronecker

        if a is not None:
            assert c is not None  # given together with a (_check)
            return favor_attention_split_kronecker(xq, xk, v, projection, a, c, causal=causal, key_mask=key_mask,
                                                   chunk_size=chunk_size, segments=segments)
        return favor_attention_split(xq, xk, v, projection, causal=causal, extra_q=extra_q, extra_k=extra_k, key_mask=key_mask,
                                     chunk_size=chunk_size, segments=segments)
    return _FavorAttention.apply(xq, xk, v, projection, extra_q, extra_k, a, c, key_mask, causal, chunk_size, segments)


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


def segment_count(programs: int, n: int, chunk: int, device: torch.device) -> int:
    """How many segments to cut the sequence into: enough programs for two per
    multiprocessor of the GPU (``programs`` per segment), at most one per 4 chunks."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(math.ceil(target / programs), n // (4 * chunk)))


#: The tile that fitted, per kernel configuration and list of candidates (:func:`launch_fitted`).
_FITTED: dict[tuple, tuple[int, int, int | None]] = {}

def tile_candidates(chunk: int, bv: int, bm: int, device: torch.device) -> list[tuple[int, int, int | None]]:
    """Tiles ``(tokens per step, value columns per program, pipeline stages)`` to try in
    order, largest first. A program keeps the ``[m, BV]`` state, the projection and
    ``[BC, m]`` feature tiles on chip: on an H200 (232,448 bytes of shared memory a block)
    the default tile failed for FLT's logit coupling at ``m = 256`` (720,896 bytes in
    float64) and, in float64, at ``m = 64`` too (the multiplicative coupling 263,168, the
    band 466,944). The smaller tiles give up reuse of loaded rows, not results. Off CUDA
    (the interpreter) only the given tile."""
    if device.type != "cuda":
        return [(chunk, bv, None)]
    small: list[tuple[int, int, int | None]] = [(16, min(bv, 32), 1), (16, min(bv, 16), 1)]
    tiles = ([(chunk, bv, 3)] if bm <= 64 else []) + small
    return list(dict.fromkeys(tiles))  # without repeats (bv <= 16 makes the two small ones one)


def launch_fitted(key: tuple, candidates: list[tuple[int, int, int | None]], attempt: Callable[[int, int, int | None], None],
                  hint: str = "") -> None:
    """Run ``attempt(chunk, bv, stages)`` with the first candidate tile that fits the GPU's
    shared memory (remembered per ``key`` and candidate list); a tile that does not fit
    fails before any work (triton's ``OutOfResources`` at launch, before the kernel runs;
    an attempt's earlier launches write only its own segment states), so trying the next
    one is safe. ``hint``: what else the caller can change, for the error."""
    from triton.runtime.errors import OutOfResources

    remembered = _FITTED.get((key, tuple(candidates)))
    tiles = [remembered] if remembered is not None else candidates
    failures = []
    for tile in tiles:
        try:
            attempt(*tile)
        except OutOfResources as err:
            failures.append(f"{tile}: {err}")
            continue
        _FITTED[(key, tuple(candidates))] = tile
        return
    raise ValueError(f"no tile of the Triton kernel fits this GPU's shared memory; tried (tokens, value columns, stages) "
                     f"{'; '.join(failures)}. Use fewer features (num_features){hint}, float32 instead of float64, or backend='torch'.")


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


def combine_segments(states: torch.Tensor, levels: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The state each segment starts from, from the segments' own key states ``[..., S, m, Dv+1]``
    relative to their levels ``[..., S]``: the keys of the earlier segments (causal) or of all
    segments, relative to the largest level among them; every factor ``exp(l - L) <= 1``."""
    if not causal:
        top = levels.amax(dim=-1, keepdim=True)
        total = (states * torch.exp(levels - top)[..., None, None]).sum(dim=-3, keepdim=True)
        return total.expand_as(states), top.expand_as(levels)
    S = levels.shape[-1]
    before = torch.ones(S, S, dtype=torch.bool, device=levels.device).tril(-1)  # segment s' < s
    seen = levels.unsqueeze(-2).masked_fill(~before, -float("inf"))  # [..., S, S']
    start = seen.amax(dim=-1)  # level of the keys before segment s (-inf: none)
    start = torch.where(torch.isinf(start), torch.full_like(start, NO_KEY), start)
    weights = torch.exp(seen - start.unsqueeze(-1))  # 0 where s' >= s
    carried = torch.einsum("...st,...tmd->...smd", weights, states)
    return carried, start


#: The level of an empty state (:data:`flt.ops.triton.kernels._NO_KEY`).
NO_KEY = -1.0e30


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
