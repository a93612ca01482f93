"""flt search on the molecule and graph tasks (their held-out parts, reproducible and
resumable searches with decided slots one-hot) and the absolute encoding as a searched slot."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from flt.cli import main
from flt.models import replace_fields
from flt.search import (
    MixedEncoding,
    SearchConfig,
    SearchInterrupted,
    arch_fields,
    arch_posenc,
    build_supernet,
    encoding_slot,
    magnitude_choice,
    mixed_slots,
    parse_candidates,
    parse_posenc_candidates,
    removal_metrics,
    search,
    select_slot,
)
from flt.search.run import supernet_model
from flt.search.holdout import split_task
from flt.tasks import get_preset, get_task, load_task
from flt.train.checkpoint import find_checkpoint, load_weights


def _keys(pairs: torch.Tensor) -> set[tuple[int, int]]:
    return {tuple(p) for p in pairs.tolist()}


# ---------------------------------------------------------------- held-out parts


def _molecule_task():
    preset = get_preset("molecule", "smoke")
    task = load_task("molecule", {**preset.data, "progress": False})
    task.configure(preset.model)
    return task


def _structures(data) -> set[tuple]:
    return {(tuple(z.tolist()), tuple(pos.flatten().tolist())) for z, pos, _ in (data[i] for i in range(len(data)))}


def test_molecule_holdout_is_whole_training_structures_drawn_from_the_seed():
    task = _molecule_task()
    weights, alpha = split_task(task, 0.25, seed=0)
    n = len(task.train)
    assert len(alpha.train) == round(0.25 * n) and len(weights.train) + len(alpha.train) == n
    assert alpha.valid is alpha.train and weights.valid is task.valid  # validation untouched
    held, rest, valid = _structures(alpha.train), _structures(weights.train), _structures(task.valid)
    assert not held & rest and not held & valid and held | rest == _structures(task.train)
    # Targets travel with their structures.
    targets = {s: float(task.train.y[i]) for i, s in enumerate(_structures_list(task.train))}
    assert all(targets[s] == float(alpha.train.y[i]) for i, s in enumerate(_structures_list(alpha.train)))
    # Deterministic from the seed; another seed holds out other structures.
    assert _structures(split_task(task, 0.25, seed=0)[1].train) == held
    other = _structures(split_task(task, 0.25, seed=1)[1].train)
    assert other != held and len(other) == len(held)
    # The standardisation is the whole training split's (the model's output scale).
    assert alpha.target_mean == weights.target_mean == task.target_mean
    with pytest.raises(ValueError, match="empty part"):
        split_task(task, 0.001)


def _structures_list(data) -> list[tuple]:
    return [(tuple(z.tolist()), tuple(pos.flatten().tolist())) for z, pos, _ in (data[i] for i in range(len(data)))]


def test_graph_link_holdout_takes_its_edges_out_of_the_structure():
    task = load_task("graph", {})
    weights, alpha = split_task(task, 0.2, seed=0)
    pairs, labels = task.train
    train_edges = _keys(pairs[labels == 1])
    held_pos = _keys(alpha.train[0][alpha.train[1] == 1])
    rest_pos = _keys(weights.train[0][weights.train[1] == 1])
    assert len(held_pos) == round(0.2 * len(train_edges)) and held_pos | rest_pos == train_edges and not held_pos & rest_pos
    assert int((alpha.train[1] == 0).sum()) == len(held_pos)  # as many negatives
    assert not _keys(alpha.train[0][alpha.train[1] == 0]) & _keys(weights.train[0][weights.train[1] == 0])
    # The structure of both parts is the remaining edges; the held-out edges are not in it,
    # nor the validation pairs in any part.
    assert _keys(weights.edges) == _keys(alpha.edges) == rest_pos
    assert _keys(task.edges) == train_edges  # the task itself is unchanged
    assert not _keys(task.valid[0]) & (held_pos | _keys(alpha.train[0]))
    assert weights.valid is task.valid and alpha.valid is alpha.train
    # Anchors and positions are those of the reduced structure.
    from flt.graphs import anchor_inputs, select_anchors

    anchors = select_anchors(task.num_nodes, task.num_anchors, seed=task.seed, edges=weights.edges)
    torch.testing.assert_close(weights.anchors, anchors, rtol=0, atol=0)
    torch.testing.assert_close(weights.pos, anchor_inputs(task.num_nodes, weights.edges, anchors)[1], rtol=0, atol=0)
    assert not torch.equal(weights.pos, task.pos)
    assert alpha.pos is weights.pos
    # Deterministic from the seed.
    assert _keys(split_task(task, 0.2, seed=0)[1].train[0]) == _keys(alpha.train[0])
    assert _keys(split_task(task, 0.2, seed=3)[1].train[0]) != _keys(alpha.train[0])


def test_graph_pair_holdout_is_a_part_of_the_labelled_pairs():
    task = load_task("graph", {"graph": "communities", "task": "pair", "num_pairs": 400})
    weights, alpha = split_task(task, 0.2, seed=0)
    assert len(alpha.train[1]) == round(0.2 * len(task.train[1]))
    assert not _keys(alpha.train[0]) & _keys(weights.train[0])
    assert _keys(alpha.train[0]) | _keys(weights.train[0]) == _keys(task.train[0])
    assert weights.edges is task.edges and alpha.pos is task.pos  # every edge stays structure


def test_with_structure_checks_its_edges():
    task = load_task("graph", {})
    with pytest.raises(ValueError, match="edges"):
        task.with_structure(torch.tensor([[0, 400]]))
    with pytest.raises(ValueError, match="edges"):
        task.with_structure(torch.zeros(3, 3, dtype=torch.int64))


# ---------------------------------------------------------------- the encoding slot


class Constant(nn.Module):
    """A toy encoding: ``c`` everywhere (the signature of a POSENC entry)."""

    def __init__(self, c: float):
        super().__init__()
        self.register_buffer("c", torch.tensor(c, dtype=torch.float64))  # float64: so is alpha

    def forward(self, pos):
        return self.c.expand(*pos.shape[:2], 3)


def toy_encoding() -> MixedEncoding:
    # The target is 1 everywhere. "useful" carries all of it with the smallest weight
    # (0.2 * 5 = 1); the two others add nothing and hold the largest weights (0.4 each).
    slot = MixedEncoding([Constant(5.0), Constant(0.0), Constant(0.0)], ["useful", "none-a", "none-b"])
    with torch.no_grad():
        slot.alpha.copy_(torch.log(torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64)))
    return slot


def test_encoding_slot_perturbation_picks_the_useful_encoding_with_the_smallest_alpha_magnitude_does_not():
    pos = torch.randn(2, 5, 1, dtype=torch.float64)
    slot = toy_encoding()

    def loss() -> float:
        with torch.no_grad():
            return float(((slot(pos) - 1.0) ** 2).mean())

    assert slot.alpha.dtype == torch.float64 and loss() < 1e-28
    assert slot.labels[magnitude_choice(slot)] == "none-a"
    assert removal_metrics(slot, loss) == pytest.approx([1.0, 0.0, 0.0], abs=1e-12)
    entry = select_slot(slot, loss, higher_is_better=False)
    assert entry["chosen"] == "useful" and entry["magnitude"] == "none-a"
    # Decided: one-hot, for good, and kept in the state dict.
    assert slot.weights().tolist() == [1.0, 0.0, 0.0] and not slot.alpha.requires_grad
    torch.testing.assert_close(slot(pos), torch.full((2, 5, 3), 5.0, dtype=torch.float64), rtol=0, atol=0)
    fresh = toy_encoding()
    fresh.load_state_dict(slot.state_dict())
    assert fresh.choice == "useful"


def test_mixed_encoding_matches_the_weighted_sum_in_float64():
    task = get_task("image")
    cands = parse_posenc_candidates("none,sinusoidal,fourier", task)
    torch.manual_seed(0)
    model = task.build_model(get_preset("image", "smoke").model, dtype=torch.float64)
    build_supernet(model, parse_candidates("flt,softmax", task), posenc_candidates=cands)
    slot = encoding_slot(model)
    assert model.posenc is slot and slot.labels == ["none", "sinusoidal", "fourier"]
    with torch.no_grad():
        slot.alpha.copy_(torch.tensor([0.2, -0.5, 0.9]))
    pos = torch.rand(2, 16, 2, dtype=torch.float64) * 2 - 1
    w = torch.softmax(slot.alpha.detach(), 0)
    torch.testing.assert_close(slot(pos), sum(w[k] * slot.ops[k](pos) for k in range(3)), rtol=1e-12, atol=1e-12)
    slot.keep[2] = 0.0
    torch.testing.assert_close(slot(pos), w[1] * slot.ops[1](pos), rtol=1e-12, atol=1e-12)
    slot.keep[2] = 1.0
    # alpha and the learnable encodings get gradients through the mixture.
    slot(pos).pow(2).sum().backward()
    assert slot.alpha.grad is not None and torch.isfinite(slot.alpha.grad).all() and slot.alpha.grad.abs().sum() > 0
    assert len(mixed_slots(model)) == 2  # the attention slots are separate


def test_arch_fields_rebuild_the_chosen_encoding():
    data = {
        "candidates": [{"label": "flt", "attention": "flt", "attention_options": {"spectrum": "gaussian"}},
                       {"label": "softmax", "attention": "softmax", "attention_options": {"relative_bias": "alibi"}}],
        "perturbation": ["softmax", "flt"], "magnitude": ["flt", "flt"],
        "posenc_candidates": [{"label": "none", "posenc": "none", "posenc_options": {}},
                              {"label": "fourier", "posenc": "fourier", "posenc_options": {}}],
        "posenc": {"perturbation": "fourier", "magnitude": "none"},
    }
    fields = arch_fields(data, "perturbation")
    assert fields["posenc"] == "fourier" and [e["attention"] for e in fields["layer_attention"]] == ["softmax", "flt"]
    task = get_task("molecule")
    model = task.build_model(replace_fields(get_preset("molecule", "smoke").model, **fields))
    assert type(model.posenc).__name__ == "LearnableFourierFeatures"
    assert [type(b.attn).__name__ for b in model.trunk.blocks] == ["SoftmaxAttention", "FLTAttention"]
    assert arch_fields(data, "magnitude")["posenc"] == "none"
    assert arch_posenc({**data, "posenc_candidates": None}) is None  # a search that did not mix it
    with pytest.raises(ValueError, match="no magnitude choice of the absolute encoding"):
        arch_posenc({**data, "posenc": {"perturbation": "none", "magnitude": None}}, "magnitude")


# ---------------------------------------------------------------- searches


def _tiny(task: str, steps: int = 4, **data):
    preset = get_preset(task, "smoke", "flt")
    run = replace_fields(preset.run, steps=steps, eval_every=2, checkpoint_every=2, eval_batches=2,
                         batch_size=16 if task == "molecule" else 64)
    extra = {"progress": False} if task == "molecule" else {}
    return type(preset)(preset.task, preset.model, run, {**preset.data, **extra, **data})


def _config(task: str, posenc: str | None = "none,fourier", **kw):
    t = get_task(task)
    return SearchConfig(tuple(parse_candidates("flt,performer,softmax", t)), tune_steps=1,
                        posenc_candidates=tuple(parse_posenc_candidates(posenc, t)) if posenc else (), **kw)


def _stable(result: dict) -> str:
    return json.dumps({k: v for k, v in result.items() if k not in ("seconds", "wall_time_s")}, sort_keys=True)


def _check_decided(out_dir, result, task: str) -> None:
    """The final checkpoint's supernet has every slot decided, one-hot on the recorded choice."""
    t = get_task(task)
    preset = get_preset(task, "smoke")
    cfg = _config(task, "none,fourier" if result.get("posenc_candidates") else None)
    model = supernet_model(t, t.config(**{k: v for k, v in result["model"].items() if k != "task"}), cfg)
    load_weights(find_checkpoint(str(out_dir), report=lambda m: None), model)
    slots = mixed_slots(model)
    assert [s.choice for s in slots] == result["perturbation"] and preset.model.depth == len(slots)
    enc = encoding_slot(model)
    for s in slots + ([enc] if enc is not None else []):
        w = s.weights().tolist()
        assert sorted(w) == [0.0] * (len(w) - 1) + [1.0] and w[s.labels.index(s.choice)] == 1.0
        with torch.no_grad():
            s.alpha.add_(torch.randn_like(s.alpha))
        assert s.weights().tolist() == w  # alpha no longer matters
    if result.get("posenc_candidates"):
        assert enc.choice == result["posenc"]["perturbation"]
    else:
        assert enc is None


@pytest.mark.parametrize("task", ["molecule", "graph"])
def test_search_of_the_task_is_reproducible_resumes_and_decides_every_slot(tmp_path, task):
    torch.set_num_threads(1)
    cfg = _config(task)
    first = search(_tiny(task), cfg, str(tmp_path / "a"), progress=False, plots=False)
    assert first["complete"] and sorted(first["order"], key=str) == [0, 1, "posenc"]
    assert first["posenc"]["perturbation"] == first["posenc_slot"]["chosen"] in ("none", "fourier")
    assert first["posenc"]["magnitude"] in ("none", "fourier") and set(first["posenc_slot"]["removed"]) == {"none", "fourier"}
    assert len(first["alpha_end"]) == 2 and len(first["posenc_alpha_end"]) == 2
    assert first["metric"] == ("mae" if task == "molecule" else "auc")
    _check_decided(tmp_path / "a", first, task)
    second = search(_tiny(task), cfg, str(tmp_path / "b"), progress=False, plots=False)
    assert _stable(first) == _stable(second)

    # Stopped mid-supernet (step 3; checkpoint of step 2) and during the fine-tuning after
    # the first decision (step 5; checkpoint of step 4, the supernet's last): both resumes
    # end with the uninterrupted result.
    for stop_at in (3, 5):
        out = tmp_path / f"stop-{stop_at}"

        def stop(step, stop_at=stop_at):
            if step == stop_at:
                raise KeyboardInterrupt

        with pytest.raises(SearchInterrupted) as info:
            search(_tiny(task), cfg, str(out), progress=False, plots=False, on_step=stop)
        assert info.value.checkpoint is not None
        assert _stable(search(_tiny(task), cfg, str(out), resume=True, progress=False, plots=False)) == _stable(first)
    # Another set of encodings is refused on resume.
    with pytest.raises(ValueError, match="differ"):
        search(_tiny(task), _config(task, "fourier,none"), str(tmp_path / "a"),
               resume=True, progress=False, plots=False)


def test_search_without_the_encoding_slot_keeps_its_record(tmp_path):
    torch.set_num_threads(1)
    result = search(_tiny("graph", 2), _config("graph", None), str(tmp_path / "g"), progress=False, plots=False)
    assert "posenc" not in result and "posenc_candidates" not in result and "posenc_candidates" not in result["search"]
    assert sorted(result["order"]) == [0, 1]
    _check_decided(tmp_path / "g", result, "graph")


@pytest.mark.cli
def test_cli_search_molecule_then_train_arch(tmp_path, capsys):
    out = tmp_path / "s"
    code = main(["search", "molecule", "--candidates", "flt,performer,softmax", "--posenc-candidates", "none,fourier",
                 "--preset", "smoke", "--steps", "4", "--tune-steps", "1", "--eval-every", "2", "--batch-size", "16",
                 "--out-dir", str(out), "--threads", "1", "--no-plots", "--data-opt", "progress=false"])
    printed = capsys.readouterr().out
    assert code == 0 and "slot 3/3" in printed and "absolute encoding: perturbation" in printed
    result = json.loads((out / "search.json").read_text())
    run_dir = tmp_path / "t"
    code = main(["train", "molecule", "--arch", str(out / "search.json"), "--preset", "smoke", "--steps", "2",
                 "--eval-every", "2", "--run-opt", "draw_gap=false", "--data-opt", "progress=false", "--out-dir", str(run_dir),
                 "--threads", "1", "--no-progress", "--no-plots"])
    assert code == 0
    from flt.train import load_checkpoint_model

    model, meta = load_checkpoint_model(str(run_dir))
    names = {c["label"]: c["attention"] for c in result["candidates"]}
    assert [e["attention"] for e in meta["model"]["layer_attention"]] == [names[c] for c in result["perturbation"]]


@pytest.mark.cli
@pytest.mark.parametrize("task, args, match", [
    ("molecule", ["--posenc-candidates", "none,sinusoidal"], "'sinusoidal' does not construct"),  # dim 32, P = 3
    ("molecule", ["--posenc-candidates", "fourier"], "at least two encodings"),
    ("molecule", ["--posenc-candidates", "none,nosuchencoding"], "nosuchencoding"),
    ("graph", ["--model-opt", "encoder=gcn"], "encoder='gcn' has no attention layers"),
    ("molecule", ["--candidates", "flt:spectrum=gaussian_mixture:shift=true,softmax"], "does not fit isotropic=true"),
])
def test_bad_search_options_are_clear_errors_before_any_training(tmp_path, capsys, task, args, match):
    out = tmp_path / "s"
    if "--candidates" not in args:
        args = ["--candidates", "flt,softmax", *args]
    code = main(["search", task, "--preset", "smoke", "--out-dir", str(out), "--threads", "1", *args])
    err = capsys.readouterr().err
    assert code == 2 and "flt search: error:" in err and match in err
    assert not out.exists()
