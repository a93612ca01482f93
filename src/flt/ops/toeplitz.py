"""Kernelized attention with a Toeplitz relative bias, by FFT (Luo et al. 2021).

docs/math.md section 6. Tokens sit on an integer grid ``0..N-1`` and every head has a bias
table ``beta_t`` for the offsets ``t = i - j`` in ``[-(N-1), N-1]``, stored as
``bias[h, t + N - 1]``. With key features ``kf_j exp(s_j)`` (``s`` the optional
``key_log_scale``, FAVOR+'s per-key stabiliser) the attention weights are

    w_ij = exp(beta_(i-j) + s_j) * (qf_i . kf_j),    out_i = sum_j w_ij v_j / sum_j w_ij.

With ``c_t = exp(beta_t - max beta)`` the numerator and denominator are
``qf_i^T sum_j c_(i-j) kf_j v_j^T`` and ``qf_i^T sum_j c_(i-j) kf_j``: Toeplitz products
of the ``m * Dv + m`` channels ``[kf_j (x) v_j, kf_j]``. Each is computed for all
channels and heads at once by embedding the Toeplitz matrix in a circulant of length
``L >= 2N - 1`` and multiplying with ``rfft``/``irfft``: ``O(N log N * m * Dv)`` time and
``O(N * m * Dv)`` memory, never an ``N x N`` matrix. Bidirectional attention does exactly
that, with the keys rescaled by ``exp(s_j - max_j s_j)``: one shift for every key, so it
cancels in the ratio.

Causal attention cannot: one FFT over the whole sequence mixes every position into every
output at the rounding level (``eps`` times the *largest* entries of the signal), and any
key shift shared by all keys is a maximum over future keys too. A later key with a huge
scale then underflows the earlier keys and drowns the early rows in rounding noise: the
past would depend on the future. A per-key shift does not cancel in a Toeplitz sum, and a
running maximum (the chunked linear attention's stabiliser) is not a Toeplitz operator. So
the causal sum is split by aligned key blocks of ``b = block_size`` tokens:

* row ``i``'s own block is computed densely, exactly as the reference does (row maximum
  over the keys it sees);
* every earlier block ``J`` reaches the queries of block ``I > J`` through the offsets
  ``(I - J) b + e``, ``|e| < b``: a Toeplitz product of size ``b``, one circulant of
  length ``2b``. Each key block is transformed once (one batched ``rfft`` of length
  ``2b``); for each frequency a matmul over the block index sums the strictly earlier
  blocks times the kernel spectra of their distances, and one ``irfft`` per query block
  returns to positions. One FFT length and a fixed number of operations whatever ``N``
  (on a GPU every operation is a launch).

These key ranges partition ``[0, i]`` for every row ``i``, and every one lies before the
row. Each key block is stabilised by the maximum of its keys' ``s_j`` and each distance by
the maximum of the coefficients ``beta_t`` it uses (both detached); a query block sums its
earlier blocks rescaled by ``exp(their log scales - the largest)``, in which blocks at or
after it weigh exactly zero, and a row adds that sum and its own block rescaled by the
row's largest log scale. Every shift therefore cancels exactly, and is a maximum over keys
the row sees. No output depends on a later key, value or key scale, not even through
rounding (a query block's inverse FFT holds only earlier keys), and the error of a row's
FFT products is relative to the blocks before it, not to the largest sums of the sequence.
Cost: ``O(N log(block_size) m Dv)`` for the FFTs, ``O(N^2 / block_size * m Dv)`` for the
matmul over the block index (as many flops as the FFTs near ``N = 32 block_size``) and
``O(N block_size (m + Dv))`` for the dense blocks; memory ``O(N m Dv)``.
An earlier version used a divide-and-conquer over ``log2(N / block_size)`` levels, one
FFT length each, so its operation count grew with ``N``. On a CPU this one is faster for
forward+backward at every length measured; the forward alone is slower at N = 2048-4096,
where the transposing copies around the matmul cost more than the levels it replaces
(docs/performance.md).

Accuracy. An FFT product has an error of about ``eps * log(L)`` times the *largest*
entries of its signal, not of each output entry. A row whose exact denominator is far
below those (keys with tiny features, a bias that removes almost every key of that row)
gets a large relative error; a row whose denominator is indistinguishable from the rounding
floor of its FFT products is treated as having no weight at all and returns zeros, the
same convention as a fully masked row in :func:`flt.ops._common.safe_divide`. The FFT runs
in float32 or better (half inputs are upcast).

Shapes follow :mod:`flt.ops`: ``q_feat, k_feat [B, H, N, m]``, ``v [B, H, N, Dv]``,
``bias [H, 2N - 1]``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange

from flt._checks import check_nonnegative_int, check_positive_int, check_tensor
from flt._dtype import compute_dtype
from flt.ops._common import causal_mask_like, safe_divide

#: Rows whose FFT denominator is below this many ``eps * log2(L)`` units of the row's
#: rounding scale are treated as empty (see the module docstring). The FFT error measured
#: on wide-dynamic-range inputs stays below 2.5 units, so a row under the threshold would
#: carry a relative error of 15% or more: it is noise, not a weighted average.
_DEAD_ROW_UNITS = 16.0

#: Causal diagonal blocks computed densely (see :func:`toeplitz_attention`). A dense block
#: costs ``block_size (m + Dv)`` multiply-adds per row in matmuls; the earlier blocks cost
#: about ``m Dv (5 log2(2 block_size) + 4 N / block_size)`` per row in FFTs and the matmul
#: over the block index. On one CPU thread (m = 64, Dv = 32, N = 1024-4096), against 512:
#: 256 was slower; 1024 was faster for fwd+bwd at N = 2048-4096 (about 1.15x) but slower
#: for the forward at N = 1024 (one dense block against two blocks and one FFT).
DEFAULT_BLOCK_SIZE = 512

#: Sequences of at most this many tokens take the quadratic formula
#: (:func:`toeplitz_attention_reference`, exact): on a CPU it is the faster route there.
#: Forward+backward, one thread, B = 16, H = 2, m = 64, Dv = 32: N = 300, 50 ms against
#: 1.7 s (bidirectional FFT) and 54 ms (causal, blocked); N = 512, 0.30 s against 3.2 s and
#: 0.30 s; N = 1024, 1.3 s against 7.1 s and 3.7 s.
DEFAULT_DENSE_BELOW = 512


@functools.lru_cache(maxsize=256)
def fft_length(n: int) -> int:
    """Smallest 2-3-5-smooth integer ``>= n``: a length every FFT library handles fast.

    Closer to ``n`` than the next power of two (at most 1.07x for ``1000 <= n < 2e5``,
    versus up to 2x), which matters because the cost is linear in ``L``.
    """
    if n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    best = 1 << max(0, math.ceil(math.log2(n)))
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            # Smallest power of two that lifts p35 to at least n.
            cand = p35
            while cand < n:
                cand *= 2
            best = min(best, cand)
            p35 *= 3
        p5 *= 5
    return best


def toeplitz_matrix(coeffs: torch.Tensor, n: int) -> torch.Tensor:
    """Dense Toeplitz matrices ``T[..., i, j] = coeffs[..., i - j + n - 1]``.

    Args:
        coeffs: ``[..., 2n - 1]``, entry ``t + n - 1`` belongs to the offset ``t = i - j``.
        n: matrix size ``N``.

    Returns:
        ``[..., N, N]``. O(N^2) memory: for references and tests.
    """
    check_tensor("coeffs", coeffs)
    if coeffs.ndim < 1 or coeffs.shape[-1] != 2 * n - 1:
        raise ValueError(f"coeffs must have last dimension 2N - 1 = {2 * n - 1}, got shape {tuple(coeffs.shape)}")
    idx = torch.arange(n, device=coeffs.device)
    offsets = idx.unsqueeze(1) - idx.unsqueeze(0) + (n - 1)  # [N, N], values in [0, 2N-2]
    return coeffs[..., offsets]


def _circulant_hat(coeffs: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """``rfft`` of the first column of the length-``L`` circulant holding the Toeplitz matrix.

    ``coeffs [H, 2N-1]`` -> ``[H, L//2 + 1]``. The column is ``c_0 .. c_(N-1), zeros,
    c_-(N-1) .. c_-1``; any ``L >= 2N-1`` keeps the wrapped-around negative offsets away
    from the positive ones.
    """
    pad = coeffs.new_zeros(coeffs.shape[0], length - (2 * n - 1))
    column = torch.cat([coeffs[:, n - 1 :], pad, coeffs[:, : n - 1]], dim=-1)  # [H, L]
    return torch.fft.rfft(column, n=length)


def _toeplitz_fft(coeffs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y[b, h, :, i] = sum_j coeffs[h, i - j + N - 1] x[b, h, :, j]`` via a circulant.

    ``coeffs [H, 2N-1]``, ``x [B, H, C, N]`` (sequence last, so each FFT runs over
    contiguous memory), both in a real dtype of at least float32. Returns ``[B, H, C, N]``.
    """
    n = x.shape[-1]
    length = fft_length(2 * n - 1)
    x_hat = torch.fft.rfft(x, n=length)  # zero-padded to L: [B, H, C, L//2 + 1]
    y = torch.fft.irfft(x_hat * _circulant_hat(coeffs, n, length).unsqueeze(1), n=length)
    return y[..., :n]


def toeplitz_matvec(coeffs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Toeplitz product ``y_i = sum_j coeffs[:, i - j + N - 1] x_j`` by FFT, per head.

    Args:
        coeffs: ``[H, 2N - 1]`` (any sign); entry ``t + N - 1`` belongs to ``t = i - j``.
        x: ``[B, H, N, C]``.

    Returns:
        ``[B, H, N, C]`` in ``x``'s dtype (computed in float32 or better).
        Equal to ``toeplitz_matrix(coeffs, N) @ x`` in ``O(N log N * C)``.
    """
    check_tensor("x", x, ndim=4, layout="[B, H, N, C]")
    check_tensor("coeffs", coeffs, ndim=2, layout="[H, 2N - 1]")
    _check_table("coeffs", coeffs, heads=x.shape[1], n=x.shape[2])
    cdt = compute_dtype(coeffs, x)
    y = _toeplitz_fft(coeffs.to(cdt), rearrange(x.to(cdt), "b h n c -> b h c n"))
    return rearrange(y, "b h c n -> b h n c").to(x.dtype)


def _check_table(name: str, table: torch.Tensor, *, heads: int, n: int) -> None:
    if table.shape[0] != heads:
        raise ValueError(f"{name} has {table.shape[0]} heads (dim 0 of shape {tuple(table.shape)}), expected H = {heads}")
    if table.shape[1] != 2 * n - 1:
        raise ValueError(
            f"{name} must have 2N - 1 = {2 * n - 1} offsets for N = {n} tokens (dim 1), got shape {tuple(table.shape)}"
        )


def _check_inputs(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, key_log_scale: torch.Tensor | None = None) -> None:
    check_tensor("q_feat", q_feat, ndim=4, layout="[B, H, N, m]")
    check_tensor("k_feat", k_feat, ndim=4, layout="[B, H, N, m]")
    check_tensor("v", v, ndim=4, layout="[B, H, N, Dv]")
    check_tensor("bias", bias, ndim=2, layout="[H, 2N - 1]")
    if q_feat.shape != k_feat.shape:
        raise ValueError(f"q_feat and k_feat must have the same shape, got {tuple(q_feat.shape)} and {tuple(k_feat.shape)}")
    if v.shape[:3] != k_feat.shape[:3]:
        raise ValueError(f"v must be [B, H, N, Dv] matching k_feat {tuple(k_feat.shape[:3])}, got {tuple(v.shape)}")
    _check_table("bias", bias, heads=q_feat.shape[1], n=q_feat.shape[2])
    if key_log_scale is not None:
        check_tensor("key_log_scale", key_log_scale, ndim=3, layout="[B, H, N]")
        if key_log_scale.shape != k_feat.shape[:3]:
            raise ValueError(f"key_log_scale must be [B, H, N] = {tuple(k_feat.shape[:3])}, got {tuple(key_log_scale.shape)}")


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _bias_to_coeffs(bias: torch.Tensor) -> torch.Tensor:
    """``c_t = exp(beta_t - max beta)`` per head (bidirectional; the causal path shifts the
    offsets each block distance uses by their own max). The max cancels in the ratio, hence
    detached. An all ``-inf`` table gives all-zero coefficients (every row empty).
    """
    shift = _finite_or_zero(bias.amax(dim=-1, keepdim=True).detach())
    return torch.exp(bias - shift)


def _scaled_keys(k_feat: torch.Tensor, key_log_scale: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_feat * exp(s - S), S)`` with ``S`` the max of ``s`` over ``dim`` among live keys.

    ``k_feat [..., n, m]``, ``key_log_scale [..., n]``; ``dim`` indexes ``key_log_scale``.
    A key is live when some feature is nonzero: a featureless key (padding) cannot carry
    weight, so its scale must not set the shift. ``S`` is detached (it cancels in the
    ratio) and is ``-inf`` where no key is live; the exponent of dead keys is ``-inf``
    before ``exp``, so neither the forward nor the backward pass meets ``inf * 0``.
    """
    live = (k_feat != 0).any(dim=-1)
    masked = key_log_scale.detach().masked_fill(~live, -math.inf)
    top = masked.amax(dim=dim, keepdim=True)
    exponent = torch.where(live, key_log_scale - _finite_or_zero(top), torch.full_like(key_log_scale, -math.inf))
    return k_feat * torch.exp(exponent).unsqueeze(-1), top.squeeze(dim)


def _dead_rows(den: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """Zero the denominators at or below their FFT rounding floor (the module docstring)."""
    return torch.where(den <= floor, torch.zeros_like(den), den)


def toeplitz_attention(
    q_feat: torch.Tensor,
    k_feat: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    *,
    causal: bool = False,
    key_log_scale: torch.Tensor | None = None,
    fft_dtype: torch.dtype | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    dense_below: int = DEFAULT_DENSE_BELOW,
) -> torch.Tensor:
    """Linear attention with a Toeplitz logit bias, ``O(N log N * m * Dv)`` (docs/math.md 6).

    ``out_i = sum_j exp(beta_(i-j) + s_j) (qf_i.kf_j) v_j / sum_j exp(beta_(i-j) + s_j) (qf_i.kf_j)``
    with ``beta_t = bias[h, t + N - 1]`` and ``s = key_log_scale`` (0 when None). Tokens
    are the integer grid ``0..N-1``; the bias is a function of ``i - j`` only, so the op
    is translation invariant.

    Bidirectional: one batched FFT product over all channels; keys are rescaled by one
    global maximum of ``s``, which cancels exactly. Causal: the blocked product of the
    module docstring, a fixed number of operations whatever ``N``, in which no output
    depends on a later key, value or key scale, not even through rounding, and every
    stabiliser is a maximum over keys the row sees.

    Args:
        q_feat, k_feat: ``[B, H, N, m]`` nonnegative kernel features.
        v: ``[B, H, N, Dv]``.
        bias: ``[H, 2N - 1]`` log-weights per offset, finite or ``-inf`` (offset removed).
        causal: token ``i`` attends to ``j <= i`` (``c_t = 0`` for ``t < 0``).
        key_log_scale: optional ``[B, H, N]``: the true key features are
            ``k_feat * exp(key_log_scale)`` (FAVOR+'s per-token stabiliser).
        fft_dtype: real dtype of the FFT products, ``torch.float32`` or ``torch.float64``;
            by default the promoted input dtype, at least float32. Bidirectional rows with
            small sums next to the largest ones see the largest relative error; float64
            removes it.
        block_size: causal only: the diagonal blocks of this many tokens are computed
            densely (exactly, ``O(N * block_size * (m + Dv))``); longer offsets by FFTs.
        dense_below: sequences of ``N <= dense_below`` tokens take the exact quadratic
            formula instead (:data:`DEFAULT_DENSE_BELOW`; 0: always the FFTs).

    Returns:
        ``[B, H, N, Dv]`` in the promoted dtype of ``q_feat, k_feat, v``. Rows with no
        weight (or weight below the FFT's rounding floor) return zeros.
    """
    _check_inputs(q_feat, k_feat, v, bias, key_log_scale)
    check_positive_int("block_size", block_size)
    check_nonnegative_int("dense_below", dense_below, "0: always the FFTs")
    if q_feat.shape[2] <= dense_below:
        return toeplitz_attention_reference(q_feat, k_feat, v, bias, causal=causal, key_log_scale=key_log_scale)
    out_dtype = torch.promote_types(torch.promote_types(q_feat.dtype, k_feat.dtype), v.dtype)
    if fft_dtype is None:
        cdt = compute_dtype(q_feat, k_feat, v, bias)
    elif fft_dtype in (torch.float32, torch.float64):
        cdt = fft_dtype
    else:
        raise ValueError(f"fft_dtype must be None, torch.float32 or torch.float64, got {fft_dtype!r}")
    qf, kf, vv, beta = q_feat.to(cdt), k_feat.to(cdt), v.to(cdt), bias.to(cdt)
    kls = None if key_log_scale is None else key_log_scale.to(cdt)
    if causal:
        out = _causal_blocked(qf, kf, vv, beta, kls, block_size)
    else:
        if kls is not None:
            kf, _ = _scaled_keys(kf, kls, dim=-1)
        out = _bidirectional(qf, kf, vv, beta)
    return out.to(out_dtype)


def _bidirectional(qf: torch.Tensor, kf: torch.Tensor, vv: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One FFT product of all channels (keys already carry their scales)."""
    B, H, N, _ = qf.shape
    Dv = vv.shape[-1]
    cdt = qf.dtype
    coeffs = _bias_to_coeffs(beta)
    length = fft_length(2 * N - 1)

    # All channels kf (x) [v, 1] (numerators and, in the last column, denominators) go
    # through one batched rfft/irfft along the sequence, laid out [B, H, m, Dv + 1, L] so
    # each transform runs over contiguous memory. The factors are zero-padded to L before
    # their outer product, so the product is born padded (no extra copy for the FFT).
    k_t = F.pad(kf.transpose(-1, -2), (0, length - N))  # [B, H, m, L]
    v_t = F.pad(torch.cat([vv, vv.new_ones(B, H, N, 1)], dim=-1).transpose(-1, -2), (0, length - N))  # [B, H, Dv+1, L]
    x_hat = torch.fft.rfft(k_t.unsqueeze(-2) * v_t.unsqueeze(-3))  # [B, H, m, Dv+1, L//2 + 1]
    column_hat = _circulant_hat(coeffs, N, length)[:, None, None, :]  # [H, 1, 1, L//2 + 1]
    if torch.is_grad_enabled() and column_hat.requires_grad:
        x_hat = x_hat * column_hat
    else:
        x_hat *= column_hat  # nothing saved for backward needs the old x_hat: save the memory
    y = torch.fft.irfft(x_hat, n=length)[..., :N]  # [B, H, m, Dv+1, N]
    del x_hat
    # out[n, d] = sum_m qf[n, m] y[m, d, n]; reading y in its own layout (no permuted copy).
    out = (y * qf.transpose(-1, -2).unsqueeze(-2)).sum(dim=2).transpose(-1, -2)  # [B, H, N, Dv+1]
    num, den = out[..., :Dv], out[..., Dv:]
    y_k = y[:, :, :, Dv]  # [B, H, m, N]: the Toeplitz sums of the key features

    # Rounding floor of each row's denominator: the FFT error is relative to the largest
    # Toeplitz sums of each channel, seen through this row's query features.
    unit = torch.finfo(cdt).eps * math.log2(max(length, 2))
    scale = torch.einsum("bhnm,bhm->bhn", qf.abs(), y_k.abs().amax(dim=-1)).unsqueeze(-1).detach()
    return safe_divide(num, _dead_rows(den, _DEAD_ROW_UNITS * unit * scale))


def _causal_blocked(qf: torch.Tensor, kf: torch.Tensor, vv: torch.Tensor, beta: torch.Tensor, kls: torch.Tensor | None, block: int) -> torch.Tensor:
    """Causal Toeplitz attention whose rows never see later tokens (module docstring).

    Contributions to row ``i``: its own block of ``block`` tokens (dense, exact) and every
    earlier block (:func:`_earlier_blocks`: one FFT length for all of them). These key
    ranges partition ``[0, i]``. Each contribution carries its own log scale; they are
    combined per row with the row's largest.
    """
    B, H, N, _ = qf.shape
    Dv = vv.shape[-1]
    kls = qf.new_zeros(B, H, N) if kls is None else kls
    vv1 = torch.cat([vv, vv.new_ones(B, H, N, 1)], dim=-1)  # [B, H, N, Dv+1]: numerators, denominator
    beta_c = beta[:, N - 1 :]  # [H, N]: beta_t for t = 0 .. N-1, the only offsets that carry weight
    parts = [_diagonal_blocks(qf, kf, vv1, beta_c, kls, block)]  # (num_den, log scale, floor)
    if N > block:
        parts.append(_earlier_blocks(qf, kf, vv1, beta_c, kls, block))
    log_scales = torch.stack([p[1] for p in parts])  # [parts, B, H, N]
    top = _finite_or_zero(log_scales.amax(dim=0))
    weights = torch.exp(log_scales - top)  # 0 where a part is absent (log scale -inf)
    num_den = sum(w.unsqueeze(-1) * p[0] for w, p in zip(weights, parts, strict=True))
    floor = sum(w * p[2] for w, p in zip(weights, parts, strict=True)).unsqueeze(-1)
    num, den = num_den[..., :Dv], num_den[..., Dv:]
    return safe_divide(num, _dead_rows(den, floor))


class _RealFFT(torch.autograd.Function):
    """``torch.fft.rfft`` over the last dimension with a cheaper backward.

    The adjoint of the one-sided transform of a length-``n`` real signal is
    ``grad_x[t] = Re sum_k g_k e^(2 pi i k t / n)`` over the kept bins ``k = 0 .. n // 2``:
    half of an unnormalised inverse real FFT of ``g``, plus half of the bins that
    ``irfft`` counts once (``0`` and, for even ``n``, ``n / 2``). One half-size ``irfft``
    instead of autograd's padded full complex FFT (about 1.5x faster on one CPU thread).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.n = x.shape[-1]
        return torch.fft.rfft(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        n = ctx.n
        edge = g[..., :1].real
        if n % 2 == 0:
            alternating = torch.ones(n, dtype=edge.dtype, device=edge.device)
            alternating[1::2] = -1
            edge = edge + g[..., -1:].real * alternating
        return torch.add(edge, torch.fft.irfft(g, n=n, norm="forward"), alpha=1.0).mul_(0.5)


class _BatchedMatmul(torch.autograd.Function):
    """``a @ b`` whose backward hands contiguous gradients to the matmuls.

    Autograd passes this product the gradient of a transposing copy, a strided view; a
    batched complex matmul of strided operands falls back to one copy per matrix: a
    number of operations that grows with the number of frequencies, and slow.
    """

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, b = ctx.saved_tensors
        g = g.contiguous()
        grad_a = g @ b.mH if ctx.needs_input_grad[0] else None
        grad_b = a.mH.resolve_conj().contiguous() @ g if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def _pad_seq(x: torch.Tensor, length: int, value: float = 0.0) -> torch.Tensor:
    """Pad dim 2 (the sequence of ``[B, H, N, ...]`` or ``[B, H, N]``) to ``length``."""
    extra = length - x.shape[2]
    if extra == 0:
        return x
    pad = [0, 0] * (x.ndim - 3) + [0, extra]
    return F.pad(x, pad, value=value)


def _diagonal_blocks(qf: torch.Tensor, kf: torch.Tensor, vv1: torch.Tensor, beta_c: torch.Tensor, kls: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense causal attention within aligned blocks of ``block`` tokens: the reference's
    formula (row max over live keys), ``O(N * block * (m + Dv))``."""
    N = qf.shape[2]
    c = min(block, N)
    n_blocks = -(-N // c)
    total = n_blocks * c
    q_b = _pad_seq(qf, total).unflatten(2, (n_blocks, c))  # [B, H, nb, c, m]
    k_b = _pad_seq(kf, total).unflatten(2, (n_blocks, c))
    v_b = _pad_seq(vv1, total).unflatten(2, (n_blocks, c))  # [B, H, nb, c, Dv+1]
    s_b = _pad_seq(kls, total).unflatten(2, (n_blocks, c))  # [B, H, nb, c]
    idx = torch.arange(c, device=qf.device)
    t = idx.view(-1, 1) - idx.view(1, -1)  # [c, c], i - j
    causal = t >= 0
    beta_pad = F.pad(beta_c, (0, max(0, c - beta_c.shape[-1])), value=-math.inf)  # offsets >= N never occur
    logits = beta_pad[:, t.clamp(min=0)][None, :, None] + s_b.unsqueeze(-2)  # [B, H, nb, c, c]
    qk = q_b @ k_b.transpose(-1, -2)  # [B, H, nb, c, c]
    live = causal & (qk != 0) & (logits > -math.inf)
    row_max = _finite_or_zero(logits.detach().masked_fill(~live, -math.inf).amax(dim=-1, keepdim=True))
    exponent = torch.where(live, logits - row_max, torch.full_like(logits, -math.inf))
    w = qk * torch.exp(exponent)
    num_den = (w @ v_b).flatten(2, 3)[:, :, :N]  # [B, H, N, Dv+1]
    log_scale = row_max.squeeze(-1).flatten(2, 3)[:, :, :N]
    # A row with no live key has log scale -inf, so it adds nothing to the combination.
    has_live = live.any(dim=-1).flatten(2, 3)[:, :, :N]
    log_scale = log_scale.masked_fill(~has_live, -math.inf)
    return num_den, log_scale, torch.zeros_like(log_scale)


def _block_kernel_spectra(beta_c: torch.Tensor, block: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Spectra of the kernels between blocks ``d = 1 .. n_blocks - 1`` apart, with log scales.

    Keys of block ``J`` reach the queries of block ``J + d`` through the offsets
    ``d b + e``, ``e = u - w`` in ``(-b, b)`` (``u, w`` the positions in the blocks): a
    Toeplitz product of size ``b`` embedded in a circulant of length ``2b`` whose column
    holds ``c_(db + e)`` at ``e mod 2b`` (slot ``b`` unused). The coefficients of each
    ``d`` are shifted by their own maximum (detached), returned as the log scale
    (``-inf`` where every offset is removed). Row ``d = 0`` (the dense diagonal) is zero.

    Returns ``([H, n_blocks, b + 1]`` complex, ``[H, n_blocks]``).
    """
    N = beta_c.shape[1]
    b = block
    padded = F.pad(beta_c, (0, (n_blocks + 1) * b - N), value=-math.inf)  # offsets >= N carry no weight
    windows = padded.unfold(-1, 2 * b, b)[:, : n_blocks - 1]  # [H, nb-1, 2b]: offsets (d-1)b .. (d+1)b - 1
    # Offset (d - 1) b (e = -b) is never used: blank it so it sets no scale.
    windows = torch.cat([torch.full_like(windows[..., :1], -math.inf), windows[..., 1:]], dim=-1)
    top = windows.detach().amax(dim=-1)  # [H, nb-1]
    coeffs = torch.exp(windows - _finite_or_zero(top).unsqueeze(-1))
    column = torch.cat([coeffs[..., b:], coeffs[..., :b]], dim=-1)  # e >= 0 first, then e < 0 wrapped
    spectra = torch.fft.rfft(column, dim=-1)  # [H, nb-1, b+1]
    spectra = torch.cat([torch.zeros_like(spectra[:, :1]), spectra], dim=1)
    top = torch.cat([torch.full_like(top[:, :1], -math.inf), top], dim=1)
    return spectra, top


def _earlier_blocks(qf: torch.Tensor, kf: torch.Tensor, vv1: torch.Tensor, beta_c: torch.Tensor, kls: torch.Tensor,
                    block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contributions of every earlier block of ``block`` tokens to each block's queries.

    One length ``2b`` FFT per key block (its keys scaled by their own maximum), one
    batched matmul over the block index that sums, per frequency, the strictly earlier
    blocks times the kernel spectra of their distances, and one inverse FFT per query
    block: a fixed number of operations whatever ``N``, and a query block's inverse FFT
    only ever holds keys before it. The sums are weighted by
    ``exp(key scale + kernel scale - the query block's largest)``, exact zeros for the
    key blocks at or after it. ``O(N m Dv (log b + N / b))`` time, ``O(N m Dv)`` memory.
    """
    B, H, N, m = qf.shape
    D1 = vv1.shape[-1]
    b = block
    nb = -(-N // b)
    total = nb * b
    n_mix = nb - 1  # key blocks 0 .. nb-2 reach query blocks 1 .. nb-1

    def blocks(x: torch.Tensor, keep: slice) -> torch.Tensor:
        return _pad_seq(x, total).unflatten(2, (nb, b))[:, :, keep]  # [B, H, blocks, b, ...]

    keys, queries = slice(0, n_mix), slice(1, nb)
    k_b, key_top = _scaled_keys(blocks(kf, keys), blocks(kls, keys), dim=-1)  # [B, H, nb-1, b, m], [B, H, nb-1]
    # Channels kf (x) [v, 1], sequence last as in _bidirectional: the factors are padded
    # to 2b before their outer product, so the FFT input is born padded.
    k_t = F.pad(k_b.transpose(-1, -2), (0, b))  # [B, H, nb-1, m, 2b]
    v_t = F.pad(blocks(vv1, keys).transpose(-1, -2), (0, b))  # [B, H, nb-1, D1, 2b]
    x_hat = _RealFFT.apply(k_t.unsqueeze(-2) * v_t.unsqueeze(-3))  # [B, H, nb-1, m, D1, b+1]

    spectra, coeff_top = _block_kernel_spectra(beta_c, b, nb)
    idx = torch.arange(n_mix, device=qf.device)
    dist = (idx.view(-1, 1) + 1 - idx.view(1, -1)).clamp(min=0)  # [I, J]: query block I+1, key block J; 0: none
    log_w = key_top.unsqueeze(-2) + coeff_top[:, dist]  # [B, H, nb-1 (I), nb-1 (J)]
    row_top = log_w.amax(dim=-1)  # [B, H, nb-1]: -inf where no earlier block has weight
    w = torch.exp(log_w - _finite_or_zero(row_top).unsqueeze(-1))
    mix = w.unsqueeze(2) * spectra[:, dist].permute(0, 3, 1, 2)  # [B, H, b+1, I, J] complex
    if n_mix == 1:
        # Two blocks (N <= 2b): the sum over earlier blocks is one term, a product per
        # frequency; no transposes (on a CPU they cost about as much as the FFTs).
        factor = rearrange(mix, "b h w i j -> b h i j 1 w")
        if torch.is_grad_enabled() and (x_hat.requires_grad or factor.requires_grad):
            y_hat = x_hat * factor
        else:
            y_hat = x_hat.mul_(factor)  # nothing saved for backward needs the old x_hat: save the memory
    else:
        # Frequency first for the matmul over the block index: one transposing copy each
        # way is cheaper than FFTs and outer products over a strided dimension.
        x_hat = rearrange(x_hat, "b h j m d w -> b h w j (m d)").contiguous()
        y_hat = _BatchedMatmul.apply(mix.contiguous(), x_hat)  # [B, H, b+1, nb-1, m D1]
        y_hat = rearrange(y_hat, "b h w i (m d) -> b h i m d w", m=m).contiguous()
    del x_hat
    y = torch.fft.irfft(y_hat, n=2 * b)  # [B, H, nb-1, m, D1, 2b]
    del y_hat
    q_t = blocks(qf, queries).transpose(-1, -2)  # [B, H, nb-1, m, b]
    out = (y[..., :b] * q_t.unsqueeze(-2)).sum(dim=3).transpose(-1, -2)  # [B, H, nb-1, b, D1]

    # Rounding floor: the error of the FFT products is relative to the largest circular
    # outputs of each key channel (all 2b of them), seen through the row's query features.
    unit = torch.finfo(qf.dtype).eps * math.log2(2 * total)
    y_max = y[..., D1 - 1, :].detach().abs().amax(dim=-1)  # [B, H, nb-1, m]
    floor = _DEAD_ROW_UNITS * unit * torch.einsum("bhimu,bhim->bhiu", q_t.detach().abs(), y_max)
    # Block 0 has no earlier keys: nothing, with log scale -inf.
    num_den = F.pad(out.flatten(2, 3), (0, 0, b, 0))[:, :, :N]  # [B, H, N, D1]
    log_scale = F.pad(row_top.unsqueeze(-1).expand(B, H, n_mix, b).flatten(2, 3), (b, 0), value=-math.inf)[:, :, :N]
    return num_den, log_scale, F.pad(floor.flatten(2, 3), (b, 0))[:, :, :N]


def toeplitz_attention_reference(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, *, causal: bool = False,
                                 key_log_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The quadratic formula behind :func:`toeplitz_attention`, O(N^2) memory.

    Weights ``w_ij = exp(beta_(i-j) + s_j - M_i) (qf_i . kf_j)`` with
    ``beta_t = bias[h, t + N - 1]``, ``s = key_log_scale`` (0 when None), causal rows
    restricted to ``j <= i``, and ``M_i`` the row's largest ``beta_(i-j) + s_j`` over the
    keys that can carry weight (it cancels; as in :func:`flt.ops.rpe_attention_reference`).
    ``out = w v / row sums``; rows with no weight give zeros. Same arguments and shapes as
    :func:`toeplitz_attention`.
    """
    _check_inputs(q_feat, k_feat, v, bias, key_log_scale)
    N = q_feat.shape[2]
    out_dtype = torch.promote_types(torch.promote_types(q_feat.dtype, k_feat.dtype), v.dtype)
    cdt = compute_dtype(q_feat, k_feat, v, bias)
    logits = toeplitz_matrix(bias.to(cdt), N).unsqueeze(0)  # [1, H, N, N]
    if key_log_scale is not None:
        logits = logits + key_log_scale.to(cdt).unsqueeze(-2)
    qk = torch.einsum("bhim,bhjm->bhij", q_feat.to(cdt), k_feat.to(cdt))
    live = (qk != 0) & (logits > -math.inf)
    if causal:
        live = live & (causal_mask_like(qk) != 0)
    row_max = _finite_or_zero(logits.detach().masked_fill(~live, -math.inf).amax(dim=-1, keepdim=True))
    weights = qk * torch.exp(torch.where(live, logits - row_max, torch.full_like(logits, -math.inf)))
    out = safe_divide(weights @ v.to(cdt), weights.sum(dim=-1, keepdim=True))
    return out.to(out_dtype)
