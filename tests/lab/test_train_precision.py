"""``RunConfig.precision`` / ``flt train --precision``: bfloat16 autocast of the training
step (CPU autocast here), the device default, and ``--resume`` keeping the run's precision."""

from __future__ import annotations

import dataclasses

import argparse

import pytest
import torch

from conftest import Killed, kill_at
from flt.train import RunConfig, train
from flt.train.checkpoint import find_checkpoint, read_checkpoint_config
from flt.train.metrics import read_metrics
from test_train import tiny_lm, weights

pytestmark = pytest.mark.usefixtures("one_thread")


def _precision(out) -> str:
    return read_checkpoint_config(find_checkpoint(str(out)))["preset"]["run"]["precision"]


def _train_losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(str(out / "metrics.jsonl")) if r["split"] == "train"]


def test_cpu_default_is_fp32_and_bf16_changes_the_arithmetic(tmp_path):
    train(tiny_lm(steps=3), str(tmp_path / "default"), progress=False, plots=False)
    train(tiny_lm(steps=3, precision="fp32"), str(tmp_path / "fp32"), progress=False, plots=False)
    train(tiny_lm(steps=3, precision="bf16"), str(tmp_path / "bf16"), progress=False, plots=False)
    assert _precision(tmp_path / "default") == "fp32"
    assert _precision(tmp_path / "bf16") == "bf16"
    default, fp32, bf16 = (_train_losses(tmp_path / n) for n in ("default", "fp32", "bf16"))
    assert default == fp32  # None on a CPU is float32, bit for bit
    assert bf16 != fp32  # the step really ran under bfloat16 autocast
    assert all(abs(a - b) < 0.05 * abs(b) for a, b in zip(bf16, fp32))  # ... and computes the same loss to bf16 accuracy
    # Weights, gradients and the optimizer stay float32.
    assert all(t.dtype == torch.float32 for t in weights(str(tmp_path / "bf16")).values() if t.is_floating_point())


def test_resume_keeps_the_precision(tmp_path):
    preset = tiny_lm(steps=6, precision="bf16")
    train(preset, str(tmp_path / "straight"), progress=False, plots=False)
    with pytest.raises(Killed):
        train(preset, str(tmp_path / "resumed"), progress=False, plots=False, on_step=kill_at(4))
    unset = dataclasses.replace(preset, run=dataclasses.replace(preset.run, precision=None))
    with pytest.raises(ValueError, match="run.precision"):
        other = dataclasses.replace(preset, run=dataclasses.replace(preset.run, precision="fp32"))
        train(other, str(tmp_path / "resumed"), resume=True, progress=False, plots=False)
    train(unset, str(tmp_path / "resumed"), resume=True, progress=False, plots=False)  # unset: the run's own
    assert _precision(tmp_path / "resumed") == "bf16"
    a, b = weights(str(tmp_path / "straight")), weights(str(tmp_path / "resumed"))
    assert all((a[k] == b[k]).all() for k in a)


def test_precision_is_checked():
    with pytest.raises(ValueError, match="precision"):
        RunConfig(precision="fp16")


@pytest.mark.cli
def test_cli_flag(tmp_path, isolated_cli, capsys):
    from flt.cli import main
    from flt.commands.train import add_parser, preset_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "lm", "--preset", "smoke", "--precision", "bf16"])
    assert preset_from_args(args, "flt").run.precision == "bf16"
    args = parser.parse_args(["train", "lm", "--preset", "smoke"])
    assert preset_from_args(args, "flt").run.precision is None  # decided by the device when the run starts
    with pytest.raises(SystemExit):
        main(["train", "lm", "--preset", "smoke", "--precision", "half", "--out-dir", str(tmp_path / "x")])
    assert "invalid choice: 'half'" in capsys.readouterr().err


def test_compare_passes_precision_to_every_run_and_keeps_finished_ones(tmp_path):
    import json

    import flt.commands.compare as compare
    from flt.cli import build_parser

    args = build_parser().parse_args(["compare", "lm", "--attention", "flt", "--precision", "bf16"])
    argv = compare._child_argv(args, "flt", {}, 0, str(tmp_path))
    assert build_parser().parse_args(argv[argv.index("train"):]).precision == "bf16"
    # A finished run recorded its precision; a comparison that leaves it unset keeps the run.
    done = tmp_path / "done"
    (done / "checkpoints" / "step-00000004").mkdir(parents=True)
    (done / "summary.json").write_text("{}")
    (done / "run.json").write_text(json.dumps({"preset": {"task": "lm", "run": {"steps": 4, "precision": "bf16"}}}))
    assert compare._run_state(str(done), {"task": "lm", "run": {"steps": 4, "precision": None}}) == "finished"
    assert compare._run_state(str(done), {"task": "lm", "run": {"steps": 4, "precision": "fp32"}}) == "resume"
