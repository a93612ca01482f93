"""Two CPU processes (torchrun, gloo) compute what one process computes on the same global batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from flt.train import load_checkpoint_model
from flt.train.metrics import read_metrics

pytestmark = pytest.mark.cli

ARGS = ["train", "lm", "--preset", "smoke", "--steps", "6", "--run-opt", "log_every=1", "--eval-every", "3",
        "--no-progress", "--no-plots", "--data-opt", "max_bytes=20000", "--model-opt", "dim=32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(argv, env=None):
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_two_processes_match_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_cli(["-m", "flt.cli", *ARGS, "--threads", "1", "--out-dir", str(tmp_path / "one")], env)
    run_cli([
        "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), "-m", "flt.cli", *ARGS, "--out-dir", str(tmp_path / "two"),
    ], env)
    one = read_metrics(str(tmp_path / "one" / "metrics.jsonl"))
    two = read_metrics(str(tmp_path / "two" / "metrics.jsonl"))
    assert [(r["step"], r["split"]) for r in one] == [(r["step"], r["split"]) for r in two]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5), (a, b)
    # Parameters after 6 steps agree to float32 reduction-order rounding.
    pa = load_checkpoint_model(str(tmp_path / "one"))[0].state_dict()
    pb = load_checkpoint_model(str(tmp_path / "two"))[0].state_dict()
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-4, atol=1e-5)
