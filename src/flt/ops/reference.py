"""Exact O(N^2) references. Every fast path in :mod:`flt.ops` is tested against these.

Shapes follow :mod:`flt.ops`: ``q, k [B, H, N, D]``, ``v [B, H, N, Dv]``, features
``[B, H, N, m]``, spectral features ``a, c [B or 1, H, N, 2R]``.
"""

from __future__ import annotations

import math

import torch

from flt._checks import check_broadcast, check_tensor
from flt.ops._common import causal_mask_like, safe_divide


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_name: tuple[str, str] = ("q", "k")) -> None:
    check_tensor(qk_name[0], q, ndim=4, layout="[B, H, N, D]")
    check_tensor(qk_name[1], k, ndim=4, layout="[B, H, N, D]")
    check_tensor("v", v, ndim=4, layout="[B, H, N, Dv]")
    if q.shape[:2] != k.shape[:2] or q.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"{qk_name[0]}, {qk_name[1]} and v must share [B, H], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{qk_name[0]} and {qk_name[1]} must share their last dimension, got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{qk_name[1]} and v must have the same length N, got {k.shape[2]} and {v.shape[2]}")


def rpe_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None, bias: torch.Tensor | None = None, causal: bool = False,
                            scale: float | None = None) -> torch.Tensor:
    """Exact attention with a relative positional mask and/or bias, O(N^2).

    Weights are proportional to ``mask_ij * exp(q_i.k_j * scale + bias_ij)`` and are
    normalised over ``j``:  ``out_i = sum_j w_ij v_j / sum_j w_ij`` (docs/math.md section 1).
    ``mask`` may be signed (an FLT mask ``f`` can be negative). A row whose weights are
    all zero (everything masked) returns zeros instead of NaN.

    Args:
        q, k: ``[B, H, N, D]`` (``k`` may have its own length ``Nk``).
        v: ``[B, H, Nk, Dv]``.
        mask: multiplicative mask broadcasting to ``[B, H, N, Nk]`` (``M = f(r_i - r_j)``).
        bias: additive logit bias broadcasting to ``[B, H, N, Nk]``; ``-inf`` removes a key.
        causal: if True, token ``i`` attends only to ``j <= i``.
        scale: logit scale, ``1/sqrt(D)`` by default.

    Returns:
        ``[B, H, N, Dv]``.
    """
    _check_qkv(q, k, v)
    B, H, N, D = q.shape
    Nk = k.shape[2]
    target = (B, H, N, Nk)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if bias is not None:
        check_tensor("bias", bias)
        check_broadcast("bias", bias, target, "[B, H, N, Nk]")
        logits = logits + bias.to(logits.dtype)
    weight_mask = torch.ones_like(logits)
    if mask is not None:
        check_tensor("mask", mask)
        check_broadcast("mask", mask, target, "[B, H, N, Nk]")
        weight_mask = weight_mask * mask.to(logits.dtype)
    if causal:
        if N != Nk:
            raise ValueError(f"causal attention needs as many keys as queries, got N = {N}, Nk = {Nk}")
        weight_mask = weight_mask * causal_mask_like(logits)
    live = (weight_mask != 0) & (logits > -math.inf)
    # Stabilise with the row max over the keys that can carry weight; it cancels in the ratio.
    row_max = logits.masked_fill(~live, -math.inf).amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    weights = torch.where(live, weight_mask * torch.exp(logits - row_max), torch.zeros_like(logits))
    num = weights @ v
    den = weights.sum(dim=-1, keepdim=True)
    return safe_divide(num, den)


def flt_attention_reference(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor, a: torch.Tensor, c: torch.Tensor, *, causal: bool = False,
                            key_log_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The multiplicative FLT coupling written as its quadratic formula, O(N^2).

    ``out = ((a c^T) * (qf kf^T)) v / row sums``, i.e. weights
    ``w_ij = (a_i . c_j) (qf_i . kf_j) exp(s_j)`` with ``s = key_log_scale`` (zero when None).
    Rows whose weights sum to (nearly) zero follow :func:`flt.ops._common.safe_divide`.
    """
    weights = torch.einsum("bhik,bhjk->bhij", a, c) * torch.einsum("bhis,bhjs->bhij", q_feat, k_feat)
    return _weighted(weights, v, causal, key_log_scale)


def linear_attention_reference(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor, *, causal: bool = False, key_log_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Linear attention written as its quadratic formula: ``(qf kf^T) v / row sums``, O(N^2)."""
    weights = torch.einsum("bhis,bhjs->bhij", q_feat, k_feat)
    return _weighted(weights, v, causal, key_log_scale)


def _weighted(weights: torch.Tensor, v: torch.Tensor, causal: bool, key_log_scale: torch.Tensor | None) -> torch.Tensor:
    if causal:
        weights = weights * causal_mask_like(weights)
    if key_log_scale is not None:
        kls = key_log_scale.to(weights.dtype)
        if causal:
            # Each row is shifted by the max over the keys it sees, so no row underflows
            # because of a later key.
            row_max = torch.cummax(kls, dim=-1).values.unsqueeze(-1)  # [B, H, N, 1]
            log_w = (kls.unsqueeze(-2) - row_max).masked_fill(causal_mask_like(weights) == 0, -float("inf"))
        else:
            log_w = (kls - kls.amax(dim=-1, keepdim=True)).unsqueeze(-2)
        weights = weights * torch.exp(log_w)
    return safe_divide(weights @ v, weights.sum(dim=-1, keepdim=True))
