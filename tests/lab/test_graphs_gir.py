"""Anchors, BFS distances, anchor indication and GIR path encodings on shortest-path DAGs."""

from __future__ import annotations

import pytest
import torch

from flt.graphs import (
    GCN,
    UNREACHABLE,
    GIRPathEncoder,
    Graph,
    anchor_distances,
    anchor_indicators,
    count_shortest_paths,
    indicate,
    select_anchors,
    shortest_path_dag,
)


@pytest.fixture
def nx():
    return pytest.importorskip("networkx")


def small_graphs(nx):
    """Small graphs with many ties among shortest paths, plus a disconnected one."""
    out = []
    g = nx.grid_2d_graph(4, 5)
    g = nx.convert_node_labels_to_integers(g, ordering="sorted")
    out.append(g)
    out.append(nx.connected_caveman_graph(3, 4))
    out.append(nx.gnp_random_graph(18, 0.2, seed=4))
    out.append(nx.hypercube_graph(4))
    two = nx.disjoint_union(nx.cycle_graph(6), nx.path_graph(4))  # nodes 6..9 unreachable from 0..5
    out.append(two)
    return [nx.convert_node_labels_to_integers(h) for h in out]


def as_graph(h) -> Graph:
    return Graph(h.number_of_nodes(), torch.tensor(list(h.edges()), dtype=torch.int64).reshape(-1, 2))


def test_bfs_distances_match_networkx(nx):
    for h in small_graphs(nx):
        g = as_graph(h)
        anchors = torch.tensor([0, g.num_nodes - 1, g.num_nodes // 2])
        dist = anchor_distances(g.num_nodes, g.edges, anchors)
        assert dist.shape == (g.num_nodes, 3) and dist.dtype == torch.int64
        for k, a in enumerate(anchors.tolist()):
            lengths = nx.single_source_shortest_path_length(h, a)
            expected = [lengths.get(v, UNREACHABLE) for v in range(g.num_nodes)]
            assert dist[:, k].tolist() == expected


def test_sum_propagation_on_the_dag_counts_shortest_paths(nx):
    for h in small_graphs(nx):
        g = as_graph(h)
        anchors = torch.arange(g.num_nodes)  # every node is an anchor once
        counts = count_shortest_paths(g.num_nodes, g.edges, anchors)
        expected = torch.zeros(g.num_nodes, g.num_nodes, dtype=torch.float64)
        for a in range(g.num_nodes):
            for v in nx.node_connected_component(h, a):
                expected[v, a] = sum(1 for _ in nx.all_shortest_paths(h, a, v))
        assert torch.equal(counts, expected), h
        assert expected.max() >= 2  # the graphs do have ties for the identity to check
    # On a grid the count is a binomial coefficient: C(dx + dy, dx).
    g = as_graph(nx.convert_node_labels_to_integers(nx.grid_2d_graph(6, 6), ordering="sorted"))
    assert count_shortest_paths(36, g.edges, torch.tensor([0]))[35, 0] == 252  # C(10, 5)


def test_truncated_propagation_reaches_exactly_t_hops(nx):
    h = nx.convert_node_labels_to_integers(nx.grid_2d_graph(5, 5), ordering="sorted")
    g = as_graph(h)
    anchors = torch.tensor([0, 12])
    full = count_shortest_paths(25, g.edges, anchors)
    dist = anchor_distances(25, g.edges, anchors)
    for t in (1, 2, 3):
        truncated = count_shortest_paths(25, g.edges, anchors, steps=t)
        assert torch.equal(truncated, torch.where(dist <= t, full, torch.zeros(()).double()))


def test_dag_edges_go_one_level_down_and_cover_every_shortest_path_step(nx):
    h = nx.gnp_random_graph(20, 0.15, seed=1)
    g = as_graph(h)
    dag = shortest_path_dag(20, g.edges, torch.tensor([3, 7]))
    d = dag.dist
    assert bool((d[dag.dst, dag.anchor] == d[dag.src, dag.anchor] + 1).all())
    for k, a in enumerate([3, 7]):
        steps = {(p[i], p[i + 1]) for v in nx.node_connected_component(h, a) for p in nx.all_shortest_paths(h, a, v) for i in range(len(p) - 1)}
        mine = {(u, v) for kk, u, v in zip(dag.anchor.tolist(), dag.src.tolist(), dag.dst.tolist()) if kk == k}
        assert mine == steps


def test_select_anchors_is_seeded_distinct_and_stratified():
    a, b, c = select_anchors(40, 8, seed=1), select_anchors(40, 8, seed=1), select_anchors(40, 8, seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c) and len(set(a.tolist())) == 8
    # Five groups of six nodes with degrees 5 (K6), 3 (prism), 2 (C6), 1 (a matching), 0:
    # five equal strata are exactly the five groups, so every draw takes one of each.
    edges = [(i, j) for i in range(6) for j in range(i + 1, 6)]
    edges += [(6, 7), (7, 8), (8, 6), (9, 10), (10, 11), (11, 9), (6, 9), (7, 10), (8, 11)]
    edges += [(12 + i, 12 + (i + 1) % 6) for i in range(6)]
    edges += [(18, 19), (20, 21), (22, 23)]
    edges = torch.tensor(edges)
    deg = torch.bincount(edges.reshape(-1), minlength=30)
    assert sorted(deg.tolist()) == sorted([5] * 6 + [3] * 6 + [2] * 6 + [1] * 6 + [0] * 6)
    drawn = set()
    for seed in range(6):
        s = select_anchors(30, 5, seed=seed, edges=edges, stratified=True)
        assert sorted(deg[s].tolist()) == [0, 1, 2, 3, 5]
        drawn |= set(s.tolist())
    assert len(drawn) > 10  # within a stratum the choice is random
    with pytest.raises(ValueError, match="k = 41 anchors cannot be distinct"):
        select_anchors(40, 41)
    with pytest.raises(ValueError, match="stratified=True needs edges"):
        select_anchors(40, 3, stratified=True)


def test_anchor_indicators_and_errors():
    ind = anchor_indicators(5, torch.tensor([3, 1]))
    assert ind.tolist() == [[0, 0], [0, 1], [0, 0], [1, 0], [0, 0]]
    assert indicate(torch.ones(5, 1), torch.tensor([3, 1])).shape == (5, 3)
    with pytest.raises(ValueError, match="anchors must be distinct"):
        anchor_indicators(5, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"anchors must lie in \[0, num_nodes = 5\)"):
        anchor_indicators(5, torch.tensor([5]))


@pytest.mark.parametrize("layers", [1, 2, 3, 4])
def test_indicated_mpnn_first_reaches_a_node_after_exactly_d_steps(nx, layers, one_thread):
    """With the indicator of anchor a on, a node's GCN output changes iff d(v, a) <= layers."""
    h = nx.convert_node_labels_to_integers(nx.grid_2d_graph(6, 6), ordering="sorted")
    g = as_graph(h)
    anchors = torch.tensor([14, 0])
    dist = anchor_distances(36, g.edges, anchors)
    torch.manual_seed(layers)
    gcn = GCN(36, g.edges, 3, hidden=16, out_dim=8, layers=layers).double()
    x = indicate(torch.ones(36, 1, dtype=torch.float64), anchors)
    for k in range(2):
        off = x.clone()
        off[:, 1 + k] = 0.0  # anchor k not indicated
        with torch.no_grad():
            changed = (gcn(x) != gcn(off)).any(dim=1)
        assert torch.equal(changed, dist[:, k] <= layers), (k, layers)


def _permuted(g: Graph, perm: torch.Tensor) -> Graph:
    return Graph(g.num_nodes, perm[g.edges])


@pytest.mark.parametrize("combine", ["concat", "mean", "sum"])
def test_relabelling_nodes_permutes_gir_embeddings(nx, combine):
    h = nx.connected_caveman_graph(4, 5)
    h.add_edge(0, 12)
    g = as_graph(h)
    anchors = torch.tensor([2, 17, 9])
    perm = torch.randperm(g.num_nodes, generator=torch.Generator().manual_seed(3))
    pg = _permuted(g, perm)
    torch.manual_seed(0)
    enc = GIRPathEncoder(1, 3, hidden=8, out_dim=6, combine=combine).double()
    x = torch.ones(g.num_nodes, 1, dtype=torch.float64)
    z = enc(x, shortest_path_dag(g.num_nodes, g.edges, anchors))
    pz = enc(x, shortest_path_dag(g.num_nodes, pg.edges, perm[anchors]))
    torch.testing.assert_close(pz[perm], z, rtol=1e-12, atol=1e-12)
    assert z.std(0).min() > 1e-6  # the embeddings do tell nodes apart
    if combine != "concat":  # pooling over anchors ignores their order
        rz = enc(x, shortest_path_dag(g.num_nodes, g.edges, anchors.flip(0)))
        torch.testing.assert_close(rz, z, rtol=1e-12, atol=1e-12)


def test_gir_states_beyond_t_hops_know_nothing_of_the_anchor(nx):
    h = nx.convert_node_labels_to_integers(nx.grid_2d_graph(6, 6), ordering="sorted")
    g = as_graph(h)
    anchors = torch.tensor([0, 21])
    dag = shortest_path_dag(36, g.edges, anchors)
    torch.manual_seed(0)
    for steps in (2, 4):
        enc = GIRPathEncoder(1, 2, hidden=8, steps=steps).double()
        x = torch.ones(36, 1, dtype=torch.float64)
        states = enc.anchor_states(x, dag)  # [K, N, H]
        far = (enc.s_far + enc.input(x)).detach()
        for k in range(2):
            beyond = dag.dist[:, k] > steps
            assert bool(beyond.any()) and bool((~beyond).sum() > 1)
            torch.testing.assert_close(states[k][beyond], far[beyond])
            near = states[k][~beyond]
            assert (near - far[~beyond]).abs().amax(1).min() > 1e-8  # reached nodes are updated
