"""``flt train graph``: link prediction over all nodes at anchor coordinates through the
task registry (training, resume, checkpoint reload, the validation AUC, data errors)."""

from __future__ import annotations

import json
import math

import pytest
import torch

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


def test_an_edge_list_replaces_the_generated_graph(tmp_path, capsys):
    edges = tmp_path / "edges.txt"
    edges.write_text("".join(f"{i} {i + 1}\n{i} {(i + 7) % 60}\n" for i in range(59)))
    out = tmp_path / "file"
    assert main(["train", "graph", *TINY, "--out-dir", str(out), "--data", str(edges), "--batch-size", "64"]) == 0
    assert math.isfinite(_summary(out)["final"]["auc"])
    both = ["--data", str(edges), "--data-opt", "graph=grid"]
    assert main(["train", "graph", *TINY, "--out-dir", str(tmp_path / "both"), *both]) == 2
    assert "names a generated graph" in capsys.readouterr().err


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
