"""flt search: the mixed op, perturbation vs magnitude selection, the search driver
(reproducible, resumable), the CLI and flt train --arch."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch import nn

from flt.cli import main
from flt.layers.draws import random_feature_modules, redraw
from flt.models.block import build_attention
from flt.search import (
    MixedAttention,
    SearchConfig,
    SearchInterrupted,
    build_supernet,
    magnitude_choice,
    mixed_slots,
    parse_candidates,
    removal_metrics,
    search,
    select_slot,
)
from flt.search.holdout import split_task
from flt.tasks import get_preset, get_task, load_task
from flt.train.checkpoint import find_checkpoint, load_trainer_state
from flt.models import replace_fields


class Scale(nn.Module):
    """A toy candidate: ``c * x`` (signature of an attention layer)."""

    def __init__(self, c: float):
        super().__init__()
        self.c = c

    def forward(self, x, pos=None, key_padding_mask=None):
        return self.c * x


def toy_slot() -> MixedAttention:
    # The target is y = x. "useful" carries all of it with the smallest weight (0.2 * 5 = 1);
    # the two others output nothing and hold the largest weights (0.4 each).
    slot = MixedAttention([Scale(5.0), Scale(0.0), Scale(0.0)], ["useful", "idle-a", "idle-b"])
    with torch.no_grad():
        slot.alpha.copy_(torch.log(torch.tensor([1.0, 2.0, 2.0])))
    return slot


def mse(slot: MixedAttention, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float(((slot(x) - x) ** 2).mean())


def test_perturbation_picks_the_useful_candidate_with_the_smallest_alpha_magnitude_does_not():
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    slot = toy_slot()
    assert mse(slot, x) < 1e-12  # the supernet fits the target exactly
    assert slot.labels[magnitude_choice(slot)] == "idle-a"
    removed = removal_metrics(slot, lambda: mse(slot, x))
    assert removed[0] == pytest.approx(float((x**2).mean()))
    assert removed[1] == removed[2] == pytest.approx(0.0, abs=1e-12)
    assert slot.keep.tolist() == [1.0, 1.0, 1.0]  # measuring leaves the slot as it was
    entry = select_slot(slot, lambda: mse(slot, x), higher_is_better=False)
    assert entry["chosen"] == "useful" and entry["magnitude"] == "idle-a"
    assert entry["alpha"]["useful"] == pytest.approx(0.2) and entry["alpha"]["idle-a"] == pytest.approx(0.4)
    # Higher-is-better metrics choose the lowest score without the candidate.
    slot2 = toy_slot()
    assert select_slot(slot2, lambda: -mse(slot2, x), higher_is_better=True)["chosen"] == "useful"


def test_decided_slot_is_one_hot_and_stays_decided():
    slot = toy_slot()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    select_slot(slot, lambda: mse(slot, x), higher_is_better=False)
    assert slot.is_decided and slot.choice == "useful"
    assert slot.weights().tolist() == [1.0, 0.0, 0.0]
    torch.testing.assert_close(slot(x), 5.0 * x, rtol=0, atol=0)
    # Training cannot move a decided slot: alpha takes no gradient, the weights stay one-hot.
    assert not slot.alpha.requires_grad
    opt = torch.optim.Adam([slot.alpha], lr=1.0)
    opt.step()
    assert slot.weights().tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="decided already"):
        slot.decide(1)
    with pytest.raises(ValueError, match="decided already"):
        removal_metrics(slot, lambda: 0.0)
    # The decision is in the state dict (checkpoints keep it).
    fresh = toy_slot()
    fresh.load_state_dict(slot.state_dict())
    assert fresh.choice == "useful" and fresh.weights().tolist() == [1.0, 0.0, 0.0]


def test_mixed_attention_matches_the_weighted_sum_in_float64():
    torch.manual_seed(0)
    fk = {"dtype": torch.float64}
    ops = [build_attention(name, 8, 2, pos_dim=1, causal=True, options=opts, **fk)
           for name, opts in (("softmax", {}), ("performer", {"num_features": 16}), ("flt", {"num_features": 16}))]
    slot = MixedAttention(ops, ["softmax", "performer", "flt"])
    with torch.no_grad():
        slot.alpha.copy_(torch.tensor([0.3, -1.0, 0.5]))
    x = torch.randn(2, 6, 8, **fk)
    w = torch.softmax(slot.alpha.detach(), 0)
    expected = sum(w[k] * ops[k](x) for k in range(3))
    torch.testing.assert_close(slot(x), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(slot.exact(x), sum(w[k] * ops[k].exact(x) for k in range(3)), rtol=1e-12, atol=1e-12)
    slot.keep[1] = 0.0
    torch.testing.assert_close(slot(x), w[0] * ops[0](x) + w[2] * ops[2](x), rtol=1e-12, atol=1e-12)
    # alpha gets a gradient through the mixture.
    slot.keep[1] = 1.0
    slot(x).sum().backward()
    assert slot.alpha.grad is not None and torch.isfinite(slot.alpha.grad).all()


def test_supernet_keeps_random_feature_redraws_working():
    task = get_task("lm")
    cands = parse_candidates("flt,performer,softmax", task)
    model = task.build_model(get_preset("lm", "smoke").model)
    build_supernet(model, cands)
    slots = mixed_slots(model)
    assert len(slots) == 2 and all(s.labels == ["flt", "performer", "softmax"] for s in slots)
    found = [name for name, _ in random_feature_modules(model)]
    # Every FLT and Performer candidate of every slot is found by module traversal.
    for i in range(2):
        assert any(name.startswith(f"trunk.blocks.{i}.attn.ops.0") for name in found)
        assert any(name.startswith(f"trunk.blocks.{i}.attn.ops.1") for name in found)
    _, module = next(random_feature_modules(model))
    buf = module.random_feature_buffers[0]
    before = getattr(module, buf).clone()
    assert redraw(model, torch.Generator().manual_seed(1)) == len(found)
    assert not torch.equal(before, getattr(module, buf))
    # Candidates take the task's defaults for their name.
    assert cands[0].options["spectrum"] == "local" and cands[2].options["relative_bias"] == "t5"


def test_holdout_is_a_disjoint_part_of_the_training_split():
    task = load_task("image", {})
    task.configure(get_preset("image", "smoke").model)
    weights, alpha = split_task(task, 0.2)
    n = len(task.train)
    assert len(weights.train) + len(alpha.train) == n
    assert len(alpha.train) == round(0.2 * n) and alpha.valid is alpha.train
    assert task.valid is weights.valid  # the validation split is untouched
    rows = {tuple(img.flatten().tolist()) for img in weights.train.images}
    assert not any(tuple(img.flatten().tolist()) in rows for img in alpha.train.images[:50])
    with pytest.raises(ValueError, match="holdout"):
        split_task(task, 1.5)


def _tiny(steps: int = 6):
    preset = get_preset("image", "smoke", "flt")
    run = replace_fields(preset.run, steps=steps, eval_every=3, checkpoint_every=3, batch_size=16, eval_batches=4)
    return type(preset)(preset.task, preset.model, run, preset.data)


def _config(**kw):
    return SearchConfig(tuple(parse_candidates("flt,performer,softmax", get_task("image"))), tune_steps=2, **kw)


def _stable(result: dict) -> str:
    return json.dumps({k: v for k, v in result.items() if k not in ("seconds", "wall_time_s")}, sort_keys=True)


def test_search_is_reproducible_from_its_seed_and_resumes_to_the_same_result(tmp_path):
    torch.set_num_threads(1)
    cfg = _config()
    first = search(_tiny(), cfg, str(tmp_path / "a"), progress=False, plots=False)
    assert first["complete"] and sorted(first["order"]) == [0, 1]
    assert first["perturbation"] == [first["slots"][i]["chosen"] for i in range(2)]
    for entry in first["slots"]:
        assert set(entry["removed"]) == {"flt", "performer", "softmax"}
        assert math.isclose(sum(entry["alpha"].values()), 1.0, rel_tol=1e-9)
    second = search(_tiny(), cfg, str(tmp_path / "b"), progress=False, plots=False)
    assert _stable(first) == _stable(second)

    # Stopped during the fine-tuning after the first decision (step 8; the last checkpoint
    # is the supernet's, step 6): the resume ends with the uninterrupted result.
    _stop_and_resume(tmp_path / "stop-8", cfg, 8, first, tmp_path / "a")
    # A different configuration is refused on resume, and a fresh start in a used directory.
    with pytest.raises(ValueError, match="differ"):
        search(_tiny(), _config(alpha_lr=1e-2), str(tmp_path / "a"), resume=True, progress=False, plots=False)
    with pytest.raises(ValueError, match="already holds a search"):
        search(_tiny(), cfg, str(tmp_path / "a"), progress=False, plots=False)


def _stop_and_resume(out, cfg, stop_at: int, expected: dict, expected_dir) -> None:
    """Stop a search after step ``stop_at``, resume it, and compare it with the uninterrupted
    search in ``expected_dir``: the same record (selection, history, metrics) and, in the
    final checkpoint, the same weights and the same optimizer states, byte for byte."""
    def stop(step):
        if step == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(SearchInterrupted) as info:
        search(_tiny(), cfg, str(out), progress=False, plots=False, on_step=stop)
    assert info.value.checkpoint is not None and info.value.step == stop_at
    resumed = search(_tiny(), cfg, str(out), resume=True, progress=False, plots=False)
    assert _stable(resumed) == _stable(expected)
    ours, theirs = find_checkpoint(str(out)), find_checkpoint(str(expected_dir))
    assert os.path.basename(ours) == os.path.basename(theirs) == f"step-{expected['steps']:08d}"
    with open(os.path.join(ours, "model.safetensors"), "rb") as a, open(os.path.join(theirs, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()
    state, uninterrupted = load_trainer_state(ours), load_trainer_state(theirs)
    for key in ("optimizer", "alpha_optimizer", "rng"):
        assert _same(state[key], uninterrupted[key]), key


def _same(a, b) -> bool:
    """Equal nested containers of tensors and plain values (tensors equal bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_search_resumes_from_the_supernet_phase(tmp_path):
    torch.set_num_threads(1)
    cfg = _config()
    expected = search(_tiny(), cfg, str(tmp_path / "a"), progress=False, plots=False)
    _stop_and_resume(tmp_path / "stop-4", cfg, 4, expected, tmp_path / "a")  # checkpoint of step 3, mid-supernet


def test_fixed_alpha_stays_uniform_and_has_no_magnitude_choice(tmp_path):
    torch.set_num_threads(1)
    result = search(_tiny(3), _config(fixed_alpha=True), str(tmp_path / "f"), progress=False, plots=False)
    assert result["magnitude"] is None and all(e["magnitude"] is None for e in result["slots"])
    for entry in result["slots"]:
        assert all(p == pytest.approx(1 / 3, abs=1e-12) for p in entry["alpha"].values())


def test_weights_learn_from_the_training_split_alone(tmp_path):
    # With a negligible alpha learning rate the only trace of the held-out batches would be
    # their gradients on the weights: the supernet must train as with alpha frozen.
    torch.set_num_threads(1)
    moving = search(_tiny(3), _config(alpha_lr=1e-12), str(tmp_path / "m"), progress=False, plots=False)
    frozen = search(_tiny(3), _config(fixed_alpha=True), str(tmp_path / "f"), progress=False, plots=False)
    assert [h["loss"] for h in moving["history"]] == pytest.approx([h["loss"] for h in frozen["history"]], rel=1e-5)
    assert moving["slots"][0]["metric"] == pytest.approx(frozen["slots"][0]["metric"], abs=1e-9)


@pytest.mark.cli
@pytest.mark.parametrize("entry, match", [
    ("flt,softmax:no_such_option=1", "'softmax:no_such_option=1'"),
    ("flt,nosuchmechanism", "nosuchmechanism"),
    ("flt,toeplitz", "'toeplitz' does not construct"),  # a 1-D mechanism on 2-D patch positions
    ("flt", "at least two"),
])
def test_bad_candidate_is_a_clear_error_before_any_training(tmp_path, capsys, entry, match):
    out = tmp_path / "s"
    code = main(["search", "image", "--candidates", entry, "--preset", "smoke", "--out-dir", str(out), "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "flt search: error:" in err and match in err
    assert not out.exists()


@pytest.mark.cli
def test_search_refuses_init_from(tmp_path, capsys):
    out = tmp_path / "s"
    code = main(["search", "image", "--candidates", "flt,softmax", "--preset", "smoke", "--out-dir", str(out),
                 "--run-opt", "init_from=runs/x", "--threads", "1"])
    assert code == 2 and "init_from is not supported" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.cli
def test_cli_search_then_train_arch_builds_the_chosen_layers(tmp_path, capsys):
    out = tmp_path / "s"
    code = main(["search", "image", "--candidates", "flt,performer,softmax", "--preset", "smoke", "--steps", "4",
                 "--tune-steps", "1", "--eval-every", "2", "--out-dir", str(out), "--threads", "1", "--no-plots"])
    printed = capsys.readouterr().out
    assert code == 0 and "supernet step 4/4" in printed and "slot 2/2" in printed and "perturbation:" in printed
    result = json.loads((out / "search.json").read_text())
    for selection in ("perturbation", "magnitude"):
        run_dir = tmp_path / f"t-{selection}"
        code = main(["train", "image", "--arch", str(out / "search.json"), "--arch-select", selection, "--preset", "smoke",
                     "--steps", "2", "--eval-every", "2", "--run-opt", "draw_gap=false", "--out-dir", str(run_dir),
                     "--threads", "1", "--no-progress", "--no-plots"])
        assert code == 0
        from flt.train import load_checkpoint_model

        model, meta = load_checkpoint_model(str(run_dir))
        chosen = result[selection]
        names = {c["label"]: c["attention"] for c in result["candidates"]}
        assert [layer["attention"] for layer in meta["model"]["layer_attention"]] == [names[c] for c in chosen]
        classes = {"flt": "FLTAttention", "performer": "PerformerAttention", "softmax": "SoftmaxAttention"}
        assert [type(b.attn).__name__ for b in model.trunk.blocks] == [classes[names[c]] for c in chosen]
    capsys.readouterr()
    # --arch with --attention, a search of another task, and an unfinished search are refused.
    assert main(["train", "image", "--arch", str(out), "--attention", "flt", "--out-dir", str(tmp_path / "x")]) == 2
    assert "leave out --attention" in capsys.readouterr().err
    assert main(["train", "lm", "--arch", str(out), "--out-dir", str(tmp_path / "y")]) == 2
    assert "for task 'image'" in capsys.readouterr().err
    partial = json.loads((out / "search.json").read_text())
    partial["complete"] = False
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    assert main(["train", "image", "--arch", str(tmp_path / "partial.json"), "--out-dir", str(tmp_path / "z")]) == 2
    assert "not decided every layer" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "z")


def test_search_plot_draws_every_layer(tmp_path):
    pytest.importorskip("matplotlib")
    from flt.search.plots import plot_search

    cands = [{"label": k, "attention": k, "attention_options": {}} for k in ("flt", "softmax")]
    slot = {"alpha": {"flt": 0.3, "softmax": 0.7}, "metric": 0.9, "removed": {"flt": 0.5, "softmax": 0.88},
            "chosen": "flt", "magnitude": "softmax"}
    result = {"task": "image", "metric": "accuracy", "candidates": cands, "alpha_end": [[0.3, 0.7], [0.6, 0.4]],
              "slots": [{"layer": 0, **slot}, {"layer": 1, **slot, "magnitude": None}]}
    path = plot_search(result, str(tmp_path / "search.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_search_refuses_a_directory_another_process_holds(tmp_path):
    # The lock of flt train (flt.train.lock) guards a search's directory too; the search
    # is refused before anything is written there, and the holder's files stay as they were.
    import subprocess
    import sys

    from flt.train.lock import RunDirectoryInUse

    out = tmp_path / "held"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from flt.train.lock import lock_run_dir; "
         "lock_run_dir(sys.argv[1], 'flt search'); print('locked', flush=True); time.sleep(120)", str(out)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = sorted(p.name for p in out.iterdir())
        with pytest.raises(RunDirectoryInUse, match=rf"in use by flt search \(pid {holder.pid}"):
            search(_tiny(), _config(), str(out), progress=False, plots=False)
        assert sorted(p.name for p in out.iterdir()) == before
    finally:
        holder.kill()
        holder.wait()
