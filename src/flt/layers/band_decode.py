"""The decoding state of FLT's banded estimator: constant memory per token.

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

:meth:`flt.layers.near.Band.step` decodes one token with this state and
:meth:`flt.layers.near.Band.prefill` takes a whole prompt in one forward pass and builds the
same state directly: the ring buffer from the prompt's last ``w + 1`` tokens, the far field
from the sum over the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BandDecodeState:
    """State of a banded FLT layer after ``position`` tokens (sizes independent of it).

    ``xk [B, H, w+1, D]``, ``v [B, H, w+1, Dv]``, ``kf [B, H, w+1, m]``, ``kls [B, H, w+1]``
    and ``pos [B, w+1, P]`` are the ring buffer (slot ``t % (w+1)`` holds token ``t``);
    ``kv [B, H, m, Dv]``, ``z [B, H, m]`` and ``level [B, H]`` the far field (``level`` is
    ``-inf`` while no token has left the band). ``pad [B, w+1]`` (bool, or None when no
    prompt was padded) marks the slots that hold a padded token of a left-padded prompt:
    no query attends to them and they leave the band without entering the far field.
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
    pad: torch.Tensor | None = None


def empty_state(width: int, xk: torch.Tensor, v: torch.Tensor, kf: torch.Tensor, pos: torch.Tensor) -> BandDecodeState:
    B, H, _, D = xk.shape
    S = width + 1
    new = lambda *shape, like: like.new_zeros(*shape)  # noqa: E731
    return BandDecodeState(
        xk=new(B, H, S, D, like=xk), v=new(B, H, S, v.shape[-1], like=v), kf=new(B, H, S, kf.shape[-1], like=kf),
        kls=new(B, H, S, like=kf), pos=new(B, S, pos.shape[-1], like=pos),
        kv=new(B, H, kf.shape[-1], v.shape[-1], like=kf), z=new(B, H, kf.shape[-1], like=kf),
        level=torch.full((B, H), float("-inf"), dtype=kf.dtype, device=kf.device), position=0,
    )


def fold_into_far(state: BandDecodeState, slot: int) -> None:
    """Add the token in ``slot`` (leaving the band) to the far field's linear state; a
    padded token (``state.pad``) leaves its row's far field as it was."""
    kls = state.kls[:, :, slot]
    level = torch.maximum(state.level, kls)
    keep = torch.exp(state.level - level)  # 0 while the far field is empty (level was -inf)
    kf = state.kf[:, :, slot] * torch.exp(kls - level).unsqueeze(-1)  # [B, H, m]
    kv = state.kv * keep[..., None, None] + kf.unsqueeze(-1) * state.v[:, :, slot].unsqueeze(-2)
    z = state.z * keep.unsqueeze(-1) + kf
    if state.pad is not None:
        padded = state.pad[:, slot].view(-1, 1)  # [B, 1]
        kv = torch.where(padded[..., None, None], state.kv, kv)
        z = torch.where(padded[..., None], state.z, z)
        level = torch.where(padded, state.level, level)
    state.kv, state.z, state.level = kv, z, level
