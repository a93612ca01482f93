"""Exact softmax attention with an additive relative bias: SDPA, FlexAttention, reference.

The logit coupling of docs/math.md section 1 computed exactly, ``O(N * Nk)``:

    out_i = sum_j w_ij v_j / sum_j w_ij,   w_ij = exp(scale * q_i.k_j + bias_ij) * keep_ij

where ``keep_ij`` is 0 for padded keys and, when causal, for ``j > i``. Three backends
compute the same thing and are tested against one another:

- ``"sdpa"``: :func:`torch.nn.functional.scaled_dot_product_attention` with one additive
  float mask (bias, padding and causal folded together; ``is_causal`` when there is
  nothing else to add). Materialises the ``[B|1, H|1, N, Nk]`` mask, not the weights.
- ``"flex"``: :func:`torch.nn.attention.flex_attention.flex_attention` with a
  ``score_mod`` that indexes the bias tensor and applies the masks, optionally after a
  user ``score_mod``. Called eagerly; wrap the caller in ``torch.compile`` for the fused
  kernel (eager FlexAttention materialises the scores, and torch warns once about it).
  FlexAttention has no backward pass on CPU (torch 2.13): see
  :func:`flex_attention_available`. It is never replaced by another backend silently.
- ``"reference"``: :func:`flt.ops.reference.rpe_attention_reference`.

Fully masked rows (every key padded or biased to ``-inf``, e.g. a causal first row whose
only key is padding) return zeros in every backend, with zero gradients, matching the
reference. The sdpa backend enforces this explicitly, because SDPA kernels disagree on it
(NaN in some versions and devices); FlexAttention returns zeros for such rows itself.

Shapes follow :mod:`flt.ops`: ``q [B, H, N, D]``, ``k [B, H, Nk, D]``, ``v [B, H, Nk, Dv]``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from flt._checks import check_broadcast, check_choice, check_tensor
from flt._dtype import compute_dtype
from flt.ops.reference import rpe_attention_reference

BACKENDS = ("sdpa", "flex", "reference")


def flex_attention_available(device: torch.device | str, requires_grad: bool) -> tuple[bool, str]:
    """Whether eager FlexAttention runs on ``device``, with gradients if ``requires_grad``.

    Decided by running it once on a tiny input the first time a ``(device, requires_grad)``
    pair is asked about (never at import), then cached. Returns ``(True, "")`` or
    ``(False, reason)`` where ``reason`` quotes torch's own error. In torch 2.13 the forward
    pass runs on CPU and torch refuses any input that requires grad there, with
    "FlexAttention does not support backward on CPU".
    """
    if torch.compiler.is_compiling():  # traced by torch.compile: the fused kernel runs, not the eager one probed here
        return True, ""
    return _probe_flex(str(torch.device(device)), bool(requires_grad))


@functools.cache
def _probe_flex(device: str, requires_grad: bool) -> tuple[bool, str]:
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as err:
        return False, f"torch {torch.__version__} has no torch.nn.attention.flex_attention ({err})"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return False, "CUDA is not available"
    what = "forward and backward" if requires_grad else "forward"
    x = torch.zeros(1, 1, 16, 16, device=dev, requires_grad=requires_grad)  # 16: the smallest head dim the GPU kernels take
    try:
        with torch.enable_grad():
            out = flex_attention(x, x, x)
            if requires_grad:
                out.sum().backward()
    # NotImplementedError (no backward on this device) is a RuntimeError; ValueError is
    # torch's answer for an unsupported device type. Anything else is a real bug: let it out.
    except (RuntimeError, ValueError) as err:
        return False, f"FlexAttention {what} fails on {device} in torch {torch.__version__}: {type(err).__name__}: {err}"
    return True, ""


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, key_padding_mask: torch.Tensor | None, causal: bool,
                  score_mod: Callable[..., torch.Tensor] | None, backend: str) -> None:
    check_choice("backend", backend, BACKENDS)
    check_tensor("q", q, ndim=4, layout="[B, H, N, D]")
    check_tensor("k", k, ndim=4, layout="[B, H, Nk, D]")
    check_tensor("v", v, ndim=4, layout="[B, H, Nk, Dv]")
    if q.shape[:2] != k.shape[:2] or q.shape[:2] != v.shape[:2]:
        raise ValueError(f"q, k and v must share [B, H], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share their last dimension D, got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same length Nk, got {k.shape[2]} and {v.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, N, _ = q.shape
    Nk = k.shape[2]
    if bias is not None:
        check_tensor("bias", bias)
        check_broadcast("bias", bias, (B, H, N, Nk), "[B, H, N, Nk]")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(key_padding_mask).__name__}")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = padded key), got {key_padding_mask.dtype}")
        if tuple(key_padding_mask.shape) != (B, Nk):
            raise ValueError(f"key_padding_mask must be [B, Nk] = {(B, Nk)}, got {tuple(key_padding_mask.shape)}")
    if causal and N != Nk:
        raise ValueError(f"causal attention needs as many keys as queries, got N = {N}, Nk = {Nk}")
    if score_mod is not None:
        if backend != "flex":
            raise ValueError(f"score_mod is only supported by backend='flex', got backend={backend!r}")
        if not callable(score_mod):
            raise TypeError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score, got {type(score_mod).__name__}")


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    score_mod: Callable | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Exact softmax attention with an additive bias, ``softmax(scale q k^T + bias) v``.

    Args:
        q: ``[B, H, N, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``, one dtype.
        bias: additive logits broadcasting to ``[B, H, N, Nk]`` (``[B|1, H|1, N, Nk]``),
            finite or ``-inf`` (removes that key for that query). A relative bias is
            ``b(r_i - r_j)`` evaluated on the pairs.
        causal: token ``i`` attends only to ``j <= i`` (needs ``N == Nk``).
        scale: logit scale, ``1/sqrt(D)`` by default.
        key_padding_mask: bool ``[B, Nk]``, True marks a padded key that no query
            attends to (the convention of ``nn.MultiheadAttention`` and of every layer here).
        score_mod: ``backend="flex"`` only: ``score_mod(score, b, h, q_idx, kv_idx)`` applied
            to ``scale * q.k`` before the bias is added and the masks applied, so it can
            never revive a masked key.
        backend: ``"sdpa"``, ``"flex"`` or ``"reference"`` (see the module docstring).

    Returns:
        ``[B, H, N, Dv]`` in ``q``'s dtype. Fully masked rows are zeros.

    Raises:
        NotImplementedError: ``backend="flex"`` where FlexAttention cannot run, e.g. on CPU
            when any input requires grad (:func:`flex_attention_available`).
    """
    _check_inputs(q, k, v, bias, key_padding_mask, causal, score_mod, backend)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    # Internally the backends take the complement: True = a real key.
    key_padding_mask = None if key_padding_mask is None else ~key_padding_mask
    if backend == "reference":
        mask = None
        if key_padding_mask is not None:
            mask = key_padding_mask[:, None, None, :].to(q.dtype)
        return rpe_attention_reference(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale)
    if backend == "sdpa":
        return _sdpa(q, k, v, bias, causal, scale, key_padding_mask)
    return _flex(q, k, v, bias, causal, scale, key_padding_mask, score_mod)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool, scale: float | None, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    N, Nk = q.shape[2], k.shape[2]
    if bias is None and key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    # SDPA wants a float mask in the query dtype; -inf removes a key.
    mask = None
    if bias is not None:
        mask = bias.to(q.dtype)
    if key_padding_mask is not None:
        pad = torch.zeros(key_padding_mask.shape, dtype=q.dtype, device=q.device)
        pad = pad.masked_fill(~key_padding_mask, -math.inf)[:, None, None, :]  # [B, 1, 1, Nk]
        mask = pad if mask is None else mask + pad
    assert mask is not None  # bias or key_padding_mask is given (the early return above)
    if causal:
        future = torch.ones(N, Nk, dtype=torch.bool, device=q.device).triu(1)
        mask = mask + torch.zeros(N, Nk, dtype=q.dtype, device=q.device).masked_fill(future, -math.inf)
    # A row with every key removed has no softmax; give SDPA a harmless row and zero it
    # afterwards, so the result (zeros) and its gradient (zero) do not depend on the kernel.
    dead = torch.isneginf(mask).all(dim=-1, keepdim=True)  # [B|1, H|1, N, 1]
    mask = mask.masked_fill(dead, 0.0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.masked_fill(dead, 0.0)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool, scale: float | None, key_padding_mask: torch.Tensor | None,
          user_mod: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    tensors = (q, k, v) if bias is None else (q, k, v, bias)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    ok, reason = flex_attention_available(q.device, needs_grad)
    if not ok:
        raise NotImplementedError(f"backend='flex' cannot run here: {reason}. Use backend='sdpa' or 'reference'.")
    from torch.nn.attention.flex_attention import flex_attention

    if not needs_grad:
        # torch rejects inputs that merely carry requires_grad on CPU, even under no_grad,
        # where no backward can happen; detaching them there changes nothing else.
        q, k, v = q.detach(), k.detach(), v.detach()
    B, H, N, _ = q.shape
    Nk = k.shape[2]
    full_bias = None
    if bias is not None:
        # A broadcast view, so score_mod can index [b, h, i, j] without copying.
        full_bias = bias.to(compute_dtype(q)).expand(B, H, N, Nk)

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        if user_mod is not None:
            score = user_mod(score, b, h, q_idx, kv_idx)
        if full_bias is not None:
            score = score + full_bias[b, h, q_idx, kv_idx]
        if key_padding_mask is not None:
            score = torch.where(key_padding_mask[b, kv_idx], score, -math.inf)
        if causal:
            score = torch.where(q_idx >= kv_idx, score, -math.inf)
        return score

    return flex_attention(q, k, v, score_mod=score_mod, scale=scale)
