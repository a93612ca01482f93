"""ALiBi (Press et al. 2022): a fixed or learned per-head slope times the distance between
positions, ``-slope_h |r_q - r_k| / unit``, added to the attention logits (the logit
coupling of docs/math.md section 1); :class:`AlibiBias` is ``RELATIVE["alibi"]``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flt._checks import (
    check_bool,
    check_finite,
    check_positive_float,
    check_positive_int,
    check_tensor,
)
from flt._dtype import compute_dtype
from flt.relative.base import RelativeTerm, pair_positions, tensor_sum


def alibi_slopes(heads: int, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """ALiBi head slopes ``[H]``.

    For ``H`` a power of two the slopes are the geometric sequence ``2^(-8h/H)``,
    ``h = 1 .. H``. Otherwise, with ``H'`` the largest power of two below ``H``, the
    slopes are those for ``H'`` followed by the first ``H - H'`` odd-indexed slopes
    for ``2H'`` (``2^(-8(2k-1)/(2H'))``, ``k = 1, 2, ...``), as in the ALiBi paper's code.
    Values are exact powers of two, computed in float64 before casting.
    """
    check_positive_int("heads", heads)

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    low = 2 ** int(math.floor(math.log2(heads)))
    slopes = power_of_two(low) + power_of_two(2 * low)[0::2][: heads - low]
    return torch.tensor(slopes, dtype=torch.float64, device=device).to(dtype or torch.get_default_dtype())


def alibi_bias(pos_q: torch.Tensor, pos_k: torch.Tensor, slopes: torch.Tensor, *, unit: float = 1.0) -> torch.Tensor:
    """ALiBi bias ``b[b, h, i, j] = -slopes[h] * |r_i - r_j| / unit``: ``[B, H, N, Nk]``.

    For ``P > 1`` the distance is Euclidean, ``|r_i - r_j|_2`` (an isotropic extension;
    the paper is 1-D). The paper's causal form ``-m (i - j)`` for ``j <= i`` equals this
    on the causal part; the symmetric ``|i - j|`` is the usual bidirectional variant.

    ``unit`` is the distance that counts as one step: ALiBi's slopes (:func:`alibi_slopes`,
    ``1/2 .. 1/256``) were designed per *token*, so real-valued positions should be
    measured in their typical spacing. For integer token indices that is 1 (the default,
    the paper's bias). For the ``n x n`` patch centres on ``[-1, 1]^2``
    (:func:`flt.posenc.patch_grid`) it is the patch spacing ``2 / n``; with ``unit = 1``
    those positions are less than ``2 sqrt(2)`` apart (2.12 for ``n = 4``), so the largest
    bias is about ``2 * slope``: 0.53 logits for the steepest of 4 heads, nearly
    position-blind. Scaling the positions and ``unit`` by the same factor leaves
    the bias unchanged.

    Args:
        pos_q: query positions ``[B or 1, N, P]`` or ``[N, P]``.
        pos_k: key positions ``[B or 1, Nk, P]`` or ``[Nk, P]``.
        slopes: ``[H]``, e.g. :func:`alibi_slopes` (any positive values; may require grad).
        unit: a finite number ``> 0``, the distance of one step.

    Returns:
        ``[B or 1, H, N, Nk]`` in float32 or better.
    """
    pos_q, pos_k = pair_positions(pos_q, pos_k)
    check_tensor("slopes", slopes, ndim=1, layout="[H]")
    check_finite("slopes", slopes)
    unit = check_positive_float("unit", unit)
    cdt = compute_dtype(pos_q, pos_k, slopes)
    diff = pos_q.to(cdt).unsqueeze(2) - pos_k.to(cdt).unsqueeze(1)  # [B, N, Nk, P]
    # vector_norm's backward is 0 (not NaN) at zero distance, unlike a hand-written sqrt.
    dist = diff.abs().squeeze(-1) if diff.shape[-1] == 1 else torch.linalg.vector_norm(diff, dim=-1)
    if unit != 1.0:
        dist = dist / unit
    return -slopes.to(cdt)[None, :, None, None] * dist.unsqueeze(1)



class AlibiBias(RelativeTerm):
    """ALiBi as a relative term (``RELATIVE["alibi"]``): ``-slope_h |r_q - r_k| / unit``
    (:func:`alibi_bias`, Euclidean for ``P > 1``).

    Args:
        heads: ``H``; the slopes start at :func:`alibi_slopes`.
        pos_dim: any ``P``.
        unit: the distance that counts as one step (see :func:`alibi_bias`).
        learnable: learn the slopes, stored as ``log_slopes`` so they stay positive;
            otherwise they are a fixed (non-persistent) buffer ``slopes``, as in the paper.
    """

    slopes: torch.Tensor  # registered buffer (learnable=False)

    def __init__(self, heads: int, *, pos_dim: int = 1, unit: float = 1.0, learnable: bool = False, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        check_positive_int("heads", heads)
        check_positive_int("pos_dim", pos_dim)
        self.heads, self.pos_dim = heads, pos_dim
        self.unit = check_positive_float("alibi_unit", unit)
        check_bool("alibi_learnable", learnable)
        self.learnable = learnable
        slopes = alibi_slopes(heads, device=device, dtype=torch.float64)
        if learnable:
            self.log_slopes = nn.Parameter(slopes.log().to(dtype or torch.get_default_dtype()))
        else:
            self.register_buffer("slopes", slopes.to(torch.float32), persistent=False)

    def current_slopes(self) -> torch.Tensor:
        return self.log_slopes.exp() if self.learnable else self.slopes

    def pairwise(self, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
        return alibi_bias(pos_q, pos_k, self.current_slopes(), unit=self.unit)

    def of_offsets(self, delta: torch.Tensor) -> torch.Tensor:
        slopes = self.current_slopes()
        cdt = compute_dtype(delta, slopes)
        delta = delta.to(cdt)
        dist = delta.abs()[..., 0] if delta.shape[-1] == 1 else torch.linalg.vector_norm(delta, dim=-1)
        return -slopes.to(cdt) * (dist / self.unit).unsqueeze(-1)

    def head_value(self, delta: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        slope = self.log_slopes[h].exp() if self.learnable else self.slopes[h]
        sq = tensor_sum(d * d for d in delta)
        # sqrt's derivative is infinite at 0: the double where keeps gradients finite there.
        dist = torch.where(sq > 0, torch.sqrt(torch.where(sq > 0, sq, torch.ones_like(sq))), torch.zeros_like(sq))
        return -slope * dist / self.unit

    def extra_repr(self) -> str:
        return f"heads={self.heads}, unit={self.unit}, learnable={self.learnable}"
