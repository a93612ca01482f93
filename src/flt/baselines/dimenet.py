"""torch_geometric's DimeNet++ (Gasteiger et al., 2020) on graphs computed with plain torch.

PyG's ``DimeNet.forward`` builds its radius graph with ``torch_geometric.nn.radius_graph``
(``pyg-lib``'s compiled op; ``torch_cluster`` in older releases) and its angle triplets
with the module function ``triplets`` (a ``torch_sparse.SparseTensor``); neither
extension is part of this project's plain install. :class:`PlainDimeNetPlusPlus` runs
PyG's own forward and blocks unchanged and only swaps those two module-level names, for
the duration of its forward, for :func:`flt.baselines.atom_graphs.radius_graph` and
:func:`flt.baselines.atom_graphs.triplets`.

Why a swap of two names and not a forward of our own: the forward is the model (angles,
bases, embedding, interaction and output blocks, readout); rewriting it would be a copy
of PyG's code that drifts from it. PyG offers no argument for either function, so the
swap uses ``unittest.mock.patch.object``, which raises ``AttributeError`` if a later PyG
renames either name, rather than silently running PyG's own (torch_geometric is pinned in
constraints.txt). The swap is process-wide while a forward runs and not thread-safe: two
forwards in threads of one process (``nn.DataParallel``) can restore PyG's functions under
each other; use processes (DDP) instead. For the same reason of not copying, the constructor swaps PyG's
``dimenet_utils.bessel_basis`` for a cached call of itself (see :class:`PlainDimeNetPlusPlus`).
"""

from __future__ import annotations

import functools
from typing import Any
from unittest.mock import patch

import torch

try:
    from torch_geometric.nn.models import DimeNetPlusPlus, dimenet, dimenet_utils
except ImportError as error:  # the error names what is missing (torch_geometric, sympy or scipy)
    raise ImportError(f"encoder='dimenet++' runs torch_geometric's DimeNetPlusPlus, which could not be imported "
                      f"({error}); install the qm9 extra: pip install -e '.[qm9]'") from error

from flt.baselines.atom_graphs import radius_graph, triplets


def _radius_edges(x: torch.Tensor, r: float, batch: torch.Tensor | None = None, max_num_neighbors: int = 32,
                  **_: object) -> torch.Tensor:
    """``torch_geometric.nn.radius_graph``'s call as ``DimeNet.forward`` makes it, answered
    by :func:`flt.baselines.atom_graphs.radius_graph`: ``edge_index [2, E]`` of every ordered pair within
    ``r`` (symmetric, so either row may be read as the source). PyG keeps at most
    ``max_num_neighbors`` per atom, an arbitrary subset when there are more; here that case
    is refused instead (it never arises in QM9: at most 28 neighbours against PyG's 32)."""
    if batch is None:
        batch = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    edge_index = radius_graph(x, batch, r)[0]
    most = int(torch.bincount(edge_index[1], minlength=x.shape[0]).max()) if edge_index.numel() else 0
    if most > max_num_neighbors:
        raise ValueError(f"an atom has {most} neighbours within {r} Angstrom, more than DimeNet++'s "
                         f"max_num_neighbors={max_num_neighbors}, which PyG would cut arbitrarily; lower the cutoff")
    return edge_index


#: PyG's sympy derivation of the radial Bessel basis, once per ``(num_spherical, num_radial)``.
_cached_bessel_basis = functools.cache(dimenet_utils.bessel_basis)


class PlainDimeNetPlusPlus(DimeNetPlusPlus):
    """PyG's ``DimeNetPlusPlus`` (same constructor, parameters and ``forward(z [A], pos
    [A, 3], batch [A]) -> [B, out_channels]``) with its radius graph and triplets computed
    in plain torch; see the module docstring for how and why.

    Building one derives the Bessel basis symbolically (about 9 s of CPU at the paper's
    7 x 6 sizes), the same expressions every time; the constructor lets one process derive
    them once, so a reload for evaluation or a second model costs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with patch.object(dimenet_utils, "bessel_basis", _cached_bessel_basis):
            super().__init__(*args, **kwargs)

    def forward(self, z: torch.Tensor, pos: torch.Tensor, batch: torch.Tensor | None = None) -> torch.Tensor:
        with patch.object(dimenet, "radius_graph", _radius_edges), patch.object(dimenet, "triplets", triplets):
            return super().forward(z, pos, batch)
