"""Rotary position embedding (RoPE, Su et al. 2021) at real-valued positions, 1-D and axial.

Queries and keys ``[B, H, N, D]`` are rotated pairwise by position-dependent angles, so
``rot(q, r_i).rot(k, r_j)`` depends on the positions only through ``r_i - r_j``. Pairing
is "rotate half" (GPT-NeoX / Llama layout): channel ``c`` pairs with ``c + D/2``, and pair
``c`` turns by ``angles[..., c]``. The interleaved layout of the RoFormer paper (pairs
``(2c, 2c+1)``) is the same map up to a fixed permutation of channels, so for attention
scores the two are interchangeable once q and k use the same one.

Axial RoPE for ``P > 1``: the ``D/2`` pairs are split into ``P`` consecutive blocks of
``D/(2P)`` pairs, block ``p`` turned by coordinate ``p`` with the 1-D frequency ladder of
a head of size ``D/P``: ``omega_k = base^(-2k/(D/P))``, ``k = 0 .. D/(2P) - 1``. Hence
``D`` must be divisible by ``2P``.
"""

from __future__ import annotations

import torch

from flt._checks import (
    check_dim,
    check_finite,
    check_positions,
    check_positive_float,
    check_positive_int,
    check_tensor,
)
from flt.posenc._common import compute_dtype
from flt.posenc.sinusoidal import sinusoidal_frequencies


def rope_angles(pos: torch.Tensor, head_dim: int, *, base: float = 10000.0) -> torch.Tensor:
    """Rotation angles ``[B, N, head_dim/2]`` for positions ``pos [B, N, P]`` (or ``[N, P]``,
    giving ``[1, N, head_dim/2]``), in float32 or better.

    Entry ``p * head_dim/(2P) + k`` is ``pos[..., p] * base^(-2k/(head_dim/P))``.
    """
    check_tensor("pos", pos, ndim=(2, 3), layout="[B, N, P] or [N, P]")
    check_finite("pos", pos)
    check_positive_int("head_dim", head_dim)
    base = check_positive_float("base", base)
    if pos.ndim == 2:
        pos = pos.unsqueeze(0)
    P = pos.shape[-1]
    if head_dim % (2 * P) != 0:
        raise ValueError(
            f"head_dim = {head_dim} must be divisible by 2 * P = {2 * P} (rotary pairs split evenly across the P axes)"
        )
    cdt = compute_dtype(pos)
    freqs = sinusoidal_frequencies(head_dim // P, base=base, device=pos.device, dtype=cdt)  # [D/(2P)]
    angles = pos.to(cdt).unsqueeze(-1) * freqs  # [B, N, P, D/(2P)]
    return angles.flatten(-2)


def apply_rope(
    x: torch.Tensor,
    pos: torch.Tensor | None = None,
    *,
    angles: torch.Tensor | None = None,
    base: float = 10000.0,
) -> torch.Tensor:
    """Rotate ``x [B, H, N, D]`` by RoPE; give exactly one of ``pos`` or ``angles``.

    Args:
        x: queries or keys ``[B, H, N, D]``.
        pos: positions ``[B or 1, N, P]`` or ``[N, P]`` (shared by heads).
        angles: precomputed :func:`rope_angles`, ``[B or 1, N, D/2]`` (reuse them for
            q and k, and across layers).
        base: frequency base, used with ``pos``.

    Returns:
        ``[B, H, N, D]`` in ``x``'s dtype; the rotation runs in float32 or better.
    """
    check_tensor("x", x, ndim=4, layout="[B, H, N, D]")
    B, _, N, D = x.shape
    if (pos is None) == (angles is None):
        raise ValueError("give exactly one of pos or angles")
    if D % 2 != 0:
        raise ValueError(f"x has head dimension D = {D}; RoPE needs an even D")
    if pos is not None:
        pos = check_positions("pos", pos, batch=B, length=N, pos_dim=None)
        angles = rope_angles(pos, D, base=base)
    else:
        assert angles is not None  # exactly one of pos and angles (checked above)
        check_tensor("angles", angles, ndim=3, layout="[B or 1, N, D/2]")
        check_finite("angles", angles)
        if angles.shape[0] not in (1, B):
            raise ValueError(f"angles has batch size {angles.shape[0]}, expected 1 or {B}")
        check_dim("angles", angles, 1, N, "length N")
        check_dim("angles", angles, 2, D // 2, "number of rotary pairs D/2")
    cdt = compute_dtype(x, angles)
    theta = angles.to(cdt).unsqueeze(1)  # [B or 1, 1, N, D/2], broadcast over heads
    cos, sin = theta.cos(), theta.sin()
    x1, x2 = x.to(cdt).chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)
