"""How ``flt`` fails: one line ``flt COMMAND: error: CAUSE`` and exit status 2 (bad input),
1 (a failure at run time) or 130 (Ctrl-C), never a traceback, except for a bug in flt (its
traceback, under a line that says so) and under ``flt --debug``."""

from __future__ import annotations

import errno
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
import torch

from flt.cli import main

@pytest.fixture(autouse=True)
def _isolated(isolated_cli, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    yield


def _one_line(capsys) -> str:
    """The command's stderr, which must be exactly one line and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _files(tmp_path):
    """A file where a directory is expected, an empty .pt file and a search.json without its task."""
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "notask.json").write_text(json.dumps({"format": "flt-search-1", "complete": True, "candidates": []}))
    (tmp_path / "adir").mkdir()


SMOKE = ["--preset", "smoke", "--no-progress", "--threads", "1"]

#: (argv, exit status, words the one line must contain): bad input, refused before any work.
BAD_INPUT = [
    (["train", "image", *SMOKE, "--out-dir", "afile"], 2, ["--out-dir afile is a file"]),
    (["train", "image", *SMOKE, "--out-dir", "afile/run"], 2, ["--out-dir afile/run", "is a file"]),
    (["search", "image", "--candidates", "flt,softmax", "--preset", "smoke", "--out-dir", "afile"], 2, ["--out-dir afile is a file"]),
    (["compare", "image", "--attention", "flt,softmax", "--preset", "smoke", "--out-dir", "afile"], 2, ["--out-dir afile is a file"]),
    (["approx", "--quick", "--out-dir", "afile"], 2, ["--out-dir afile is a file"]),
    (["bench", "speed", "--quick", "--out-dir", "afile"], 2, ["flt bench speed:", "--out-dir afile is a file"]),
    (["bench", "approx", "--quick", "--out-dir", "afile"], 2, ["flt bench approx:", "--out-dir afile is a file"]),
    (["fit", "signal", "--preset", "smoke", "--out-dir", "afile"], 2, ["--out-dir afile is a file"]),
    (["evaluate", "afile"], 2, ["afile is a file, not a run directory"]),
    (["evaluate", "adir", "--out", "adir"], 2, ["--out adir is a directory, not a file"]),
    (["generate", "afile"], 2, ["afile is a file, not a run directory"]),
    (["generate", "adir", "--temperature", "nan"], 2, ["--temperature", "nan"]),
    (["generate", "adir", "--temperature", "inf"], 2, ["--temperature", "inf"]),
    (["generate", "adir", "--temperature", "-1"], 2, ["--temperature", "-1"]),
    (["generate", "adir", "--seed", "-1"], 2, ["--seed", "-1"]),
    (["generate", "adir", "--threads", "0"], 2, ["--threads", "0"]),
    (["train", "image", *SMOKE, "--seed", "-1"], 2, ["--seed must be a non-negative integer"]),
    (["train", "image", *SMOKE, "--run-opt", "seed=-1"], 2, ["seed must be a non-negative integer, got -1"]),
    (["train", "image", *SMOKE, "--seed", "1", "--run-opt", "seed=2"], 2, ["--seed 1", "--run-opt seed=2"]),
    (["search", "image", "--candidates", "flt,softmax", "--preset", "smoke", "--seed", "1", "--run-opt", "seed=2"], 2,
     ["--seed 1", "--run-opt seed=2"]),
    (["compare", "image", "--attention", "flt", "--preset", "smoke", "--run-opt", "seed=2"], 2, ["--run-opt seed", "--seeds"]),
    (["fit", "signal", "--preset", "smoke", "--seed", "-1"], 2, ["--seed", "-1"]),
    (["train", "graph", *SMOKE, "--data", "empty.pt", "--out-dir", "g"], 2, ["empty.pt", "0 bytes"]),
    (["train", "image", *SMOKE, "--arch", "notask.json", "--out-dir", "a"], 2, ["notask.json", "'task'"]),
]


@pytest.mark.cli
@pytest.mark.parametrize("argv, code, words", BAD_INPUT, ids=[" ".join(c[0][:2] + c[0][-2:]) for c in BAD_INPUT])
def test_bad_input_is_one_line_naming_the_cause(argv, code, words, tmp_path, capsys, monkeypatch):
    import flt.commands.compare as compare

    monkeypatch.setattr(compare.subprocess, "run", lambda *a, **k: pytest.fail("a run started"))
    _files(tmp_path)
    assert main(argv) == code
    line = _one_line(capsys)
    assert line.startswith(f"flt {argv[0]}") and ": error: " in line, line
    for word in words:
        assert word in line, (word, line)
    # Refused before any work: nothing was created.
    assert not (tmp_path / "runs").exists() and not (tmp_path / "g").exists() and not (tmp_path / "a").exists()


@pytest.mark.cli
def test_a_nan_loss_is_one_line(tmp_path, capsys):
    argv = ["train", "image", *SMOKE, "--steps", "3", "--lr", "1e30", "--no-plots", "--out-dir", str(tmp_path / "nan")]
    assert main(argv) == 1
    line = _one_line(capsys)
    assert line.startswith("flt train: error: the training loss is nan at step") and "--lr" in line


def _raise_in_writer(err: BaseException, path: str):
    """Raise ``err`` from a function holding ``path`` as a writer does (flt._io.atomic_write)."""
    def atomic_write(path, write=None):
        raise err

    atomic_write(path)


def _safetensor_error():
    from safetensors import SafetensorError

    def load_file(filename, device="cpu"):
        raise SafetensorError("Error while deserializing header: HeaderTooLarge")

    load_file("/data/run/checkpoints/step-00000010/model.safetensors")


#: (what the work raises, exit status, words of the one line)
RUNTIME_FAILURES = [
    (lambda: _raise_in_writer(OSError(errno.ENOSPC, "No space left on device"), "/data/run/run.json"), 1,
     ["no space left on device while writing /data/run/run.json"]),
    (lambda: _raise_in_writer(OSError(errno.EDQUOT, "Disk quota exceeded"), "/data/run/metrics.jsonl"), 1,
     ["no space left on device while writing /data/run/metrics.jsonl"]),
    (lambda: _raise_in_writer(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 15360 vs 15252"),
                              "/data/run/trainer.pt"), 1, ["writing /data/run/trainer.pt failed", "disk is full"]),
    (lambda: _raise_in_writer(RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
                              "/data/run/trainer.pt"), 1, ["disk is full"]),
    (lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")), 1,
     ["out of memory", "--batch-size"]),
    (lambda: (_ for _ in ()).throw(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")), 1,
     ["out of memory", "--batch-size"]),
    (lambda: (_ for _ in ()).throw(MemoryError()), 1, ["out of memory"]),
    (_safetensor_error, 2, ["/data/run/checkpoints/step-00000010/model.safetensors", "corrupt"]),
    (lambda: (_ for _ in ()).throw(FloatingPointError("the training loss is nan at step 3; lower --lr or check the data")), 1,
     ["the training loss is nan at step 3"]),
    (lambda: (_ for _ in ()).throw(ModuleNotFoundError("No module named 'networkx'", name="networkx")), 1,
     ["networkx", "pip install", "[graph]"]),
    (lambda: (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied", "/data/run/x")), 2,
     ["Permission denied: /data/run/x"]),
    (lambda: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error", "/data/run/x")), 1, ["Input/output error: /data/run/x"]),
]


@pytest.mark.cli
@pytest.mark.parametrize("work, code, words", RUNTIME_FAILURES, ids=[" ".join(c[2])[:40] for c in RUNTIME_FAILURES])
def test_runtime_failures_are_one_line_naming_the_cause(work, code, words, tmp_path, monkeypatch, capsys):
    import flt.commands.evaluate as evaluate

    monkeypatch.setattr(evaluate, "evaluate_run", lambda *a, **k: work())
    assert main(["evaluate", str(tmp_path)]) == code
    line = _one_line(capsys)
    assert line.startswith("flt evaluate: error: "), line
    for word in words:
        assert word in line, (word, line)


@pytest.mark.cli
def test_a_bug_keeps_its_traceback_under_a_line_that_says_so(tmp_path, monkeypatch, capsys):
    import flt.commands.evaluate as evaluate

    monkeypatch.setattr(evaluate, "evaluate_run", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["evaluate", str(tmp_path)])
    assert "flt evaluate: this is a bug in flt (an unexpected ZeroDivisionError)" in capsys.readouterr().err


@pytest.mark.cli
def test_debug_shows_the_traceback_of_an_expected_failure(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["evaluate", str(tmp_path / "afile")]) == 2
    assert _one_line(capsys) == f"flt evaluate: error: {tmp_path / 'afile'} is a file, not a run directory or a checkpoint directory"
    # --debug lets the exception through: Python prints its traceback.
    with pytest.raises(ValueError, match="is a file, not a run directory"):
        main(["--debug", "evaluate", str(tmp_path / "afile")])
    assert capsys.readouterr().err == ""


@pytest.mark.cli
def test_version_comes_from_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"flt {importlib.metadata.version('flt-attention')}"


def _ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt


#: (command, the work function patched to raise KeyboardInterrupt: (module, attribute))
CTRL_C = [
    (["evaluate", "RUN"], ("flt.commands.evaluate", "evaluate_run")),
    (["generate", "RUN", "--max-new-tokens", "3"], ("flt.train", "load_checkpoint_model")),
    (["compare", "image", "--attention", "flt", "--preset", "smoke", "--out-dir", "OUT"], ("subprocess", "run")),
    (["approx", "--quick", "--out-dir", "OUT"], ("flt.bench.approx", "mask_errors")),
    (["bench", "speed", "--quick", "--out-dir", "OUT"], ("flt.bench.speed", "run")),
    (["bench", "approx", "--quick", "--out-dir", "OUT"], ("flt.bench.approx", "mask_errors")),
]


@pytest.mark.cli
@pytest.mark.parametrize("argv, target", CTRL_C, ids=[" ".join(c[0][:2]) for c in CTRL_C])
def test_ctrl_c_is_one_line_and_status_130(argv, target, tmp_path, monkeypatch, capsys):
    import importlib

    module, name = target
    monkeypatch.setattr(importlib.import_module(module), name, _ctrl_c)
    (tmp_path / "RUN").mkdir()
    assert main([str(tmp_path / a) if a in ("RUN", "OUT") else a for a in argv]) == 130
    line = _one_line(capsys)
    command = " ".join(argv[:2]) if argv[0] == "bench" else argv[0]
    assert line.startswith(f"flt {command}: interrupted"), line


@pytest.mark.cli
def test_disk_full_while_checkpointing_leaves_a_run_that_resumes(tmp_path, monkeypatch, capsys):
    """A write of the second checkpoint fails as on a full disk (torch's writer error, which
    names neither the disk nor the file): one line naming the file and the disk, status 1,
    and --resume afterwards finishes the run from the first checkpoint."""
    real_save = torch.save
    calls = []

    def full_disk(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 15360 vs 15252")
        return real_save(obj, f, *args, **kwargs)

    out = tmp_path / "run"
    argv = ["train", "image", *SMOKE, "--steps", "6", "--checkpoint-every", "3", "--no-plots", "--out-dir", str(out)]
    monkeypatch.setattr(torch, "save", full_disk)
    assert main(argv) == 1
    line = _one_line(capsys)
    assert line.startswith("flt train: error: writing ") and "trainer.pt failed, most likely because the disk is full" in line
    assert "--resume" in line
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    monkeypatch.setattr(torch, "save", real_save)
    assert main([*argv, "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


@pytest.mark.cli
def test_no_space_in_a_writer_names_the_file(tmp_path, monkeypatch, capsys):
    """OSError(ENOSPC) without a file name (as a full disk raises it from flush) is named
    by the writer's path, and the run continues with --resume."""
    import flt.train.checkpoint as checkpoint

    real = checkpoint.save_model
    calls = []

    def full_disk(model, filename, *args, **kwargs):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(model, filename, *args, **kwargs)

    out = tmp_path / "run"
    argv = ["train", "image", *SMOKE, "--steps", "6", "--checkpoint-every", "3", "--no-plots", "--out-dir", str(out)]
    monkeypatch.setattr(checkpoint, "save_model", full_disk)
    assert main(argv) == 1
    line = _one_line(capsys)
    assert line.startswith("flt train: error: no space left on device while writing ") and "model.safetensors" in line
    monkeypatch.setattr(checkpoint, "save_model", real)
    assert main([*argv, "--resume"]) == 0


@pytest.mark.cli
@pytest.mark.slow
def test_a_real_full_filesystem(tmp_path, capsys):
    """A 420 KiB tmpfs: the second checkpoint of an image smoke run does not fit (needs root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=420k", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        argv = ["train", "image", *SMOKE, "--no-plots", "--out-dir", str(mount / "run")]
        assert main(argv) == 1
        line = _one_line(capsys)
        assert "disk is full" in line or "no space left on device" in line
        subprocess.run(["mount", "-o", "remount,size=4m", str(mount)], check=True)
        assert main([*argv, "--resume"]) == 0
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.cli
def test_seed_and_run_opt_seed_agree(tmp_path, monkeypatch):
    import flt.train

    seen = []
    monkeypatch.setattr(flt.train, "train", lambda preset, out_dir, **kw: seen.append((preset.run.seed, out_dir)))
    assert main(["train", "image", *SMOKE, "--run-opt", "seed=3"]) == 0
    assert main(["train", "image", *SMOKE, "--seed", "4"]) == 0
    assert main(["train", "image", *SMOKE, "--seed", "5", "--run-opt", "seed=5"]) == 0
    assert main(["train", "image", *SMOKE]) == 0
    assert seen == [(3, os.path.join("runs", "image-flt-smoke-s3")), (4, os.path.join("runs", "image-flt-smoke-s4")),
                    (5, os.path.join("runs", "image-flt-smoke-s5")), (0, os.path.join("runs", "image-flt-smoke-s0"))]


@pytest.mark.cli
def test_a_missing_plotting_library_costs_the_plots_not_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "run"
    assert main(["train", "image", *SMOKE, "--steps", "2", "--out-dir", str(out)]) == 0
    err = capsys.readouterr().err
    assert "flt train: matplotlib is not installed, so no plots are written" in err and "pip install" in err
    assert (out / "summary.json").exists() and not (out / "learning_curves.png").exists()


def test_install_hints_fit_the_installation(monkeypatch):
    import flt._extras as extras

    root = extras.checkout_root()
    assert root is not None and (root / "src" / "flt" / "_extras.py").exists()
    assert extras.install_hint("graph") == f'pip install -e "{root}[graph]"'
    monkeypatch.setattr(extras, "checkout_root", lambda: None)
    assert extras.install_hint("graph") == 'pip install "flt-attention[graph]"'


def test_the_draw_gap_spread_has_the_precision_of_its_mean():
    from flt.train.drawgap import format_draw_gap, mean_and_spread

    assert mean_and_spread(0.8123, 0.009491) == "0.8123 ± 0.0095"
    assert mean_and_spread(0.3, 0.009491) == "0.3000 ± 0.0095"
    assert mean_and_spread(150.2, 3.456) == "150.2 ± 3.5"
    assert mean_and_spread(None, None) == "n/a ± n/a"
    line = format_draw_gap({"own": 0.8, "fresh_mean": 0.8123, "fresh_std": 0.009491, "exact": 0.81}, "accuracy")
    assert "fresh draws 0.8123 ± 0.0095 (n=3)" in line


@pytest.mark.cli
def test_an_output_folder_that_cannot_be_written_is_refused_first(tmp_path, monkeypatch, capsys):
    import flt.commands.outputs as outputs

    # As root every folder is writable: pretend this one is not.
    monkeypatch.setattr(outputs.os, "access", lambda path, mode: os.path.abspath(path) != str(tmp_path))
    assert main(["train", "image", *SMOKE, "--out-dir", "new/run"]) == 2
    assert _one_line(capsys) == f"flt train: error: --out-dir new/run: cannot create it, {tmp_path} is not writable; choose another --out-dir"
    assert main(["evaluate", "RUN", "--out", "result.json"]) == 2
    assert "--out result.json: its folder" in _one_line(capsys)


@pytest.mark.cli
def test_a_missing_extra_is_one_line_with_the_command_that_installs_it(tmp_path, monkeypatch, capsys):
    from flt._extras import install_hint

    monkeypatch.setitem(sys.modules, "networkx", None)  # import networkx raises ImportError
    assert main(["train", "graph", *SMOKE, "--out-dir", str(tmp_path / "g")]) == 1
    line = _one_line(capsys)
    assert line == f"flt train: error: the graph generators need networkx: {install_hint('graph')}"


@pytest.mark.cli
def test_torch_reader_errors_are_not_taken_for_a_full_disk(tmp_path, monkeypatch, capsys):
    """torch's reader also raises '[enforce fail ...]': outside torch.save it is no disk-write
    failure (here a bug-shaped RuntimeError, which keeps its traceback)."""
    import flt.commands.evaluate as evaluate

    def read():
        raise RuntimeError("[enforce fail at inline_container.cc:234] . file not found: archive/data.pkl")

    monkeypatch.setattr(evaluate, "evaluate_run", lambda *a, **k: read())
    with pytest.raises(RuntimeError):
        main(["evaluate", str(tmp_path)])
    assert "disk" not in capsys.readouterr().err


@pytest.mark.cli
def test_an_output_file_below_a_file_is_refused_naming_both(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["evaluate", "RUN", "--out", "afile/result.json"]) == 2
    assert _one_line(capsys) == f"flt evaluate: error: --out afile/result.json: {tmp_path / 'afile'} is a file, not a folder; choose another --out"
