"""Kernelized attention with a Toeplitz relative bias, by FFT (Luo et al. 2021).

docs/math.md section 6. Tokens sit on an integer grid ``0..N-1`` and every head has a bias
table ``beta_t`` for the offsets ``t = i - j`` in ``[-(N-1), N-1]``, stored as
``bias[h, t + N - 1]``. The attention weights are

    w_ij = exp(beta_(i-j)) * (qf_i . kf_j),    out_i = sum_j w_ij v_j / sum_j w_ij.

With ``c_t = exp(beta_t - max beta)`` the numerator and denominator are
``qf_i^T sum_j c_(i-j) kf_j v_j^T`` and ``qf_i^T sum_j c_(i-j) kf_j``: Toeplitz products
of the ``m * Dv + m`` channels ``[kf_j (x) v_j, kf_j]``. Each is computed for all
channels and heads at once by embedding the Toeplitz matrix in a circulant of length
``L >= 2N - 1`` and multiplying with ``rfft``/``irfft``: ``O(N log N * m * Dv)`` time and
``O(N * m * Dv)`` memory, never an ``N x N`` matrix.

Accuracy. An FFT product has an error of about ``eps * log(L)`` times the *largest*
entries of the signal, not of each output entry. A row whose exact denominator is far
below the largest one (keys with tiny features, a bias that removes almost every key of
that row) gets a large relative error; a row whose denominator is indistinguishable from
the rounding floor is treated as having no weight at all and returns zeros, the same
convention as a fully masked row in :func:`flt.ops._common.safe_divide`. The FFT runs in
float32 or better (half inputs are upcast). For the same reason a causal output is
causal only up to rounding: the FFT mixes all positions at the ``eps`` level.

Shapes follow :mod:`flt.ops`: ``q_feat, k_feat [B, H, N, m]``, ``v [B, H, N, Dv]``,
``bias [H, 2N - 1]``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange

from flt._checks import check_tensor
from flt.ops._common import causal_mask_like, safe_divide

#: Rows whose FFT denominator is below this many ``eps * log2(L)`` units of the row's
#: rounding scale are treated as empty (see the module docstring). The FFT error measured
#: on wide-dynamic-range inputs stays below 2.5 units, so a row under the threshold would
#: carry a relative error of 15% or more: it is noise, not a weighted average.
_DEAD_ROW_UNITS = 16.0


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


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


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
    cdt = _compute_dtype(coeffs, x)
    y = _toeplitz_fft(coeffs.to(cdt), rearrange(x.to(cdt), "b h n c -> b h c n"))
    return rearrange(y, "b h c n -> b h n c").to(x.dtype)


def _check_table(name: str, table: torch.Tensor, *, heads: int, n: int) -> None:
    if table.shape[0] != heads:
        raise ValueError(f"{name} has {table.shape[0]} heads (dim 0 of shape {tuple(table.shape)}), expected H = {heads}")
    if table.shape[1] != 2 * n - 1:
        raise ValueError(
            f"{name} must have 2N - 1 = {2 * n - 1} offsets for N = {n} tokens (dim 1), got shape {tuple(table.shape)}"
        )


def _check_inputs(q_feat, k_feat, v, bias) -> None:
    check_tensor("q_feat", q_feat, ndim=4, layout="[B, H, N, m]")
    check_tensor("k_feat", k_feat, ndim=4, layout="[B, H, N, m]")
    check_tensor("v", v, ndim=4, layout="[B, H, N, Dv]")
    check_tensor("bias", bias, ndim=2, layout="[H, 2N - 1]")
    if q_feat.shape != k_feat.shape:
        raise ValueError(f"q_feat and k_feat must have the same shape, got {tuple(q_feat.shape)} and {tuple(k_feat.shape)}")
    if v.shape[:3] != k_feat.shape[:3]:
        raise ValueError(f"v must be [B, H, N, Dv] matching k_feat {tuple(k_feat.shape[:3])}, got {tuple(v.shape)}")
    _check_table("bias", bias, heads=q_feat.shape[1], n=q_feat.shape[2])


def _bias_to_coeffs(bias: torch.Tensor, causal: bool) -> torch.Tensor:
    """``c_t = exp(beta_t - max beta)`` per head, ``c_t = 0`` for ``t < 0`` when causal.

    The max runs over the offsets that can carry weight, so a large bias on a future
    offset cannot underflow the causal ones. It cancels in the ratio, hence detached.
    An all ``-inf`` table gives all-zero coefficients (every row empty).
    """
    n = (bias.shape[-1] + 1) // 2
    live = bias[:, n - 1 :] if causal else bias
    shift = live.amax(dim=-1, keepdim=True).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    if not causal:
        return torch.exp(bias - shift)
    # Future offsets never pass through exp: a large one would overflow to inf, and inf
    # times a zero gradient is NaN in the backward pass.
    return torch.cat([torch.zeros_like(bias[:, : n - 1]), torch.exp(live - shift)], dim=-1)


def toeplitz_attention(q_feat, k_feat, v, bias, *, causal: bool = False, fft_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Linear attention with a Toeplitz logit bias, ``O(N log N * m * Dv)`` (docs/math.md 6).

    ``out_i = sum_j exp(beta_(i-j)) (qf_i.kf_j) v_j / sum_j exp(beta_(i-j)) (qf_i.kf_j)``
    with ``beta_t = bias[h, t + N - 1]``. Tokens are the integer grid ``0..N-1``; the
    bias is a function of ``i - j`` only, so the op is translation invariant.

    Args:
        q_feat, k_feat: ``[B, H, N, m]`` nonnegative kernel features (e.g. FAVOR+ with the
            key scale already folded in; this op has no per-key log scale because a
            causal FFT product cannot carry a running maximum).
        v: ``[B, H, N, Dv]``.
        bias: ``[H, 2N - 1]`` log-weights per offset, finite or ``-inf`` (offset removed).
        causal: token ``i`` attends to ``j <= i`` (``c_t = 0`` for ``t < 0``).
        fft_dtype: real dtype of the FFT products, ``torch.float32`` or ``torch.float64``;
            by default the promoted input dtype, at least float32. Causal rows near the
            start have small sums next to the later rows and see the largest relative
            error (about ``1e-4`` at ``N = 1000`` in float32); float64 removes it.

    Returns:
        ``[B, H, N, Dv]`` in the promoted dtype of ``q_feat, k_feat, v``. Rows with no
        weight (or weight below the FFT's rounding floor) return zeros.
    """
    _check_inputs(q_feat, k_feat, v, bias)
    B, H, N, m = q_feat.shape
    Dv = v.shape[-1]
    out_dtype = torch.promote_types(torch.promote_types(q_feat.dtype, k_feat.dtype), v.dtype)
    if fft_dtype is None:
        cdt = _compute_dtype(q_feat, k_feat, v, bias)
    elif fft_dtype in (torch.float32, torch.float64):
        cdt = fft_dtype
    else:
        raise ValueError(f"fft_dtype must be None, torch.float32 or torch.float64, got {fft_dtype!r}")
    qf, kf, vv = q_feat.to(cdt), k_feat.to(cdt), v.to(cdt)
    coeffs = _bias_to_coeffs(bias.to(cdt), causal)
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
    dead = den <= _DEAD_ROW_UNITS * unit * scale
    out = safe_divide(num, torch.where(dead, torch.zeros_like(den), den))
    return out.to(out_dtype)


def toeplitz_attention_reference(q_feat, k_feat, v, bias, *, causal: bool = False) -> torch.Tensor:
    """The quadratic formula behind :func:`toeplitz_attention`, O(N^2) memory.

    ``w = exp(T(bias) - max) * (qf kf^T)`` with ``T(bias)[h, i, j] = bias[h, i - j + N - 1]``,
    causal rows restricted to ``j <= i``, ``out = w v / row sums`` (empty rows give zeros).
    Same arguments and shapes as :func:`toeplitz_attention`.
    """
    _check_inputs(q_feat, k_feat, v, bias)
    N = q_feat.shape[2]
    out_dtype = torch.promote_types(torch.promote_types(q_feat.dtype, k_feat.dtype), v.dtype)
    cdt = _compute_dtype(q_feat, k_feat, v, bias)
    coeffs = _bias_to_coeffs(bias.to(cdt), causal)
    weights = toeplitz_matrix(coeffs, N) * torch.einsum("bhim,bhjm->bhij", q_feat.to(cdt), k_feat.to(cdt))
    if causal:
        weights = weights * causal_mask_like(weights)
    out = safe_divide(weights @ v.to(cdt), weights.sum(dim=-1, keepdim=True))
    return out.to(out_dtype)
