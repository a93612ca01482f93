"""A shortest-path-distance bias over graph positions given as hop-distance vectors.

Graphs have no coordinates, but a node ``v`` can be placed at ``r_v = (d(v, x_1) .. d(v,
x_P)) * unit``, its hop distances to ``P`` reference nodes: ``K`` anchors (the anchor
coordinates of :mod:`flt.graphs.transformer`, ``unit = 1 / sqrt(K)``) or all ``N`` nodes
(the rows of the distance matrix, ``unit = 1``). By the triangle inequality
``|d(u, x) - d(v, x)| <= d(u, v)`` for every reference ``x``, so the Chebyshev length of
the offset, in hops,

    ``h(u, v) = round(max_x |r_u,x - r_v,x| / unit)``,

is a lower bound on the hop distance ``d(u, v)``, equal to it when ``u`` or ``v`` is a
reference node; with the full distance matrix as positions it *is* the shortest-path
distance. :class:`ShortestPathBias` (``RELATIVE["spd"]``) adds the learned per-head value
``scale_h * table[min(h, max_distance), h]`` to the logits (Graphormer's spatial encoding,
read off positions): one row per hop count ``0 .. max_distance`` (the last one for every
larger count) and one more row for pairs with no path.

"No path" travels in the positions too: a reference that ``v`` cannot reach is written at
``UNREACHABLE_HOPS * 2`` hops (:func:`hop_positions`). Two nodes in different components
then differ by at least ``UNREACHABLE_HOPS`` hops on some axis (on the axis of a reference
in one component, provided the graph's diameter is below ``UNREACHABLE_HOPS``), and an
estimate ``h >= UNREACHABLE_HOPS`` selects the unreachable row. Positions that write an
unreachable anchor at a finite distance (:func:`flt.graphs.anchor_coordinates` uses
``d_max + 1``) never select it.

The estimate is a function of ``r_q - r_k`` alone, so the term is translation-invariant
(:meth:`of_offsets`); it has no linear-time features (a table lookup of a rounded maximum
does not factorise), so it serves :class:`flt.layers.SoftmaxAttention` (``relative_bias=
"spd"``, options in ``relative_options``), not FLT. The rounding passes no gradient to the
positions; the table and its scale learn.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from flt._checks import check_bool, check_positive_float, check_positive_int
from flt.relative.base import RelativeTerm, pair_positions
from flt.relative.tables import DEFAULT_TABLE_SCALE

#: Hop estimates at or above this count read as "no path" (:func:`hop_positions` writes an
#: unreachable reference at twice this).
UNREACHABLE_HOPS = 10_000


def hop_positions(dist: torch.Tensor, *, unit: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Positions ``[N, P]`` of :class:`ShortestPathBias` from integer hop distances ``dist [N, P]``
    (``-1`` where there is no path, as :func:`flt.graphs.anchor_distances` reports): ``dist *
    unit``, with unreachable entries at ``2 * UNREACHABLE_HOPS * unit``."""
    if not isinstance(dist, torch.Tensor) or dist.ndim != 2 or dist.is_floating_point() or dist.dtype == torch.bool:
        raise ValueError(f"dist must be an integer [N, P] tensor of hop distances, got {getattr(dist, 'dtype', type(dist).__name__)} "
                         f"of shape {tuple(getattr(dist, 'shape', ()))}")
    if dist.numel() and int(dist.max()) >= UNREACHABLE_HOPS:
        raise ValueError(f"dist holds a hop distance of {int(dist.max())}; distances must stay below UNREACHABLE_HOPS = {UNREACHABLE_HOPS}")
    unit = check_positive_float("unit", unit)
    far = torch.full_like(dist, 2 * UNREACHABLE_HOPS)
    return torch.where(dist < 0, far, dist).to(torch.float64).mul(unit).to(dtype)


class ShortestPathBias(RelativeTerm):
    """Learned bias of the hop estimate ``h(u, v)`` of hop-distance positions (module docstring).

    ``bias(pos_q [B|1, N, P], pos_k [B|1, Nk, P]) -> [B|1, H, N, Nk]``:
    ``scale_h * table[row(h), h]`` with ``row(h) = min(h, max_distance)`` for
    ``h < UNREACHABLE_HOPS`` and ``max_distance + 1`` otherwise.

    Args:
        heads: ``H``.
        pos_dim: ``P``, the number of reference nodes (any; checked against the positions).
        unit: the length of one hop in the positions (``1 / sqrt(K)`` for
            :func:`flt.graphs.anchor_coordinates` of ``K`` anchors).
        max_distance: the last hop count with its own row; larger counts share it.
        table_scale, learn_scale: ``bias = scale * table``, the table starting at zero and
            ``scale`` at ``table_scale`` (learned unless ``learn_scale=False``), the
            learning-rate reparameterisation of :class:`flt.relative.RelativeBiasTable`.
    """

    def __init__(self, heads: int, *, pos_dim: int = 1, unit: float = 1.0, max_distance: int = 8,
                 table_scale: float = DEFAULT_TABLE_SCALE, learn_scale: bool = True, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        check_positive_int("heads", heads)
        check_positive_int("pos_dim", pos_dim)
        check_positive_int("max_distance", max_distance)
        check_bool("learn_scale", learn_scale)
        self.heads, self.pos_dim, self.max_distance = heads, pos_dim, max_distance
        self.unit = check_positive_float("unit", unit)
        self.table_scale = check_positive_float("table_scale", table_scale)
        self.learn_scale = learn_scale
        self.table = nn.Parameter(torch.zeros(max_distance + 2, heads, device=device, dtype=dtype))
        scale = torch.full((heads,), self.table_scale, device=device, dtype=dtype)
        if learn_scale:
            self.scale = nn.Parameter(scale)
        else:
            self.register_buffer("scale", scale)

    def rows(self, hops: torch.Tensor) -> torch.Tensor:
        """Table row (``torch.long``, same shape) of real hop estimates before rounding."""
        h = torch.round(hops)
        clipped = h.clamp(min=0, max=self.max_distance).long()
        return torch.where(h >= UNREACHABLE_HOPS, torch.full_like(clipped, self.max_distance + 1), clipped)

    def hops(self, pos_q: torch.Tensor, pos_k: torch.Tensor | None = None) -> torch.Tensor:
        """The unrounded estimate ``max_x |r_q,x - r_k,x| / unit`` of every pair: ``[B|1, N, Nk]``,
        in float64 (positions of a few thousand hops times ``1 / sqrt(K)`` must round right).
        Positions ``[B|1, N, P]`` or ``[N, P]``, as :meth:`bias` takes them."""
        pos_q, pos_k = pair_positions(pos_q, pos_k)
        q, k = pos_q.detach().to(torch.float64), pos_k.detach().to(torch.float64)
        b = max(q.shape[0], k.shape[0])
        # cdist with p = inf is the Chebyshev distance without the [N, Nk, P] differences.
        cheb = torch.cdist(q.expand(b, *q.shape[1:]), k.expand(b, *k.shape[1:]), p=float("inf"))
        return cheb / self.unit

    def scaled_table(self) -> torch.Tensor:
        """``scale * table``: ``[max_distance + 2, H]``, the bias of every row (last: no path)."""
        return self.table * self.scale

    def pairwise(self, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
        bias = self.scaled_table()[self.rows(self.hops(pos_q, pos_k))]  # [B, N, Nk, H]
        return rearrange(bias, "b i j h -> b h i j")

    def of_offsets(self, delta: torch.Tensor) -> torch.Tensor:
        """The bias at offsets ``delta = r_q - r_k`` ``[..., P]``: ``[..., H]``."""
        hops = delta.detach().to(torch.float64).abs().amax(dim=-1) / self.unit
        return self.scaled_table()[self.rows(hops)]

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, pos_dim={self.pos_dim}, unit={self.unit}, max_distance={self.max_distance}, "
                f"table_scale={self.table_scale}, learn_scale={self.learn_scale}")
