"""Graph data: the generated Grid and Communities sets, the edge-list loader, link splits
and the pairwise-classification sampler."""

from __future__ import annotations

import pytest
import torch

from flt.data import DataError, MissingDataError
from flt.graphs import Graph, canonical_edges, load_edge_list, sample_node_pairs, split_links


@pytest.fixture
def nx():
    return pytest.importorskip("networkx")


def edge_keys(pairs: torch.Tensor, n: int) -> set[int]:
    return set((pairs[:, 0] * n + pairs[:, 1]).tolist())


def test_grid_has_the_benchmark_size_and_neighbours(nx):
    from flt.graphs import grid_graph

    g = grid_graph(20)
    assert (g.num_nodes, g.num_edges) == (400, 760)
    keys = edge_keys(g.edges, 400)
    assert 0 * 400 + 1 in keys and 0 * 400 + 20 in keys and 0 * 400 + 21 not in keys  # right, down, not diagonal
    assert 19 * 400 + 20 not in keys  # no wrap-around from the end of row 0 to row 1
    deg = torch.bincount(g.edges.reshape(-1), minlength=400)
    assert torch.bincount(deg).tolist() == [0, 0, 4, 72, 324]  # corners, borders, interior


def test_communities_are_seeded_rewired_cliques(nx):
    from flt.graphs import communities

    a, b, c = communities(20, 20, p=0.01, seed=0), communities(20, 20, p=0.01, seed=0), communities(20, 20, p=0.01, seed=1)
    assert (a.num_nodes, a.num_edges) == (400, 20 * 190)  # rewiring keeps the edge count
    assert torch.equal(a.edges, b.edges) and not torch.equal(a.edges, c.edges)
    assert torch.equal(a.labels, torch.arange(400) // 20)
    unrewired = communities(20, 20, p=0.0, seed=0)
    assert torch.equal(unrewired.edges, canonical_edges(torch.tensor(list(nx.connected_caveman_graph(20, 20).edges())), 400))
    moved = len(edge_keys(unrewired.edges, 400) - edge_keys(a.edges, 400))
    assert 10 <= moved <= 70  # about 1% of 3800 edges
    same = a.labels[a.edges[:, 0]] == a.labels[a.edges[:, 1]]
    assert int((~same).sum()) >= 20  # the ring links plus rewired edges cross communities
    assert len(nx.node_connected_component(nx.Graph(a.edges.tolist()), 0)) == 400


def test_graph_canonicalises_and_validates_edges():
    g = Graph(4, torch.tensor([[1, 0], [0, 1], [2, 2], [3, 2]]))
    assert g.edges.tolist() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"node ids in \[0, num_nodes = 4\)"):
        Graph(4, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="labels must be an integer tensor of shape"):
        Graph(4, torch.tensor([[0, 1]]), labels=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_nodes must be a positive integer"):
        Graph(0, torch.zeros(0, 2, dtype=torch.int64))


def test_edge_list_loader_reads_comments_duplicates_and_extra_fields(tmp_path):
    path = tmp_path / "email.txt"
    path.write_text("# exported graph\n0 1\n1 0 0.5\n\n2\t3  # tab-separated\n3 3\n5 2 17 1999\n")
    g = load_edge_list(path)
    assert g.num_nodes == 6 and g.name == "email.txt"
    assert g.edges.tolist() == [[0, 1], [2, 3], [2, 5]]  # duplicate and self-loop dropped
    assert load_edge_list(path, num_nodes=10).num_nodes == 10


@pytest.mark.parametrize(
    "body, line, what",
    [
        ("0 1\n2\n", 2, "expected two node ids"),
        ("0 1\n# fine\n1 x\n", 3, "node ids must be non-negative integers, got .1 x."),
        ("0 1\n1 2.5\n", 2, "node ids must be non-negative integers"),
        ("-1 2\n", 1, "node ids must be non-negative integers"),
    ],
)
def test_edge_list_loader_names_file_and_line_of_corrupt_input(tmp_path, body, line, what):
    path = tmp_path / "bad.edges"
    path.write_text(body)
    with pytest.raises(DataError, match=rf"bad\.edges, line {line}: {what}"):
        load_edge_list(path)


def test_edge_list_loader_rejects_empty_binary_missing_and_small_num_nodes(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    with pytest.raises(DataError, match="empty.txt holds no edge"):
        load_edge_list(empty)
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"0 1\n\xff\xfe 2\n")
    with pytest.raises(DataError, match="blob.bin is not a UTF-8 text edge list"):
        load_edge_list(binary)
    with pytest.raises(MissingDataError, match="edge-list file not found"):
        load_edge_list(tmp_path / "absent.txt")
    ok = tmp_path / "ok.txt"
    ok.write_text("0 7\n")
    with pytest.raises(DataError, match="names node 7, but num_nodes = 5"):
        load_edge_list(ok, num_nodes=5)


def _ring_with_chords(n=60):
    edges = [(i, (i + 1) % n) for i in range(n)] + [(i, (i + 7) % n) for i in range(0, n, 3)]
    return Graph(n, torch.tensor(edges))


def test_link_split_sizes_disjointness_and_negatives():
    g = _ring_with_chords()
    s = split_links(g, seed=3)
    n, e = g.num_nodes, g.num_edges
    assert (len(s.valid_pos), len(s.test_pos)) == (round(0.1 * e), round(0.1 * e))
    assert len(s.train_pos) == e - 2 * round(0.1 * e)
    for pos, neg in ((s.train_pos, s.train_neg), (s.valid_pos, s.valid_neg), (s.test_pos, s.test_neg)):
        assert neg.shape == pos.shape and bool((neg[:, 0] < neg[:, 1]).all())
        assert len(edge_keys(neg, n)) == len(neg)  # no repeated negative
    true = edge_keys(g.edges, n)
    tr, va, te = edge_keys(s.train_pos, n), edge_keys(s.valid_pos, n), edge_keys(s.test_pos, n)
    assert tr | va | te == true and not (tr & va) and not (tr & te) and not (va & te)
    assert not (edge_keys(s.valid_neg, n) & true) and not (edge_keys(s.test_neg, n) & true)
    assert not (edge_keys(s.train_neg, n) & tr)
    assert not (edge_keys(s.train_neg, n) & (edge_keys(s.valid_neg, n) | edge_keys(s.test_neg, n)))
    assert not (edge_keys(s.valid_neg, n) & edge_keys(s.test_neg, n))


def test_link_split_is_a_function_of_the_seed():
    g = _ring_with_chords()
    a, b, c = split_links(g, seed=5), split_links(g, seed=5), split_links(g, seed=6)
    names = ("train_pos", "train_neg", "valid_pos", "valid_neg", "test_pos", "test_neg")
    assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in names)
    assert not torch.equal(a.test_pos, c.test_pos) and not torch.equal(a.test_neg, c.test_neg)


def test_link_split_errors_name_the_argument():
    g = _ring_with_chords()
    with pytest.raises(ValueError, match="valid_fraction must lie strictly between 0 and 1"):
        split_links(g, valid_fraction=1.5)
    with pytest.raises(ValueError, match="valid_fraction \\+ test_fraction must be < 1"):
        split_links(g, valid_fraction=0.5, test_fraction=0.5)
    dense = Graph(4, torch.tensor([[i, j] for i in range(4) for j in range(i + 1, 4)]))
    with pytest.raises(ValueError, match="cannot draw 1 negative pairs"):
        split_links(dense, valid_fraction=0.2, test_fraction=0.2)


def test_node_pairs_are_balanced_distinct_and_correctly_labelled():
    labels = torch.arange(60) // 10
    g = Graph(60, torch.tensor([[i, i + 1] for i in range(59)]), labels=labels)
    pairs, target = sample_node_pairs(g, 301, seed=2)
    assert pairs.shape == (301, 2) and int(target.sum()) == 150
    assert torch.equal(target, (labels[pairs[:, 0]] == labels[pairs[:, 1]]).float())
    assert bool((pairs[:, 0] < pairs[:, 1]).all()) and len(edge_keys(pairs, 60)) == 301
    again, _ = sample_node_pairs(g, 301, seed=2)
    other, _ = sample_node_pairs(g, 301, seed=3)
    assert torch.equal(pairs, again) and not torch.equal(pairs, other)
    with pytest.raises(ValueError, match="has no node labels"):
        sample_node_pairs(Graph(3, torch.tensor([[0, 1]])), 2)
    with pytest.raises(ValueError, match="more than the graph's distinct"):
        sample_node_pairs(g, 2000)
