"""Nothing lost in a run directory: one trainer per directory (its lock, taken over from a
killed holder), resume equal to the uninterrupted run in every file, leftovers of a kill
cleared, a corrupt newest checkpoint skipped with a message, checkpoint file names
confined to the checkpoint, and a diverging loss stopping with the last checkpoint intact."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import Killed, kill_at
from flt.cli import main
from flt.tasks import TASKS
from flt.train import CheckpointError, get_preset, load_checkpoint_model, train
from flt.train import checkpoint as ckpt_io
from flt.train.checkpoint import find_checkpoint, read_checkpoint_config
from flt.train.config import Preset
from flt.train.lock import LOCK_FILE, RunDirectoryInUse, lock_run_dir
from flt.train.loop import TrainingDiverged
from flt.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

#: Fields that measure time, not what was computed: the only ones a resumed run may change.
TIMING_METRICS = {"tok_per_s"}
TIMING_SUMMARY = {"time_per_step_s", "train_time_s", "wall_time_s", "peak_memory_mib"}


def tiny_lm(steps=11, **run) -> Preset:
    """A few-second LM run (as in test_train.py), logging every 4 steps and checkpointing
    every 3, so that checkpoints fall inside a logging window."""
    p = get_preset("lm", "smoke")
    model = dataclasses.replace(p.model, dim=32, dropout=0.1, max_len=32)
    fields = {"steps": steps, "batch_size": 4, "eval_every": 4, "checkpoint_every": 3, "log_every": 4, "draw_gap": False, **run}
    return Preset("lm", model, dataclasses.replace(p.run, **fields), {"max_bytes": 20_000})


def run_quietly(preset, out, **kwargs):
    return train(preset, str(out), progress=False, plots=False, **kwargs)



def weights(path):
    model, _ = load_checkpoint_model(str(path), report=lambda m: None)
    return model.state_dict()


def assert_same_weights(a, b):
    a, b = weights(a), weights(b)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def without(record: dict, keys) -> dict:
    return {k: v for k, v in record.items() if k not in keys}


def run_files(out) -> dict:
    """Every file a run wrote, timings left out: metrics, summary, run.json, and the final
    checkpoint's weights (bytes), trainer state and config. The trainer state holds two
    timings (the step times, the seconds of the logging window), so its SHA-256 in
    config.json is left out too."""
    ckpt = find_checkpoint(str(out), report=lambda m: None)
    config = json.loads(Path(ckpt, "config.json").read_text())
    del config["files"]["trainer.pt"]["sha256"]
    state = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=True)
    del state["step_times"]
    for window in state["log_window"]:
        del window["seconds"]
    return {
        "metrics": [without(r, TIMING_METRICS) for r in read_metrics(str(out / "metrics.jsonl"))],
        "summary": without(json.loads((out / "summary.json").read_text()), TIMING_SUMMARY),
        "run.json": (out / "run.json").read_text(),
        "config.json": config,
        "model": Path(ckpt, "model.safetensors").read_bytes(),
        "trainer.pt": plain(state),
    }


def plain(value):
    """``value`` with tensors turned into (dtype, shape, values) tuples, comparable with ==."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype), tuple(value.shape), value.flatten().tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 11-step run that resumed runs are compared with."""
    out = tmp_path_factory.mktemp("straight") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every test here (one_thread)
    try:
        run_quietly(tiny_lm(), out)
    finally:
        torch.set_num_threads(threads)
    return out


# --- the lock -----------------------------------------------------------------------------


def test_a_second_trainer_is_refused_and_the_first_run_is_intact(tmp_path, straight):
    out = tmp_path / "run"
    leftover = out / ".summary.json.abcd1234.tmp"
    refusals = []

    def second_trainer(step):
        if step != 5:
            return
        leftover.write_text("not ours to delete while the first trainer runs")
        for resume in (False, True):
            with pytest.raises(RunDirectoryInUse) as refused:
                run_quietly(tiny_lm(seed=1), out, resume=resume)
            refusals.append(str(refused.value))

    run_quietly(tiny_lm(), out, on_step=second_trainer)
    assert len(refusals) == 2
    for message in refusals:
        assert message.startswith(f"{out} is in use by flt train (pid {os.getpid()}, started ")
        assert message.endswith("wait for it to finish or use another --out-dir")
    # The refused trainers touched nothing: not the first one's files, nor its temporaries.
    assert leftover.exists()
    assert run_files(out) == run_files(straight)
    assert not (out / LOCK_FILE).exists()


def test_the_lock_of_a_killed_trainer_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from flt.train.lock import lock_run_dir; "
         "lock_run_dir(sys.argv[1], 'flt train'); print('locked', flush=True); time.sleep(120)", str(out)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    with holder:
        try:
            assert holder.stdout.readline().strip() == "locked"
            with pytest.raises(RunDirectoryInUse, match=rf"in use by flt train \(pid {holder.pid}, started "):
                run_quietly(tiny_lm(steps=2), out)
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=30)
    # The kernel released the dead holder's lock; its record is still in the file.
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == holder.pid
    capsys.readouterr()
    run_quietly(tiny_lm(steps=2), out)
    assert f"marked as in use by flt train (pid {holder.pid}, started" in capsys.readouterr().out
    assert not (out / LOCK_FILE).exists()
    assert read_checkpoint_config(find_checkpoint(str(out)))["step"] == 2


def test_lock_file_is_replaced_safely_and_a_refused_directory_is_left_alone(tmp_path):
    out = tmp_path / "run"
    with lock_run_dir(str(out)) as lock:
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(RunDirectoryInUse):
            lock_run_dir(str(out))
        assert lock.note is None
    # Released: the file is gone and the directory the lock created is removed again.
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with lock_run_dir(str(out)):
        pass
    assert sorted(os.listdir(out)) == ["keep.txt"]


# --- resume: every file as in the uninterrupted run ------------------------------------------


@pytest.mark.parametrize("killed_after", [5, 8])
def test_resume_writes_the_files_of_the_uninterrupted_run(tmp_path, straight, killed_after):
    # Killed after step 5 (checkpoint 3, one step into the window of steps 5..8) or 8
    # (checkpoint 6, steps 5 and 6 of that window done): the first record after the resume
    # must average the whole window, as the uninterrupted run's does.
    out = tmp_path / "run"
    with pytest.raises(Killed):
        run_quietly(tiny_lm(), out, on_step=kill_at(killed_after))
    run_quietly(tiny_lm(), out, resume=True)
    resumed, reference = run_files(out), run_files(straight)
    assert [(r["step"], r["split"]) for r in resumed["metrics"]] == [(r["step"], r["split"]) for r in reference["metrics"]]
    for a, b in zip(resumed["metrics"], reference["metrics"]):
        assert a == b
    assert resumed == reference
    # Timings restored from the checkpoint: one per step, of the steps that count.
    assert len(torch.load(os.path.join(find_checkpoint(str(out)), "trainer.pt"), weights_only=True)["step_times"]) == 11


def test_resuming_a_finished_run_keeps_its_timings(tmp_path):
    out = tmp_path / "run"
    before = run_quietly(tiny_lm(steps=4), out)
    after = run_quietly(tiny_lm(steps=4), out, resume=True)
    assert before["time_per_step_s"] > 0 and before["train_time_s"] > 0
    saved = json.loads((out / "summary.json").read_text())
    for key in ("time_per_step_s", "train_time_s"):
        assert after[key] == saved[key] == before[key]
    assert after["final"] == before["final"]


CLI = ["train", "lm", "--preset", "smoke", "--run-opt", "log_every=1", "--eval-every", "2", "--no-progress", "--no-plots",
       "--data-opt", "max_bytes=20000", "--model-opt", "dim=32", "--run-opt", "draw_gap=false"]


@pytest.mark.cli
def test_a_plain_resume_of_an_extended_run_continues_to_its_own_budget(tmp_path, capsys):
    argv = [*CLI, "--out-dir", str(tmp_path / "run")]
    assert main([*argv, "--steps", "2"]) == 0
    assert main([*argv, "--steps", "4", "--resume"]) == 0
    capsys.readouterr()
    # No --steps: the run's own (extended) budget, not the preset's, and not an error.
    assert main([*argv, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "steps 5..4" in out and "extending" not in out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


def test_keep_steps_resumes_to_the_saved_budget_and_a_smaller_one_is_refused(tmp_path):
    short = tiny_lm(steps=2)
    run_quietly(short, tmp_path / "py")
    run_quietly(tiny_lm(steps=3), tmp_path / "py", resume=True)
    assert run_quietly(short, tmp_path / "py", resume=True, keep_steps=True)["steps"] == 3
    with pytest.raises(ValueError, match=r"--steps 2 is below the budget"):
        run_quietly(short, tmp_path / "py", resume=True)


# --- leftovers of a kill ----------------------------------------------------------------------


def test_leftovers_of_a_killed_trainer_are_removed_on_resume(tmp_path, straight, capsys):
    out = tmp_path / "run"
    with pytest.raises(Killed):
        run_quietly(tiny_lm(), out, on_step=kill_at(8))
    root = out / "checkpoints"
    leftovers = [out / ".summary.json.k2j4h5g6.tmp", out / ".metrics.jsonl.a1b2c3d4.tmp", root / ".latest.zzzz9999.tmp"]
    for path in leftovers:
        path.write_text("half written")
    temp_dir = root / ".step-00000009.abcdefgh.tmp"
    temp_dir.mkdir()
    (temp_dir / "model.safetensors").write_bytes(b"half")
    # step-3 as an older version left it when killed while deleting it: files gone, dir kept.
    (root / "step-00000003" / "model.safetensors").unlink()
    keep = [out / "notes.txt", out / ".hidden.tmp", root / "README"]
    for path in keep:
        path.write_text("the user's")
    capsys.readouterr()
    run_quietly(tiny_lm(), out, resume=True)
    text = capsys.readouterr().out
    for path in [*leftovers, temp_dir, root / "step-00000003"]:
        assert not path.exists(), path
        assert f"removed {path}, left half written by a trainer that was killed" in text
    assert all(path.read_text() == "the user's" for path in keep)
    assert run_files(out) == run_files(straight)


def test_leftovers_are_removed_when_a_fresh_run_starts(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    leftover = out / ".run.json.q1w2e3r4.tmp"
    leftover.write_text("{")
    run_quietly(tiny_lm(steps=1), out)
    assert not leftover.exists()
    assert f"removed {leftover}" in capsys.readouterr().out


def test_pruned_checkpoints_are_renamed_before_they_are_deleted(tmp_path, monkeypatch):
    out = tmp_path / "run"
    run_quietly(tiny_lm(steps=6), out)
    root = out / "checkpoints"
    model, meta = load_checkpoint_model(str(out))

    def killed_mid_delete(path, *args, **kwargs):
        raise Killed

    monkeypatch.setattr(shutil, "rmtree", killed_mid_delete)
    with pytest.raises(Killed):
        ckpt_io.save_checkpoint(str(out), 9, model, config={k: meta[k] for k in ("preset", "model", "extra")},
                                trainer_state={}, keep=2)
    # step-3 was being deleted: it is gone under its own name, left under a temporary one.
    names = sorted(os.listdir(root))
    assert [n for n in names if n.startswith("step-")] == ["step-00000006", "step-00000009"]
    assert [n for n in names if n.startswith(".step-00000003.") and n.endswith(".tmp")]
    monkeypatch.undo()
    assert ckpt_io.remove_leftovers(str(out)) and not [n for n in os.listdir(root) if n.endswith(".tmp")]


# --- a corrupt newest checkpoint ----------------------------------------------------------


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(tmp_path, straight, capsys):
    out = tmp_path / "run"
    run_quietly(tiny_lm(keep_checkpoints=3), out)
    root = out / "checkpoints"
    newest, before = root / "step-00000011", root / "step-00000009"
    model_file = newest / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    messages = []
    assert find_checkpoint(str(out), report=messages.append) == str(before)
    assert messages == [f"{newest} is corrupt (checkpoint file {model_file} is corrupt or truncated (its size or SHA-256 does "
                        f"not match {newest / 'config.json'})); using {before}, the newest complete checkpoint"]
    # flt evaluate's loader falls back and says so on stderr in one line.
    capsys.readouterr()
    load_checkpoint_model(str(out))
    assert capsys.readouterr().err == f"note: {messages[0]}\n"
    from flt.commands.evaluate import evaluate_run

    assert math.isfinite(evaluate_run(str(out), draws=0, exact=False, max_batches=1)["own"])
    # --resume redoes steps 10 and 11 from step 9, and ends where the run ended.
    capsys.readouterr()
    run_quietly(tiny_lm(keep_checkpoints=3), out, resume=True)
    assert messages[0] in capsys.readouterr().out
    assert (root / "latest").read_text() == "step-00000011\n"
    assert_same_weights(out, straight)


def test_when_no_checkpoint_verifies_the_error_names_each(tmp_path):
    out = tmp_path / "run"
    run_quietly(tiny_lm(steps=6), out)
    root = out / "checkpoints"
    for name in ("step-00000003", "step-00000006"):
        (root / name / "trainer.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"latest names step-00000006 and none of step-00000003, step-00000006 is complete "
                       r"\(step-00000006: checkpoint file .*trainer.pt is corrupt .*; step-00000003: "):
        find_checkpoint(str(out), report=lambda m: None)


# --- file names read from a checkpoint ----------------------------------------------------


@pytest.mark.parametrize("name", ["../../secret", "/etc/passwd", "..", "sub/model.safetensors", ""])
def test_config_json_cannot_name_files_outside_the_checkpoint(tmp_path, monkeypatch, name):
    out = tmp_path / "run"
    run_quietly(tiny_lm(steps=1), out)
    (tmp_path / "secret").write_text("not a checkpoint file")
    ckpt = find_checkpoint(str(out))
    config = Path(ckpt, "config.json")
    meta = json.loads(config.read_text())
    meta["files"][name] = {"sha256": "0" * 64, "bytes": 21}
    config.write_text(json.dumps(meta))
    opened = []
    real_sha = ckpt_io.sha256_file
    monkeypatch.setattr(ckpt_io, "sha256_file", lambda path: opened.append(path) or real_sha(path))
    with pytest.raises(CheckpointError, match=rf"config.json names {name!r}, which is not a file name inside .*; refusing to open it"):
        read_checkpoint_config(ckpt)
    assert opened == []  # refused before any file was read


def test_links_out_of_the_checkpoint_are_refused(tmp_path):
    out = tmp_path / "run"
    run_quietly(tiny_lm(steps=1), out)
    ckpt = find_checkpoint(str(out))
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(os.path.join(ckpt, "model.safetensors"), outside)
    os.symlink(outside, os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"names 'model.safetensors', a link to {outside}, outside {ckpt}"):
        read_checkpoint_config(ckpt)
    with pytest.raises(CheckpointError, match="a link to"):
        load_checkpoint_model(ckpt)
    # A step directory that links out of the run is skipped like a corrupt one, unread.
    os.unlink(os.path.join(ckpt, "model.safetensors"))
    os.replace(outside, os.path.join(ckpt, "model.safetensors"))
    elsewhere = tmp_path / "elsewhere"
    os.replace(ckpt, elsewhere)
    os.symlink(elsewhere, ckpt)
    with pytest.raises(CheckpointError, match=rf"run {out} names 'step-00000001', a link to {elsewhere}, outside {out / 'checkpoints'}"):
        find_checkpoint(str(out))


def test_a_config_that_lists_no_weights_cannot_pass_unverified(tmp_path):
    out = tmp_path / "run"
    run_quietly(tiny_lm(steps=1), out)
    ckpt = find_checkpoint(str(out))
    config = Path(ckpt, "config.json")
    meta = json.loads(config.read_text())
    del meta["files"]["model.safetensors"]
    config.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not list model.safetensors among its files"):
        read_checkpoint_config(ckpt)


# --- a diverging loss -----------------------------------------------------------------------


def test_a_non_finite_loss_names_the_step_and_leaves_the_run_resumable(tmp_path, straight, monkeypatch):
    real_loss = TASKS["lm"].loss
    calls = []

    def nan_at_step_5(self, model, batch):
        if model.training:  # a training step, not an evaluation
            calls.append(1)
        loss = real_loss(self, model, batch)
        return loss * float("nan") if model.training and len(calls) == 5 else loss

    monkeypatch.setattr(TASKS["lm"], "loss", nan_at_step_5)
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as diverged:
        run_quietly(tiny_lm(), out)
    assert isinstance(diverged.value, ValueError) and isinstance(diverged.value, FloatingPointError)
    ckpt = out / "checkpoints" / "step-00000003"
    assert str(diverged.value) == (f"the training loss is nan at step 5 of 11 in {out}; the last checkpoint, {ckpt}, is intact; "
                                   "lower --lr or check the data")
    assert find_checkpoint(str(out)) == str(ckpt) and not (out / LOCK_FILE).exists()
    monkeypatch.undo()
    run_quietly(tiny_lm(), out, resume=True)
    assert run_files(out) == run_files(straight)


@pytest.mark.cli
@pytest.mark.slow  # two torchrun workers: about 15 s
def test_under_torchrun_every_process_stops_when_the_directory_is_in_use(tmp_path):
    # Only rank 0 takes the lock; the other process must stop too, not wait for it.
    from test_train_ddp import ARGS, free_port

    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("x")
    with lock_run_dir(str(out)):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
             "--master_port", str(free_port()), "-m", "flt.cli", *ARGS, "--out-dir", str(out)],
            capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert proc.returncode != 0
    assert f"{out} is in use by flt train (pid {os.getpid()}, started " in proc.stderr
    assert os.listdir(out) == ["notes.txt"]


def test_atomic_dir_replaces_a_left_directory_and_leaves_nothing_on_failure(tmp_path):
    from flt._io import atomic_dir

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("old")
    final = atomic_dir(str(tmp_path), "out", lambda d: Path(d, "new.txt").write_text("new"))
    assert final == str(tmp_path / "out") and sorted(os.listdir(final)) == ["new.txt"]

    def fail(d):
        Path(d, "half.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_dir(str(tmp_path), "out", fail)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary left
    assert sorted(os.listdir(final)) == ["new.txt"]  # the old directory untouched


def finished_run(tmp_path_factory) -> Path:
    """A finished 4-step tiny run (checkpoints at steps 3 and 4), trained on one thread, for
    the run-file tests to copy."""
    out = tmp_path_factory.mktemp("finished") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_quietly(tiny_lm(steps=4), out)
    finally:
        torch.set_num_threads(threads)
    return out
