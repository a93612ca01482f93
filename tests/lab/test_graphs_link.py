"""Link prediction: ROC AUC, no leak of held-out edges into the models, training."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from flt.graphs.gnn import parse_kind
from flt.graphs import MODEL_KINDS, Graph, build_link_model, roc_auc, run_link_prediction, split_links, train_link_model


def test_roc_auc_hand_case_and_ties():
    # Positives 0.9 and 0.4 against negatives 0.5, 0.1, 0.4: 0.9 beats all three (3),
    # 0.4 beats 0.1 (1) and ties 0.4 (1/2): (3 + 1.5) / (2 * 3).
    scores = torch.tensor([0.9, 0.5, 0.4, 0.1, 0.4])
    labels = torch.tensor([1, 0, 1, 0, 0])
    assert roc_auc(scores, labels) == 0.75
    assert roc_auc(torch.tensor([1.0, 2.0]), torch.tensor([0, 1])) == 1.0
    assert roc_auc(torch.tensor([1.0, 2.0]), torch.tensor([1, 0])) == 0.0
    assert roc_auc(torch.zeros(6), torch.tensor([1, 0, 1, 0, 0, 1])) == 0.5


def test_roc_auc_equals_the_pairwise_definition():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 12, (57,), generator=g).float()  # many ties
    labels = torch.randint(0, 2, (57,), generator=g)
    pos, neg = scores[labels == 1].tolist(), scores[labels == 0].tolist()
    pairwise = sum((p > q) + 0.5 * (p == q) for p, q in itertools.product(pos, neg)) / (len(pos) * len(neg))
    assert roc_auc(scores, labels) == pytest.approx(pairwise, abs=1e-12)


def test_roc_auc_errors():
    with pytest.raises(ValueError, match="needs both classes"):
        roc_auc(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="same length"):
        roc_auc(torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        roc_auc(torch.ones(2), torch.tensor([0, 2]))


def grid(side: int) -> Graph:
    idx = torch.arange(side * side).reshape(side, side)
    edges = torch.cat([torch.stack([idx[:, :-1].reshape(-1), idx[:, 1:].reshape(-1)], 1), torch.stack([idx[:-1].reshape(-1), idx[1:].reshape(-1)], 1)])
    return Graph(side * side, edges, name=f"grid{side}")


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_no_held_out_edge_enters_message_passing_or_distances(kind, one_thread):
    """Two splits with the same training edges but different held-out edges (and different
    full graphs) must give identical embeddings; putting the validation edges into the
    training edges must change them, so the comparison can see structure."""
    split = split_links(grid(7), seed=1)
    n = split.num_nodes
    other_graph = Graph(n, torch.cat([split.train_pos, split.valid_neg, split.test_neg]))
    swapped = dataclasses.replace(
        split, graph=other_graph, valid_pos=split.valid_neg, valid_neg=split.valid_pos, test_pos=split.test_neg, test_neg=split.test_pos
    )
    leaked = dataclasses.replace(split, train_pos=torch.cat([split.train_pos, split.valid_pos]))
    options = dict(seed=4, num_anchors=6, stratified=True)
    if kind.endswith("+indication"):
        options["layers"] = 6  # reach every node from some anchor on the 7 x 7 grid
    with torch.no_grad():
        z = build_link_model(kind, split, **options).embeddings()
        z_swapped = build_link_model(kind, swapped, **options).embeddings()
        z_leaked = build_link_model(kind, leaked, **options).embeddings()
    assert torch.equal(z, z_swapped)
    if kind in ("sage", "gat"):
        # Mean-type aggregation of a constant feature is that constant: these two see no
        # structure at all, and every node gets the same embedding.
        assert torch.allclose(z, z[:1].expand_as(z), atol=1e-6) and torch.allclose(z, z_leaked, atol=1e-6)
    else:
        assert not torch.allclose(z, z_leaked)


def test_training_only_reads_the_training_pairs_for_gradients(one_thread):
    """Changing validation and test labels changes the reported AUCs but not the training."""
    split = split_links(grid(6), seed=0)
    flipped = dataclasses.replace(split, valid_pos=split.valid_neg, valid_neg=split.valid_pos, test_pos=split.test_neg, test_neg=split.test_pos)
    a = train_link_model(build_link_model("anchor-distance", split, num_anchors=8), split, steps=20, eval_every=5)
    b = train_link_model(build_link_model("anchor-distance", flipped, num_anchors=8), flipped, steps=20, eval_every=5)
    for (sa, va, ta), (sb, vb, tb) in zip(a.history, b.history):
        assert sa == sb and va == pytest.approx(1 - vb, abs=1e-12) and ta == pytest.approx(1 - tb, abs=1e-12)


def test_best_validation_step_is_reported(one_thread):
    result = run_link_prediction(grid(8), "anchor-distance", seed=0, steps=40, eval_every=10, num_anchors=16)
    steps, valid, test = zip(*result.history)
    assert steps == (10, 20, 30, 40)
    best = max(range(len(valid)), key=lambda i: (valid[i], -i))
    assert (result.best_step, result.valid_auc, result.test_auc) == (steps[best], valid[best], test[best])


def test_run_is_deterministic_and_leaves_the_global_generator_alone(one_thread):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = run_link_prediction(grid(6), "gir", seed=2, steps=6, eval_every=3, num_anchors=5, hidden=4)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = run_link_prediction(grid(6), "gir", seed=2, steps=6, eval_every=3, num_anchors=5, hidden=4)
    c = run_link_prediction(grid(6), "gir", seed=3, steps=6, eval_every=3, num_anchors=5, hidden=4)
    assert a.history == b.history and a.history != c.history


def test_position_aware_models_learn_grid_links_and_featureless_gcn_cannot(one_thread):
    """On a 12 x 12 grid, distances to anchors predict links; a featureless GCN sees every
    interior node alike and stays near chance."""
    g = grid(12)
    distance = run_link_prediction(g, "anchor-distance", seed=0, steps=150, num_anchors=24)
    gir = run_link_prediction(g, "gir", seed=0, steps=60, num_anchors=12, hidden=8)
    gcn = run_link_prediction(g, "gcn", seed=0, steps=60)
    assert distance.test_auc > 0.85, distance
    assert gir.test_auc > 0.8, gir
    assert gcn.test_auc < 0.7, gcn


def test_link_model_errors_name_the_argument():
    split = split_links(grid(5), seed=0)
    with pytest.raises(ValueError, match="kind must be one of"):
        build_link_model("mlp", split)
    with pytest.raises(ValueError, match="modifiers"):
        parse_kind("gir+indication")
    assert parse_kind("gin+indication+gir") == ("gin", {"indication": True, "fusion": True})
    with pytest.raises(ValueError, match="graph must be one of"):
        run_link_prediction("cora", "gir")
    with pytest.raises(ValueError, match="unknown option"):
        build_link_model("anchor-distance", split, layers=3)
    with pytest.raises(ValueError, match="unknown option"):
        build_link_model("sage", split, gir_steps=3)  # GIR options only with +gir
    with pytest.raises(TypeError, match="split must be a flt.graphs.LinkSplit"):
        build_link_model("gir", split.graph)
    assert build_link_model("gir", split, num_anchors=3, gir_steps=2).encoder.net.gir.steps == 2
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        build_link_model("gir", split, num_anchors=3, gir_steps=0)
