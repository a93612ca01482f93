"""Every command that trains or evaluates runs one torch thread unless asked for more
(``--threads`` or ``OMP_NUM_THREADS``): on a CPU shared with other jobs, torch's choice
(a thread per core) was many times slower. ``flt evaluate`` shows what it is doing on
stderr, step by step, instead of nothing for a minute."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from flt.cli import build_parser, main
from flt.commands import THREADS_HELP
from flt.train import get_preset, train
from flt.train.config import Preset

#: A command line of every command with --threads, before the flag.
COMMANDS = {
    "train": ["train", "lm"], "compare": ["compare", "lm", "--attention", "flt,softmax"],
    "search": ["search", "lm", "--candidates", "flt,softmax"], "evaluate": ["evaluate", "run"], "generate": ["generate", "run"],
    "fit": ["fit", "signal"], "linearize": ["linearize", "model", "--out-dir", "o"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_one_thread_unless_asked(command, monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert build_parser().parse_args(COMMANDS[command]).threads == 1
    assert build_parser().parse_args([*COMMANDS[command], "--threads", "3"]).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # torch follows the environment's choice
    assert build_parser().parse_args(COMMANDS[command]).threads is None
    with pytest.raises(SystemExit):
        build_parser().parse_args([*COMMANDS[command], "--help"])
    assert " ".join(THREADS_HELP.split()[:6]) in " ".join(capsys.readouterr().out.split())


@pytest.fixture(scope="module")
def molecule_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    mp = pytest.MonkeyPatch()
    mp.setenv("FLT_CACHE_DIR", str(root / "cache"))
    p = get_preset("molecule", "smoke", "flt")
    run = dataclasses.replace(p.run, steps=2, batch_size=4, eval_every=2, checkpoint_every=2)
    model = dataclasses.replace(p.model, dim=16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(Preset("molecule", model, run, {**p.data, "num_samples": 32, "progress": False}), str(root / "run"),
              progress=False, plots=False)
        yield str(root / "run")
    finally:
        torch.set_num_threads(threads)
        mp.undo()


@pytest.mark.cli
def test_evaluate_shows_each_step_and_runs_one_thread(molecule_run, monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar shows on a terminal only
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["evaluate", molecule_run, "--draws", "2", "--max-batches", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    for step in ("loading the molecule data", "building the model", "fresh draw 1 of 2", "fresh draw 2 of 2",
                 "exact attention", "own draw"):
        assert f"evaluate: {step}" in captured.err, step
    assert "0/1" in captured.err  # each step counts its batches
    assert "own draw" in captured.out


@pytest.mark.cli
@pytest.mark.parametrize("terminal", [True, False])
def test_evaluate_without_progress_or_terminal_prints_only_its_result(molecule_run, terminal, monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    argv = ["evaluate", molecule_run, "--draws", "1", "--max-batches", "1", "--threads", "1"]
    assert main([*argv, "--no-progress"] if terminal else argv) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "own draw" in captured.out
