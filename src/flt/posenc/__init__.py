"""Positional encodings (docs/math.md section 7).

Absolute encodings live in the registry ``POSENC``: every entry is built as
``POSENC[name](dim, pos_dim, **options)`` and maps positions ``[B, N, P]`` to
``[B, N, dim]``, which models add to the token embeddings.

Outside the registry:

- :class:`CAPE` augments the positions themselves (training only), so it composes with
  any encoding, FLT's spectral RPE included.
- :func:`apply_rope` / :func:`rope_angles` rotate queries and keys inside attention.
- Relative terms (tables, ALiBi, spectra) live in :mod:`flt.relative`; the names
  :func:`alibi_bias`, :func:`alibi_slopes`, :func:`t5_relative_buckets`,
  :func:`clipped_relative_indices` and :class:`RelativeBiasTable` stay importable from
  here as aliases.
- :func:`stable_rank` and :func:`distance_preservation` diagnose embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from flt._checks import check_positive_int
from flt.posenc._common import check_abs_positions
from flt.posenc.cape import CAPE, CAPEDraws, patch_grid
from flt.posenc.fourier import LearnableFourierFeatures
from flt.posenc.rope import apply_rope, rope_angles
from flt.posenc.shifted_basis import (
    KINDS as SHIFTED_BASIS_KINDS,
    ShiftedBasisEmbedding,
    distance_preservation,
    embedding_matrix,
    stable_rank,
)
from flt.posenc.sinusoidal import LearnedEncoding, SinusoidalEncoding, sinusoidal_frequencies
from flt.relative.alibi import alibi_bias, alibi_slopes
from flt.relative.tables import RelativeBiasTable, clipped_relative_indices, t5_relative_buckets


class NoEncoding(nn.Module):
    """No absolute encoding: zeros ``[B, N, dim]`` (for models whose positions enter
    only through attention, e.g. RoPE, ALiBi or FLT's RPE).

    Positions are still validated so a misconfigured model fails the same way with
    every registry entry. Output dtype: ``dtype`` if given, else the positions' dtype.
    """

    def __init__(self, dim: int, pos_dim: int = 1, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("pos_dim", pos_dim)
        self.dim, self.pos_dim, self.out_dtype = dim, pos_dim, dtype

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        check_abs_positions("pos", pos, self.pos_dim)
        return pos.new_zeros(*pos.shape[:2], self.dim, dtype=self.out_dtype or pos.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, pos_dim={self.pos_dim}"


#: Absolute encodings, one constructor signature ``cls(dim, pos_dim, **options)`` and
#: one forward ``(pos [B, N, P]) -> [B, N, dim]``. ``learned`` supports ``pos_dim = 1`` only.
POSENC: dict[str, type[nn.Module]] = {
    "none": NoEncoding,
    "sinusoidal": SinusoidalEncoding,
    "learned": LearnedEncoding,
    "fourier": LearnableFourierFeatures,
    "shifted_basis": ShiftedBasisEmbedding,
}

__all__ = [
    "CAPE",
    "POSENC",
    "SHIFTED_BASIS_KINDS",
    "CAPEDraws",
    "LearnableFourierFeatures",
    "LearnedEncoding",
    "NoEncoding",
    "RelativeBiasTable",
    "ShiftedBasisEmbedding",
    "SinusoidalEncoding",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "clipped_relative_indices",
    "distance_preservation",
    "embedding_matrix",
    "patch_grid",
    "rope_angles",
    "sinusoidal_frequencies",
    "stable_rank",
    "t5_relative_buckets",
]
