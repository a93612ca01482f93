"""The shortest-path-distance bias (``RELATIVE["spd"]``) on graph positions: hop-distance
vectors to anchors or the rows of the distance matrix."""

from __future__ import annotations

import math

import networkx as nx
import pytest
import torch

from conftest import assert_close
from flt.graphs import anchor_coordinates, anchor_distances, select_anchors
from flt.layers import SoftmaxAttention
from flt.relative import RELATIVE, build_relative
from flt.relative.shortest_path import UNREACHABLE_HOPS, ShortestPathBias, hop_positions
from flt.tasks import get_preset, load_task

F64 = torch.float64


def _numbered_table(term: ShortestPathBias) -> None:
    """Row ``r`` of head ``h`` holds ``10 h + r`` (scale 1), so a bias value names its row."""
    rows, heads = term.table.shape
    with torch.no_grad():
        term.table.copy_(torch.arange(rows, dtype=F64)[:, None] + 10 * torch.arange(heads, dtype=F64)[None, :])
        term.scale.fill_(1.0)


def test_spd_is_registered_with_the_relative_interface():
    assert RELATIVE["spd"] is ShortestPathBias
    term = build_relative("spd", heads=2, pos_dim=3, max_distance=4, dtype=F64)
    assert term.table.shape == (6, 2) and not term.linear
    with pytest.raises(ValueError, match="P = 3, got P = 2"):
        term.bias(torch.zeros(1, 4, 2, dtype=F64))


def test_on_distance_matrix_rows_the_bias_is_the_table_at_the_shortest_path_distance():
    # A path 0-1-2-3-4 and a separate edge 5-6. Distances by hand: |i - j| on the path,
    # 1 between 5 and 6, no path between the two parts.
    edges = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4], [5, 6]])
    n = 7
    dist = anchor_distances(n, edges, torch.arange(n))  # [N, N]: every node a reference
    pos = hop_positions(dist, dtype=F64)
    term = ShortestPathBias(2, pos_dim=n, max_distance=3, dtype=F64)
    _numbered_table(term)
    bias = term.bias(pos)[0]  # [H, N, N]
    expected = torch.empty(n, n, dtype=F64)
    for i in range(n):
        for j in range(n):
            if i < 5 and j < 5:
                expected[i, j] = min(abs(i - j), 3)  # d(0, 4) = 4 is clipped to row 3
            elif i >= 5 and j >= 5:
                expected[i, j] = abs(i - j)
            else:
                expected[i, j] = 4  # the unreachable row, max_distance + 1
    assert_close(bias[0], expected)
    assert_close(bias[1], expected + 10)


def test_from_anchors_the_estimate_is_a_lower_bound_exact_at_the_anchors():
    # On the 6-cycle with anchor 0 (distances 0 1 2 3 2 1) nodes 1 and 5 look alike: the
    # estimate of d(1, 5) = 2 is |1 - 1| = 0.
    cycle = torch.tensor([[i, (i + 1) % 6] for i in range(6)])
    term = ShortestPathBias(1, pos_dim=1, dtype=F64)
    pos = hop_positions(anchor_distances(6, cycle, torch.tensor([0])), dtype=F64)
    assert term.hops(pos)[0, 1, 5] == 0 and term.hops(pos)[0, 0, 3] == 3

    g = nx.grid_2d_graph(6, 6)
    g.remove_edges_from([((0, 0), (0, 1)), ((2, 3), (3, 3)), ((4, 4), (4, 5))])
    g = nx.convert_node_labels_to_integers(g)
    edges = torch.tensor(list(g.edges))
    anchors = select_anchors(36, 5, seed=1)
    # The task's anchor coordinates, d / sqrt(K): the unit must round back to whole hops.
    pos = anchor_coordinates(anchor_distances(36, edges, anchors), dtype=torch.float32)
    term = ShortestPathBias(1, pos_dim=5, unit=1 / math.sqrt(5), dtype=F64)
    hops = term.hops(pos)[0]
    est = torch.round(hops)
    assert torch.allclose(hops, est, atol=1e-5)
    true = torch.tensor([[nx.shortest_path_length(g, u, v) for v in range(36)] for u in range(36)], dtype=F64)
    assert bool((est <= true).all())
    assert torch.equal(est[anchors], true[anchors]) and torch.equal(est[:, anchors], true[:, anchors])
    assert bool((est < true).any())  # a real bound, not the distance itself


def test_nodes_an_anchor_set_in_one_component_cannot_reach_take_the_unreachable_row():
    edges = torch.tensor([[0, 1], [1, 2], [3, 4]])
    pos = hop_positions(anchor_distances(5, edges, torch.tensor([0, 2])), dtype=F64)  # 3 and 4 reach no anchor
    term = ShortestPathBias(1, pos_dim=2, max_distance=2, dtype=F64)
    _numbered_table(term)
    assert term.hops(pos)[0, 1, 3] >= UNREACHABLE_HOPS
    assert_close(term.bias(pos)[0, 0], torch.tensor([[0, 1, 2, 3, 3], [1, 0, 1, 3, 3], [2, 1, 0, 3, 3], [3, 3, 3, 0, 0], [3, 3, 3, 0, 0]], dtype=F64))


def test_gradient_reaches_the_rows_in_use_and_the_scale_through_softmax_attention():
    torch.manual_seed(0)
    edges = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4]])
    pos = hop_positions(anchor_distances(5, edges, torch.tensor([0, 4])), dtype=F64).unsqueeze(0)
    layer = SoftmaxAttention.from_options(8, 2, pos_dim=2, relative_bias="spd", relative_options={"max_distance": 6}, backend="reference").double()
    with torch.no_grad():
        layer.relative.table.normal_()
    x = torch.randn(1, 5, 8, dtype=F64)
    layer(x, pos).square().sum().backward()
    grad = layer.relative.table.grad
    used = torch.zeros(8, dtype=torch.bool)
    used[:5] = True  # hop counts 0 .. 4 on the path; rows 5, 6 (and unreachable, 7) unused
    assert bool((grad[used].abs().sum(1) > 0).all()) and bool((grad[~used] == 0).all())
    assert bool((layer.relative.scale.grad.abs() > 0).all())


def test_hop_positions_name_bad_distances():
    with pytest.raises(ValueError, match="dist must be an integer"):
        hop_positions(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="below UNREACHABLE_HOPS"):
        hop_positions(torch.full((2, 2), UNREACHABLE_HOPS))


def test_the_graph_task_gives_spd_the_hop_length_and_drops_the_spectrum_defaults():
    task = load_task("graph", {"num_anchors": 16})
    preset = get_preset("graph", "smoke", "softmax")
    options = {**preset.model.attention_options, "relative_bias": "spd"}
    cfg = task.configure(type(preset.model)(**{**preset.model.__dict__, "attention_options": options}))
    assert cfg.attention_options == {"relative_bias": "spd", "relative_options": {"unit": 0.25}}
    model = task.build_model(cfg).double()
    term = model.encoder.blocks[0].attention.relative
    dist = anchor_distances(task.num_nodes, task.edges, task.anchors)
    dist = torch.where(dist < 0, dist.max() + 1, dist)  # anchor_coordinates puts unreachable anchors at d_max + 1
    hops = term.hops(task.pos.double())[0]
    assert torch.equal(torch.round(hops), (dist[:, None, :] - dist[None, :, :]).abs().amax(-1).to(F64))
    rwse = load_task("graph", {"num_anchors": 16, "positions": "rwse"})
    with pytest.raises(ValueError, match="relative_bias='spd' reads hop distances"):
        rwse.configure(type(preset.model)(**{**preset.model.__dict__, "attention_options": options}))
