"""``flt compare ... --resume``: an interrupted comparison continues; finished runs are kept,
an unfinished one continues from its checkpoint, the rest run."""

from __future__ import annotations

import contextlib
import json
import subprocess

import pytest

import flt.commands.compare as compare
from flt.cli import main


pytestmark = pytest.mark.usefixtures("isolated_cli")


def _argv(out, *extra):
    return ["compare", "image", "--attention", "flt:near_neighbors=0", "--seeds", "0,1,2", "--preset", "smoke", "--steps", "4",
            "--checkpoint-every", "2", "--threads", "1", "--no-plots", "--run-opt", "draw_gap=false", "--out-dir", str(out), *extra]


def _seed_of(argv):
    return int(argv[argv.index("--seed") + 1])


def _in_process(argv, stdout, stderr, check):
    """A child ``flt train`` run in this process (seconds faster than a new interpreter),
    its output in the log as the child's would be."""
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
        code = main(argv[argv.index("train"):])
    return subprocess.CompletedProcess(argv, code)


@pytest.mark.cli
@pytest.mark.parametrize("child", [
    pytest.param("in-process", id="in-process"),
    pytest.param("subprocess", id="subprocess", marks=pytest.mark.slow),
])
def test_an_interrupted_compare_continues_with_resume(child, tmp_path, monkeypatch, capsys):
    real_run = subprocess.run if child == "subprocess" else _in_process
    out = tmp_path / "cmp"
    run_dir = out / "flt_near_neighbors=0"

    def interrupted_in_seed_1(argv, **kwargs):
        done = real_run(argv, **kwargs)
        if _seed_of(argv) == 1:
            # Killed after its step-2 checkpoint: no summary, latest at step 2.
            seed_dir = run_dir / "seed-1"
            (seed_dir / "summary.json").unlink()
            for f in (seed_dir / "checkpoints" / "step-00000004").iterdir():
                f.unlink()
            (seed_dir / "checkpoints" / "step-00000004").rmdir()
            (seed_dir / "checkpoints" / "latest").write_text("step-00000002\n")
            raise KeyboardInterrupt
        return done

    monkeypatch.setattr(compare.subprocess, "run", interrupted_in_seed_1)
    assert main(_argv(out)) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("flt compare: interrupted during flt:near_neighbors=0 seed 1") and err.strip().endswith("--resume")
    assert not (run_dir / "seed-2").exists()
    finished = (run_dir / "seed-0" / "summary.json").read_text()

    # Without --resume the directory is refused; with it, seed 0 is kept, seed 1 resumes, seed 2 runs.
    monkeypatch.setattr(compare.subprocess, "run", lambda *a, **k: pytest.fail("a run started"))
    assert main(_argv(out)) == 2
    assert "pass --resume" in capsys.readouterr().err
    calls = []

    def recorded(argv, **kwargs):
        calls.append((_seed_of(argv), "--resume" in argv))
        return real_run(argv, **kwargs)

    monkeypatch.setattr(compare.subprocess, "run", recorded)
    assert main(_argv(out, "--resume")) == 0
    text = capsys.readouterr().out
    assert calls == [(1, True), (2, False)]
    assert "seed 0 ... finished earlier" in text and "continuing from its last checkpoint" in text
    assert (run_dir / "seed-0" / "summary.json").read_text() == finished
    data = json.loads((out / "compare.json").read_text())
    assert data["rows"][0]["seeds"] == [0, 1, 2] and not data["rows"][0]["failed"]
    assert [r["steps"] for r in data["rows"][0]["runs"]] == [4, 4, 4]
    # The resumed seed continued from step 2: its log holds both parts.
    assert "steps 3..4" in (run_dir / "seed-1" / "train.log").read_text()


def test_resume_states_of_a_run_directory(tmp_path):
    expected = {"task": "image", "run": {"steps": 4}}
    assert compare._run_state(str(tmp_path / "none"), expected) == "new"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert compare._run_state(str(empty), expected) == "restart"
    partial = tmp_path / "partial"
    (partial / "checkpoints" / "step-00000002").mkdir(parents=True)
    assert compare._run_state(str(partial), expected) == "resume"
    done = tmp_path / "done"
    (done / "checkpoints" / "step-00000004").mkdir(parents=True)
    (done / "summary.json").write_text("{}")
    (done / "run.json").write_text(json.dumps({"preset": expected}))
    assert compare._run_state(str(done), expected) == "finished"
    # Finished with other options (here a larger budget): flt train --resume extends it or refuses.
    assert compare._run_state(str(done), {"task": "image", "run": {"steps": 8}}) == "resume"


@pytest.mark.cli
def test_compare_help_documents_resume(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = capsys.readouterr().out
    assert "--resume" in text and "summary.json" in text and "Ctrl-C" in text
