"""Graphs as position spaces: anchor distances, anchor indication and GIR path encodings.

Nothing is generated or read at import time; the generators need ``networkx``
(``pip install "flt-attention[graph]"``). See ``docs/graphs.md`` for the design and measured numbers.

* :mod:`~flt.graphs.data`: :class:`Graph`, :func:`grid_graph`, :func:`communities`,
  :func:`load_edge_list`, :func:`load_pyg` (PyTorch Geometric files), :func:`load_graph`.
* :mod:`~flt.graphs.split`: :func:`split_links` (80/10/10 with fixed negatives),
  :func:`sample_node_pairs` (same community or not).
* :mod:`~flt.graphs.anchors`: :func:`select_anchors`, :func:`anchor_distances` (BFS),
  :func:`anchor_indicators`.
* :mod:`~flt.graphs.gir`: shortest-path DAGs, :func:`dag_propagate`,
  :class:`GIRPathEncoder`.
* :mod:`~flt.graphs.gnn`: :class:`GNN` (GCN / GraphSAGE / GAT / GIN through
  ``torch_geometric``), :class:`StructuralEncoder` (GIR, anchor distances, GNNs with anchor
  indication and GIR fusion, reading the structure at call time).
* :mod:`~flt.graphs.link`: link-prediction models, :func:`roc_auc`,
  :func:`run_link_prediction`, :class:`LinkTransformer` (the model of ``flt train graph``).
* :mod:`~flt.graphs.transformer`: :func:`anchor_coordinates`, :class:`NodeTransformer`
  (any attention over nodes at anchor coordinates), :class:`GraphTransformer` (its FLT and
  exact softmax kinds), :class:`LaplacianPE`, :func:`laplacian_eigenvectors` and
  :func:`random_walk_encoding` (positional baselines).
* :mod:`~flt.graphs.pairs`: :func:`run_pair_classification` (same community or not).
"""

from .anchors import (
    UNREACHABLE,
    anchor_distances,
    anchor_indicators,
    degrees,
    distance_features,
    indicate,
    select_anchors,
)
from .data import (
    Graph,
    canonical_edges,
    communities,
    grid_graph,
    load_edge_list,
    load_graph,
    load_pyg,
)
from .gir import (
    GIRPathEncoder,
    ShortestPathDAG,
    count_shortest_paths,
    dag_propagate,
    shortest_path_dag,
)
from .gnn import GNN, GNN_KINDS, StructuralEncoder
from .link import (
    GCN,
    MODEL_KINDS,
    LinkModel,
    LinkResult,
    LinkTransformer,
    PairHead,
    build_link_model,
    build_pair_model,
    generated_split,
    roc_auc,
    run_link_prediction,
    train_link_model,
    train_pair_model,
)
from .pairs import run_pair_classification, split_node_pairs
from .split import LinkSplit, sample_node_pairs, split_links
from .transformer import (
    GraphTransformer,
    LaplacianPE,
    NodeTransformer,
    anchor_coordinates,
    anchor_inputs,
    laplacian_eigenvectors,
    random_walk_encoding,
    standardize_columns,
)

__all__ = [
    "GCN",
    "GNN",
    "GNN_KINDS",
    "MODEL_KINDS",
    "UNREACHABLE",
    "GIRPathEncoder",
    "Graph",
    "GraphTransformer",
    "LaplacianPE",
    "LinkModel",
    "LinkResult",
    "LinkSplit",
    "LinkTransformer",
    "NodeTransformer",
    "PairHead",
    "ShortestPathDAG",
    "StructuralEncoder",
    "anchor_coordinates",
    "anchor_distances",
    "anchor_indicators",
    "anchor_inputs",
    "build_link_model",
    "build_pair_model",
    "canonical_edges",
    "communities",
    "count_shortest_paths",
    "dag_propagate",
    "degrees",
    "distance_features",
    "generated_split",
    "grid_graph",
    "indicate",
    "laplacian_eigenvectors",
    "load_edge_list",
    "load_graph",
    "load_pyg",
    "random_walk_encoding",
    "roc_auc",
    "run_link_prediction",
    "run_pair_classification",
    "sample_node_pairs",
    "select_anchors",
    "shortest_path_dag",
    "split_links",
    "split_node_pairs",
    "standardize_columns",
    "train_link_model",
    "train_pair_model",
]
