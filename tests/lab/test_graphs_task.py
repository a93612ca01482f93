"""``flt train graph``: link prediction over all nodes at anchor coordinates through the
task registry (training, resume, checkpoint reload, the validation AUC, data errors)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close
from flt.cli import main
from flt.graphs import LinkTransformer, anchor_inputs, generated_split, roc_auc, select_anchors
from flt.tasks import get_preset, load_task
from flt.train import load_checkpoint_model

#: A few steps of the smoke preset (its warm-up is 5 steps, so extending 4 -> 6 steps is
#: bit for bit the same as 6 steps from the start).
TINY = ["--preset", "smoke", "--steps", "4", "--eval-every", "2", "--checkpoint-every", "2", "--no-progress", "--no-plots"]


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.cli
def test_smoke_training_writes_a_finite_auc_and_resumes_bit_for_bit(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "graph", *TINY, "--out-dir", str(out)]) == 0
    summary = _summary(out)
    assert summary["task"] == "graph" and summary["metric"] == "auc" and summary["steps"] == 4
    assert math.isfinite(summary["final"]["auc"]) and 0.0 <= summary["final"]["auc"] <= 1.0
    # FLT has random features: the draw gap, exact attention over all 400 nodes included.
    assert summary["draw_gap"]["exact"] is not None and math.isfinite(summary["draw_gap"]["exact"])
    model, meta = load_checkpoint_model(str(out))
    assert isinstance(model, LinkTransformer) and meta["preset"]["task"] == "graph"

    assert main(["train", "graph", *TINY, "--out-dir", str(out), "--resume", "--steps", "6"]) == 0
    assert _summary(out)["steps"] == 6
    straight = tmp_path / "straight"
    assert main(["train", "graph", *TINY, "--out-dir", str(straight), "--steps", "6"]) == 0
    assert _summary(out)["final"] == _summary(straight)["final"]
    text = capsys.readouterr().out
    assert "test ROC AUC" in text and "draw gap (auc)" in text


def test_validation_is_one_batch_on_one_process_and_its_auc_is_the_rank_formula():
    task = load_task("graph", {"num_anchors": 16})
    cfg = task.configure(get_preset("graph", "smoke").model)
    assert cfg.num_anchors == 16
    model = task.build_model(cfg).eval()
    assert list(task.eval_batches(8, 1, rank=1, world=2)) == []
    (batch,) = task.eval_batches(8, 1, rank=0, world=2)
    pairs, labels = task.valid
    assert torch.equal(batch[4], pairs) and len(pairs) == 2 * 76  # 10% of the grid's 760 edges and as many non-edges
    with torch.no_grad():
        metrics = task.metrics(task.eval_sums(model, batch))
        assert metrics["auc"] == pytest.approx(roc_auc(model(*batch[:5]), labels), abs=1e-12)


def test_positions_come_from_the_training_edges_of_the_seeded_split():
    task = load_task("graph", {"graph": "communities", "seed": 3, "num_anchors": 8})
    split = generated_split("communities", seed=3)
    anchors = select_anchors(split.num_nodes, 8, seed=3, edges=split.train_pos)
    features, pos = anchor_inputs(split.num_nodes, split.train_pos, anchors)
    assert torch.equal(task.features, features) and torch.equal(task.pos, pos)
    assert task.longest_sequence(None) == 400


@pytest.mark.cli
@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("graph=cube", "graph must be one of ['grid', 'communities'], got 'cube'"),
        ("graphs=grid", "unknown data options for 'graph': ['graphs']"),
        ("num_anchors=0", "num_anchors must be a positive integer, got 0"),
    ],
)
def test_a_bad_data_option_is_named_in_one_line(option, message, tmp_path, capsys):
    out = tmp_path / "bad"
    assert main(["train", "graph", *TINY, "--out-dir", str(out), "--data-opt", option]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flt train: error: ") and message in err and "Traceback" not in err
    assert not (out / "summary.json").exists()


@pytest.mark.cli
def test_an_edge_list_replaces_the_generated_graph(tmp_path, capsys):
    edges = tmp_path / "edges.txt"
    edges.write_text("".join(f"{i} {i + 1}\n{i} {(i + 7) % 60}\n" for i in range(59)))
    out = tmp_path / "file"
    assert main(["train", "graph", *TINY, "--out-dir", str(out), "--data", str(edges), "--batch-size", "64"]) == 0
    assert math.isfinite(_summary(out)["final"]["auc"])
    both = ["--data", str(edges), "--data-opt", "graph=grid"]
    assert main(["train", "graph", *TINY, "--out-dir", str(tmp_path / "both"), *both]) == 2
    assert "--data-opt/--data graph: options of the bundled data, which the dataset at" in capsys.readouterr().err
    both = ["--data", str(edges), "--graph", "communities"]  # the shortcut flag is named too
    assert main(["train", "graph", *TINY, "--out-dir", str(tmp_path / "both2"), *both]) == 2
    assert "--data-opt/--data/--graph graph: options of the bundled data" in capsys.readouterr().err


@pytest.mark.cli
@pytest.mark.parametrize(
    "options",
    [
        ["--model-opt", "encoder=gir", "--model-opt", "gir_steps=3"],
        ["--model-opt", "encoder=sage", "--model-opt", "indication=true", "--model-opt", "fusion=true", "--data-opt", "resample_anchors=true"],
        ["--model-opt", "encoder=indicator", "--data-opt", "task=pair", "--data-opt", "graph=communities"],
    ],
    ids=["gir", "sage-indication-gir-resampled", "indicator-pair"],
)
def test_structural_encoders_train_and_reload(options, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "graph", *TINY, "--out-dir", str(out), "--data-opt", "num_anchors=16", *options]) == 0
    summary = _summary(out)
    assert math.isfinite(summary["final"]["auc"]) and summary.get("draw_gap") is None
    model, _ = load_checkpoint_model(str(out))
    assert isinstance(model, LinkTransformer) and model.encoder_kind != "transformer"


def test_pair_task_reads_labelled_pairs_and_every_edge():
    from flt.graphs import communities, split_node_pairs

    task = load_task("graph", {"graph": "communities", "task": "pair", "seed": 2, "num_pairs": 200, "num_anchors": 8})
    g = communities(20, 20, p=0.01, seed=2)
    train, valid, test = split_node_pairs(g, 200, seed=2)
    assert torch.equal(task.edges, g.edges) and torch.equal(task.valid[0], valid[0]) and torch.equal(task.test[1], test[1])
    assert len(task.train[0]) == 160
    with pytest.raises(ValueError, match="task='pair' needs node labels"):
        load_task("graph", {"task": "pair"})


def test_resampled_anchors_change_per_epoch_and_validation_keeps_the_seeded_ones():
    task = load_task("graph", {"num_anchors": 8, "resample_anchors": True})
    n_train = len(task.train[0])  # 1216 pairs: 4 batches of 304 make an epoch
    first = task.train_batch(1, 304, 0, 0, 1)  # steps are 1-based
    same_epoch = task.train_batch(4, 304, 0, 0, 1)
    next_epoch = task.train_batch(5, 304, 0, 0, 1)
    assert n_train == 1216 and torch.equal(first[3], same_epoch[3]) and not torch.equal(first[3], next_epoch[3])
    assert not torch.equal(first[1], next_epoch[1])  # positions follow the anchors
    (valid,) = task.eval_batches(8, 1, 0, 1)
    assert torch.equal(valid[3], task.anchors) and torch.equal(valid[1], task.pos)
    fixed = load_task("graph", {"num_anchors": 8})
    assert torch.equal(fixed.train_batch(5, 304, 0, 0, 1)[3], fixed.anchors)


@pytest.mark.cli
@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("encoder=mlp", "encoder must be one of"),
        ("gir_steps=-1", "gir_steps must be 0 (every level) or a positive integer"),
        ("indication=true", "indication and fusion apply to the GNN encoders"),
    ],
)
def test_a_bad_encoder_option_is_named_in_one_line(option, message, tmp_path, capsys):
    assert main(["train", "graph", *TINY, "--out-dir", str(tmp_path / "bad"), "--model-opt", option]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.cli
def test_a_pyg_file_with_labels_feeds_the_pair_task(tmp_path):
    from torch_geometric.data import Data

    from flt.graphs import communities

    g = communities(4, 6, p=0.0, seed=0)
    path = tmp_path / "caves.pt"
    torch.save(Data(edge_index=g.edges.T.contiguous(), y=g.labels, num_nodes=g.num_nodes), path)
    out = tmp_path / "run"
    args = ["--data", str(path), "--data-opt", "task=pair", "--data-opt", "num_pairs=100", "--model-opt", "encoder=anchor-distance",
            "--batch-size", "32"]
    assert main(["train", "graph", *TINY, "--out-dir", str(out), *args]) == 0
    assert math.isfinite(_summary(out)["final"]["auc"])


def test_random_walk_and_laplacian_positions_come_from_the_training_edges():
    from flt.graphs import grid_graph, laplacian_eigenvectors, random_walk_encoding, standardize_columns

    split = generated_split("grid", seed=1)
    rwse = load_task("graph", {"seed": 1, "positions": "rwse", "walk_steps": 6})
    expected = standardize_columns(random_walk_encoding(400, split.train_pos, 6)).float()
    assert rwse.features is rwse.pos and torch.equal(rwse.pos, expected)
    assert rwse.configure(get_preset("graph", "smoke").model).in_dim == 6
    lap = load_task("graph", {"seed": 1, "positions": "laplacian", "eigenvectors": 5})
    vectors = laplacian_eigenvectors(400, split.train_pos, 5)[1] * 20.0  # sqrt(N) = 20
    assert_close(lap.pos, vectors.float())
    every_edge = standardize_columns(random_walk_encoding(400, grid_graph(20).edges, 6)).float()
    assert not torch.allclose(rwse.pos, every_edge)  # the held-out edges would change them
    with pytest.raises(ValueError, match="positions must be one of"):
        load_task("graph", {"positions": "spectral"})


def test_laplacian_signs_flip_per_training_step_reproducibly_and_not_in_evaluation():
    task = load_task("graph", {"positions": "laplacian", "eigenvectors": 8})
    a, b, again = task.train_batch(1, 64, 0, 0, 1), task.train_batch(2, 64, 0, 0, 1), task.train_batch(1, 64, 0, 0, 1)
    assert torch.equal(a[1], again[1]) and not torch.equal(a[1], b[1])
    for batch in (a, b):
        signs = (batch[1] * task.pos).sum(0) / task.pos.square().sum(0)
        assert torch.equal(signs.abs().round(), torch.ones(8)) and torch.equal(batch[0], batch[1])
    (valid,) = task.eval_batches(8, 1, 0, 1)
    assert torch.equal(valid[1], task.pos)


@pytest.mark.cli
@pytest.mark.parametrize(
    "options",
    [["--data-opt", "positions=rwse"], ["--data-opt", "positions=laplacian"], ["--attention", "softmax:relative_bias=spd"]],
    ids=["rwse", "laplacian", "spd"],
)
def test_position_baselines_and_the_hop_bias_train_and_reload(options, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "graph", *TINY, "--out-dir", str(out), "--data-opt", "num_anchors=16", *options]) == 0
    assert math.isfinite(_summary(out)["final"]["auc"])
    model, meta = load_checkpoint_model(str(out))
    assert isinstance(model, LinkTransformer) and meta["model"]["in_dim"] == (16 if "softmax" in options[1] else model.encoder.embed.in_features)


@pytest.mark.cli
def test_gir_positions_smoke_run_ends_with_an_auc(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "graph", "--preset", "smoke", "--no-progress", "--no-plots", "--out-dir", str(out), "--model-opt", "gir_positions=8"]) == 0
    summary = _summary(out)
    assert summary["final"]["auc"] > 0.7 and math.isfinite(summary["draw_gap"]["exact"])  # 0.895 measured
    model, _ = load_checkpoint_model(str(out))
    assert model.position_basis.shape == (32, 8)


def test_gir_positions_are_orthonormal_projections_and_pass_the_gradient_to_gir():
    torch.manual_seed(0)
    task = load_task("graph", {"num_anchors": 8})
    cfg = task.configure(get_preset("graph", "smoke").model)
    cfg = type(cfg)(**{**cfg.__dict__, "gir_positions": 4, "depth": 1})
    model = task.build_model(cfg).double()
    features, pos, edges, anchors, pairs, labels = task.train_batch(1, 32, 0, 0, 1)
    basis = model.position_basis
    assert_close(basis.T @ basis, torch.eye(4, dtype=torch.float64), dtype=torch.float32)  # drawn in float32
    r = model.learned_positions(400, edges, anchors)
    assert r.shape == (400, 4) and bool((r.norm(dim=1) <= math.sqrt(32) + 1e-9).all())
    # The fast FLT path equals its O(N^2) reference at these positions (float64, one draw).
    fast = model.embeddings(features.double(), pos.double(), edges, anchors)
    model.encoder.mode = "reference"
    assert_close(model.embeddings(features.double(), pos.double(), edges, anchors), fast)
    model.encoder.mode = "fast"
    # The given positions are not used; the attention's gradient reaches GIR through its own.
    assert torch.equal(model.embeddings(features.double(), torch.zeros_like(pos).double(), edges, anchors), fast)
    F.binary_cross_entropy_with_logits(model(features.double(), pos.double(), edges, anchors, pairs), labels.double()).backward()
    grads = [p.grad for p in model.position_encoder.parameters()]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0


@pytest.mark.cli
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model-opt", "gir_positions=8", "--model-opt", "encoder=gir"], "gir_positions applies to encoder='transformer'"),
        (["--model-opt", "gir_positions=8", "--data-opt", "positions=rwse"], "gir_positions replaces the positions of the data"),
        (["--model-opt", "gir_positions=64"], "must not exceed dim (32)"),
        (["--attention", "softmax:relative_bias=spd", "--data-opt", "positions=laplacian"], "relative_bias='spd' reads hop distances"),
    ],
)
def test_bad_position_choices_are_named_in_one_line(args, message, tmp_path, capsys):
    assert main(["train", "graph", *TINY, "--out-dir", str(tmp_path / "bad"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.cli
def test_the_issue_s_command_line_shortcuts_set_the_encoder_graph_and_task(tmp_path, capsys):
    """--model / --graph / --task are --model-opt encoder= / --data-opt graph= / task=."""
    out = tmp_path / "short"
    assert main(["train", "graph", *TINY, "--out-dir", str(out), "--model", "gcn", "--graph", "communities", "--task", "pair"]) == 0
    _, meta = load_checkpoint_model(str(out))
    assert meta["model"]["encoder"] == "gcn"
    assert meta["preset"]["data"]["graph"] == "communities" and meta["preset"]["data"]["task"] == "pair"
    assert math.isfinite(_summary(out)["final"]["auc"])
    # Contradicting the long form, or a shortcut another task does not have, is an error.
    assert main(["train", "graph", *TINY, "--out-dir", str(tmp_path / "x"), "--model", "gcn", "--model-opt", "encoder=gat"]) == 2
    assert "--model 'gcn' contradicts --model-opt encoder='gat'" in capsys.readouterr().err
    assert main(["train", "lm", *TINY, "--out-dir", str(tmp_path / "y"), "--graph", "grid"]) == 2
    assert "--graph is a shortcut of the graph task(s), not of 'lm'" in capsys.readouterr().err
