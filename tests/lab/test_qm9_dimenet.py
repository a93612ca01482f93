"""DimeNet++ on plain-torch graphs: the triplets and the radius graph against brute force,
and PyG's model through them (finite gradients, invariances, PyG's names restored)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_geometric")

from torch_geometric.nn.models import dimenet

import flt.baselines.dimenet
from flt.baselines.atom_graphs import triplets
from flt.baselines.dimenet import PlainDimeNetPlusPlus, _radius_edges
from flt.baselines.qm9 import CUTOFFS, QM9Config, QM9Regressor
from flt.tasks.qm9 import QM9Task

pytestmark = pytest.mark.usefixtures("one_thread")


def _brute_force_triplets(edge_index: torch.Tensor) -> set[tuple[int, int, int, int, int]]:
    """Every ``(k, j, i, kj, ji)``: edge ``kj`` is ``k -> j``, edge ``ji`` is ``j -> i``, ``k != i``."""
    edges = edge_index.t().tolist()
    return {(k, j, i, kj, ji) for ji, (j, i) in enumerate(edges) for kj, (k, j2) in enumerate(edges)
            if j2 == j and k != i}


def _random_directed_graph(num_nodes: int, num_edges: int, seed: int) -> torch.Tensor:
    """Distinct directed edges without self-loops, unsorted, some atoms without edges."""
    g = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, num_nodes, (2, 3 * num_edges), generator=g)
    pairs = pairs[:, pairs[0] != pairs[1]].unique(dim=1)
    return pairs[:, torch.randperm(pairs.shape[1], generator=g)[:num_edges]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_triplets_are_every_two_hop_path_without_going_back(seed):
    edge_index = _random_directed_graph(num_nodes=9, num_edges=30, seed=seed)
    i, j, idx_i, idx_j, idx_k, idx_kj, idx_ji = triplets(edge_index, num_nodes=11)  # atoms 9, 10 have no edges
    assert torch.equal(i, edge_index[1]) and torch.equal(j, edge_index[0])
    got = list(zip(idx_k.tolist(), idx_j.tolist(), idx_i.tolist(), idx_kj.tolist(), idx_ji.tolist(), strict=True))
    expected = _brute_force_triplets(edge_index)
    assert len(got) == len(set(got)) == len(expected) > 0 and set(got) == expected
    # The atoms agree with the edges they came from.
    assert torch.equal(idx_k, edge_index[0, idx_kj]) and torch.equal(idx_j, edge_index[1, idx_kj])
    assert torch.equal(idx_j, edge_index[0, idx_ji]) and torch.equal(idx_i, edge_index[1, idx_ji])


def test_triplets_of_a_graph_without_edges_are_empty():
    out = triplets(torch.zeros(2, 0, dtype=torch.long), num_nodes=3)
    assert len(out) == 7 and all(t.numel() == 0 and t.dtype == torch.long for t in out)


def test_the_radius_edges_pyg_asks_for_are_the_brute_force_pairs_and_refuse_a_cap_they_would_cut():
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(10, 3, generator=g, dtype=torch.float64) * 2
    edges = _radius_edges(pos, r=3.0)  # batch None: one molecule, as PyG's default
    expected = {(a, b) for a in range(10) for b in range(10) if a != b and float((pos[a] - pos[b]).norm()) < 3.0}
    assert set(map(tuple, edges.t().tolist())) == expected and edges.shape[1] == len(expected) > 0
    cluster = torch.randn(40, 3, generator=g)  # 40 atoms within 5 Angstrom of each other: 39 neighbours each
    with pytest.raises(ValueError, match=r"39 neighbours within 5.0 Angstrom, more than .*max_num_neighbors=32"):
        _radius_edges(cluster * 0.3, r=5.0, max_num_neighbors=32)


def _molecules(dtype=torch.float64):
    """Three small molecules (5, 4 and 6 atoms), bonded-length spacing, as a padded batch."""
    g = torch.Generator().manual_seed(3)
    sizes = (5, 4, 6)
    z = torch.zeros(len(sizes), max(sizes), dtype=torch.long)
    pos = torch.zeros(len(sizes), max(sizes), 3, dtype=dtype)
    mask = torch.ones(len(sizes), max(sizes), dtype=torch.bool)
    for b, n in enumerate(sizes):
        z[b, :n] = torch.randint(1, 10, (n,), generator=g)
        pos[b, :n] = torch.randn(n, 3, generator=g, dtype=dtype) * 1.3
        mask[b, :n] = False
    return z, pos, mask


class _SmallBasis(PlainDimeNetPlusPlus):
    """The same model with a 3 x 4 spherical basis: the paper's 7 x 6 takes about 9 s of
    CPU to derive with sympy, once per process, and is the same code."""

    def __init__(self, **sizes):
        super().__init__(**{**sizes, "num_spherical": 3, "num_radial": 4})


@pytest.fixture(autouse=True)
def small_basis(monkeypatch):
    monkeypatch.setattr(flt.baselines.dimenet, "PlainDimeNetPlusPlus", _SmallBasis)


def _dimenet(readout: str = "sum") -> QM9Regressor:
    """A small DimeNet++ in float64 whose output layers are not PyG's zeros (with them every
    molecule would predict the mean and no invariance test could fail)."""
    cfg = QM9Config(encoder="dimenet++", dim=16, depth=2, heads=1, readout=readout, target_mean=1.0, target_std=2.0)
    torch.manual_seed(0)
    model = QM9Task.build_model(cfg, dtype=torch.float64)
    with torch.no_grad():
        for out in model.net.output_blocks:
            out.lin.weight.normal_(0, 0.5)
    return model.eval()


def test_dimenet_plus_plus_uses_its_published_cutoff_and_restores_pygs_functions():
    model = _dimenet()
    assert isinstance(model.net, PlainDimeNetPlusPlus) and model.net.cutoff == CUTOFFS["dimenet++"] == 5.0
    before = dimenet.radius_graph, dimenet.triplets
    model(*_molecules())
    assert (dimenet.radius_graph, dimenet.triplets) == before  # swapped only while the forward ran


def test_dimenet_plus_plus_trains_and_ignores_atom_order_padding_and_rotation():
    model = _dimenet()
    z, pos, mask = _molecules()
    pos = pos.clone().requires_grad_(True)
    out = model(z, pos, mask)
    assert out.shape == (3,) and torch.isfinite(out).all()
    assert (out - out.mean()).abs().max() > 1e-3  # the molecules are told apart: the checks below can fail
    out.square().sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert torch.isfinite(pos.grad).all() and pos.grad[~mask].abs().sum() > 0
    with torch.no_grad():
        # Permuting the atoms within molecule 2 (and moving its padding around) changes nothing.
        n = int((~mask[2]).sum())
        perm = torch.cat([torch.randperm(n), torch.arange(n, z.shape[1])])
        z2, pos2 = z.clone(), pos.detach().clone()
        z2[2], pos2[2] = z[2, perm], pos[2, perm]
        assert torch.allclose(model(z2, pos2, mask), out, rtol=0, atol=1e-10)
        # Each molecule alone, and all of them rotated and shifted, give the same values.
        alone = torch.cat([model(z[b : b + 1, : int((~mask[b]).sum())], pos[b : b + 1, : int((~mask[b]).sum())].detach())
                           for b in range(3)])
        assert torch.allclose(alone, out, rtol=0, atol=1e-10)
        q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64))
        assert torch.allclose(model(z, pos.detach() @ q.T + 4.0, mask), out, rtol=0, atol=1e-9)
        # Swapping two molecules swaps their predictions.
        order = torch.tensor([2, 0, 1])
        assert torch.allclose(model(z[order], pos.detach()[order], mask[order]), out[order], rtol=0, atol=1e-10)


def test_dimenet_plus_plus_mean_readout_divides_the_sum_by_the_atoms():
    z, pos, mask = _molecules()
    total, mean = _dimenet("sum"), _dimenet("mean")
    with torch.no_grad():
        summed = (total(z, pos, mask) - 1.0) / 2.0
        averaged = (mean(z, pos, mask) - 1.0) / 2.0
    assert torch.allclose(averaged, summed / (~mask).sum(dim=1), rtol=1e-12)


@pytest.mark.parametrize(("encoder", "saved", "loaded"), [
    ("transformer", 10.0, None), ("schnet", 10.0, None), ("schnet", 7.0, 7.0), ("dimenet++", 10.0, 10.0),
])
def test_configs_saved_with_the_old_shared_cutoff_read_as_the_same_model(encoder, saved, loaded):
    """Runs saved when ``cutoff`` defaulted to 10.0 for every encoder resume against
    today's preset (cutoff None: each model's own), and mean the same model."""
    from flt.baselines.qm9 import QM9Config
    from flt.tasks import config_from_dict, config_to_dict

    record = config_to_dict(QM9Config(encoder=encoder, cutoff=saved, attention="softmax"))
    config = config_from_dict(record)
    assert config.cutoff == loaded
    if loaded is None:
        assert config_to_dict(config) == config_to_dict(QM9Config(encoder=encoder, attention="softmax"))


def test_triplets_refuse_a_malformed_edge_index():
    from flt.baselines.atom_graphs import triplets

    with pytest.raises(ValueError, match=r"edge_index must be an integer tensor \[2, E\], got \(3, 4\)"):
        triplets(torch.zeros(3, 4, dtype=torch.long), 5)
    with pytest.raises(ValueError, match=r"edge_index must be an integer tensor \[2, E\], got \(2, 4\)"):
        triplets(torch.zeros(2, 4), 5)
