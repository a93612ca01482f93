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

Algorithm: tokens are cut into blocks of ``T >= w``. A query of block ``b`` sees its near
keys in blocks ``b-1, b, b+1`` (a ``T x 3T`` window: exact weights on the band, estimated
ones off it), and the far keys of all blocks ``<= b-2`` (and ``>= b+2`` bidirectionally)
through per-block key states ``sum_j kf_j (x) [v_j, 1]``. Cost
``O(N (3T (D + m + Dv) + m (Dv + 1)))``, memory ``O(N T + (N / T) m Dv)``.

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


def band_offsets(width: int) -> torch.Tensor:
    """Offsets ``j - i`` of the band, ``-w .. w``: the layout of ``band_bias``'s last axis."""
    return torch.arange(-width, width + 1)


def _check(xq, xk, v, qf, kf, q_shift, key_log_scale, band_bias, width, key_mask):
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
    if key_mask is not None:
        if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, N):
            raise ValueError(f"key_mask must be a bool tensor [B, N] = {(B, N)} (True = a valid key), got {key_mask.dtype} {tuple(key_mask.shape)}")


def band_attention_reference(xq, xk, v, qf, kf, q_shift, key_log_scale, band_bias, *, width, causal=False, key_mask=None):
    """The O(N^2) formula of :func:`band_attention`, for tests.

    Args as in :func:`band_attention`. Returns ``[B, H, N, Dv]``.
    """
    _check(xq, xk, v, qf, kf, q_shift, key_log_scale, band_bias, width, key_mask)
    B, H, N, _ = xq.shape
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


def band_attention(xq, xk, v, qf, kf, q_shift, key_log_scale, band_bias, *, width, causal=False, key_mask=None, block_size=None):
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
        block_size: ``T >= w`` (default ``max(w, 32)``).

    Returns:
        ``[B, H, N, Dv]`` in the promoted dtype (float32 or better). Rows without any valid
        key return zeros.
    """
    _check(xq, xk, v, qf, kf, q_shift, key_log_scale, band_bias, width, key_mask)
    T = max(width, 32) if block_size is None else int(block_size)
    if T < width:
        raise ValueError(f"block_size ({T}) must be at least width ({width})")
    B, H, N, _ = xq.shape
    cdt = compute_dtype(xq, qf, v)
    xq, xk, qf, kf = (t.to(cdt) for t in (xq, xk, qf, kf))
    vaug = torch.cat([v.to(cdt), v.new_ones(*v.shape[:-1], 1).to(cdt)], dim=-1)
    sq, sk = q_shift.to(cdt), key_log_scale.to(cdt)
    valid = torch.ones(B, N, dtype=torch.bool, device=xq.device) if key_mask is None else key_mask
    if key_mask is not None:
        # A padded key never sets a level; its features and values are zeroed below.
        floor = sk.detach().masked_fill(~valid[:, None, :], float("inf")).amin(-1, keepdim=True)
        floor = torch.where(torch.isinf(floor), torch.zeros_like(floor), floor)  # no valid key at all
        sk = torch.where(valid[:, None, :], sk, floor.expand_as(sk))
    if causal:
        level = torch.cummax(sk, dim=-1).values  # [B, H, N]
    else:
        level = sk.amax(dim=-1, keepdim=True).expand(B, H, N)
    kw = torch.exp(sk - level if causal else sk - level[..., :1]) * valid[:, None, :]  # key weights <= 1
    nb = -(-N // T)
    pad = nb * T - N

    def blocks(t, value=0.0):  # [B, H, N, ...] -> [B, H, nb, T, ...], padded at the end
        if pad:
            t = F.pad(t, (0, 0) * (t.ndim - 3) + (0, pad), value=value)
        return t.unflatten(2, (nb, T))

    def window(t):  # [B, H, nb, T, ...] -> [B, H, nb, 3T, ...]: blocks b-1, b, b+1 (small tensors only)
        z = torch.zeros_like(t[:, :, :1])
        return torch.cat([torch.cat([z, t[:, :, :-1]], 2), t, torch.cat([t[:, :, 1:], z], 2)], dim=3)

    def shifted_products(a, b):
        """``a_b @ b_(b+o)^T`` for the window's three parts ``o = -1, 0, 1`` (each
        ``[B, H, nb, T, T]``; missing blocks give zeros), never copying the wide ``b``."""
        z = a.new_zeros(*a.shape[:2], 1, a.shape[3], b.shape[3])
        prev = torch.cat([z, a[:, :, 1:] @ b[:, :, :-1].transpose(-1, -2)], dim=2)
        nxt = torch.cat([a[:, :, :-1] @ b[:, :, 1:].transpose(-1, -2), z], dim=2)
        return prev, a @ b.transpose(-1, -2), nxt

    def apply_parts(parts, vals):  # sum over the window of weights [.., T, T] x 3 times the keys' rows
        p, c0, n = parts
        z = vals.new_zeros(*vals.shape[:2], 1, p.shape[-2], vals.shape[-1])
        out = c0 @ vals
        out = out + torch.cat([z, p[:, :, 1:] @ vals[:, :, :-1]], dim=2)
        return out + torch.cat([n[:, :, :-1] @ vals[:, :, 1:], z], dim=2)

    if pad:  # padded queries repeat the last level, so block levels stay nondecreasing
        level = torch.cat([level, level[..., -1:].expand(B, H, pad)], dim=-1)
    qb, sqb, lvb = blocks(qf), blocks(sq), level.unflatten(2, (nb, T))
    kfb = blocks(kf * kw.unsqueeze(-1))  # estimated weights need kf exp(s_j - level)
    vb = blocks(vaug * valid[:, None, :, None].to(cdt))
    # Query and key indices of the three window parts, for the band and causal masks.
    qi = torch.arange(nb * T, device=xq.device).view(nb, T)
    validb = blocks(valid[:, None, :].expand(B, 1, N), value=False)  # [B, 1, nb, T]
    bias = blocks(band_bias.to(cdt).expand(B, H, N, 2 * width + 1))  # [B, H, nb, T, 2w+1]
    row = (sqb + lvb).unsqueeze(-1)
    logit_parts = shifted_products(blocks(xq), blocks(xk))
    est_parts = shifted_products(qb, kfb)
    lvw = None if not causal else (torch.cat([lvb[:, :, :1], lvb[:, :, :-1]], 2), lvb, torch.cat([lvb[:, :, 1:], lvb[:, :, -1:]], 2))
    vw = (torch.cat([validb[:, :, :1] & False, validb[:, :, :-1]], 2), validb, torch.cat([validb[:, :, 1:], validb[:, :, -1:] & False], 2))
    expos, fars = [], []
    for o, (logit, est) in enumerate(zip(logit_parts, est_parts)):
        kj = qi + (o - 1) * T  # [nb, T]
        off = kj.unsqueeze(1) - qi.unsqueeze(2)  # [nb, T, T]: j - i
        keep = ((kj >= 0) & (kj < N)).unsqueeze(1) & vw[o].unsqueeze(-2)  # [B, 1, nb, T, T]
        if causal:
            keep = keep & (off <= 0)
        in_band = off.abs() <= width
        near, far = keep & in_band, keep & ~in_band
        # Exact band exponents relative to the row level: x_i.y_j + b_ij - sq_i - L_i.
        idx = (off.clamp(-width, width) + width).expand(B, H, nb, T, T)
        expos.append((logit + bias.gather(-1, idx) - row).masked_fill(~near, -float("inf")))
        if causal:
            # kf was scaled by exp(s_j - level_j); bring key j to the row's level L_i >= level_j.
            est = est * torch.exp((lvw[o].unsqueeze(-2) - lvb.unsqueeze(-1)).masked_fill(~far, -float("inf")))
        fars.append(torch.where(far, est, torch.zeros_like(est)))
    # Row stabiliser c_i >= 0 (detached: a common factor of the row, it cancels).
    c = torch.stack([e.detach().amax(dim=-1) for e in expos]).amax(0).clamp_min(0.0)  # [B, H, nb, T]
    scale = torch.exp(-c).unsqueeze(-1)
    out = apply_parts([torch.exp(e - c.unsqueeze(-1)) for e in expos], vb)
    if causal:
        out = out + apply_parts(fars, vb) * scale + _causal_far_blocks(qb, kfb, vb, lvb, c)
    else:
        # Far field = the estimate over all keys minus its window part (near or not),
        # plus the window's far keys: total - est(window) + est(window far) = total - est(band).
        # Rounding of order eps * total relative to the far part, only where the far field
        # is negligible next to the window.
        total = kfb.flatten(2, 3).transpose(-1, -2) @ vb.flatten(2, 3)  # [B, H, m, Dv+1]
        band_est = [torch.where(torch.isfinite(e), est, torch.zeros_like(est)) for e, est in zip(expos, est_parts)]
        out = out + ((qb @ total.unsqueeze(2)) - apply_parts(band_est, vb)) * scale
    out = out.flatten(2, 3)[:, :, :N]
    return safe_divide(out[..., :-1], out[..., -1:])


def _causal_far_blocks(qb, kb, vb, lvb, c):
    """Causal reads of the key states of blocks ``<= b-2`` for every query block ``b``:
    ``[B, H, nb, T, Dv+1]`` relative to ``exp(sq_i + L_i + c_i)``.

    ``kb [B, H, nb, T, m]`` are key features times ``exp(s_j - level_j)``; ``vb
    [B, H, nb, T, Dv+1]`` the augmented values of valid keys. Block ``b``'s sums are
    re-expressed at ``e_b``, the level at its last key (levels only grow: every factor is
    ``<= 1``), then accumulated block by block.
    """
    B, H, nb = kb.shape[:3]
    ends = lvb[..., -1]  # [B, H, nb]
    fresh = (kb * torch.exp(lvb - ends.unsqueeze(-1)).unsqueeze(-1)).transpose(-1, -2) @ vb
    zero = fresh.new_zeros(B, H, *fresh.shape[3:])
    states = [zero, zero]
    st, st_level = zero, ends[:, :, 0]
    for b in range(nb - 2):
        st = st * torch.exp(st_level - ends[:, :, b])[..., None, None] + fresh[:, :, b]
        st_level = ends[:, :, b]
        states.append(st)
    prefix = torch.stack(states[:nb], dim=2)  # [B, H, nb, m, Dv+1]: blocks <= b-2 at level e_(b-2)
    plev = torch.cat([ends[:, :, :1], ends[:, :, :1], ends[:, :, : max(nb - 2, 0)]], dim=2)[:, :, :nb]
    return (qb @ prefix) * torch.exp(plev.unsqueeze(-1) - lvb - c).unsqueeze(-1)
