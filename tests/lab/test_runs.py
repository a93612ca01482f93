"""Run directories: file permissions under the umask, Ctrl-C, resuming without
``checkpoints/latest``, and extending a run's step budget (tracker issue 9)."""

from __future__ import annotations

import dataclasses
import os
import shlex
import stat
import sys
import warnings

import pytest
import torch

import flt.train
from flt import _io
from flt.cli import main
from flt.commands.train import interrupted_message, launcher
from flt.train import CheckpointError, RunConfig, get_preset, load_checkpoint_model, train
from flt.train.checkpoint import find_checkpoint, has_checkpoint
from flt.train.config import Preset
from flt.train.loop import TrainingInterrupted
from flt.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_lm(steps=9, **run) -> Preset:
    """A few-second LM run (as in test_train.py): 2 layers of width 32, dropout, FLT's
    random features redrawn every step unless ``redraw_interval`` says otherwise."""
    p = get_preset("lm", "smoke")
    model = dataclasses.replace(p.model, dim=32, dropout=0.1, max_len=32)
    fields = {"steps": steps, "batch_size": 4, "eval_every": 4, "checkpoint_every": 3, "log_every": 1, "draw_gap": False, **run}
    return Preset("lm", model, dataclasses.replace(p.run, **fields), {"max_bytes": 20_000})


def weights(path):
    model, _ = load_checkpoint_model(path)
    return model.state_dict()


def assert_same_weights(a, b):
    a, b = weights(str(a)), weights(str(b))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def run_quietly(preset, out, **kwargs):
    return train(preset, str(out), progress=False, plots=False, **kwargs)


# --- 1. permissions -----------------------------------------------------------------------


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_current_umask_is_read_without_changing_it(umask, monkeypatch):
    assert _io.current_umask() == umask
    assert _io.file_mode() == 0o666 & ~umask and _io.dir_mode() == 0o777 & ~umask
    # Without /proc (macOS, Windows): set and restore, with the same answer.
    def no_proc(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(_io, "open", no_proc, raising=False)
    assert _io.current_umask() == umask
    monkeypatch.undo()
    assert os.umask(umask) == umask  # still set as the fixture left it


def test_run_files_checkpoints_and_caches_get_the_modes_of_open_and_makedirs(umask, tmp_path):
    f, d = 0o666 & ~umask, 0o777 & ~umask
    out = tmp_path / "run"
    run_quietly(tiny_lm(steps=3), out)
    run_quietly(tiny_lm(steps=3), out, resume=True)  # rewrites metrics.jsonl atomically
    root = out / "checkpoints"
    files = [out / "run.json", out / "summary.json", out / "metrics.jsonl", root / "latest"]
    step_dirs = [p for p in root.iterdir() if p.name.startswith("step-")]
    assert step_dirs
    for ckpt in step_dirs:
        files += [ckpt / "model.safetensors", ckpt / "trainer.pt", ckpt / "config.json"]
    assert {str(p): oct(mode(p)) for p in files} == {str(p): oct(f) for p in files}
    assert {str(p): oct(mode(p)) for p in [out, root, *step_dirs]} == {str(p): oct(d) for p in [out, root, *step_dirs]}
    # The molecule cache is written by the same atomic writer.
    from flt.data.molecules import load_catalysis

    load_catalysis(4, relax_steps=0, valid_fraction=0.5, cache_dir=tmp_path / "cache", progress=False)
    (cache,) = (tmp_path / "cache").iterdir()
    assert mode(cache) == f
    # An atomic write over an existing private file gives the new file open()'s mode too.
    target = tmp_path / "private.txt"
    target.write_text("old")
    os.chmod(target, 0o600)
    _io.atomic_write(str(target), lambda fh: fh.write("new"))
    assert target.read_text() == "new" and mode(target) == f
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


# --- 2. Ctrl-C ----------------------------------------------------------------------------


def ctrl_c_at(step):
    def hook(s):
        if s == step:
            raise KeyboardInterrupt

    return hook


IMAGE = ["train", "image", "--preset", "smoke", "--steps", "8", "--checkpoint-every", "3", "--no-progress", "--no-plots"]


@pytest.mark.cli
def test_ctrl_c_prints_one_line_with_the_resume_command_and_exits_130(tmp_path, monkeypatch, capsys):
    assert main([*IMAGE, "--out-dir", str(tmp_path / "straight")]) == 0
    real_train = flt.train.train
    monkeypatch.setattr(flt.train, "train", lambda *a, **kw: real_train(*a, on_step=ctrl_c_at(5), **kw))
    out = tmp_path / "with space"  # the command must be shell-quoted
    argv = [*IMAGE, "--out-dir", str(out)]
    capsys.readouterr()
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    head, command = err.strip().split("; resume with: ")
    assert head == f"flt train: interrupted after step 5 of 8; last checkpoint {out / 'checkpoints' / 'step-00000003'}"
    words = shlex.split(command)
    assert words == [sys.executable, "-m", "flt", *argv, "--resume"]
    monkeypatch.undo()
    # The printed command resumes the run, which ends where an uninterrupted one does.
    assert main(words[3:]) == 0
    assert_same_weights(tmp_path / "straight", out)


@pytest.mark.cli
def test_ctrl_c_before_the_first_checkpoint_and_on_other_processes(tmp_path, monkeypatch, capsys):
    real_train = flt.train.train
    monkeypatch.setattr(flt.train, "train", lambda *a, **kw: real_train(*a, on_step=ctrl_c_at(1), **kw))
    argv = [*IMAGE, "--out-dir", str(tmp_path / "run")]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip()
    # No checkpoint: --resume would fail, the same command starts over.
    assert err == ("flt train: interrupted after step 1 of 8, before the first checkpoint; nothing to resume; start again with: "
                   + shlex.join([sys.executable, "-m", "flt", *argv]))

    # Under torchrun only rank 0 speaks; every process exits with 130.
    def interrupted_elsewhere(*args, **kwargs):
        raise TrainingInterrupted(str(tmp_path / "run"), 4, 8, None, is_main=False)

    monkeypatch.setattr(flt.train, "train", interrupted_elsewhere)
    assert main(argv) == 130
    assert capsys.readouterr().err == ""


def test_resume_command_names_the_launcher(monkeypatch):
    package = os.path.dirname(flt.__file__)
    monkeypatch.setattr(sys, "argv", [os.path.join(package, "__main__.py"), "train", "lm"])
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-m", "flt", "train", "lm"])
    assert launcher() == ["python3", "-m", "flt"]
    stop = TrainingInterrupted("runs/x", 7, 10, "runs/x/checkpoints/step-00000005", is_main=True)
    assert interrupted_message(stop, ["train", "lm", "--resume"]).endswith("resume with: python3 -m flt train lm --resume")
    # torchrun on one node: relaunch with the same number of processes.
    monkeypatch.setattr(sys, "argv", [os.path.join(package, "cli.py"), "train", "lm"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert launcher() == ["torchrun", "--nproc_per_node=2", "-m", "flt.cli"]
    # Several nodes: the rendezvous options are unknown here.
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert launcher() is None
    assert "resume with the same torchrun launch and the arguments train lm --resume" in interrupted_message(stop, ["train", "lm"])


# --- 3. resuming without checkpoints/latest -----------------------------------------------


def test_resume_without_latest_takes_the_newest_complete_checkpoint(tmp_path, capsys):
    preset = tiny_lm(steps=6, checkpoint_every=2, keep_checkpoints=3)
    out = tmp_path / "run"
    run_quietly(preset, out)
    final = weights(str(out))
    root = out / "checkpoints"
    (root / "latest").unlink()
    # The newest checkpoint is damaged (a truncated file); the one before is complete.
    model_file = root / "step-00000006" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:100])
    assert has_checkpoint(str(out))
    with pytest.raises(ValueError, match="already holds a run"):
        run_quietly(preset, out)
    capsys.readouterr()
    run_quietly(preset, out, resume=True)
    text = capsys.readouterr().out
    assert f"skipping {root / 'step-00000006'}: checkpoint file {model_file} is corrupt or truncated" in text
    assert f"using {root / 'step-00000004'}, the newest complete checkpoint" in text
    assert "steps 5..6" in text
    # Steps 5 and 6 were redone: the same weights as before, and `latest` is back.
    resumed = weights(str(out))
    assert all(torch.equal(final[k], resumed[k]) for k in final)
    assert (root / "latest").read_text() == "step-00000006\n"


def test_find_checkpoint_reports_its_fallback_and_fails_clearly(tmp_path, capsys):
    out = tmp_path / "run"
    run_quietly(tiny_lm(steps=2, checkpoint_every=1), out)
    root = out / "checkpoints"
    (root / "latest").unlink()
    messages = []
    assert find_checkpoint(str(out), report=messages.append) == str(root / "step-00000002")
    assert messages == [f"{root / 'latest'} is missing; using {root / 'step-00000002'}, the newest complete checkpoint"]
    # By default the message is one line on stderr, not a Python warning.
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_checkpoint_model(str(out))
    assert capsys.readouterr().err == f"note: {messages[0]}\n"
    for name in ("step-00000001", "step-00000002"):
        (root / name / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="none of step-00000001, step-00000002 is complete"):
        find_checkpoint(str(out))
    for name in ("step-00000001", "step-00000002"):
        for f in (root / name).iterdir():
            f.unlink()
        (root / name).rmdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        find_checkpoint(str(out))


# --- 4. extending the step budget ---------------------------------------------------------


@pytest.mark.parametrize("redraw_interval", [1, 2])
def test_extending_a_finished_run_equals_the_longer_run_when_the_schedule_has_no_decay(tmp_path, redraw_interval):
    # min_lr_ratio=1: constant after warm-up, the same rate at every step for any budget;
    # the documented case in which an extension is bit for bit the longer run. With
    # redraw_interval=2, step 6 trains on step 5's draw, which the final checkpoint of the
    # 5-step run does not hold (it keeps the evaluation draw).
    short = tiny_lm(steps=5, warmup_steps=2, min_lr_ratio=1.0, redraw_interval=redraw_interval)
    long = dataclasses.replace(short, run=dataclasses.replace(short.run, steps=9))
    run_quietly(long, tmp_path / "long")
    run_quietly(short, tmp_path / "extended")
    summary = run_quietly(long, tmp_path / "extended", resume=True)
    assert summary["steps"] == 9
    assert_same_weights(tmp_path / "long", tmp_path / "extended")


def test_extension_follows_the_schedule_of_the_new_budget_and_other_changes_are_refused(tmp_path, capsys):
    # With the default cosine decay: steps 1..4 at the 4-step rates, 5..8 at the 8-step ones.
    short = tiny_lm(steps=4, warmup_steps=2)
    assert short.run.min_lr_ratio < 1
    out = tmp_path / "run"
    run_quietly(short, out)
    longer = dataclasses.replace(short, run=dataclasses.replace(short.run, steps=8))
    capsys.readouterr()
    run_quietly(longer, out, resume=True)
    assert "extending the run from 4 to 8 steps" in capsys.readouterr().out
    lrs = {r["step"]: r["lr"] for r in read_metrics(str(out / "metrics.jsonl")) if r["split"] == "train"}
    assert lrs == {s: (short.run if s <= 4 else longer.run).lr_at(s) for s in range(1, 9)}
    assert lrs[5] > lrs[4] == short.run.lr_at(4) == short.run.min_lr_ratio * short.run.lr  # the warm restart
    assert lrs[8] == pytest.approx(longer.run.min_lr_ratio * longer.run.lr)
    assert RunConfig(**{**dataclasses.asdict(short.run), "steps": 8}).lr_at(5) == lrs[5]
    # Shortening, or any other change, is still refused, naming the field.
    with pytest.raises(ValueError, match=r"--steps 6 is below the budget .* \(8 steps, checkpoint at step 8\).*pass --steps 8"):
        run_quietly(dataclasses.replace(short, run=dataclasses.replace(short.run, steps=6)), out, resume=True)
    other = dataclasses.replace(short, run=dataclasses.replace(short.run, steps=12, lr=1e-4))
    with pytest.raises(ValueError, match=r"these differ: run\.lr \(only --steps may change"):
        run_quietly(other, out, resume=True)
