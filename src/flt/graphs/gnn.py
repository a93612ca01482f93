"""Message-passing baselines (GCN, GraphSAGE, GAT, GIN through ``torch_geometric``), anchor
indication and fusion with GIR, as node encoders that read the structure at call time.

:class:`GNN` stacks ``layers`` convolutions of one kind of :data:`GNN_KINDS` with ReLU
between them:

* ``gcn``: ``GCNConv``, ``H' = A_hat H W`` with ``A_hat = D^-1/2 (A + I) D^-1/2`` (equal to
  the plain-torch :class:`flt.graphs.link.GCN` in float64, tested);
* ``sage``: ``SAGEConv`` with mean aggregation, ``H' = W_1 H + W_2 mean_{u ~ v} H_u``;
* ``gat``: ``GATConv`` with ``heads`` attention heads averaged (self-loops added);
* ``gin``: ``GINConv`` with a two-layer MLP, ``H' = MLP((1 + eps) H + sum_{u ~ v} H_u)``.

:class:`StructuralEncoder` is what the link and pair models put in front of their pair
head when the encoder is not a transformer. ``forward(num_nodes, edges, anchors)`` takes
the structure (the undirected training edges ``[E, 2]`` and the anchor ids ``[K]``) as
arguments and derives from it what its kind needs (hop distances, shortest-path DAGs,
``edge_index``, indicator channels), cached for the last structure seen, so that anchors
can be redrawn between calls (per-epoch resampling) and a model is a function of its
parameters alone. Kinds:

* ``gir``: :class:`flt.graphs.gir.GIRPathEncoder` on the constant feature;
* ``anchor-distance``: an MLP on the distance features ``1 / (1 + d(v, a_k))``;
* a :data:`GNN_KINDS` name, featureless (the constant node feature), with
  ``indication=True`` the ``K`` anchor-indicator channels appended to that feature, and
  with ``fusion=True`` the GNN embedding concatenated with a GIR embedding and mapped
  back to ``dim`` by a linear layer.
"""

from __future__ import annotations

import itertools
from types import ModuleType

import torch
from torch import nn

from flt._checks import check_choice, check_positive_int

from .anchors import anchor_distances, anchor_indicators, check_anchors, distance_features
from .gir import GIRPathEncoder, ShortestPathDAG, shortest_path_dag

#: Message-passing kinds of :class:`GNN`.
GNN_KINDS = ("gcn", "sage", "gat", "gin")
#: Kinds of :class:`StructuralEncoder`.
ENCODER_KINDS = ("gir", "anchor-distance", *GNN_KINDS)


def _import_pyg() -> ModuleType:
    try:
        import torch_geometric.nn as pyg_nn
    except ImportError as e:
        from flt._extras import install_hint

        raise ImportError(f"the GCN / GraphSAGE / GAT / GIN baselines need torch_geometric: {install_hint('graph')}") from e
    return pyg_nn


def edge_index(edges: torch.Tensor) -> torch.Tensor:
    """``[2, 2E]`` both directions of the undirected ``edges [E, 2]`` (PyG's layout)."""
    return torch.cat([edges, edges.flip(1)]).T.contiguous()


class GNN(nn.Module):
    """``layers`` convolutions of ``kind`` (:data:`GNN_KINDS`), ReLU between them:
    ``forward(x [N, F], edge_index [2, M]) -> [N, out_dim]``. A node's output depends only
    on inputs within ``layers`` hops of it."""

    def __init__(self, kind: str, in_dim: int, *, hidden: int = 32, out_dim: int = 32, layers: int = 3, heads: int = 2):
        super().__init__()
        check_choice("kind", kind, GNN_KINDS)
        for name, value in (("in_dim", in_dim), ("hidden", hidden), ("out_dim", out_dim), ("layers", layers), ("heads", heads)):
            check_positive_int(name, value)
        pyg = _import_pyg()
        self.kind = kind
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]

        def conv(a: int, b: int) -> nn.Module:
            if kind == "gcn":
                return pyg.GCNConv(a, b)
            if kind == "sage":
                return pyg.SAGEConv(a, b, aggr="mean")
            if kind == "gat":
                return pyg.GATConv(a, b, heads=heads, concat=False)
            return pyg.GINConv(nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, b)), train_eps=True)

        self.convs = nn.ModuleList(conv(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = torch.relu(x)
        return x


def _dag_to(dag: ShortestPathDAG, device: torch.device | str | None) -> ShortestPathDAG:
    levels = tuple(tuple(None if t is None else t.to(device) for t in level) for level in dag.levels)
    counts = None if dag.path_counts is None else dag.path_counts.to(device)
    return ShortestPathDAG(dag.num_nodes, dag.anchors.to(device), dag.dist.to(device), dag.anchor.to(device), dag.src.to(device),
                           dag.dst.to(device), levels, counts)


class StructuralEncoder(nn.Module):
    """Node embeddings ``[N, dim]`` from the structure given at call time (module docstring).

    Args:
        kind: :data:`ENCODER_KINDS`.
        num_anchors: ``K`` (fixes the GIR concatenation and the indicator width).
        dim: embedding size.
        hidden, layers, heads: GNN width, depth and GAT heads; ``hidden`` is also the
            hidden width of the ``anchor-distance`` MLP.
        indication, fusion: anchor-indicator channels on the GNN input; concatenation
            with GIR (GNN kinds only).
        gir_hidden, gir_steps, gir_combine, gir_aggregation, gir_norm: :class:`GIRPathEncoder`'s
            ``hidden``, ``steps`` (``None``: full reach), ``combine``, ``aggregation`` and ``norm``.
    """

    def __init__(
        self,
        kind: str,
        num_anchors: int,
        *,
        dim: int = 32,
        hidden: int = 32,
        layers: int = 3,
        heads: int = 2,
        indication: bool = False,
        fusion: bool = False,
        gir_hidden: int = 16,
        gir_steps: int | None = None,
        gir_combine: str = "concat",
        gir_aggregation: str = "mean",
        gir_norm: bool = True,
    ):
        super().__init__()
        check_choice("kind", kind, ENCODER_KINDS)
        check_positive_int("num_anchors", num_anchors)
        if (indication or fusion) and kind not in GNN_KINDS:
            raise ValueError(f"indication and fusion apply to the GNN kinds {list(GNN_KINDS)}, got kind={kind!r}")
        self.kind, self.num_anchors = kind, num_anchors
        self.indication, self.fusion = bool(indication), bool(fusion)
        self._cache: tuple | None = None
        self.gir: GIRPathEncoder | None = None
        self.gnn: GNN | None = None
        self.mlp: nn.Sequential | None = None
        self.fuse: nn.Linear | None = None
        if kind == "gir" or fusion:
            self.gir = GIRPathEncoder(1, num_anchors, hidden=gir_hidden, out_dim=dim, steps=gir_steps, combine=gir_combine,
                                      aggregation=gir_aggregation, norm=gir_norm)
        if kind == "anchor-distance":
            check_positive_int("hidden", hidden)
            self.mlp = nn.Sequential(nn.Linear(num_anchors, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        elif kind in GNN_KINDS:
            self.gnn = GNN(kind, 1 + (num_anchors if indication else 0), hidden=hidden, out_dim=dim, layers=layers, heads=heads)
            if fusion:
                self.fuse = nn.Linear(2 * dim, dim)

    def structure(self, num_nodes: int, edges: torch.Tensor, anchors: torch.Tensor, device: torch.device | str | None = None) -> dict:
        """What this kind needs of ``(edges, anchors)``, recomputed only when they change:
        ``edge_index``, ``dist`` (distance features), ``indicators``, ``dag``."""
        edges = edges.detach().to("cpu", torch.int64)
        anchors = check_anchors(anchors.detach().cpu(), num_nodes)
        if len(anchors) != self.num_anchors:
            raise ValueError(f"anchors holds {len(anchors)} nodes, but the encoder was built for num_anchors = {self.num_anchors}")
        cache = self._cache
        if cache is not None and cache[0] == num_nodes and torch.equal(cache[1], edges) and torch.equal(cache[2], anchors) and cache[3] == device:
            return cache[4]
        out: dict = {}
        dist = anchor_distances(num_nodes, edges, anchors)
        if self.gnn is not None:
            out["edge_index"] = edge_index(edges).to(device)
        if self.indication:
            out["indicators"] = anchor_indicators(num_nodes, anchors).to(device)
        if self.mlp is not None:
            out["dist"] = distance_features(dist).to(device)
        if self.gir is not None:
            out["dag"] = _dag_to(shortest_path_dag(num_nodes, edges, anchors, dist=dist), device)
        self._cache = (num_nodes, edges.clone(), anchors.clone(), device, out)
        return out

    def forward(self, num_nodes: int, edges: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        param = next(self.parameters())
        s = self.structure(num_nodes, edges, anchors, param.device)
        ones = torch.ones(num_nodes, 1, dtype=param.dtype, device=param.device)
        if self.kind == "anchor-distance":
            assert self.mlp is not None  # built for this kind
            return self.mlp(s["dist"].to(param.dtype))
        if self.kind == "gir":
            assert self.gir is not None  # built for this kind
            return self.gir(ones, s["dag"])
        assert self.gnn is not None  # the GNN kinds
        x = torch.cat([ones, s["indicators"].to(param.dtype)], dim=1) if self.indication else ones
        z = self.gnn(x, s["edge_index"])
        if self.fusion:
            assert self.fuse is not None and self.gir is not None  # built with fusion=True
            z = self.fuse(torch.cat([z, self.gir(ones, s["dag"])], dim=1))
        return z

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, num_anchors={self.num_anchors}, indication={self.indication}, fusion={self.fusion}"


def parse_kind(kind: str) -> tuple[str, dict]:
    """``"sage+indication+gir"`` -> ``("sage", {"indication": True, "fusion": True})``: a
    :data:`ENCODER_KINDS` name with the GNN modifiers ``+indication`` and ``+gir``."""
    base, *mods = kind.split("+")
    flags = {"indication": False, "fusion": False}
    for mod in mods:
        key = {"indication": "indication", "gir": "fusion"}.get(mod)
        if key is None or flags[key] or base not in GNN_KINDS:
            raise ValueError(f"kind {kind!r}: modifiers '+indication' and '+gir' (once each) follow a GNN kind {list(GNN_KINDS)}")
        flags[key] = True
    check_choice("kind", base, ENCODER_KINDS)
    return base, flags


__all__ = ["ENCODER_KINDS", "GNN", "GNN_KINDS", "StructuralEncoder", "edge_index", "parse_kind"]
