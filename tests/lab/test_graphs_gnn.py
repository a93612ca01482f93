"""GNN baselines through torch_geometric, anchor indication, GIR fusion, structural
encoders, per-epoch anchor resampling, redraws in run_link_prediction and the PyG loader."""

from __future__ import annotations

import pytest
import torch

from flt.data import DataError, MissingDataError
from flt.graphs import (
    GCN,
    GNN,
    GNN_KINDS,
    Graph,
    StructuralEncoder,
    anchor_distances,
    anchor_indicators,
    build_link_model,
    load_graph,
    load_pyg,
    run_link_prediction,
    split_links,
)
from flt.graphs.gnn import edge_index


def grid(side: int) -> Graph:
    idx = torch.arange(side * side).reshape(side, side)
    edges = torch.cat([torch.stack([idx[:, :-1].reshape(-1), idx[:, 1:].reshape(-1)], 1), torch.stack([idx[:-1].reshape(-1), idx[1:].reshape(-1)], 1)])
    return Graph(side * side, edges, name=f"grid{side}")


def test_pyg_gcn_equals_the_plain_gcn_in_float64():
    """The same weights give the same output: PyG's GCNConv normalisation is ours,
    ``D^-1/2 (A + I) D^-1/2``. Biases are zeroed: the plain GCN adds its bias before the
    propagation, GCNConv after it."""
    g = grid(5)
    torch.manual_seed(0)
    plain = GCN(g.num_nodes, g.edges, 3, hidden=8, out_dim=5, layers=3).double()
    pyg = GNN("gcn", 3, hidden=8, out_dim=5, layers=3).double()
    with torch.no_grad():
        for lin, conv in zip(plain.linears, pyg.convs):
            lin.bias.zero_()
            conv.bias.zero_()
            conv.lin.weight.copy_(lin.weight)
    x = torch.randn(g.num_nodes, 3, dtype=torch.float64)
    torch.testing.assert_close(pyg(x, edge_index(g.edges)), plain(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", GNN_KINDS)
def test_an_indicated_gnn_first_reaches_a_node_after_exactly_d_steps(kind):
    """Switching off anchor a's indicator changes a node's output iff d(v, a) <= layers."""
    g = grid(6)
    anchors = torch.tensor([7, 29])
    dist = anchor_distances(g.num_nodes, g.edges, anchors)
    x = torch.cat([torch.ones(g.num_nodes, 1), anchor_indicators(g.num_nodes, anchors)], 1).double()
    off = x.clone()
    off[anchors[0], 1] = 0.0
    for layers in (1, 2, 4):
        torch.manual_seed(layers)
        gnn = GNN(kind, 3, hidden=16, out_dim=8, layers=layers).double()
        with torch.no_grad():
            changed = (gnn(x, edge_index(g.edges)) - gnn(off, edge_index(g.edges))).abs().amax(1) > 1e-12
        assert torch.equal(changed, dist[:, 0] <= layers), (kind, layers)


@pytest.mark.parametrize("kind", ["gir", "anchor-distance", "gcn+indication", "sage+indication+gir", "gat+gir", "gin+indication"])
def test_relabelling_nodes_permutes_structural_embeddings(kind):
    from flt.graphs.gnn import parse_kind

    g = grid(5)
    anchors = torch.tensor([3, 12, 21])
    base, flags = parse_kind(kind)
    torch.manual_seed(0)
    enc = StructuralEncoder(base, 3, dim=6, hidden=8, layers=2, gir_hidden=4, **flags).double()
    perm = torch.randperm(g.num_nodes, generator=torch.Generator().manual_seed(1))  # old id v -> new id perm[v]
    with torch.no_grad():
        z = enc(g.num_nodes, g.edges, anchors)
        z_perm = enc(g.num_nodes, perm[g.edges], perm[anchors])
    torch.testing.assert_close(z_perm[perm], z, rtol=0, atol=1e-10)


def test_the_structure_is_recomputed_when_the_anchors_change():
    g = grid(5)
    torch.manual_seed(0)
    enc = StructuralEncoder("sage", 3, dim=6, indication=True, fusion=True, gir_hidden=4)
    a, b = torch.tensor([0, 12, 24]), torch.tensor([1, 13, 20])
    with torch.no_grad():
        za = enc(g.num_nodes, g.edges, a)
        zb = enc(g.num_nodes, g.edges, b)
        assert not torch.allclose(za, zb)
        assert torch.equal(enc(g.num_nodes, g.edges, a), za)
        assert not torch.allclose(enc(g.num_nodes, g.edges[1:], a), za)  # and when the edges change
    with pytest.raises(ValueError, match="num_anchors = 3"):
        enc(g.num_nodes, g.edges, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="indication and fusion apply to the GNN kinds"):
        StructuralEncoder("gir", 3, indication=True)
    with pytest.raises(ValueError, match="kind must be one of"):
        GNN("gcnn", 1)


def test_fusion_embeds_gir_and_the_gnn_together():
    """A fused featureless SAGE sees structure (through GIR) where plain SAGE sees none."""
    g = grid(5)
    anchors = torch.tensor([0, 24])
    torch.manual_seed(0)
    plain = StructuralEncoder("sage", 2, dim=4)
    fused = StructuralEncoder("sage", 2, dim=4, fusion=True, gir_hidden=4)
    with torch.no_grad():
        zp, zf = plain(g.num_nodes, g.edges, anchors), fused(g.num_nodes, g.edges, anchors)
    assert torch.allclose(zp, zp[:1].expand_as(zp), atol=1e-6)
    assert len(torch.unique(zf.round(decimals=5), dim=0)) > g.num_nodes // 2


def test_anchor_resampling_is_seeded_and_evaluates_on_the_fixed_anchors(one_thread):
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    g = grid(6)
    a = run_link_prediction(g, "anchor-distance", seed=1, steps=6, eval_every=3, num_anchors=5, resample_anchors=True)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = run_link_prediction(g, "anchor-distance", seed=1, steps=6, eval_every=3, num_anchors=5, resample_anchors=True)
    fixed = run_link_prediction(g, "anchor-distance", seed=1, steps=6, eval_every=3, num_anchors=5)
    assert a.history == b.history and a.history != fixed.history
    model = build_link_model("gir", split_links(g, seed=0), num_anchors=4, hidden=4)
    first = model.encoder.anchors
    model.encoder.resample_anchors(7)
    assert not torch.equal(model.encoder.anchors, first) and len(model.encoder.anchors) == 4
    model.encoder.fixed_anchors()
    assert torch.equal(model.encoder.anchors, first)
    with pytest.raises(ValueError, match="resample_anchors=True needs a structural model kind"):
        run_link_prediction(g, "flt", seed=0, steps=2, num_anchors=4, resample_anchors=True)


def test_run_link_prediction_redraws_flt_features_every_step(one_thread):
    g = grid(6)
    options = dict(seed=0, steps=6, eval_every=3, num_anchors=6, dim=8, heads=1, layers=1, num_features=8, num_frequencies=4)
    a = run_link_prediction(g, "flt", **options)
    b = run_link_prediction(g, "flt", **options)
    one_draw = run_link_prediction(g, "flt", redraw_features=False, **options)
    assert a.history == b.history and a.history != one_draw.history
    # Models without random features are not affected by the flag.
    c = run_link_prediction(g, "gir", seed=0, steps=4, eval_every=2, num_anchors=4, hidden=4)
    d = run_link_prediction(g, "gir", seed=0, steps=4, eval_every=2, num_anchors=4, hidden=4, redraw_features=False)
    assert c.history == d.history


def test_pyg_files_load_as_data_objects_and_dicts(tmp_path):
    from torch_geometric.data import Data

    ei = torch.tensor([[0, 1, 1, 2, 4], [1, 0, 2, 3, 3]])
    y = torch.tensor([0, 0, 1, 1, 1, 2])
    torch.save(Data(edge_index=ei, y=y, x=torch.randn(6, 3), num_nodes=6), tmp_path / "data.pt")
    torch.save({"edge_index": ei}, tmp_path / "plain.pt")
    g = load_pyg(tmp_path / "data.pt")
    assert g.num_nodes == 6 and torch.equal(g.labels, y) and g.name == "data.pt"
    assert g.edges.tolist() == [[0, 1], [1, 2], [2, 3], [3, 4]]
    h = load_graph(tmp_path / "plain.pt")
    assert h.num_nodes == 5 and h.labels is None and torch.equal(h.edges, g.edges)
    (tmp_path / "edges.txt").write_text("0 1\n1 2\n")
    assert load_graph(tmp_path / "edges.txt").num_edges == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"x": torch.ones(3)}, "without 'edge_index'"),
        ({"edge_index": torch.ones(2, 3)}, "integer tensor of shape \\[2, E\\]"),
        ({"edge_index": torch.tensor([[0, -1], [1, 2]])}, "negative node ids"),
        ({"edge_index": torch.tensor([[0, 5], [1, 2]]), "num_nodes": 3}, "does not cover node id 5"),
        ({"edge_index": torch.zeros(2, 0, dtype=torch.int64)}, "holds no edge"),
    ],
)
def test_a_bad_pyg_file_is_named(tmp_path, content, message):
    path = tmp_path / "bad.pt"
    torch.save(content, path)
    with pytest.raises(DataError, match=message) as err:
        load_pyg(path)
    assert str(path) in str(err.value)


def test_a_pyg_file_that_is_not_a_torch_file_or_missing_is_named(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_text("not a pickle")
    with pytest.raises(DataError, match="weights_only=True"):
        load_pyg(path)
    with pytest.raises(MissingDataError):
        load_pyg(tmp_path / "absent.pt")


def test_gir_states_stay_normalised_along_the_levels():
    """With the LayerNorm (default) every updated state has norm sqrt(hidden) at
    initialisation, however far the node; without it the residual updates accumulate."""
    from flt.graphs import GIRPathEncoder, shortest_path_dag

    g = grid(12)
    dag = shortest_path_dag(g.num_nodes, g.edges, torch.tensor([0]))
    x = torch.ones(g.num_nodes, 1)
    torch.manual_seed(0)
    normed, plain = GIRPathEncoder(1, 1, hidden=8), GIRPathEncoder(1, 1, hidden=8, norm=False)
    with torch.no_grad():
        far = dag.dist[:, 0] >= 15
        h = normed.anchor_states(x, dag)[0]
        torch.testing.assert_close(h[far].norm(dim=-1), torch.full((int(far.sum()),), 8**0.5), rtol=1e-3, atol=1e-3)
        near = dag.dist[:, 0] == 1
        hp = plain.anchor_states(x, dag)[0]
        assert hp[far].norm(dim=-1).mean() > 2 * hp[near].norm(dim=-1).mean()
