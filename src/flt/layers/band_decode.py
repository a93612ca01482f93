"""Token-by-token decoding of FLT's banded estimator with constant memory.

A causal layer with ``near_field = w`` gives query ``i`` exact weights
``exp(x_i.y_j + f(r_i - r_j) + f_near(r_i - r_j))`` on the keys ``i - w <= j <= i`` and the
FAVOR+ estimate ``qf_i.kf_j exp(s_i + s_j)`` on the keys ``j < i - w``
(:func:`flt.ops.band.band_attention`). Decoding keeps two things, both of a size that does
not grow with the number of tokens:

* a ring buffer of the last ``w + 1`` tokens: their scaled keys ``x_k``, values, positions
  (the exact band needs ``r_i - r_j``) and far-field key features with their log scales;
* the linear state of the far field: ``sum_j kf_j exp(s_j - L) v_j^T`` and
  ``sum_j kf_j exp(s_j - L)`` over the keys that have left the band, relative to ``L``, the
  largest key log scale among them.

At token ``i`` the slot about to be overwritten holds token ``i - w - 1``, the one that
leaves the band at this step: it is folded into the far state before the new token is
written. The output combines the two parts relative to their largest exponent, so the
result equals the full forward's row ``i`` (the common factor cancels) without overflow.

:func:`band_prefill` takes a whole prompt in one forward pass and builds the same state
directly: the ring buffer from the prompt's last ``w + 1`` tokens, the far field from the
sum over the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from flt.layers.base import Prepared


@dataclass
class BandDecodeState:
    """State of a banded FLT layer after ``position`` tokens (sizes independent of it).

    ``xk [B, H, w+1, D]``, ``v [B, H, w+1, Dv]``, ``kf [B, H, w+1, m]``, ``kls [B, H, w+1]``
    and ``pos [B, w+1, P]`` are the ring buffer (slot ``t % (w+1)`` holds token ``t``);
    ``kv [B, H, m, Dv]``, ``z [B, H, m]`` and ``level [B, H]`` the far field (``level`` is
    ``-inf`` while no token has left the band).
    """

    xk: torch.Tensor
    v: torch.Tensor
    kf: torch.Tensor
    kls: torch.Tensor
    pos: torch.Tensor
    kv: torch.Tensor
    z: torch.Tensor
    level: torch.Tensor
    position: int = 0


def _empty_state(width: int, xk, v, kf, pos) -> BandDecodeState:
    B, H, _, D = xk.shape
    S = width + 1
    new = lambda *shape, like: like.new_zeros(*shape)  # noqa: E731
    return BandDecodeState(
        xk=new(B, H, S, D, like=xk), v=new(B, H, S, v.shape[-1], like=v), kf=new(B, H, S, kf.shape[-1], like=kf),
        kls=new(B, H, S, like=kf), pos=new(B, S, pos.shape[-1], like=pos),
        kv=new(B, H, kf.shape[-1], v.shape[-1], like=kf), z=new(B, H, kf.shape[-1], like=kf),
        level=torch.full((B, H), float("-inf"), dtype=kf.dtype, device=kf.device), position=0,
    )


def _fold_into_far(state: BandDecodeState, slot: int) -> None:
    """Add the token in ``slot`` (leaving the band) to the far field's linear state."""
    kls = state.kls[:, :, slot]
    level = torch.maximum(state.level, kls)
    keep = torch.exp(state.level - level)  # 0 while the far field is empty (level was -inf)
    kf = state.kf[:, :, slot] * torch.exp(kls - level).unsqueeze(-1)  # [B, H, m]
    state.kv = state.kv * keep[..., None, None] + kf.unsqueeze(-1) * state.v[:, :, slot].unsqueeze(-2)
    state.z = state.z * keep.unsqueeze(-1) + kf
    state.level = level


def band_decode_step(layer, x: torch.Tensor, state: BandDecodeState | None, pos_seq: torch.Tensor):
    """One token of a causal :class:`flt.layers.flt.FLTAttention` with ``near_field = w``.

    Args:
        layer: the layer (causal, ``near_field >= 1``).
        x: ``[B, dim]``, the next token's input.
        state: from the previous call, ``None`` to start.
        pos_seq: ``[B|1, 1, P]``, the token's position.

    Returns:
        ``(y [B, dim], state)``; a sequence fed token by token gives ``layer.forward``'s
        outputs (same draws, eval mode).
    """
    w = layer.near_field
    p: Prepared = layer.prepare(x.unsqueeze(1), pos_seq, None)
    xq, xk, qf, kf, q_shift, k_shift = layer._near_set_features(p)  # [B, H, 1, *]
    B = xq.shape[0]
    cdt = xq.dtype
    v = p.v.to(cdt)
    pos = p.pos.to(cdt).expand(B, 1, p.pos.shape[-1])  # [B, 1, P]
    if state is None:
        state = _empty_state(w, xk, v, kf, pos)
    elif state.xk.shape[0] != B or state.xk.dtype != cdt:
        raise ValueError(f"state holds batch {state.xk.shape[0]} in {state.xk.dtype}; this token has batch {B} in {cdt}")
    t = state.position
    slot = t % (w + 1)
    state = BandDecodeState(**{name: getattr(state, name).clone() if name != "position" else t
                               for name in BandDecodeState.__dataclass_fields__})
    if t > w:  # token t - w - 1 leaves the band now
        _fold_into_far(state, slot)
    state.xk[:, :, slot] = xk[:, :, 0]
    state.v[:, :, slot] = v[:, :, 0]
    state.kf[:, :, slot] = kf[:, :, 0]
    state.kls[:, :, slot] = k_shift[:, :, 0]
    state.pos[:, slot] = pos[:, 0]
    filled = min(t + 1, w + 1)  # slots 0 .. filled-1 hold tokens max(0, t - w) .. t
    delta = pos - state.pos[:, :filled]  # [B, K, P]: r_i - r_j
    bias = layer.far_mask(delta.unsqueeze(1)) + layer.near_spectrum.of_offsets(delta.unsqueeze(1))  # [B, 1, K, H]
    bias = rearrange(bias, "b one k h -> b h (one k)").to(cdt)
    logits = (xq @ state.xk[:, :, :filled].transpose(-1, -2)).squeeze(-2) + bias  # [B, H, K]
    far_log = q_shift[:, :, 0] + state.level  # [B, H], -inf while the far field is empty
    top = torch.maximum(logits.amax(dim=-1), far_log)
    near_w = torch.exp(logits - top.unsqueeze(-1))
    far_scale = torch.exp(far_log - top)  # [B, H]
    q = qf[:, :, 0]
    num = (near_w.unsqueeze(-1) * state.v[:, :, :filled]).sum(-2) + far_scale.unsqueeze(-1) * (q.unsqueeze(-2) @ state.kv).squeeze(-2)
    den = near_w.sum(-1) + far_scale * (q * state.z).sum(-1)
    out = num / den.unsqueeze(-1)  # den >= exp(0) from the largest exact weight or the far part
    state.position = t + 1
    return layer.finish(out.unsqueeze(2), x.unsqueeze(1)).squeeze(1), state


def band_prefill(layer, x: torch.Tensor, pos: torch.Tensor | None = None):
    """The causal forward of a banded :class:`flt.layers.flt.FLTAttention` over a prompt,
    with the state :func:`band_decode_step` would hold after it.

    Args:
        layer: the layer (causal, ``near_field = w >= 1``).
        x: ``[B, N, dim]``; pos: ``[B, N, P]``, ``[N, P]`` or None (token indices).

    Returns:
        ``(y [B, N, dim], state)``: ``y`` is ``layer.forward(x, pos)``; the ring buffer holds
        tokens ``max(0, N - w - 1) .. N - 1`` (token ``t`` in slot ``t % (w + 1)``) and the far
        field tokens ``0 .. N - w - 2``, relative to their largest key log scale.
    """
    if not layer.causal:
        raise ValueError("prefill() decodes causal attention; build the layer with causal=True")
    w = layer.near_field
    p: Prepared = layer.prepare(x, pos, None)
    y = layer.finish(layer.attend(p), x)
    _, xk, _, kf, _, k_shift = layer._near_set_features(p)  # [B, H, N, *]
    B, _, N, _ = xk.shape
    cdt = xk.dtype
    v = p.v.to(cdt)
    pos = p.pos.to(cdt).expand(B, N, p.pos.shape[-1])
    state = _empty_state(w, xk, v, kf, pos)
    ring = torch.arange(max(0, N - w - 1), N, device=x.device)
    slots = ring % (w + 1)
    state.xk[:, :, slots] = xk[:, :, ring]
    state.v[:, :, slots] = v[:, :, ring]
    state.kf[:, :, slots] = kf[:, :, ring]
    state.kls[:, :, slots] = k_shift[:, :, ring]
    state.pos[:, slots] = pos[:, ring]
    far = N - w - 1  # tokens 0 .. far - 1 have left the band
    if far > 0:
        kls = k_shift[:, :, :far]
        state.level = kls.amax(dim=-1)  # [B, H]
        kf_far = kf[:, :, :far] * torch.exp(kls - state.level.unsqueeze(-1)).unsqueeze(-1)
        state.kv = kf_far.transpose(-1, -2) @ v[:, :, :far]  # [B, H, m, Dv]
        state.z = kf_far.sum(dim=-2)
    state.position = N
    return y, state


def band_step(layer, x: torch.Tensor, state: BandDecodeState | None = None, pos: torch.Tensor | None = None):
    """:meth:`flt.layers.flt.FLTAttention.step` for a layer with a near field: the checks
    and default positions of :meth:`flt.layers.kernel.KernelAttention.step`, then
    :func:`band_decode_step`."""
    if not layer.causal:
        raise ValueError("step() decodes causal attention; build the layer with causal=True")
    if state is not None and not isinstance(state, BandDecodeState):
        raise TypeError(f"state must be the BandDecodeState of the previous step (or None), got {type(state).__name__}")
    _, pos_seq = layer.step_input(x, pos, 0 if state is None else state.position)
    return band_decode_step(layer, x, state, pos_seq)
