"""Graphs for the position-aware tasks: the generated Grid and Communities sets and a loader
for local edge-list files.

A :class:`Graph` is undirected and featureless: ``num_nodes`` nodes numbered ``0 .. N-1``,
``edges [E, 2]`` (int64, each edge once with ``u < v``, sorted, no self-loops) and optional
integer node ``labels [N]`` (the community of each node on Communities). Its node features
are one constant channel (:meth:`Graph.features`), as in the featureless setting of P-GNN
(You et al. 2019), so that nothing but the structure tells nodes apart.

The generators need ``networkx`` (the ``graph`` extra); the loader does not.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from flt._checks import check_positive_int
from flt.data._files import check_file_size, open_regular, torch_load_error
from flt.data.errors import DataError

#: Node ids must fit int64.
MAX_NODE_ID = 2**63 - 1
#: Bytes each byte of an edge list costs once read: a line of a few bytes becomes a tuple
#: of two ints in a list (about 80 bytes), then int64 tensors.
EDGE_LIST_BYTES_PER_BYTE = 16
#: Bytes a node takes at least once a graph task holds it (features, positions, anchor
#: distances, labels), for :func:`check_node_memory`.
NODE_BYTES = 64


def _import_networkx() -> ModuleType:
    try:
        import networkx
    except ImportError as e:
        from flt._extras import install_hint

        raise ImportError(f"the graph generators need networkx: {install_hint('graph')}") from e
    return networkx


def canonical_edges(edges: torch.Tensor | np.ndarray | Sequence, num_nodes: int) -> torch.Tensor:
    """Undirected edges as ``[E, 2]`` int64 with ``u < v``, unique, sorted; self-loops dropped.

    ``edges`` is anything ``torch.as_tensor`` turns into ``[E, 2]`` integers; every id must
    lie in ``[0, num_nodes)``.
    """
    e = torch.as_tensor(edges)
    if e.layout != torch.strided:
        raise TypeError(f"edges must be a dense tensor, got layout {e.layout} (call .to_dense() first)")
    if e.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.int64)
    if e.ndim != 2 or e.shape[1] != 2:
        raise ValueError(f"edges must have shape [E, 2], got {tuple(e.shape)}")
    if e.is_floating_point() or e.dtype == torch.bool or e.is_complex():
        raise TypeError(f"edges must hold integer node ids, got dtype {e.dtype}")
    e = e.to(torch.int64)
    lo, hi = int(e.min()), int(e.max())
    if lo < 0 or hi >= num_nodes:
        raise ValueError(f"edges must hold node ids in [0, num_nodes = {num_nodes}), got ids in [{lo}, {hi}]")
    e = torch.sort(e, dim=1).values
    e = e[e[:, 0] != e[:, 1]]
    return torch.unique(e, dim=0)  # unique() also sorts rows lexicographically


@dataclass(frozen=True, eq=False)
class Graph:
    """An undirected graph; see the module docstring for the layout.

    Args:
        num_nodes: ``N``.
        edges: ``[E, 2]`` node-id pairs; canonicalised on construction (direction,
            duplicates and self-loops are dropped).
        labels: optional ``[N]`` integer class per node (the community on Communities).
        name: a short name for messages and reports.
    """

    num_nodes: int
    edges: torch.Tensor
    labels: torch.Tensor | None = None
    name: str = "graph"

    def __post_init__(self) -> None:
        check_positive_int("num_nodes", self.num_nodes)
        object.__setattr__(self, "edges", canonical_edges(self.edges, self.num_nodes))
        if self.labels is not None:
            labels = torch.as_tensor(self.labels)
            if (labels.shape != (self.num_nodes,) or labels.layout != torch.strided or labels.is_floating_point()
                    or labels.is_complex() or labels.dtype == torch.bool):
                raise ValueError(
                    f"labels must be an integer tensor of shape [num_nodes] = [{self.num_nodes}], "
                    f"got {labels.dtype} of shape {tuple(labels.shape)}"
                )
            object.__setattr__(self, "labels", labels.to(torch.int64))

    @property
    def num_edges(self) -> int:
        return int(self.edges.shape[0])

    def features(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The constant node feature: ``[N, 1]`` ones."""
        return torch.ones(self.num_nodes, 1, dtype=dtype)

    def __repr__(self) -> str:
        return f"Graph(name={self.name!r}, num_nodes={self.num_nodes}, num_edges={self.num_edges})"


def grid_graph(side: int = 20) -> Graph:
    """The ``side x side`` grid: node ``i * side + j`` sits at row ``i``, column ``j``.

    ``grid_graph(20)`` has 400 nodes and ``2 * 20 * 19 = 760`` edges.
    """
    check_positive_int("side", side)
    nx = _import_networkx()
    g = nx.grid_2d_graph(side, side)
    edges = [(i * side + j, k * side + m) for (i, j), (k, m) in g.edges()]
    return Graph(side * side, torch.tensor(edges, dtype=torch.int64).reshape(-1, 2), name=f"grid{side}")


def communities(num_cliques: int = 20, clique_size: int = 20, *, p: float = 0.01, seed: int = 0) -> Graph:
    """Connected caveman graph with random rewiring; ``labels`` are the clique of each node.

    ``networkx.connected_caveman_graph(num_cliques, clique_size)`` joins ``num_cliques``
    cliques of ``clique_size`` nodes into a ring (node ``v`` is in clique
    ``v // clique_size``). Then every edge ``(u, v)``, visited in sorted order, is with
    probability ``p`` replaced by ``(u, w)`` for a node ``w`` drawn uniformly among those
    not yet adjacent to ``u`` (the edge count is kept). The draws come from
    ``numpy.random.default_rng(seed)`` only, so the graph is a function of the arguments.
    """
    check_positive_int("num_cliques", num_cliques)
    check_positive_int("clique_size", clique_size)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be a probability in [0, 1], got {p!r}")
    if num_cliques < 2 or clique_size < 2:
        raise ValueError(
            f"communities needs at least 2 cliques of at least 2 nodes, got num_cliques = {num_cliques}, "
            f"clique_size = {clique_size}"
        )
    nx = _import_networkx()
    g = nx.connected_caveman_graph(num_cliques, clique_size)
    n = num_cliques * clique_size
    rng = np.random.default_rng(seed)
    adj = {v: set(g.neighbors(v)) for v in range(n)}
    for u, v in sorted((min(a, b), max(a, b)) for a, b in g.edges()):
        if v not in adj[u] or rng.random() >= p:
            continue
        candidates = [w for w in range(n) if w != u and w not in adj[u]]
        if not candidates:
            continue
        w = candidates[int(rng.integers(len(candidates)))]
        adj[u].discard(v)
        adj[v].discard(u)
        adj[u].add(w)
        adj[w].add(u)
    edges = [(u, v) for u in range(n) for v in adj[u] if u < v]
    labels = torch.arange(n, dtype=torch.int64) // clique_size
    return Graph(n, torch.tensor(edges, dtype=torch.int64), labels=labels, name=f"communities{num_cliques}x{clique_size}")


def load_edge_list(path: str | os.PathLike, *, num_nodes: int | None = None, name: str | None = None) -> Graph:
    """Read an undirected graph from a text edge list.

    Each non-blank line holds two non-negative integer node ids ``u v`` separated by
    whitespace; further fields on the line (a weight, a timestamp) are ignored, and a
    ``#`` starts a comment that runs to the end of the line. Edge direction, duplicates
    and self-loops are dropped (:func:`canonical_edges`). Ids are kept as they are:
    ``num_nodes`` defaults to the largest id plus one, so ids missing from the file are
    isolated nodes.

    Raises :class:`flt.data.MissingDataError` if the file does not exist and
    :class:`flt.data.DataError`, naming the file and the line, if a line cannot be read
    or the file holds no edge.
    """
    path = os.fspath(path)
    rows: list[tuple[int, int]] = []
    try:
        # utf-8-sig: a byte-order mark is not part of the first node id.
        with open_regular(path, "edge-list file", encoding="utf-8-sig") as f:
            check_file_size(path, os.fstat(f.fileno()).st_size, "edge-list file", bytes_per_byte=EDGE_LIST_BYTES_PER_BYTE)
            for lineno, line in enumerate(f, start=1):
                fields = line.split("#", 1)[0].split()
                if not fields:
                    continue
                if len(fields) < 2:
                    raise DataError(f"{path}, line {lineno}: expected two node ids 'u v', got {line.strip()!r}")
                try:
                    u, v = int(fields[0]), int(fields[1])
                except ValueError:
                    raise DataError(
                        f"{path}, line {lineno}: node ids must be non-negative integers, got {line.strip()!r}"
                    ) from None
                if u < 0 or v < 0:
                    raise DataError(f"{path}, line {lineno}: node ids must be non-negative integers, got {line.strip()!r}")
                if max(u, v) >= MAX_NODE_ID:
                    big = str(max(u, v))
                    shown = big if len(big) <= 24 else f"{big[:12]}...({len(big)} digits)"
                    raise DataError(f"{path}, line {lineno}: node id {shown} does not fit int64 (ids must be below 2**63 - 1)")
                rows.append((u, v))
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not a UTF-8 text edge list ({e.reason} at byte {e.start})") from None
    if not rows:
        raise DataError(f"{path} holds no edge (only blank or comment lines)")
    edges = torch.tensor(rows, dtype=torch.int64)
    largest = int(edges.max())
    if num_nodes is None:
        num_nodes = largest + 1
    else:
        check_positive_int("num_nodes", num_nodes)
        if largest >= num_nodes:
            raise DataError(f"{path} names node {largest}, but num_nodes = {num_nodes} allows ids up to {num_nodes - 1}")
    check_node_memory(path, num_nodes, "the largest node id + 1")
    return Graph(num_nodes, edges, name=name or os.path.basename(path))



def check_node_memory(path: str, num_nodes: int, why: str) -> None:
    """Refuse a node count that the machine cannot hold (``num_nodes`` of 10^12 with
    three edges) before anything per node is allocated; ``why`` says where it comes from."""
    from flt._limits import check_memory

    check_memory(f"{path}: {num_nodes:,} nodes ({why})", num_nodes * NODE_BYTES,
                 hint="isolated nodes count too: renumber the nodes 0..N-1")


def _pyg_safe_globals() -> list:
    """The PyG classes a pickled ``Data`` object holds, allowlisted for ``weights_only`` loading."""
    try:
        from torch_geometric.data.data import Data, DataEdgeAttr, DataTensorAttr
        from torch_geometric.data.storage import (
            BaseStorage,
            EdgeStorage,
            GlobalStorage,
            NodeStorage,
        )
    except ImportError:
        return []
    return [Data, DataEdgeAttr, DataTensorAttr, BaseStorage, EdgeStorage, GlobalStorage, NodeStorage]


def load_pyg(path: str | os.PathLike, *, name: str | None = None) -> Graph:
    """Read a graph saved with ``torch.save`` in PyTorch Geometric's layout.

    The file holds a ``torch_geometric.data.Data`` object or a plain dict (what
    ``data.to_dict()`` returns) with ``edge_index`` ``[2, E]`` integer node ids and
    optionally ``num_nodes`` and an integer node label vector ``y`` ``[N]`` (kept as
    :attr:`Graph.labels`; other fields such as ``x`` are ignored: the benchmarks are
    featureless). Loaded with ``weights_only=True``, the PyG data classes allowlisted, so
    the file cannot run code. Raises :class:`flt.data.MissingDataError` for a missing file
    and :class:`flt.data.DataError`, naming the file, for anything else it cannot use.
    """
    path = os.fspath(path)
    with open_regular(path, "PyTorch Geometric file") as fh:  # a FIFO or a directory is refused, not read
        check_file_size(path, os.fstat(fh.fileno()).st_size, "PyTorch Geometric file", bytes_per_byte=2)
    try:
        with torch.serialization.safe_globals(_pyg_safe_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (pickle raises many types; all mean "not a usable file")
        why = torch_load_error(e)
        if not str(e).strip():  # an error without a message (EOFError of an empty file): say how big the file is
            why = f"{why} (the file is {os.path.getsize(path)} bytes)"
        raise DataError(f"{path} is not a torch.save file of a PyG Data object or dict that loads with weights_only=True: "
                        f"{why}") from None
    fields = obj.to_dict() if hasattr(obj, "to_dict") and not isinstance(obj, dict) else obj
    if not isinstance(fields, dict) or "edge_index" not in fields:
        raise DataError(f"{path} holds a {type(obj).__name__} without 'edge_index'; expected a PyG Data object or a dict with edge_index [2, E]")
    ei = fields["edge_index"]
    if not isinstance(ei, torch.Tensor) or ei.ndim != 2 or ei.shape[0] != 2 or ei.is_floating_point() or ei.is_complex() \
            or ei.dtype == torch.bool:
        raise DataError(f"{path}: edge_index must be an integer tensor of shape [2, E], got {getattr(ei, 'dtype', type(ei).__name__)} "
                        f"of shape {tuple(getattr(ei, 'shape', ()))}")
    if ei.layout != torch.strided:
        raise DataError(f"{path}: edge_index must be a dense tensor [2, E], got layout {ei.layout}")
    if ei.numel() == 0:
        raise DataError(f"{path} holds no edge")
    if int(ei.min()) < 0:
        raise DataError(f"{path}: edge_index holds negative node ids")
    num_nodes = fields.get("num_nodes")
    y = fields.get("y")
    if isinstance(num_nodes, torch.Tensor) and num_nodes.ndim == 0 and num_nodes.layout == torch.strided \
            and not (num_nodes.is_floating_point() or num_nodes.is_complex() or num_nodes.dtype == torch.bool):
        num_nodes = int(num_nodes)
    if num_nodes is None:
        num_nodes = max(int(ei.max()) + 1, len(y) if isinstance(y, torch.Tensor) and y.ndim == 1 else 0)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int):
        shown = " ".join(repr(num_nodes).split())[:80]  # a tensor's repr spans lines
        raise DataError(f"{path}: num_nodes must be an integer, got {shown} ({type(num_nodes).__name__})")
    if num_nodes <= int(ei.max()):
        raise DataError(f"{path}: num_nodes = {num_nodes!r} does not cover node id {int(ei.max())} of edge_index")
    check_node_memory(path, num_nodes, "its num_nodes" if "num_nodes" in fields else "the largest node id + 1")
    labels = None
    if isinstance(y, torch.Tensor) and y.ndim == 1 and len(y) == num_nodes and y.layout == torch.strided \
            and not (y.is_floating_point() or y.is_complex() or y.dtype == torch.bool):
        labels = y
    return Graph(num_nodes, ei.T, labels=labels, name=name or os.path.basename(path))


def load_graph(path: str | os.PathLike, *, name: str | None = None) -> Graph:
    """:func:`load_pyg` for ``.pt`` / ``.pth`` files, :func:`load_edge_list` for any other."""
    if str(path).endswith((".pt", ".pth")):
        return load_pyg(path, name=name)
    return load_edge_list(path, name=name)
