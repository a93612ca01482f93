"""Draw-robust training (redraws every step by default), fixed evaluation draws and the
draw-gap report of ``flt train`` (flt.train.drawgap)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from flt.layers.draws import random_feature_modules
from flt.models import build_model
from flt.train import get_preset, load_checkpoint_model, train
from flt.train.checkpoint import find_checkpoint, read_checkpoint_config
from flt.train.config import Preset, RunConfig, preset_from_dict, preset_to_dict
from flt.train.drawgap import draw_gap, evaluation_draw, exact_batch_size, redraw_for_step
from flt.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(task="lm", attention="flt", steps=7, **run) -> Preset:
    """A run of a few seconds (dropout on, so the training RNG matters for resume)."""
    p = get_preset(task, "smoke", attention)
    if task == "lm":
        model = dataclasses.replace(p.model, dim=32, dropout=0.1, max_len=32)
        data = {"max_bytes": 20_000}
    else:
        model = dataclasses.replace(p.model, dim=16, dropout=0.1)
        data = {**p.data, "num_samples": 48, "progress": False}
    run = {"checkpoint_every": 2, **run}
    run_cfg = dataclasses.replace(p.run, steps=steps, batch_size=4, eval_every=3, log_every=1, **run)
    return Preset(task, model, run_cfg, data)


def draws(model):
    return {f"{n}.{b}": getattr(m, b).clone() for n, m in random_feature_modules(model) for b in m.random_feature_buffers}


class Killed(Exception):
    pass


def test_redraw_interval_defaults_and_old_runs_load_as_fixed_draw_runs():
    assert RunConfig().redraw_interval == 1 and RunConfig().draw_gap
    assert RunConfig(redraw_interval=None).redraw_interval is None and RunConfig(redraw_interval=0).redraw_interval == 0
    with pytest.raises(ValueError, match="redraw_interval"):
        RunConfig(redraw_interval=-1)
    saved = preset_to_dict(tiny())
    del saved["run"]["redraw_interval"], saved["run"]["draw_gap"]
    # A run saved before redraws existed trained on one draw: resuming it keeps doing so.
    assert preset_from_dict(saved).run.redraw_interval == 0


def test_training_redraws_are_a_function_of_seed_and_step():
    preset = tiny()
    model = build_model(dataclasses.replace(preset.model, vocab_size=256))
    run = preset.run
    initial = draws(model)
    assert redraw_for_step(model, run, 1)
    d1 = draws(model)
    assert all(not torch.equal(d1[k], initial[k]) for k in d1)
    redraw_for_step(model, run, 2)
    assert all(not torch.equal(draws(model)[k], d1[k]) for k in d1)
    redraw_for_step(model, run, 1)
    assert all(torch.equal(draws(model)[k], d1[k]) for k in d1)
    every3 = dataclasses.replace(run, redraw_interval=3)
    assert [redraw_for_step(model, every3, s) for s in range(1, 8)] == [True, False, False, True, False, False, True]
    assert not redraw_for_step(model, dataclasses.replace(run, redraw_interval=0), 1)
    # Validation: one fixed draw whatever the training draw, and the training draw comes back.
    with evaluation_draw(model, run):
        fixed = draws(model)
    redraw_for_step(model, run, 5)
    training = draws(model)
    with evaluation_draw(model, run):
        assert all(torch.equal(draws(model)[k], fixed[k]) for k in fixed)
    assert all(torch.equal(draws(model)[k], training[k]) for k in training)


@pytest.mark.parametrize("interval", [1, 2])
def test_resume_is_bit_for_bit_with_redraws(tmp_path, interval):
    """Killed after step 5 (last checkpoint: step 3, after a validation), resumed: the same
    weights, draws, losses, validation metrics and draw gap as an uninterrupted run. With
    interval 2 the draw of step 4 is the one of step 3, from the checkpoint's buffers."""
    preset = tiny(redraw_interval=interval, checkpoint_every=3)
    straight = train(preset, str(tmp_path / "a"), progress=False, plots=False)

    def kill(step):
        if step == 5:
            raise Killed

    with pytest.raises(Killed):
        train(preset, str(tmp_path / "b"), progress=False, plots=False, on_step=kill)
    assert read_checkpoint_config(find_checkpoint(str(tmp_path / "b")))["step"] == 3
    resumed = train(preset, str(tmp_path / "b"), resume=True, progress=False, plots=False)
    a = load_checkpoint_model(str(tmp_path / "a"))[0].state_dict()
    b = load_checkpoint_model(str(tmp_path / "b"))[0].state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in rs]  # noqa: E731
    ra = strip(read_metrics(str(tmp_path / "a" / "metrics.jsonl")))
    assert ra == strip(read_metrics(str(tmp_path / "b" / "metrics.jsonl")))
    assert resumed["final"] == straight["final"] and resumed["draw_gap"] == straight["draw_gap"]


def test_the_run_trains_on_changing_draws_and_ends_on_its_evaluation_draw(tmp_path, monkeypatch):
    import flt.train.drawgap as DG

    preset = tiny(steps=4)
    snapshots = []
    real = DG.redraw_for_step

    def spy(model, run, step):
        did = real(model, run, step)
        snapshots.append(draws(model))
        return did

    monkeypatch.setattr(DG, "redraw_for_step", spy)
    train(preset, str(tmp_path / "r"), progress=False, plots=False)
    assert len(snapshots) == 4
    for s, t in zip(snapshots, snapshots[1:]):
        assert all(not torch.equal(s[k], t[k]) for k in s)
    model = load_checkpoint_model(str(tmp_path / "r"))[0]
    saved = draws(model)
    with evaluation_draw(model, preset.run):
        assert all(torch.equal(draws(model)[k], saved[k]) for k in saved)


@pytest.mark.parametrize("task", ["lm", "molecule"])
def test_draw_gap_report_is_well_formed(tmp_path, task, capsys, monkeypatch):
    monkeypatch.setenv("FLT_CACHE_DIR", str(tmp_path / "cache"))
    preset = tiny(task, steps=4)
    summary = train(preset, str(tmp_path / "run"), progress=False, plots=False)
    gap = summary["draw_gap"]
    assert set(gap) == {"own", "fresh_mean", "fresh_std", "exact"}
    assert all(isinstance(gap[k], float) and math.isfinite(gap[k]) for k in gap), gap
    assert gap["own"] == summary["final"][summary["metric"]] and gap["fresh_std"] > 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["draw_gap"] == gap
    assert f"draw gap ({summary['metric']}): own draw" in capsys.readouterr().out


def test_draw_gap_batches_caps_every_draw_gap_evaluation_and_reevaluates_own(tmp_path, monkeypatch):
    import flt.train.loop as loop

    calls = []
    real = loop.evaluate

    def spy(task, model, ctx, batch_size, max_batches, split="valid"):
        metrics = real(task, model, ctx, batch_size, max_batches, split=split)
        if split == "valid":  # the test split is read once, apart from the draw gap
            calls.append((max_batches, metrics["ppl"]))
        return metrics

    monkeypatch.setattr(loop, "evaluate", spy)
    summary = train(tiny(steps=3, draw_gap_batches=1), str(tmp_path / "r"), progress=False, plots=False)
    gap = summary["draw_gap"]
    # final validation (whole split), then own + 3 fresh + exact on the first batch only
    assert [c[0] for c in calls[-6:]] == [None, 1, 1, 1, 1, 1]
    assert gap["own"] == calls[-5][1] and gap["exact"] == calls[-1][1]
    assert gap["own"] != summary["final"]["ppl"]  # one batch, not the whole split
    with pytest.raises(ValueError, match="draw_gap_batches"):
        RunConfig(draw_gap_batches=0)


def test_models_without_random_features_have_no_draw_gap_and_toeplitz_no_exact(tmp_path, monkeypatch):
    """A layer without an exact form (Toeplitz before it had ``exact()``; here with it
    removed) gets no exact number in the draw gap, not an error."""
    from flt.layers.toeplitz import ToeplitzAttention

    softmax = train(tiny(attention="softmax", steps=2), str(tmp_path / "s"), progress=False, plots=False)
    assert "draw_gap" not in softmax
    monkeypatch.setattr(ToeplitzAttention, "exact", None)
    toeplitz = train(tiny(attention="toeplitz", steps=2), str(tmp_path / "t"), progress=False, plots=False)
    assert toeplitz["draw_gap"]["exact"] is None and math.isfinite(toeplitz["draw_gap"]["fresh_mean"])
    monkeypatch.undo()
    off = train(tiny(steps=2, draw_gap=False), str(tmp_path / "o"), progress=False, plots=False)
    assert "draw_gap" not in off


def test_toeplitz_draw_gap_has_an_exact_number(tmp_path):
    toeplitz = train(tiny(attention="toeplitz", steps=2), str(tmp_path / "t"), progress=False, plots=False)
    assert math.isfinite(toeplitz["draw_gap"]["exact"]) and math.isfinite(toeplitz["draw_gap"]["fresh_mean"])


def test_without_redraws_own_is_the_training_draw_and_exact_is_skipped_when_too_large():
    preset = tiny(redraw_interval=0)
    model = build_model(dataclasses.replace(preset.model, vocab_size=256))
    before = draws(model)
    calls = []

    def evaluate(m, bs):
        calls.append((type(m).__name__, bs))
        return {"ppl": 2.0 + 0.1 * len(calls)}

    class Task:
        name, metric = "lm", "ppl"

        def longest_sequence(self, cfg):
            return cfg.max_len

    gap = draw_gap(Task(), model, preset.model, preset.run, evaluate, 8)
    assert gap["own"] == pytest.approx(2.1)  # evaluated on the model's own (only) draw
    assert gap["fresh_mean"] == pytest.approx(2.3) and gap["exact"] == pytest.approx(2.5)
    assert calls[-1] == ("ExactForward", 8)
    assert all(torch.equal(draws(model)[k], before[k]) for k in before)
    # One sample of N = 32 tokens and 2 heads holds 2048 weights.
    assert exact_batch_size(Task(), model, preset.model, 8, max_elements=4096) == 2
    assert exact_batch_size(Task(), model, preset.model, 8, max_elements=2047) is None
    gap = draw_gap(Task(), model, preset.model, preset.run, evaluate, 8, max_elements=2047)
    assert gap["exact"] is None


def test_softmax_with_an_exact_spectrum_bias_has_no_random_features():
    from flt.layers.draws import has_random_features
    from flt.layers.softmax import SoftmaxAttention

    layer = SoftmaxAttention.from_options(16, 2, relative_bias="spectrum", spectrum="gaussian", amplitude=0.5)
    assert not has_random_features(layer)
    before = layer.spectrum.eps.clone()
    from flt.layers.draws import redraw
    redraw(layer, torch.Generator().manual_seed(3))
    assert torch.equal(layer.spectrum.eps, before)
