"""What flt reads back is checked before it is used: JSON of any depth or shape (options,
``config.json``, ``search.json``, ``metrics.jsonl``, ``summary.json``, a leftover lock, ASE
JSON databases) is one line naming the file or option, a checkpoint's ``config.json`` must
agree with its directory name and ``trainer.pt``, a recorded dataset path must be a
dataset, and flags never silently override the same option given another way."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_run_safety import finished_run, run_quietly, tiny_lm

from flt._io import JSONError, loads_json, read_json_file
from flt.cli import main
from flt.options import parse_value
from flt.train import CheckpointError, checkpoint as ckpt_io, load_checkpoint_model
from flt.train.checkpoint import read_checkpoint_config
from flt.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

DEEP = "[" * 100_000 + "]" * 100_000
SMOKE = ["--preset", "smoke", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run: checkpoints at steps 3 and 4."""
    return finished_run(tmp_path_factory)


@pytest.fixture
def run(tmp_path, finished):
    """A copy of the finished run holding only its last checkpoint (no fallback to hide behind)."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "checkpoints" / "step-00000003")
    return out


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def edit_config(run: Path, change) -> Path:
    path = run / "checkpoints" / "step-00000004" / "config.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))
    return path


def rehash(ckpt: Path, name: str) -> None:
    """Make ``config.json`` list ``name`` with its current hash, as a careful forger would."""
    path = ckpt / "config.json"
    meta = json.loads(path.read_text())
    meta["files"][name] = {"sha256": ckpt_io.sha256_file(str(ckpt / name)), "bytes": (ckpt / name).stat().st_size}
    path.write_text(json.dumps(meta))


# --- one reader ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", [DEEP, '{"a": ' + "[" * 200 + "]" * 200 + "}", b"\xff\xfe{", "{", "NaNx"], ids=["deep", "deep-200", "not-utf8", "torn", "not-json"])
def test_loads_json_is_one_error_naming_where(text):
    with pytest.raises(JSONError, match=r"^the file x\.json is ") as e:
        loads_json(text, "the file x.json")
    assert "\n" not in str(e.value)


@pytest.mark.cli
def test_option_values_nested_deeply_are_refused_naming_the_option(capsys):
    with pytest.raises(ValueError, match="--attn-opt spectrum: the value nests more than 64 levels"):
        parse_value(DEEP, "--attn-opt spectrum")
    assert parse_value("[[1, 2]]") == [[1, 2]] and parse_value("local") == "local" and parse_value("null") is None
    assert main(["train", "lm", *SMOKE, "--attn-opt", f"spectrum={DEEP}"]) == 2
    assert "--attn-opt spectrum: the value nests more than 64 levels" in one_line(capsys)


def test_a_deep_config_json_is_a_corrupt_checkpoint(run):
    path = run / "checkpoints" / "step-00000004" / "config.json"
    path.write_text(DEEP)
    with pytest.raises(CheckpointError, match=rf"{path} is corrupt: .* nests more than 64 levels"):
        read_checkpoint_config(str(path.parent))


def test_a_deep_ase_json_database_names_the_file(tmp_path):
    pytest.importorskip("ase")
    from flt.data.errors import DataError
    from flt.data.molecules import load_ase

    path = tmp_path / "db.json"
    path.write_text('{"1": ' + DEEP + "}")
    with pytest.raises(DataError, match=rf"cannot read structure file {path}: it nests too deeply"):
        load_ase(path)


# --- a checkpoint's config.json agrees with its name and its trainer state ---------------------


@pytest.mark.cli
def test_a_config_json_whose_step_is_not_its_directory_is_refused(run, capsys):
    path = edit_config(run, lambda m: m.update(step=2))
    with pytest.raises(CheckpointError, match=rf"{path} says step 2, but its directory is step-00000004"):
        read_checkpoint_config(str(path.parent))
    # Before: resumed at step 3 on the weights of step 4 and exited 0.
    assert main(["train", "lm", "--preset", "smoke", "--no-progress", "--out-dir", str(run), "--resume", "--steps", "6"]) == 2
    assert "says step 2, but its directory is step-00000004" in one_line(capsys)


@pytest.mark.parametrize("step", [2, 10**12])
def test_a_renamed_checkpoint_must_agree_with_its_trainer_state(run, step):
    ckpt = run / "checkpoints" / "step-00000004"
    edit_config(run, lambda m: m.update(step=step))
    renamed = ckpt.with_name(ckpt_io.step_dir_name(step))
    os.replace(ckpt, renamed)
    (run / "checkpoints" / "latest").write_text(renamed.name + "\n")
    budget = step <= 4
    # Before: a step of 10**12 wrote a summary that claimed a finished run.
    match = "holds the state of step 4, but .* says step 2" if budget else "says step 1000000000000, beyond its run's budget of 4 steps"
    with pytest.raises(CheckpointError, match=match):
        run_quietly(tiny_lm(steps=6), run, resume=True)
    assert json.loads((run / "summary.json").read_text())["steps"] == 4  # the run's own summary, untouched


@pytest.mark.parametrize("key", ["preset", "model", "step"])
def test_a_config_json_without_a_key_names_the_file(run, key):
    path = edit_config(run, lambda m: m.pop(key))
    with pytest.raises(CheckpointError, match=rf"{path}"):
        load_checkpoint_model(str(run))
    if key != "model":  # a resume rebuilds the model from the preset
        with pytest.raises(CheckpointError, match=rf"{path}"):
            run_quietly(tiny_lm(steps=6), run, resume=True)


@pytest.mark.parametrize("state", [[1, 2], {"step": 4}, {"step": 4, "world_size": 1, "optimizer": {}, "rng": "x"}])
def test_a_trainer_state_of_another_shape_names_the_file(run, state):
    ckpt = run / "checkpoints" / "step-00000004"
    torch.save(state, ckpt / "trainer.pt")
    rehash(ckpt, "trainer.pt")
    with pytest.raises(CheckpointError, match=rf"checkpoint file {ckpt / 'trainer.pt'} (holds|is not a trainer state)"):
        run_quietly(tiny_lm(steps=6), run, resume=True)


@pytest.mark.parametrize("line", ['[1, 2]', '{"step": "4", "split": "valid"}', '{"split": "train"}', DEEP[:5000] + DEEP[-5000:]], ids=["list", "string-step", "no-step", "deep"])
def test_metrics_lines_of_another_shape_name_the_line(tmp_path, line):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train", "loss": 2.0}\n' + line + "\n" + '{"step": 2, "split": "train"}\n')
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not"):
        read_metrics(str(path))


# --- search.json and summary.json ----------------------------------------------------------


SEARCH = {"format": "flt-search-1", "complete": True, "task": "lm", "perturbation": ["a"], "magnitude": None,
          "candidates": [{"label": "a", "attention": "softmax", "attention_options": {}}]}


@pytest.mark.cli
@pytest.mark.parametrize("change", [
    {"candidates": [1, 2]}, {"candidates": [{"label": "a"}]}, {"perturbation": "a"}, {"task": 3},
    {"posenc_candidates": [{"label": "p", "posenc": "sin"}]}, {"posenc": "x", "posenc_candidates": []},
])
def test_a_search_json_of_another_shape_is_one_line(tmp_path, change, capsys):
    path = tmp_path / "search.json"
    path.write_text(json.dumps({**SEARCH, **change}))
    assert main(["train", "lm", *SMOKE, "--arch", str(path), "--out-dir", str(tmp_path / "out")]) == 2
    line = one_line(capsys)
    assert f"--arch: {path} is not a search.json written by flt search" in line, line
    path.write_text(DEEP)
    assert main(["train", "lm", *SMOKE, "--arch", str(path), "--out-dir", str(tmp_path / "out")]) == 2
    assert f"--arch: {path} is not a JSON document flt can read" in one_line(capsys)


def test_compare_refuses_a_summary_of_another_shape(tmp_path):
    from flt.commands.compare import _read_run

    (tmp_path / "metrics.jsonl").write_text("")
    for summary in ([1], {"final": {"loss": "x"}}, {"task": "lm", "final": {}}):
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        with pytest.raises(ValueError, match=rf"{tmp_path / 'summary.json'} is not a summary of a finished flt train run"):
            _read_run(str(tmp_path), "loss", [])
    (tmp_path / "summary.json").write_text(DEEP)
    with pytest.raises(ValueError, match="nests more than"):
        _read_run(str(tmp_path), "loss", [])
    (tmp_path / "summary.json").unlink()
    os.mkfifo(tmp_path / "summary.json")  # opened for reading, it would wait for a writer
    with pytest.raises(ValueError, match=r"summary\.json is not a regular file"):
        _read_run(str(tmp_path), "loss", [])


def test_read_json_file_names_the_file(tmp_path):
    (tmp_path / "a.json").write_text("{oops")
    with pytest.raises(JSONError, match=rf"^{tmp_path / 'a.json'} is not valid JSON"):
        read_json_file(str(tmp_path / "a.json"))


# --- evaluate: the dataset a run recorded -----------------------------------------------------


@pytest.mark.parametrize("path, problem", [("/dev/zero", "is not a regular file or directory"), ("/proc/self/environ", "is a file of the system, not a dataset"),
                                           ("/nonexistent/corpus.txt", "does not exist"), (3, "is not a path")])
def test_evaluate_refuses_a_recorded_dataset_that_is_not_one(run, path, problem):
    from flt.commands.evaluate import evaluate_run

    config = edit_config(run, lambda m: m["preset"]["data"].update(path=path))
    with pytest.raises(ValueError, match=rf"{config} records the dataset path={path!r}, which {problem}; pass --data PATH"):
        evaluate_run(str(run), draws=0, exact=False)


# --- flags and options ---------------------------------------------------------------------


@pytest.mark.cli
@pytest.mark.parametrize("flag, option", [("--lr", "lr"), ("--batch-size", "batch_size"), ("--steps", "steps"),
                                          ("--eval-every", "eval_every")])
def test_a_flag_and_a_run_option_that_disagree_are_refused(flag, option, tmp_path, capsys, monkeypatch):
    import flt.train

    monkeypatch.setattr(flt.train, "train", lambda *a, **k: pytest.fail("trained"))
    # Before: the flag silently won.
    assert main(["train", "lm", *SMOKE, flag, "8", "--run-opt", f"{option}=16", "--out-dir", str(tmp_path / "o")]) == 2
    line = one_line(capsys)
    assert f"{flag} 8" in line and f"--run-opt {option}=16" in line, line
    seen = []
    monkeypatch.setattr(flt.train, "train", lambda preset, out, **k: seen.append(getattr(preset.run, option)))
    assert main(["train", "lm", *SMOKE, flag, "8", "--run-opt", f"{option}=8", "--out-dir", str(tmp_path / "o")]) == 0
    assert seen == [8]


OUT_OF_RANGE = [
    (["train", "lm", *SMOKE, "--attn-opt", "seed=-1"], ["attention option seed", "-1"]),
    (["train", "lm", *SMOKE, "--seed", str(2**64)], ["--seed", str(2**64)]),
    (["train", "lm", *SMOKE, "--run-opt", f"seed={2**64}"], ["seed must be", str(2**64)]),
    (["train", "lm", *SMOKE, "--attn-opt", f"seed={2**64}"], ["attention option seed", str(2**64)]),
    (["train", "lm", "--preset", "smoke", "--threads", str(2**64)], ["--threads", str(2**64)]),
    (["evaluate", "RUN", "--threads", str(2**64)], ["--threads", str(2**64)]),
    (["generate", "RUN", "--threads", str(2**64)], ["--threads", str(2**64)]),
    (["generate", "RUN", "--seed", str(2**64)], ["--seed", str(2**64)]),
    (["generate", "RUN", "--temperature", "5e-324"], ["--temperature", "5e-324", "0 (greedy)"]),
    (["generate", "RUN", "--temperature", "1e308"], ["--temperature", "1e+308"]),
    (["generate", "RUN", "--max-new-tokens", str(2**64)], ["--max-new-tokens", str(2**64)]),
    (["fit", "signal", "--preset", "smoke", "--seed", str(2**64)], ["--seed", str(2**64)]),
    (["fit", "signal", "--preset", "smoke", "--threads", str(2**64)], ["--threads", str(2**64)]),
]


@pytest.mark.cli
@pytest.mark.parametrize("argv, words", OUT_OF_RANGE, ids=[f"{a[0]} {a[-2]} {a[-1][:12]}" for a, _ in OUT_OF_RANGE])
def test_seeds_threads_and_temperatures_out_of_range_are_usage_errors(argv, words, run, capsys, monkeypatch):
    monkeypatch.chdir(run.parent)
    assert main([str(run) if a == "RUN" else a for a in argv]) == 2
    line = one_line(capsys)
    for word in words:
        assert word in line, (word, line)


def test_generate_checks_its_arguments_before_loading(tmp_path):
    from flt.commands.generate import check_arguments

    ok = argparse.Namespace(max_new_tokens=5, top_k=2**64, temperature=1e-3, seed=2**63 - 1, threads=1)
    check_arguments(ok)  # a top-k beyond the vocabulary keeps every token
    for field, value in (("temperature", 1e-320), ("temperature", float("nan")), ("seed", 2**63)):
        with pytest.raises(ValueError, match=f"--{field.replace('_', '-')}"):
            check_arguments(argparse.Namespace(**{**vars(ok), field: value}))
