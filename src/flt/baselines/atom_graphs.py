"""The graphs over atoms that torch_geometric's message-passing baselines read, computed in
plain torch so that neither needs a compiled extension: the radius graph
(:func:`radius_graph`, SchNet's ``interaction_graph`` in :mod:`flt.baselines.qm9`, DimeNet++'s in
:mod:`flt.baselines.dimenet`) and DimeNet's angle triplets (:func:`triplets`). PyG's own
versions need ``pyg-lib`` (or ``torch_cluster``) and ``torch_sparse``.
"""

from __future__ import annotations

import torch


def radius_graph(pos: torch.Tensor, batch: torch.Tensor, cutoff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(edge_index [2, E], distance [E])``: every ordered pair ``(i, j)``, ``i != j``, of
    atoms of one molecule within ``cutoff`` of each other. ``pos [A, 3]`` flat atoms,
    ``batch [A]`` their molecule, sorted (as PyG batches them). Dense per molecule: the
    ``[B, N, N]`` distances of a padded copy, cheap for small molecules."""
    counts = torch.bincount(batch)
    first = torch.cumsum(counts, 0) - counts
    slot = torch.arange(batch.numel(), device=pos.device) - first[batch]
    n = int(counts.max())
    dense = pos.new_zeros(counts.numel(), n, 3)
    dense[batch, slot] = pos.detach()
    real = torch.zeros(counts.numel(), n, dtype=torch.bool, device=pos.device)
    real[batch, slot] = True
    near = torch.cdist(dense, dense) < cutoff
    near &= real.unsqueeze(1) & real.unsqueeze(2)
    near &= ~torch.eye(n, dtype=torch.bool, device=pos.device)
    b, i, j = near.nonzero(as_tuple=True)
    edge_index = torch.stack([first[b] + i, first[b] + j])
    # The distance of the real positions, so gradients reach them as in PyG's own graph.
    return edge_index, (pos[edge_index[0]] - pos[edge_index[1]]).norm(dim=-1)


def triplets(edge_index: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, ...]:
    """DimeNet's angle triplets of a directed graph ``edge_index [2, E]`` (row ``j``
    sends to column ``i``): for every edge ``j -> i`` each edge ``k -> j`` with ``k != i``.
    Returns ``(i [E], j [E], idx_i [T], idx_j [T], idx_k [T], idx_kj [T], idx_ji [T])``,
    the edges' targets and sources, then per triplet its three atoms and its two edges'
    positions in ``edge_index``, the tuple and order PyG's ``DimeNet.forward`` unpacks from
    its own ``triplets`` (which needs ``torch_sparse``). Vectorised: the edges into each
    atom are contiguous once sorted by target, so edge ``j -> i`` pairs with the in-degree
    of ``j`` consecutive entries of that order."""
    if not (isinstance(edge_index, torch.Tensor) and edge_index.ndim == 2 and edge_index.shape[0] == 2
            and not edge_index.is_floating_point() and not edge_index.is_complex()):
        shape = tuple(edge_index.shape) if isinstance(edge_index, torch.Tensor) else type(edge_index).__name__
        raise ValueError(f"edge_index must be an integer tensor [2, E], got {shape}")
    source, target = edge_index
    into = torch.argsort(target, stable=True)  # edge ids grouped by their target atom
    in_degree = torch.bincount(target, minlength=num_nodes)
    first_into = torch.cumsum(in_degree, 0) - in_degree
    count = in_degree[source]  # edges k -> j for each edge j -> i
    idx_ji = torch.repeat_interleave(torch.arange(source.numel(), device=source.device), count)
    rank = torch.arange(idx_ji.numel(), device=source.device) - (torch.cumsum(count, 0) - count)[idx_ji]
    idx_kj = into[first_into[source[idx_ji]] + rank]
    idx_i, idx_j, idx_k = target[idx_ji], source[idx_ji], source[idx_kj]
    keep = idx_k != idx_i  # no k -> j -> k back-and-forth
    return target, source, idx_i[keep], idx_j[keep], idx_k[keep], idx_kj[keep], idx_ji[keep]
