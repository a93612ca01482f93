"""Link-prediction splits and the pairwise node-classification sampler.

Node pairs are ``[M, 2]`` int64 with ``u < v``. Every draw comes from
``numpy.random.default_rng(seed)``, so a split is a function of the graph and the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flt._checks import check_choice, check_positive_int

from .data import Graph


@dataclass(frozen=True, eq=False)
class LinkSplit:
    """Positive and negative node pairs for link prediction on ``graph``.

    ``train_pos`` are the only edges a model may use as structure (message passing,
    anchor distances, degrees); ``valid_pos`` and ``test_pos`` are held out. Each
    ``*_neg`` has as many pairs as the matching ``*_pos``. Validation and test negatives
    avoid every edge of the graph; training negatives avoid the training edges and the
    validation and test negatives (they cannot avoid held-out edges without revealing
    them). All negatives are drawn once, when the split is made.
    """

    graph: Graph
    train_pos: torch.Tensor
    train_neg: torch.Tensor
    valid_pos: torch.Tensor
    valid_neg: torch.Tensor
    test_pos: torch.Tensor
    test_neg: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.graph.num_nodes

    def labelled(self, part: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pairs [M, 2], labels [M])`` of ``part`` (``"train"``, ``"valid"`` or ``"test"``):
        its positives (label 1) followed by its negatives (label 0), float32 labels."""
        check_choice("part", part, ("train", "valid", "test"))
        pos, neg = getattr(self, f"{part}_pos"), getattr(self, f"{part}_neg")
        return torch.cat([pos, neg]), torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))])

    @property
    def train(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``labelled("train")``."""
        return self.labelled("train")

    @property
    def valid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``labelled("valid")``."""
        return self.labelled("valid")

    @property
    def test(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``labelled("test")``."""
        return self.labelled("test")


def _pair_keys(pairs: np.ndarray, n: int) -> np.ndarray:
    return pairs[:, 0].astype(np.int64) * n + pairs[:, 1]


def _sample_non_edges(n: int, count: int, forbidden: set[int], rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct pairs ``u < v`` whose keys ``u * n + v`` are not in ``forbidden``."""
    available = n * (n - 1) // 2 - len(forbidden)
    if count > available:
        raise ValueError(f"cannot draw {count} negative pairs: the graph has only {available} node pairs left")
    chosen: list[int] = []
    seen = set(forbidden)
    while len(chosen) < count:
        need = count - len(chosen)
        u = rng.integers(0, n, size=2 * need + 16)
        v = rng.integers(0, n, size=2 * need + 16)
        for a, b in zip(u.tolist(), v.tolist(), strict=True):
            if a == b:
                continue
            key = min(a, b) * n + max(a, b)
            if key in seen:
                continue
            seen.add(key)
            chosen.append(key)
            if len(chosen) == count:
                break
    keys = np.asarray(chosen, dtype=np.int64)
    return np.stack([keys // n, keys % n], axis=1)


def split_links(graph: Graph, *, seed: int = 0, valid_fraction: float = 0.1, test_fraction: float = 0.1) -> LinkSplit:
    """Split ``graph``'s edges into train / validation / test and draw matching negatives.

    The edges are permuted by the seeded generator; the first ``round(E * valid_fraction)``
    become validation edges, the next ``round(E * test_fraction)`` test edges and the rest
    (80% with the defaults) training edges. Negatives are drawn in the order test,
    validation, training, each set disjoint from the ones before (see :class:`LinkSplit`).
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a flt.graphs.Graph, got {type(graph).__name__}")
    for name, frac in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac < 1.0:
            raise ValueError(f"{name} must lie strictly between 0 and 1, got {frac!r}")
    if valid_fraction + test_fraction >= 1.0:
        raise ValueError(
            f"valid_fraction + test_fraction must be < 1 to leave training edges, got {valid_fraction} + {test_fraction}"
        )
    e = graph.num_edges
    n_valid, n_test = int(round(e * valid_fraction)), int(round(e * test_fraction))
    if min(n_valid, n_test, e - n_valid - n_test) < 1:
        raise ValueError(f"graph {graph.name!r} has {e} edges: too few for a train / validation / test split")
    rng = np.random.default_rng(seed)
    edges = graph.edges.numpy()
    perm = rng.permutation(e)
    valid = edges[np.sort(perm[:n_valid])]
    test = edges[np.sort(perm[n_valid : n_valid + n_test])]
    train = edges[np.sort(perm[n_valid + n_test :])]
    n = graph.num_nodes
    all_keys = set(_pair_keys(edges, n).tolist())
    test_neg = _sample_non_edges(n, len(test), all_keys, rng)
    valid_neg = _sample_non_edges(n, len(valid), all_keys | set(_pair_keys(test_neg, n).tolist()), rng)
    held_out_neg = set(_pair_keys(test_neg, n).tolist()) | set(_pair_keys(valid_neg, n).tolist())
    train_neg = _sample_non_edges(n, len(train), set(_pair_keys(train, n).tolist()) | held_out_neg, rng)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    return LinkSplit(graph, t(train), t(train_neg), t(valid), t(valid_neg), t(test), t(test_neg))


def sample_node_pairs(graph: Graph, count: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Balanced pairs for pairwise node classification: same label or not.

    Returns ``pairs [count, 2]`` (distinct pairs, ``u < v``, in random order) and
    ``target [count]`` float32, 1 where both nodes have the same label; the first
    ``count // 2`` draws are same-label pairs and the rest different-label pairs, then the
    two are shuffled together. Needs ``graph.labels`` (Communities has them).
    """
    if graph.labels is None:
        raise ValueError(f"graph {graph.name!r} has no node labels: pairwise classification needs labels")
    check_positive_int("count", count)
    labels = graph.labels.numpy()
    n = graph.num_nodes
    groups = {int(c): np.flatnonzero(labels == c) for c in np.unique(labels)}
    n_same_pairs = sum(len(g) * (len(g) - 1) // 2 for g in groups.values())
    n_same, n_diff = count // 2, count - count // 2
    if n_same > n_same_pairs or n_diff > n * (n - 1) // 2 - n_same_pairs:
        raise ValueError(f"count = {count} is more than the graph's distinct same-label / different-label pairs allow")
    rng = np.random.default_rng(seed)
    seen: set[int] = set()
    out: list[tuple[int, int, float]] = []
    while len(out) < n_same:
        u = int(rng.integers(n))
        group = groups[int(labels[u])]
        v = int(group[rng.integers(len(group))])
        key = min(u, v) * n + max(u, v)
        if u != v and key not in seen:
            seen.add(key)
            out.append((min(u, v), max(u, v), 1.0))
    while len(out) < count:
        u, v = int(rng.integers(n)), int(rng.integers(n))
        key = min(u, v) * n + max(u, v)
        if labels[u] != labels[v] and key not in seen:
            seen.add(key)
            out.append((min(u, v), max(u, v), 0.0))
    order = rng.permutation(count)
    pairs = torch.tensor([out[i][:2] for i in order], dtype=torch.int64)
    target = torch.tensor([out[i][2] for i in order], dtype=torch.float32)
    return pairs, target
