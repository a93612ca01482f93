"""Linear attention and the multiplicative (Kronecker) FLT coupling, O(N).

One engine serves both: plain linear attention is the Kronecker coupling with
``a = c = 1`` (``2R = 1``). MATH.md sections 2 and 4.

Stabilisation. Key features arrive as ``k_feat * exp(key_log_scale)`` (see
:func:`flt.ops.features.favor_plus_features`). Bidirectional attention rescales all keys
by one global maximum; causal attention keeps a running maximum over past keys only and
rescales its state when it grows (the same trick as online softmax), so an output never
depends, not even through rounding or underflow, on a key after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flt._checks import check_positive_int, check_tensor
from flt.ops._common import safe_divide

DEFAULT_CHUNK_SIZE = 128


def _check_features(q_feat, k_feat, v, a=None, c=None, key_log_scale=None) -> None:
    check_tensor("q_feat", q_feat, ndim=4, layout="[B, H, N, m]")
    check_tensor("k_feat", k_feat, ndim=4, layout="[B, H, N, m]")
    check_tensor("v", v, ndim=4, layout="[B, H, N, Dv]")
    if q_feat.shape != k_feat.shape:
        raise ValueError(f"q_feat and k_feat must have the same shape, got {tuple(q_feat.shape)} and {tuple(k_feat.shape)}")
    if v.shape[:3] != k_feat.shape[:3]:
        raise ValueError(f"v must be [B, H, N, Dv] matching k_feat {tuple(k_feat.shape[:3])}, got {tuple(v.shape)}")
    if (a is None) != (c is None):
        raise ValueError("a and c must be given together")
    if a is not None:
        B, H, N = q_feat.shape[:3]
        for name, t in (("a", a), ("c", c)):
            check_tensor(name, t, ndim=4, layout="[B or 1, H, N, 2R]")
            if t.shape[0] not in (1, B) or t.shape[1] != H or t.shape[2] != N:
                raise ValueError(f"{name} must be [B or 1, H, N, 2R] = [{B} or 1, {H}, {N}, 2R], got {tuple(t.shape)}")
        if a.shape[-1] != c.shape[-1]:
            raise ValueError(f"a and c must have the same number of spectral features 2R, got {a.shape[-1]} and {c.shape[-1]}")
    if key_log_scale is not None:
        check_tensor("key_log_scale", key_log_scale, ndim=3, layout="[B, H, N]")
        if key_log_scale.shape != k_feat.shape[:3]:
            raise ValueError(f"key_log_scale must be [B, H, N] = {tuple(k_feat.shape[:3])}, got {tuple(key_log_scale.shape)}")


def linear_attention(q_feat, k_feat, v, *, causal: bool = False, key_log_scale=None, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Normalised linear attention ``out_i = qf_i^T S / qf_i^T z`` from nonnegative features.

    Args:
        q_feat, k_feat: ``[B, H, N, m]`` nonnegative features.
        v: ``[B, H, N, Dv]``.
        causal: token ``i`` attends to ``j <= i``; computed in chunks of ``chunk_size``
            with a running ``[m, Dv]`` state, never a per-token prefix sum.
        key_log_scale: optional ``[B, H, N]``; the true key features are
            ``k_feat * exp(key_log_scale)``.

    Returns:
        ``[B, H, N, Dv]``. Rows with a zero denominator return zeros.
    """
    _check_features(q_feat, k_feat, v, key_log_scale=key_log_scale)
    return _attend(q_feat, k_feat, v, None, None, causal, key_log_scale, chunk_size)


def flt_attention(q_feat, k_feat, v, a, c, *, causal: bool = False, key_log_scale=None, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """FLT with the multiplicative coupling (MATH.md section 4), linear in N.

    ``out_i = sum_j (a_i.c_j)(qf_i.kf_j) v_j / sum_j (a_i.c_j)(qf_i.kf_j)``: linear attention
    on the Kronecker features ``a_i (x) qf_i`` and ``c_j (x) kf_j``, which are never
    materialised. Bidirectional: one contraction into a ``[2R, m, Dv]`` state, streamed over
    blocks of ``chunk_size`` tokens. Causal: chunks with a constant-size running state.
    Cost ``O(N * 2R * m * Dv)``.

    The mask ``a_i.c_j`` may be negative, so a row sum may vanish or change sign; rows whose
    denominator is zero return zeros (:func:`flt.ops._common.safe_divide`). Nonnegative
    spectra and the logit coupling avoid the issue altogether.

    Args:
        q_feat, k_feat: ``[B, H, N, m]``; v: ``[B, H, N, Dv]``;
        a, c: ``[B or 1, H, N, 2R]`` with ``a_i.c_j = f^(r_i - r_j)``;
        key_log_scale: optional ``[B, H, N]`` as in :func:`linear_attention`.
    """
    _check_features(q_feat, k_feat, v, a, c, key_log_scale)
    return _attend(q_feat, k_feat, v, a, c, causal, key_log_scale, chunk_size)


def _global_key_rescale(k_feat, key_log_scale):
    if key_log_scale is None:
        return k_feat
    kls = key_log_scale.to(k_feat.dtype)
    return k_feat * torch.exp(kls - kls.amax(dim=-1, keepdim=True)).unsqueeze(-1)


def _attend(qf, kf, v, a, c, causal, key_log_scale, chunk_size):
    check_positive_int("chunk_size", chunk_size)
    dtype = torch.promote_types(torch.promote_types(qf.dtype, kf.dtype), v.dtype)
    if a is not None:
        dtype = torch.promote_types(torch.promote_types(dtype, a.dtype), c.dtype)
        a, c = a.to(dtype), c.to(dtype)
    qf, kf, v = qf.to(dtype), kf.to(dtype), v.to(dtype)
    if causal:
        return _causal_chunked(qf, kf, v, a, c, key_log_scale, chunk_size)
    kf = _global_key_rescale(kf, key_log_scale)
    if a is None:
        kv = kf.transpose(-1, -2) @ v  # [B, H, m, Dv]
        z = kf.sum(dim=-2)  # [B, H, m]
        num = qf @ kv
        den = (qf * z.unsqueeze(-2)).sum(dim=-1, keepdim=True)
        return safe_divide(num, den)
    return _kronecker_bidirectional(qf, kf, v, a, c, chunk_size)


def _kronecker_bidirectional(qf, kf, v, a, c, chunk_size):
    B, H, N, m = qf.shape
    Dv = v.shape[-1]
    R2 = a.shape[-1]
    state = qf.new_zeros(B, H, R2, m * Dv)
    z = qf.new_zeros(B, H, R2, m)
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        kv = (kf[:, :, s:e, :, None] * v[:, :, s:e, None, :]).flatten(-2)  # [B, H, C, m*Dv]
        ct = c[:, :, s:e].transpose(-1, -2)  # [B|1, H, 2R, C]
        state = state + ct @ kv
        z = z + ct @ kf[:, :, s:e]
    outs = []
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        qb = qf[:, :, s:e]
        ab = a[:, :, s:e]
        t = (ab @ state).unflatten(-1, (m, Dv))  # [B, H, C, m, Dv]
        num = (qb.unsqueeze(-1) * t).sum(dim=-2)
        den = ((ab @ z) * qb).sum(dim=-1, keepdim=True)
        outs.append(safe_divide(num, den))
    return torch.cat(outs, dim=2)


def _running_log_scale(kf, key_log_scale):
    """Return key features and a nondecreasing log scale (prefix max) describing them."""
    if key_log_scale is None:
        return kf, None
    kls = key_log_scale.to(kf.dtype)
    run = torch.cummax(kls, dim=-1).values
    return kf * torch.exp(kls - run).unsqueeze(-1), run


def _causal_chunked(qf, kf, v, a, c, key_log_scale, chunk_size):
    B, H, N, m = qf.shape
    Dv = v.shape[-1]
    kf, run = _running_log_scale(kf, key_log_scale)
    R2 = 1 if a is None else a.shape[-1]
    state = qf.new_zeros(B, H, R2, m * Dv)
    z = qf.new_zeros(B, H, R2, m)
    level = None if run is None else run[..., 0]  # log scale the state is stored relative to
    outs = []
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        qb, kb, vb = qf[:, :, s:e], kf[:, :, s:e], v[:, :, s:e]
        w = qb @ kb.transpose(-1, -2)  # [B, H, C, C]
        if a is not None:
            ab, cb = a[:, :, s:e], c[:, :, s:e]
            w = w * (ab @ cb.transpose(-1, -2))
        C = e - s
        lower = torch.ones(C, C, dtype=torch.bool, device=qf.device).tril()
        if run is not None:
            rb = run[..., s:e]  # [B, H, C], nondecreasing
            # exp(run_j - run_i) <= 1 for j <= i; masked before exp so nothing overflows.
            diff = (rb.unsqueeze(-2) - rb.unsqueeze(-1)).masked_fill(~lower, -float("inf"))
            w = w * torch.exp(diff)
        else:
            w = w.masked_fill(~lower, 0.0)
        num = w @ vb
        den = w.sum(dim=-1, keepdim=True)
        # Contribution of all previous chunks through the running state.
        if a is None:
            num_p = qb @ state.view(B, H, m, Dv)
            den_p = (qb * z.view(B, H, 1, m)).sum(dim=-1, keepdim=True)
        else:
            t = (ab @ state).unflatten(-1, (m, Dv))
            num_p = (qb.unsqueeze(-1) * t).sum(dim=-2)
            den_p = ((ab @ z) * qb).sum(dim=-1, keepdim=True)
        if run is not None:
            decay = torch.exp(level.unsqueeze(-1) - rb).unsqueeze(-1)  # [B, H, C, 1], <= 1
            num_p, den_p = num_p * decay, den_p * decay
        outs.append(safe_divide(num + num_p, den + den_p))
        # Fold this chunk into the state, relative to the new level.
        if run is not None:
            new_level = rb[..., -1]
            state = state * torch.exp(level - new_level)[..., None, None]
            z = z * torch.exp(level - new_level)[..., None, None]
            kb = kb * torch.exp(rb - new_level.unsqueeze(-1)).unsqueeze(-1)
            level = new_level
        if a is None:
            state = state + (kb.transpose(-1, -2) @ vb).view(B, H, 1, m * Dv)
            z = z + kb.sum(dim=-2).unsqueeze(-2)
        else:
            ct = cb.transpose(-1, -2)
            state = state + ct @ (kb.unsqueeze(-1) * vb.unsqueeze(-2)).flatten(-2)
            z = z + ct @ kb
    return torch.cat(outs, dim=2)


@dataclass
class RecurrentState:
    """State of causal linear / FLT attention after some tokens: constant size in N.

    ``kv [B, H, 2R, m*Dv]`` and ``z [B, H, 2R, m]`` hold the key sums relative to
    ``exp(level)`` (``level [B, H]``, the running maximum of the key log scales); plain
    linear attention uses ``2R = 1``. ``position`` counts the tokens seen.
    """

    kv: torch.Tensor
    z: torch.Tensor
    level: torch.Tensor
    position: int = 0


def recurrent_step(q_feat, k_feat, v, state: RecurrentState | None = None, *, a=None, c=None, key_log_scale=None):
    """One token of causal linear (``a = c = None``) or multiplicative FLT attention.

    Args:
        q_feat, k_feat: ``[B, H, m]``; v: ``[B, H, Dv]``; a, c: ``[B or 1, H, 2R]``;
        key_log_scale: ``[B, H]`` or None; state: from the previous step (None to start).

    Returns:
        ``(out [B, H, Dv], new_state)``; feeding tokens one by one reproduces
        :func:`flt_attention` / :func:`linear_attention` with ``causal=True``.
    """
    check_tensor("q_feat", q_feat, ndim=3, layout="[B, H, m]")
    check_tensor("k_feat", k_feat, ndim=3, layout="[B, H, m]")
    check_tensor("v", v, ndim=3, layout="[B, H, Dv]")
    if (a is None) != (c is None):
        raise ValueError("a and c must be given together")
    B, H, m = k_feat.shape
    Dv = v.shape[-1]
    dtype = torch.promote_types(torch.promote_types(q_feat.dtype, k_feat.dtype), v.dtype)
    q_feat, k_feat, v = q_feat.to(dtype), k_feat.to(dtype), v.to(dtype)
    if a is None:
        a = c = q_feat.new_ones(1, H, 1)
    a, c = a.to(dtype), c.to(dtype)
    kls = q_feat.new_zeros(B, H) if key_log_scale is None else key_log_scale.to(dtype)
    if state is None:
        R2 = a.shape[-1]
        state = RecurrentState(q_feat.new_zeros(B, H, R2, m * Dv), q_feat.new_zeros(B, H, R2, m), kls, 0)
    level = torch.maximum(state.level, kls)
    keep = torch.exp(state.level - level)[..., None, None]
    kf = k_feat * torch.exp(kls - level).unsqueeze(-1)  # [B, H, m]
    ck = c.unsqueeze(-1)  # [B, H, 2R, 1]
    kv = state.kv * keep + ck * (kf.unsqueeze(-1) * v.unsqueeze(-2)).flatten(-2).unsqueeze(-2)
    z = state.z * keep + ck * kf.unsqueeze(-2)
    t = (a.unsqueeze(-2) @ kv).squeeze(-2).unflatten(-1, (m, Dv))  # [B, H, m, Dv]
    num = (q_feat.unsqueeze(-1) * t).sum(dim=-2)
    den = ((a.unsqueeze(-2) @ z).squeeze(-2) * q_feat).sum(dim=-1, keepdim=True)
    return safe_divide(num, den), RecurrentState(kv, z, level, state.position + 1)
