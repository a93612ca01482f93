"""Graph transformers on anchor coordinates, the Laplacian baseline and pairwise node classification."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_close
from flt.graphs import (
    UNREACHABLE,
    Graph,
    GraphTransformer,
    anchor_coordinates,
    anchor_distances,
    build_link_model,
    build_pair_model,
    communities,
    distance_features,
    laplacian_eigenvectors,
    random_walk_encoding,
    run_pair_classification,
    select_anchors,
    split_links,
    split_node_pairs,
    standardize_columns,
)
from flt.layers import FLTAttention, SoftmaxAttention

F64 = torch.float64


def grid(side: int) -> Graph:
    idx = torch.arange(side * side).reshape(side, side)
    edges = torch.cat([torch.stack([idx[:, :-1].reshape(-1), idx[:, 1:].reshape(-1)], 1), torch.stack([idx[:-1].reshape(-1), idx[1:].reshape(-1)], 1)])
    return Graph(side * side, edges, name=f"grid{side}")


def graph_inputs(g: Graph, k: int, seed: int = 0):
    anchors = select_anchors(g.num_nodes, k, seed=seed)
    dist = anchor_distances(g.num_nodes, g.edges, anchors)
    return distance_features(dist, F64), anchor_coordinates(dist, F64)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_anchor_coordinates_scale_and_unreachable():
    dist = torch.tensor([[0, 3], [1, UNREACHABLE], [2, 1], [4, 0]])
    r = anchor_coordinates(dist, F64)
    expected = torch.tensor([[0, 3], [1, 5], [2, 1], [4, 0]], dtype=F64) / math.sqrt(2)  # d_max + 1 = 5
    assert torch.equal(r, expected)
    # On the (bipartite) grid neighbours differ by one hop to every anchor: |r_u - r_v| = 1.
    g = grid(5)
    _, pos = graph_inputs(g, 7)
    gap = (pos[g.edges[:, 0]] - pos[g.edges[:, 1]]).norm(dim=-1)
    assert_close(gap, torch.ones_like(gap))


@pytest.mark.parametrize("attention", ["flt", "softmax-spectrum"])
def test_fast_path_equals_its_quadratic_reference_on_graph_coordinates(attention, one_thread):
    """Float64: the linear-time FLT forward equals the same random features through the
    O(N^2) formula (flt.ops reference), layer by layer, on K-dimensional anchor coordinates."""
    torch.manual_seed(0)
    x, pos = graph_inputs(grid(6), 9)
    net = GraphTransformer(9, 9, attention=attention, dim=16, heads=2, num_features=32, num_frequencies=8, amplitude=1.5).double()
    fast = net(x, pos)
    net.mode = "reference"
    assert_close(fast, net(x, pos))


def test_flt_converges_to_the_exact_attention_on_graph_coordinates(one_thread):
    """The exact mode (softmax with the spectrum's exact f over all node pairs) is the limit
    of the fast path as the number of features and frequencies grows."""
    x, pos = graph_inputs(grid(6), 9)
    errs = []
    for m, r in [(16, 4), (256, 64), (2048, 512)]:
        torch.manual_seed(0)
        net = GraphTransformer(9, 9, dim=8, heads=1, layers=1, num_features=m, num_frequencies=r, length_scale=1.5, amplitude=1.0).double()
        fast = net(x, pos)
        net.mode = "exact"
        errs.append(rel(fast, net(x, pos)))
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[2] < 0.03, errs


def test_flt_exact_attention_is_the_softmax_spectrum_counterpart(one_thread):
    """With the same weights (and plain 1/sqrt(D) scaling) FLTAttention.exact on anchor
    coordinates is SoftmaxAttention.from_options(relative_bias='spectrum'), the softmax-spectrum kind's
    layer, whose Gaussian bias on K > 3 coordinates (a matmul) equals the offsets' formula."""
    x, pos = graph_inputs(grid(5), 6)
    h = torch.randn(1, 25, 8, dtype=F64)
    opts = dict(pos_dim=6, spectrum="gaussian", num_frequencies=8, length_scale=[1.0, 2.0, 0.5, 1.5, 1.0, 3.0], amplitude=0.8)
    flt = FLTAttention.from_options(8, 2, num_features=16, qk_norm=False, **opts).double()
    soft = SoftmaxAttention.from_options(8, 2, relative_bias="spectrum", **opts).double()
    soft.load_state_dict(flt.state_dict(), strict=False)
    p = pos.unsqueeze(0)
    offsets = soft.spectrum.of_offsets(p.unsqueeze(2) - p.unsqueeze(1)).permute(0, 3, 1, 2)
    assert_close(soft.core.positional_term(p, F64), offsets)
    assert_close(soft(h, p), flt.exact(h, p))
    assert_close(soft(h, p), soft.reference(h, p))


@pytest.mark.parametrize("kind", ["flt", "softmax-spectrum"])
def test_relabelling_nodes_permutes_the_embeddings(kind, one_thread):
    g = grid(6)
    n = g.num_nodes
    perm = torch.randperm(n)  # new id of old node v is perm[v]
    g2 = Graph(n, perm[g.edges])
    opts = dict(seed=3, num_anchors=8, num_features=16, num_frequencies=8)
    model = build_pair_model(kind, n, g.edges, **opts).double()
    model2 = build_pair_model(kind, n, g2.edges, **opts).double()
    # The same weights and draws, and the anchors relabelled with the nodes.
    anchors = select_anchors(n, 8, seed=3)
    for m, edges, a in ((model, g.edges, anchors), (model2, g2.edges, perm[anchors])):
        dist = anchor_distances(n, edges, a)
        m.encoder.x, m.encoder.pos = distance_features(dist, F64), anchor_coordinates(dist, F64)
    model2.load_state_dict(model.state_dict())
    with torch.no_grad():
        z, z2 = model.embeddings(), model2.embeddings()
    assert_close(z2[perm], z)
    assert not torch.allclose(z[0], z[1])


def test_laplacian_eigenvectors_are_nontrivial_eigenpairs():
    g = grid(5)
    values, vectors = laplacian_eigenvectors(g.num_nodes, g.edges, 6)
    adj = torch.zeros(25, 25, dtype=F64)
    adj[g.edges[:, 0], g.edges[:, 1]] = adj[g.edges[:, 1], g.edges[:, 0]] = 1
    d = adj.sum(1).rsqrt()
    lap = torch.eye(25, dtype=F64) - d[:, None] * adj * d[None, :]
    assert_close(lap @ vectors, vectors * values)
    assert_close(vectors.T @ vectors, torch.eye(6, dtype=F64))
    assert values.min() > 1e-6  # the trivial eigenvector D^1/2 1 (eigenvalue 0) is skipped
    assert_close(vectors.T @ adj.sum(1).sqrt(), torch.zeros(6, dtype=F64))


def test_random_walk_encoding_on_a_cycle_and_a_path_by_hand():
    # 6-cycle: a walk is back after 2 steps with probability 2 / 4 (left-right or right-left),
    # after 4 with C(4, 2) / 16 = 3/8, after 6 with (C(6, 3) + 2) / 64 = 22/64 (twice round).
    cycle = torch.tensor([[i, (i + 1) % 6] for i in range(6)])
    rw = random_walk_encoding(6, cycle, 6)
    assert rw.shape == (6, 6) and rw.dtype == F64
    assert_close(rw, torch.tensor([0, 1 / 2, 0, 3 / 8, 0, 22 / 64], dtype=F64).expand(6, 6))
    # Path 0-1-2 and an isolated node 3: the end nodes come back every two steps with
    # probability 1/2, the middle one surely; the isolated node has no walk.
    rw = random_walk_encoding(4, torch.tensor([[0, 1], [1, 2]]), 4)
    half = torch.tensor([0, 1 / 2, 0, 1 / 2], dtype=F64)
    assert_close(rw, torch.stack([half, torch.tensor([0, 1, 0, 1], dtype=F64), half, torch.zeros(4, dtype=F64)]))


def test_random_walk_encoding_is_the_diagonal_of_the_walk_matrix_powers_of_the_given_edges():
    g = grid(4)
    split = split_links(g, seed=0)
    rw = random_walk_encoding(16, split.train_pos, 5)
    adj = torch.zeros(16, 16, dtype=F64)
    adj[split.train_pos[:, 0], split.train_pos[:, 1]] = adj[split.train_pos[:, 1], split.train_pos[:, 0]] = 1
    deg = adj.sum(1, keepdim=True)
    walk = torch.where(deg > 0, adj / deg.clamp(min=1), 0.0)
    expected = torch.stack([torch.linalg.matrix_power(walk, t).diagonal() for t in range(1, 6)], dim=1)
    assert_close(rw, expected)
    assert not torch.allclose(rw, random_walk_encoding(16, g.edges, 5))  # the held-out edges are not in it
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        random_walk_encoding(16, g.edges, 0)


def test_standardized_columns_have_mean_zero_and_unit_spread_and_constant_columns_vanish():
    x = torch.tensor([[1.0, 5.0, 0.0], [2.0, 5.0, 4.0], [6.0, 5.0, 2.0]], dtype=F64)
    z = standardize_columns(x)
    assert_close(z.mean(0), torch.zeros(3, dtype=F64))
    assert_close(z[:, [0, 2]].pow(2).mean(0), torch.ones(2, dtype=F64))
    assert torch.equal(z[:, 1], torch.zeros(3, dtype=F64))


def test_lap_pe_flips_signs_only_in_training_and_reproducibly():
    split = split_links(grid(5), seed=0)
    enc = build_link_model("lap-pe", split, k=6).encoder.net
    base = enc.pe
    flips = [enc.features() for _ in range(4)]
    assert any(not torch.equal(f, base) for f in flips)
    for f in flips:  # each column is +-1 times its eigenvector
        signs = (f * base).sum(0) / (base * base).sum(0)
        assert_close(signs.abs(), torch.ones_like(signs), dtype=torch.float32)
    again = build_link_model("lap-pe", split, k=6).encoder.net
    assert all(torch.equal(f, again.features()) for f in flips)
    enc.eval()
    assert torch.equal(enc.features(), base)


def test_pair_split_is_deterministic_balanced_and_disjoint():
    g = communities(4, 6, p=0.0)
    train, valid, test = split_node_pairs(g, 100, seed=1)
    assert [len(s[0]) for s in (train, valid, test)] == [80, 10, 10]
    keys = torch.cat([s[0] for s in (train, valid, test)]) @ torch.tensor([100, 1])
    assert len(torch.unique(keys)) == 100
    labels = torch.cat([s[1] for s in (train, valid, test)])
    same = (g.labels[torch.cat([s[0] for s in (train, valid, test)])].diff(dim=1) == 0).squeeze(1)
    assert torch.equal(same.float(), labels) and labels.sum() == 50
    again = split_node_pairs(g, 100, seed=1)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(again, (train, valid, test)))
    assert not torch.equal(split_node_pairs(g, 100, seed=2)[0][0], train[0])
    with pytest.raises(ValueError, match="no node labels"):
        split_node_pairs(grid(4), 40)


def test_pair_classification_is_deterministic_and_position_aware(one_thread):
    """Same seed, same run; the global generator is left alone. With anchors, same-clique
    pairs are found; the featureless GCN sees every clique alike."""
    g = communities(6, 8, p=0.0)
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    a = run_pair_classification(g, "anchor-distance", seed=0, steps=60, num_pairs=300, num_anchors=12)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = run_pair_classification(g, "anchor-distance", seed=0, steps=60, num_pairs=300, num_anchors=12)
    c = run_pair_classification(g, "anchor-distance", seed=1, steps=60, num_pairs=300, num_anchors=12)
    assert a.history == b.history and a.history != c.history
    assert a.test_auc > 0.9, a
    flt = run_pair_classification(g, "flt", seed=0, steps=40, num_pairs=300, num_anchors=12, num_features=16, num_frequencies=8)
    assert flt.test_auc > 0.9, flt
    gcn = run_pair_classification(g, "gcn", seed=0, steps=40, num_pairs=300)
    assert gcn.test_auc < 0.7, gcn
    with pytest.raises(ValueError, match="graph must be one of"):
        run_pair_classification("grid", "gir")
