"""Anchor nodes, anchor distances and anchor indication.

Structure is always given as an edge list ``edges [E, 2]`` (undirected, each edge once);
for link prediction pass the *training* edges only (:attr:`LinkSplit.train_pos`), so that
no held-out edge shortens a distance.

* :func:`select_anchors`: ``K`` anchor nodes, uniformly at random or degree-stratified.
* :func:`anchor_distances`: hop distances ``d(v, a_k)`` as ``[N, K]`` int64, by BFS;
  :data:`UNREACHABLE` (``-1``) where ``a_k`` cannot reach ``v``.
* :func:`distance_features`: ``1 / (1 + d)`` with ``0`` for unreachable pairs (the limit of
  ``d -> inf``), the form the models feed to their MLPs.
* :func:`anchor_indicators`: ``K`` one-hot channels, channel ``k`` set on node ``a_k``,
  to concatenate to node features so that message passing can tell anchors apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flt._checks import check_positive_int

#: Distance reported for a node that an anchor cannot reach.
UNREACHABLE = -1


def _check_edges(edges: object, num_nodes: int) -> torch.Tensor:
    if not isinstance(edges, torch.Tensor) or edges.is_floating_point() or edges.dtype == torch.bool:
        raise TypeError(f"edges must be an integer torch.Tensor [E, 2], got {getattr(edges, 'dtype', type(edges).__name__)}")
    if edges.ndim != 2 or edges.shape[1] != 2:
        raise ValueError(f"edges must have shape [E, 2], got {tuple(edges.shape)}")
    if edges.numel() and (int(edges.min()) < 0 or int(edges.max()) >= num_nodes):
        raise ValueError(f"edges must hold node ids in [0, num_nodes = {num_nodes}), got ids in [{int(edges.min())}, {int(edges.max())}]")
    return edges.to(torch.int64)


def check_anchors(anchors: torch.Tensor | Sequence[int], num_nodes: int) -> torch.Tensor:
    """Require distinct anchor ids ``[K]`` in ``[0, num_nodes)``; return them as int64."""
    a = torch.as_tensor(anchors)
    if a.ndim != 1 or a.numel() == 0 or a.is_floating_point() or a.dtype == torch.bool:
        raise ValueError(f"anchors must be a non-empty 1-D tensor of integer node ids, got {a.dtype} of shape {tuple(a.shape)}")
    a = a.to(torch.int64)
    if int(a.min()) < 0 or int(a.max()) >= num_nodes:
        raise ValueError(f"anchors must lie in [0, num_nodes = {num_nodes}), got ids in [{int(a.min())}, {int(a.max())}]")
    if len(torch.unique(a)) != len(a):
        raise ValueError(f"anchors must be distinct nodes, got {len(a) - len(torch.unique(a))} repeated id(s)")
    return a


def degrees(num_nodes: int, edges: torch.Tensor) -> torch.Tensor:
    """Node degrees ``[N]`` int64 of the undirected edge list."""
    edges = _check_edges(edges, num_nodes)
    return torch.bincount(edges.reshape(-1), minlength=num_nodes)


def select_anchors(num_nodes: int, k: int, *, seed: int = 0, edges: torch.Tensor | None = None, stratified: bool = False) -> torch.Tensor:
    """``k`` distinct anchor nodes ``[k]`` int64, sorted, from ``numpy.random.default_rng(seed)``.

    Uniform without replacement by default. With ``stratified=True`` the nodes are ordered
    by degree in ``edges`` (ties in a seeded random order), cut into ``k`` contiguous strata
    of (nearly) equal size, and one anchor is drawn uniformly from each stratum, so that
    low- and high-degree nodes are both represented.
    """
    check_positive_int("num_nodes", num_nodes)
    check_positive_int("k", k)
    if k > num_nodes:
        raise ValueError(f"k = {k} anchors cannot be distinct nodes of a graph with num_nodes = {num_nodes}")
    rng = np.random.default_rng(seed)
    if not stratified:
        chosen = rng.choice(num_nodes, size=k, replace=False)
    else:
        if edges is None:
            raise ValueError("stratified=True needs edges (the training edges) to compute degrees")
        deg = degrees(num_nodes, edges).numpy()
        tiebreak = rng.permutation(num_nodes)
        order = np.lexsort((tiebreak, deg))  # by degree, then by the random tiebreak
        strata = np.array_split(order, k)
        chosen = np.array([s[rng.integers(len(s))] for s in strata])
    return torch.from_numpy(np.sort(chosen).astype(np.int64))


def anchor_distances(num_nodes: int, edges: torch.Tensor, anchors: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Hop distances ``d(v, a_k)``: ``[N, K]`` int64, :data:`UNREACHABLE` where there is no path.

    One breadth-first search per anchor, all ``K`` run together as a frontier of ``[N, K]``
    flags advanced along both directions of every edge.
    """
    check_positive_int("num_nodes", num_nodes)
    edges = _check_edges(edges, num_nodes)
    anchors = check_anchors(anchors, num_nodes)
    k = len(anchors)
    src = torch.cat([edges[:, 0], edges[:, 1]])
    dst = torch.cat([edges[:, 1], edges[:, 0]])
    dist = torch.full((num_nodes, k), UNREACHABLE, dtype=torch.int64)
    cols = torch.arange(k)
    dist[anchors, cols] = 0
    frontier = torch.zeros(num_nodes, k, dtype=torch.bool)
    frontier[anchors, cols] = True
    step = 0
    while bool(frontier.any()):
        step += 1
        hits = torch.zeros(num_nodes, k, dtype=torch.int64).index_add_(0, dst, frontier[src].to(torch.int64))
        frontier = (hits > 0) & (dist == UNREACHABLE)
        dist[frontier] = step
    return dist


def distance_features(dist: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``1 / (1 + d)`` elementwise, ``0`` where ``d`` is :data:`UNREACHABLE`."""
    out = 1.0 / (1.0 + dist.clamp(min=0).to(dtype))
    return torch.where(dist == UNREACHABLE, torch.zeros((), dtype=dtype), out)


def anchor_indicators(num_nodes: int, anchors: torch.Tensor | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` indicator channels: entry ``(v, k)`` is 1 iff ``v == a_k``."""
    anchors = check_anchors(anchors, num_nodes)
    ind = torch.zeros(num_nodes, len(anchors), dtype=dtype)
    ind[anchors, torch.arange(len(anchors))] = 1.0
    return ind


def indicate(x: torch.Tensor, anchors: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Node features ``x [N, F]`` with the ``K`` anchor-indicator channels appended: ``[N, F + K]``."""
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [N, F] tensor of node features, got {getattr(x, 'shape', type(x).__name__)}")
    return torch.cat([x, anchor_indicators(x.shape[0], anchors, dtype=x.dtype)], dim=1)
