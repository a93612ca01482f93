"""Near-field exact, far-field linear attention: the banded FLT estimator, O(N w).

Random features estimate a strong, concentrated relative bias badly: the FAVOR+ input
``[x_q, a(r)]`` carries ``|a|^2 = sum_k |w_k| >= f(0)``, and FAVOR+'s variance grows like
``exp(|x + y|^2)`` (docs/math.md section 5.1 measures it). Near the diagonal, where a local
bias lives, this op therefore computes the attention weights exactly; only the far pairs
go through the kernel features:

    w_ij = exp(l_ij)                       if |i - j| <= w     (l_ij = x_i.y_j + b_ij, exact)
    w_ij = qf_i.kf_j exp(s_j)              otherwise           (FAVOR+ estimate)
    out_i = sum_j w_ij v_j / sum_j w_ij

with ``j <= i`` as well when causal. ``|i - j|`` is the distance in token order (the band
is a window of the sequence), whatever the positions are. Every weight is nonnegative and
the near ones are exact, so row sums stay positive.

Algorithm, so that the band costs little on top of plain FLT:

* the exact band is blocked local attention: queries in blocks of ``T >= w`` tokens, each
  block against the key blocks ``b - 1, b`` (and ``b + 1`` bidirectionally), exact weights
  on the pairs inside the band and nothing elsewhere: ``O(N 2T (D + Dv))`` (``3T``);
* causal far field: every pair ``i - j > w`` and no other is causal linear attention with
  the keys and values delayed by ``w + 1`` tokens, so it is the chunked scan of plain FLT
  (:func:`flt.ops.linear.causal_sums`, chunks of 64-256 tokens whatever ``w``, a fixed
  number of operations), and nothing is subtracted;
* bidirectional far field: the estimate over all keys (one ``[m, Dv + 1]`` state) minus its
  band part, computed in the band's blocks.

Memory ``O(N (T + m))``.

Stabilisation: weights of row ``i`` are computed relative to ``exp(sq_i + L_i + c_i)``
where ``sq_i`` is the query's feature shift, ``L_i`` the key level (the global maximum of
the key log scales bidirectionally; the running maximum over keys ``j <= i`` when causal,
so no output depends on a future key) and ``c_i >= 0`` the largest exact exponent of the
row above that level. Every exponent is then ``<= 0``; the common factor cancels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flt._checks import check_positive_int, check_tensor
from flt._dtype import compute_dtype
from flt.ops._common import safe_divide
from flt.ops.linear import causal_chunk_size, causal_sums


def band_offsets(width: int) -> torch.Tensor:
    """Offsets ``j - i`` of the band, ``-w .. w``: the layout of ``band_bias``'s last axis."""
    return torch.arange(-width, width + 1)


def _check(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor, q_shift: torch.Tensor, key_log_scale: torch.Tensor, band_bias: torch.Tensor, width: int,
           key_mask: torch.Tensor | None) -> None:
    check_tensor("xq", xq, ndim=4, layout="[B, H, N, D]")
    check_tensor("xk", xk, ndim=4, layout="[B, H, N, D]")
    check_tensor("v", v, ndim=4, layout="[B, H, N, Dv]")
    check_tensor("q_feat", qf, ndim=4, layout="[B, H, N, m]")
    check_tensor("k_feat", kf, ndim=4, layout="[B, H, N, m]")
    check_positive_int("width", width)
    B, H, N, _ = xq.shape
    for name, t in (("xk", xk), ("v", v), ("q_feat", qf), ("k_feat", kf)):
        if t.shape[:3] != (B, H, N):
            raise ValueError(f"{name} must share [B, H, N] = {(B, H, N)} with xq, got {tuple(t.shape)}")
    for name, t in (("q_shift", q_shift), ("key_log_scale", key_log_scale)):
        check_tensor(name, t, ndim=3, layout="[B, H, N]")
        if t.shape != (B, H, N):
            raise ValueError(f"{name} must be [B, H, N] = {(B, H, N)}, got {tuple(t.shape)}")
    check_tensor("band_bias", band_bias, ndim=4, layout="[B or 1, H, N, 2w + 1]")
    if band_bias.shape[0] not in (1, B) or band_bias.shape[1:] != (H, N, 2 * width + 1):
        raise ValueError(f"band_bias must be [B or 1, H, N, 2w + 1] = [{B} or 1, {H}, {N}, {2 * width + 1}], got {tuple(band_bias.shape)}")
    if key_mask is not None and (not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, N)):
        raise ValueError(f"key_mask must be a bool tensor [B, N] = {(B, N)} (True = a valid key), got {key_mask.dtype} {tuple(key_mask.shape)}")


def band_attention_reference(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor, q_shift: torch.Tensor, key_log_scale: torch.Tensor, band_bias: torch.Tensor, *,
                             width: int, causal: bool = False, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The O(N^2) formula of :func:`band_attention`, for tests.

    Args as in :func:`band_attention`. Returns ``[B, H, N, Dv]``.
    """
    _check(xq, xk, v, qf, kf, q_shift, key_log_scale, band_bias, width, key_mask)
    _, H, N, _ = xq.shape
    cdt = compute_dtype(xq)
    i = torch.arange(N, device=xq.device)
    off = i.view(1, -1) - i.view(-1, 1)  # j - i
    near = off.abs() <= width
    full = torch.zeros(band_bias.shape[0], H, N, N, dtype=cdt, device=xq.device)
    full = torch.where(near, band_bias.to(cdt).gather(-1, (off.clamp(-width, width) + width).expand(band_bias.shape[0], H, N, N)), full)
    exact = torch.exp(xq.to(cdt) @ xk.to(cdt).transpose(-1, -2) + full)
    est = (qf.to(cdt) @ kf.to(cdt).transpose(-1, -2)) * torch.exp(q_shift.to(cdt)).unsqueeze(-1) * torch.exp(key_log_scale.to(cdt)).unsqueeze(-2)
    w = torch.where(near, exact, est)
    keep = torch.ones(N, N, dtype=torch.bool, device=xq.device)
    if causal:
        keep = keep.tril()
    if key_mask is not None:
        keep = keep & key_mask[:, None, None, :]
    w = torch.where(keep, w, torch.zeros_like(w))
    num = w @ v.to(cdt)
    return safe_divide(num, w.sum(-1, keepdim=True))


def band_attention(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor, q_shift: torch.Tensor, key_log_scale: torch.Tensor, band_bias: torch.Tensor, *,
                   width: int, causal: bool = False, key_mask: torch.Tensor | None = None, block_size: int | None = None,
                   chunk_size: int | None = None) -> torch.Tensor:
    """Attention with exact weights on a band of ``|i - j| <= width`` tokens and FAVOR+
    estimates elsewhere (module docstring), linear in ``N``.

    Args:
        xq, xk: ``[B, H, N, D]`` scaled queries and keys: the exact kernel is ``exp(xq.xk)``.
        v: ``[B, H, N, Dv]``.
        qf, kf: ``[B, H, N, m]`` kernel features of the far field, with true features
            ``qf * exp(q_shift)`` and ``kf * exp(key_log_scale)``.
        q_shift, key_log_scale: ``[B, H, N]``, the features' log scales (detached).
        band_bias: ``[B or 1, H, N, 2w + 1]``, the exact logit bias ``b_ij`` of query ``i``
            for key ``j = i + o``, ``o = -w .. w`` (:func:`band_offsets`); entries outside
            the sequence are ignored.
        width: ``w >= 1``.
        causal: token ``i`` attends to ``j <= i``.
        key_mask: optional ``[B, N]`` bool, True marks a valid key.
        block_size: ``T >= w``, the query blocks of the exact band (default ``max(w, 16)``).
        chunk_size: causal only: the chunks of the far field's scan (default
            :func:`flt.ops.linear.causal_chunk_size`, as plain linear attention; it does not
            depend on ``w``).

    Returns:
        ``[B, H, N, Dv]`` in the promoted dtype (float32 or better). Rows without any valid
        key return zeros.
    """
    _check(xq, xk, v, qf, kf, q_shift, key_log_scale, band_bias, width, key_mask)
    T = max(width, 16) if block_size is None else int(block_size)
    if T < width:
        raise ValueError(f"block_size ({T}) must be at least width ({width})")
    if chunk_size is not None:
        check_positive_int("chunk_size", chunk_size)
    B, H, N, _ = xq.shape
    cdt = compute_dtype(xq, qf, v)
    xq, xk, qf, kf = (t.to(cdt) for t in (xq, xk, qf, kf))
    valid = torch.ones(B, N, dtype=torch.bool, device=xq.device) if key_mask is None else key_mask
    vaug = torch.cat([v.to(cdt), v.new_ones(*v.shape[:-1], 1).to(cdt)], dim=-1) * valid[:, None, :, None].to(cdt)
    sq, sk = q_shift.to(cdt), key_log_scale.to(cdt)
    if key_mask is not None:
        # A padded key never sets a level; its values (numerator and denominator) are zero.
        floor = sk.detach().masked_fill(~valid[:, None, :], float("inf")).amin(-1, keepdim=True)
        floor = torch.where(torch.isinf(floor), torch.zeros_like(floor), floor)  # no valid key at all
        sk = torch.where(valid[:, None, :], sk, floor.expand_as(sk))
    level = torch.cummax(sk, dim=-1).values if causal else sk.amax(dim=-1, keepdim=True).expand(B, H, N)
    row = sq + level  # [B, H, N]: every weight of row i is taken relative to exp(row_i + c_i)
    near, c, windows = _exact_band(xq, xk, vaug, band_bias.to(cdt), row, valid, width, T, causal)
    if causal:
        far, far_level = _causal_far_field(qf, kf, vaug, sk, width, chunk_size)
        if far is not None and far_level is not None:  # both or neither
            near = near + far * torch.exp(far_level - level - c).unsqueeze(-1)
    else:
        # Far field = the estimate over all keys minus its band part. Rounding of order
        # eps * total relative to the far part, only where the far field is negligible next
        # to the band.
        kfw = kf * torch.exp(sk - level[..., :1]).unsqueeze(-1)  # key weights <= 1
        total = qf @ (kfw.transpose(-1, -2) @ vaug)  # [B, H, N, Dv+1]
        near = near + (total - _band_estimate(qf, kfw, vaug, windows, T)) * torch.exp(-c).unsqueeze(-1)
    return safe_divide(near[..., :-1], near[..., -1:])


def _blocks(t: torch.Tensor, nb: int, T: int) -> torch.Tensor:
    """``[B, H, N, ...] -> [B, H, nb, T, ...]``, zero-padded at the end."""
    return _pad_to(t, nb * T).unflatten(2, (nb, T))


def _pad_to(t: torch.Tensor, length: int) -> torch.Tensor:
    extra = length - t.shape[2]
    return t if extra == 0 else torch.cat([t, t.new_zeros(*t.shape[:2], extra, *t.shape[3:])], dim=2)


def _window(t: torch.Tensor, causal: bool) -> torch.Tensor:
    """Key blocks ``b - 1, b`` (and ``b + 1`` when not causal) of every query block ``b``:
    ``[B, H, nb, T, ...] -> [B, H, nb, 2T or 3T, ...]``, zeros beyond the sequence."""
    zero = torch.zeros_like(t[:, :, :1])
    parts = [torch.cat([zero, t[:, :, :-1]], dim=2), t]
    if not causal:
        parts.append(torch.cat([t[:, :, 1:], zero], dim=2))
    return torch.cat(parts, dim=3)


def _exact_band(xq: torch.Tensor, xk: torch.Tensor, vaug: torch.Tensor, bias: torch.Tensor, row: torch.Tensor, valid: torch.Tensor, width: int, T: int,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The exact band as blocked local attention: each query block of ``T >= w`` tokens
    against the key blocks ``b - 1, b`` (``b + 1`` too when not causal), the weights of the
    pairs ``|i - j| <= w`` (``j <= i`` when causal) exact, all others zero.

    Returns ``(sums [B, H, N, Dv+1], c [B, H, N], windows)``: sums relative to
    ``exp(row_i + c_i)``, ``c_i >= 0`` the largest band exponent of the row above ``row_i``
    (detached: a common factor of the row, it cancels), and what
    :func:`_band_estimate` reuses. Cost ``O(N 2T (D + Dv))`` (``3T`` when not causal).
    """
    N = xq.shape[2]
    nb = -(-N // T)
    W = (2 if causal else 3) * T
    # Offsets j - i of the window's keys: key u of block b's window is token (b - 1) T + u.
    off = torch.arange(W, device=xq.device).view(1, W) - T - torch.arange(T, device=xq.device).view(T, 1)  # [T, W]
    band = (off <= 0 if causal else off <= width) & (off >= -width)
    keys = _window(_blocks(valid[:, None, :, None], nb, T), causal).squeeze(-1)  # [B, 1, nb, W], False beyond N
    keep = band & keys.unsqueeze(-2)  # [B, 1, nb, T, W]
    bias = _blocks(bias, nb, T)  # [B|1, H, nb, T, 2w+1]
    index = (off.clamp(-width, width) + width).expand(*bias.shape[:3], T, W)
    logits = _blocks(xq, nb, T) @ _window(_blocks(xk, nb, T), causal).transpose(-1, -2)  # [B, H, nb, T, W]
    expo = (logits + bias.gather(-1, index) - _blocks(row.unsqueeze(-1), nb, T)).masked_fill(~keep, -float("inf"))
    c = expo.detach().amax(dim=-1).clamp_min(0.0)  # [B, H, nb, T]
    vwin = _window(_blocks(vaug, nb, T), causal)  # [B, H, nb, W, Dv+1]
    sums = torch.exp(expo - c.unsqueeze(-1)) @ vwin
    return sums.flatten(2, 3)[:, :, :N], c.flatten(2)[..., :N], (keep, vwin)


def _band_estimate(qf: torch.Tensor, kfw: torch.Tensor, vaug: torch.Tensor, windows: tuple[torch.Tensor, torch.Tensor], T: int) -> torch.Tensor:
    """The far-field estimate restricted to the band's pairs (bidirectional: subtracted from
    the total), ``[B, H, N, Dv+1]``, relative to ``exp(row_i)``."""
    keep, vwin = windows
    N = qf.shape[2]
    nb = -(-N // T)
    est = _blocks(qf, nb, T) @ _window(_blocks(kfw, nb, T), False).transpose(-1, -2)
    return (est.masked_fill(~keep, 0.0) @ vwin).flatten(2, 3)[:, :, :N]


def _causal_far_field(qf: torch.Tensor, kf: torch.Tensor, vaug: torch.Tensor, sk: torch.Tensor, width: int,
                      chunk_size: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Causal far field: the estimate of every pair ``i - j > w``, as causal linear attention
    whose keys, values and key log scales are delayed by ``w + 1`` tokens (key ``j`` enters at
    token ``j + w + 1``), so the chunked scan itself never sees a band pair and nothing is
    subtracted. Chunks of :func:`flt.ops.linear.causal_chunk_size` tokens, whatever ``w``.

    Returns ``(sums [B, H, N, Dv+1], level [B, H, N])``, sums relative to ``exp(sq_i +
    level_i)`` where ``level_i`` is the largest log scale of the keys ``j <= i - w - 1`` (and
    of key 0, the delay's filler); ``(None, None)`` when no pair is that far apart.
    """
    N = qf.shape[2]
    shift = width + 1
    if shift >= N:
        return None, None
    if chunk_size is None:
        chunk_size = causal_chunk_size(qf.shape[-1], 1, vaug.shape[-1] - 1)

    def delay(t: torch.Tensor) -> torch.Tensor:  # one copy each way: the backward of a pad is a pad
        return F.pad(t, (0, 0) * (t.ndim - 3) + (shift, -shift))

    # The filler keys have zero features and values; their log scale is key 0's, so that
    # the level is a maximum over keys row i sees.
    sk = delay(sk - sk[:, :, :1]) + sk[:, :, :1]
    return causal_sums(qf, delay(kf), delay(vaug), None, None, sk, chunk_size)
