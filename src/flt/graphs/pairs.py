"""Pairwise node classification: do two nodes belong to the same community?

On Communities (:func:`flt.graphs.data.communities`) the label of a pair ``(u, v)`` is 1
when both nodes lie in the same clique. The task is transductive in the structure: every
edge of the graph is message-passing structure and distance source (the labels, not the
edges, are what is predicted; none of them enters a model). Pairs come from
:func:`flt.graphs.split.sample_node_pairs` (balanced, shuffled) and are cut in order into
80% training, 10% validation and 10% test pairs. Models are the link-prediction models
(:func:`flt.graphs.link.build_pair_model`): node embeddings and the symmetric pair head,
trained by :func:`flt.graphs.link.train_pair_model`.
"""

from __future__ import annotations

from typing import Any

from flt._checks import check_choice, check_positive_int

from .data import Graph
from .link import GRAPHS, LinkResult, build_pair_model, train_pair_model
from .split import sample_node_pairs

#: Graphs by name for :func:`run_pair_classification`: only those with node labels.
PAIR_GRAPHS = {"communities": GRAPHS["communities"]}


def split_node_pairs(graph: Graph, num_pairs: int, *, seed: int = 0) -> tuple[tuple, tuple, tuple]:
    """``(train, valid, test)``, each ``(pairs [M, 2], labels [M])``: ``num_pairs`` balanced
    pairs from :func:`sample_node_pairs` with ``seed``, cut 80 / 10 / 10 in their (random) order."""
    check_positive_int("num_pairs", num_pairs)
    if num_pairs < 20:
        raise ValueError(f"num_pairs must be at least 20 for an 80/10/10 split with both classes, got {num_pairs}")
    pairs, target = sample_node_pairs(graph, num_pairs, seed=seed)
    n_valid = n_test = num_pairs // 10
    n_train = num_pairs - n_valid - n_test
    cut = lambda a, b: (pairs[a:b], target[a:b])  # noqa: E731
    return cut(0, n_train), cut(n_train, n_train + n_valid), cut(n_train + n_valid, num_pairs)


def run_pair_classification(
    graph: Graph | str = "communities",
    model_kind: str = "anchor-distance",
    seed: int = 0,
    steps: int = 200,
    *,
    num_pairs: int = 2000,
    lr: float = 0.01,
    eval_every: int = 10,
    resample_anchors: bool = False,
    redraw_features: bool = True,
    **model_options: Any,
) -> LinkResult:
    """Sample ``num_pairs`` labelled pairs of ``graph`` with ``seed``, build a
    ``model_kind`` model (:data:`flt.graphs.MODEL_KINDS`) on all of the graph's edges with
    ``seed`` and train it for ``steps`` steps; ``result.test_auc`` is the test ROC AUC at
    the best validation step.

    ``graph`` is a :class:`Graph` with ``labels`` or ``"communities"`` (generated from
    ``seed``, as in :func:`flt.graphs.run_link_prediction`).
    """
    if isinstance(graph, str):
        check_choice("graph", graph, PAIR_GRAPHS)
        graph = PAIR_GRAPHS[graph](seed)
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a flt.graphs.Graph or a name, got {type(graph).__name__}")
    train, valid, test = split_node_pairs(graph, num_pairs, seed=seed)
    model = build_pair_model(model_kind, graph.num_nodes, graph.edges, seed=seed, **model_options)
    return train_pair_model(model, train, valid, test, steps=steps, lr=lr, eval_every=eval_every, seed=seed,
                            resample_anchors=resample_anchors, redraw_features=redraw_features)
