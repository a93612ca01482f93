"""Nothing written outside a run directory: every file flt writes there is replaced
atomically (a link of its name is replaced, never followed), the files written in place
(the lock, ``metrics.jsonl``, ``train.log``) refuse links, hard links and special files,
and no summary or metrics file holds NaN or infinity."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_run_safety import finished_run, run_quietly, tiny_lm

import flt
from flt._io import atomic_savefig, atomic_write_json, dumps_json, open_append_text, open_own_file
from flt.train import checkpoint as ckpt_io, loop
from flt.train.lock import LOCK_FILE, lock_run_dir
from flt.train.loop import TrainingDiverged
from flt.train.metrics import MetricsLogger

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = Path(flt.__file__).resolve().parent
NOTES = "the user's notes\n"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run (checkpoints at steps 3 and 4) that tests copy."""
    return finished_run(tmp_path_factory)


def outside_file(tmp_path: Path) -> Path:
    notes = tmp_path / "notes.txt"
    notes.write_text(NOTES)
    return notes


def plant_link(path: Path, target: Path) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    os.symlink(os.path.relpath(target, path.parent), path)


# --- the lock -----------------------------------------------------------------------------


def test_a_lock_that_links_out_of_the_run_is_refused_and_its_target_kept(tmp_path):
    run, notes = tmp_path / "run", outside_file(tmp_path)
    run.mkdir()
    plant_link(run / LOCK_FILE, notes)
    with pytest.raises(ValueError, match=rf"{re.escape(str(run / LOCK_FILE))} is a symbolic link .*does not write through links"):
        lock_run_dir(str(run))
    assert notes.read_text() == NOTES and (run / LOCK_FILE).is_symlink()


def test_a_lock_that_is_a_hard_link_or_a_fifo_is_refused(tmp_path):
    run, notes = tmp_path / "run", outside_file(tmp_path)
    run.mkdir()
    os.link(notes, run / LOCK_FILE)
    with pytest.raises(ValueError, match="has 2 names"):
        lock_run_dir(str(run))
    assert notes.read_text() == NOTES
    (run / LOCK_FILE).unlink()
    os.mkfifo(run / LOCK_FILE)
    with pytest.raises(ValueError, match="is not a regular file"):
        lock_run_dir(str(run))


@pytest.mark.parametrize("record", ["[" * 100_000, '{"pid": ' + "[" * 5000 + "]" * 5000 + "}", "\xff\xfe"], ids=["deep", "deep-pid", "not-utf8"])
def test_a_leftover_lock_with_a_corrupt_record_is_taken_over(tmp_path, record):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(record, encoding="latin-1")
    with lock_run_dir(str(run)) as lock:
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert lock.note is None  # no record to name: nothing to say
    assert not (run / LOCK_FILE).exists()


# --- files written in place: no links, one name, plain files ----------------------------------


def test_files_written_in_place_refuse_links_hard_links_and_fifos(tmp_path):
    notes = outside_file(tmp_path)
    link = tmp_path / "run" / "train.log"
    link.parent.mkdir()
    plant_link(link, notes)
    with pytest.raises(ValueError, match=r"train\.log is a symbolic link"):
        open_own_file(str(link), os.O_WRONLY | os.O_APPEND, "log file")
    link.unlink()
    os.link(notes, link)
    with pytest.raises(ValueError, match=r"train\.log has 2 names"):
        open_append_text(str(link), "log file")
    link.unlink()
    os.mkfifo(link)  # opened for writing without a reader, a FIFO would block forever
    with pytest.raises(ValueError, match=r"train\.log is not a regular file"):
        open_append_text(str(link), "log file")
    assert notes.read_text() == NOTES


def test_metrics_logger_never_appends_through_a_link(tmp_path):
    notes = outside_file(tmp_path)
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    plant_link(path, notes)
    logger = MetricsLogger(str(path))  # a fresh run deletes the link
    logger.log(4, "valid", loss=1.0)
    logger.close()
    assert notes.read_text() == NOTES and not path.is_symlink()
    assert json.loads(path.read_text())["step"] == 4
    plant_link(path, notes)  # a resumed run reads the file first: it refuses a link
    with pytest.raises(ValueError, match=r"metrics\.jsonl is a symbolic link, not the metrics file"):
        MetricsLogger(str(path), resume_step=3)
    path.unlink()
    os.mkfifo(path)  # reading it would wait for a writer forever
    with pytest.raises(ValueError, match=r"metrics\.jsonl is not a regular file"):
        MetricsLogger(str(path), resume_step=3)
    assert notes.read_text() == NOTES


def test_a_checkpoints_folder_that_links_out_of_the_run_is_refused(tmp_path, finished):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".keep.abcdefgh.tmp").write_text("a user's file that looks like a temporary")
    shutil.rmtree(run / "checkpoints")
    os.symlink(elsewhere, run / "checkpoints")
    with pytest.raises(ValueError, match=r"checkpoints is a symbolic link .*not the checkpoint directory"):
        ckpt_io.remove_leftovers(str(run))
    with pytest.raises(ValueError, match=r"checkpoints is a symbolic link"):
        ckpt_io.save_checkpoint(str(run), 5, torch.nn.Linear(1, 1), config={}, trainer_state={})
    assert os.listdir(elsewhere) == [".keep.abcdefgh.tmp"]


# --- files replaced atomically: a link of their name is replaced, its target kept -------------


def test_a_run_replaces_links_of_its_files_and_never_writes_their_targets(tmp_path, finished):
    pytest.importorskip("matplotlib")
    run, notes = tmp_path / "run", outside_file(tmp_path)
    shutil.copytree(finished, run)
    names = ("summary.json", "run.json", "learning_curves.png", "rpe_functions.png")
    for name in names:
        plant_link(run / name, notes)
    loop.train(tiny_lm(steps=6), str(run), resume=True, progress=False, plots=True)
    assert notes.read_text() == NOTES
    for name in names:
        assert not (run / name).is_symlink() and (run / name).stat().st_size > 0, name
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


def test_plot_writers_are_atomic_and_replace_links(tmp_path):
    matplotlib = pytest.importorskip("matplotlib.figure")
    from flt.fit.plots import save as save_fit_plot
    from flt.train.plots import plot_comparison

    notes = outside_file(tmp_path)
    for name, write in (("compare.png", lambda p: plot_comparison({"a": [[(1, 2.0), (2, 1.0)]]}, p, metric="loss")),
                        ("fit.png", lambda p: save_fit_plot(matplotlib.Figure(), p)),
                        ("plain.png", lambda p: atomic_savefig(matplotlib.Figure(), p))):
        path = tmp_path / name
        plant_link(path, notes)
        write(str(path))
        assert not path.is_symlink() and path.read_bytes()[:4] == b"\x89PNG", name
    assert notes.read_text() == NOTES


def test_no_run_writer_saves_a_figure_or_json_straight_to_its_path():
    """Every figure and JSON file of a run goes through flt._io (atomic, link-free, no NaN);
    a direct ``savefig(path)`` or ``json.dump`` into an open file would follow a link."""
    direct = re.compile(r"\.savefig\((?!f\b)|json\.dump\(|open\([^)]*[\"']w[\"']|\.write_(text|bytes)\(")
    owners = [*(SRC / "train").rglob("*.py"), *(SRC / "search").glob("*.py"), *(SRC / "fit").glob("*.py"),
              *(SRC / "bench").glob("*.py"), *(SRC / "integrations").glob("*.py"),
              *(SRC / "commands" / n for n in ("train.py", "evaluate.py", "compare.py", "generate.py", "search.py", "fit.py",
                                               "linearize.py", "bench.py", "approx.py"))]
    found = [f"{p.relative_to(SRC)}:{i}" for p in owners
             for i, line in enumerate(p.read_text().splitlines(), 1) if direct.search(line)]
    # measure.py resets the kernel's page counters of its own process, no file of a user's.
    assert found == ["bench/measure.py:97"]


def test_no_reader_of_a_users_json_file_parses_it_unbounded():
    """JSON read from a user's folder (a model's config.json, a run's files) goes through
    flt._io's bounded reader: ``json.loads`` of a file's text would end a deeply nested one
    in a RecursionError, and opening a FIFO would block."""
    unbounded = re.compile(r"json\.loads?\(.*(read_text|read_bytes|\bf\b|\bfh\b)")
    readers = [*(SRC / "train").rglob("*.py"), *(SRC / "integrations").glob("*.py"), *(SRC / "commands").glob("*.py"),
               *(SRC / "search").glob("*.py"), *(SRC / "fit").glob("*.py"), *(SRC / "bench").glob("*.py")]
    found = [f"{p.relative_to(SRC)}:{i}" for p in readers
             for i, line in enumerate(p.read_text().splitlines(), 1) if unbounded.search(line)]
    assert found == []


# --- no NaN or infinity in a summary -------------------------------------------------------


def test_json_writers_refuse_nan_and_infinity_naming_the_value(tmp_path):
    with pytest.raises(ValueError, match=r"refusing to write .*/s.json: test\.mae is inf, which is not a finite number"):
        atomic_write_json(str(tmp_path / "s.json"), {"test": {"mae": math.inf}, "steps": 3})
    with pytest.raises(ValueError, match=r"rows\[1\] is nan"):
        dumps_json({"rows": [1.0, math.nan]}, "x.json")
    assert not (tmp_path / "s.json").exists() and os.listdir(tmp_path) == []


def test_a_non_finite_final_metric_stops_the_run_without_a_summary(tmp_path, monkeypatch):
    real = loop.evaluate_on_draw

    def overflowing(*args, **kwargs):
        metrics = real(*args, **kwargs)
        return {**metrics, "ppl": math.inf}

    monkeypatch.setattr(loop, "evaluate_on_draw", overflowing)
    run = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=r"the final validation ppl is inf at step 2 in .*summary.json is not written"):
        run_quietly(tiny_lm(steps=2), run)
    assert not (run / "summary.json").exists()
    # The metrics file stays JSON: the logged value is null, not Infinity.
    records = [json.loads(line, parse_constant=pytest.fail) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["ppl"] for r in records if r["split"] == "valid"] == [None]
