"""Fixed sinusoidal and learned-table absolute encodings (Vaswani et al. 2017).

Both map positions ``pos [B, N, P]`` to ``[B, N, dim]``, to be added to token embeddings.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from flt._checks import check_positive_float, check_positive_int, integer_positions
from flt.posenc._common import check_abs_positions, compute_dtype


def sinusoidal_frequencies(dim: int, *, base: float = 10000.0, device: torch.device | str | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Angular frequencies ``omega_k = base^(-2k/dim)``, ``k = 0 .. dim/2 - 1``: ``[dim/2]``."""
    exponents = torch.arange(0, dim, 2, device=device, dtype=dtype) / dim
    return base ** (-exponents)


class SinusoidalEncoding(nn.Module):
    """Sinusoidal encoding at real-valued positions in ``P`` dimensions.

    ``dim`` is split evenly across the ``P`` axes; axis ``p`` gets ``dim/P`` channels laid
    out as in Vaswani et al.: channel ``2k`` is ``sin(x_p omega_k)`` and ``2k + 1`` is
    ``cos(x_p omega_k)`` with ``omega_k = base^(-2k/(dim/P))``. Axes are concatenated in
    order. For ``P = 1`` and integer positions this is exactly the original table.

    Because ``sin a sin b + cos a cos b = cos(a - b)``, the encodings satisfy
    ``PE(x).PE(y) = sum_p sum_k cos(omega_k (x_p - y_p))``: dot products depend only on
    offsets, which the tests check.

    Args:
        dim: output size; must be divisible by ``2 * pos_dim``.
        pos_dim: ``P``.
        base: frequency base (10000 in the paper).
        dtype: output dtype; ``None`` returns the positions' dtype. The module has no
            parameters; angles are always computed in float32 or better.

    Shapes: ``forward(pos [B, N, P]) -> [B, N, dim]``.
    """

    def __init__(self, dim: int, pos_dim: int = 1, *, base: float = 10000.0, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("pos_dim", pos_dim)
        if dim % (2 * pos_dim) != 0:
            raise ValueError(
                f"dim = {dim} must be divisible by 2 * pos_dim = {2 * pos_dim} (a sin/cos pair per frequency on each axis)"
            )
        self.dim = dim
        self.pos_dim = pos_dim
        self.base = check_positive_float("base", base)
        self.out_dtype = dtype

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        check_abs_positions("pos", pos, self.pos_dim)
        cdt = compute_dtype(pos)
        # Frequencies are recomputed per call (dim/2 numbers) rather than stored as a
        # buffer, so module.half() can never degrade them.
        freqs = sinusoidal_frequencies(self.dim // self.pos_dim, base=self.base, device=pos.device, dtype=cdt)
        angles = pos.to(cdt).unsqueeze(-1) * freqs  # [B, N, P, dim/(2P)]
        out = torch.stack((angles.sin(), angles.cos()), dim=-1)
        out = rearrange(out, "b n p k two -> b n (p k two)")
        return out.to(self.out_dtype or pos.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, pos_dim={self.pos_dim}, base={self.base}"


class LearnedEncoding(nn.Module):
    """A learned table of ``max_len`` vectors indexed by integer 1-D positions (GPT-2 style).

    Positions must be whole numbers in ``[0, max_len)``, given as a floating tensor with
    integral values (the library's position convention) or as an integer tensor. Entries
    are initialised N(0, 0.02^2). Only ``pos_dim = 1`` exists: a table over a ``P``-d grid
    is not a function of coordinates, so other ``P`` raise.

    Shapes: ``forward(pos [B, N, 1]) -> [B, N, dim]`` in the table's dtype.
    """

    def __init__(self, dim: int, pos_dim: int = 1, *, max_len: int = 2048, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("max_len", max_len)
        if pos_dim != 1:
            raise ValueError(f"LearnedEncoding supports only pos_dim = 1 (integer token indices), got pos_dim = {pos_dim!r}")
        self.dim = dim
        self.pos_dim = 1
        self.max_len = max_len
        self.table = nn.Parameter(torch.empty(max_len, dim, device=device, dtype=dtype))
        nn.init.normal_(self.table, std=0.02)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        if isinstance(pos, torch.Tensor) and pos.is_floating_point():
            check_abs_positions("pos", pos, 1)
        elif isinstance(pos, torch.Tensor) and pos.ndim != 3:
            raise ValueError(f"pos must have rank 3 [B, N, 1], got shape {tuple(pos.shape)}")
        idx = integer_positions("pos", pos)
        if idx.shape[-1] != 1:
            raise ValueError(f"pos has position dimension P = {idx.shape[-1]}, expected P = 1")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.max_len):
            raise ValueError(
                f"pos must lie in [0, max_len = {self.max_len}), got values in [{int(idx.min())}, {int(idx.max())}]"
            )
        return self.table[idx.squeeze(-1)]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_len={self.max_len}"
