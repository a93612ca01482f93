"""The run files of ``flt linearize``, the benchmarks and ``flt approx``, and the folders
flt reads a model or a checkpoint from: writes are atomic and never go through a link,
JSON read from a user's folder is bounded, a FIFO among the files is refused (not opened,
which would block), and the header and summary of a model without attention name the
model, not an attention mechanism it does not use."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_run_files import NOTES, finished, outside_file, plant_link  # noqa: F401 (finished: a fixture)
from test_run_safety import tiny_lm

from flt._io import JSONError
from flt.data.errors import DataError
from flt.train import loop
from flt.train.loop import TrainingDiverged

pytestmark = pytest.mark.usefixtures("one_thread")

DEEP = "[" * 100_000 + "]" * 100_000


#: Run beside the test: after a delay, open the FIFO for writing and close it, which lets a
#: reader blocked in opening it go on (to an empty file); prints whether one was there.
UNBLOCK = """
import os, sys, time
time.sleep(float(sys.argv[2]))
try:
    os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while nobody reads it
    print("opened")
except OSError:
    print("unopened")
"""


@contextlib.contextmanager
def no_hang(fifo: Path, seconds: float = 15):
    """Fail the test instead of waiting forever on ``fifo``: a reader that opened it blocks
    (holding the GIL, in some libraries) until a writer comes, so a process beside the
    test comes as one after ``seconds`` and the test fails if it found a reader."""
    helper = subprocess.Popen([sys.executable, "-c", UNBLOCK, str(fifo), str(seconds)], stdout=subprocess.PIPE, text=True)
    try:
        yield
    finally:
        helper.kill()  # the code under test returned: nothing to unblock
        found = helper.communicate()[0].strip()
    assert found != "opened", f"{fifo} was opened for reading: it blocked until a writer came"


# --- flt linearize ------------------------------------------------------------------------


def test_linearize_data_that_is_a_fifo_is_refused_without_opening_it(tmp_path):
    from flt.train.linearize import load_text

    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    with no_hang(fifo), pytest.raises(DataError, match=r"--data file .*corpus\.txt is a FIFO \(named pipe\), not a regular file"):
        load_text(str(fifo))


def test_linearize_data_is_size_checked_before_it_is_read(tmp_path, monkeypatch):
    from flt._limits import MemoryLimitError
    from flt.train.linearize import load_text

    monkeypatch.setenv("FLT_MEMORY_LIMIT", "10M")
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.truncate(200 * 2**20)  # sparse: nothing on disk, 200 MiB once read
    with pytest.raises(MemoryLimitError, match=r"--data file .*big\.txt \(200 MiB on disk\).*FLT_MEMORY_LIMIT"):
        load_text(str(big))
    (tmp_path / "small.txt").write_text("line\n" * 400)
    train, valid, name = load_text(str(tmp_path / "small.txt"))
    assert len(train) + len(valid) == 2000 and name == "small.txt"


def test_linearize_model_dir_config_nested_deeply_is_one_line_naming_it(tmp_path):
    from flt.train.linearize import check_model_dir

    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(JSONError, match=rf"^MODEL_DIR {tmp_path}: config\.json is not a JSON document flt can read: it nests"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").unlink()
    os.mkfifo(tmp_path / "config.json")
    with no_hang(tmp_path / "config.json"), pytest.raises(ValueError, match=r"config\.json"):
        check_model_dir(tmp_path)


def test_linearize_plot_replaces_a_link_and_keeps_its_target(tmp_path):
    pytest.importorskip("matplotlib")
    from flt.train.linearize import plot_linearization

    notes = outside_file(tmp_path)
    path = tmp_path / "run" / "learning_curves.png"
    path.parent.mkdir()
    plant_link(path, notes)
    records = [{"split": "softmax", "step": 0, "loss": 1.0, "ppl": 2.7},
               {"split": "valid", "step": 0, "loss": 1.2, "ppl": 3.3},
               {"split": "train", "step": 1, "loss": 1.1},
               {"split": "valid", "step": 1, "loss": 1.1, "ppl": 3.0}]
    plot_linearization(records, str(path), transfer_steps=0)
    assert notes.read_text() == NOTES
    assert not path.is_symlink() and path.read_bytes()[:4] == b"\x89PNG"


def test_linearize_refuses_a_summary_with_nan_instead_of_writing_invalid_json(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from test_linearize import TEXT, save_llama

    import flt.train.metrics as metrics_module
    from flt.train.linearize import LinearizeConfig, linearize

    real = metrics_module.read_metrics
    # The perplexity after fine-tuning (step 2) overflowed: what the summary is made from.
    monkeypatch.setattr(metrics_module, "read_metrics", lambda path: [
        {**rec, "ppl": math.nan} if rec["split"] == "valid" and rec["step"] == 2 else rec for rec in real(path)])
    text = tmp_path / "code.txt"
    text.write_text(TEXT)
    out = tmp_path / "run"
    config = LinearizeConfig(attention_options={"near_field": 4, "qk_norm": False, "num_features": 16, "seed": 0},
                             data=str(text), seq_len=32, batch_size=2, transfer_steps=1, finetune_steps=1, warmup_steps=0,
                             eval_every=1, eval_batches=1, checkpoint_every=1, byte_tokens=True)
    with pytest.raises(TrainingDiverged, match=r"^the validation perplexity finetuned is nan in .*run \(not a finite number; "
                       r"summary\.json is not written\)"):
        linearize(save_llama(tmp_path / "llama"), str(out), config, progress=False, plots=False)
    assert not (out / "summary.json").exists()
    json.loads((out / "run.json").read_text(), parse_constant=pytest.fail)


# --- model and checkpoint folders -----------------------------------------------------------


def test_a_fifo_among_a_converted_models_safetensors_is_refused_before_loading(tmp_path):
    pytest.importorskip("transformers")
    # From a lab test module: tests/lab runs without tests/library on the path.
    from test_linearize import save_llama
    from transformers import LlamaForCausalLM

    from flt.integrations.transformers import convert, from_pretrained

    model = LlamaForCausalLM.from_pretrained(save_llama(tmp_path / "softmax")).eval()
    convert(model, "flt", num_features=16, num_frequencies=4, amplitude=0.5, seed=3)
    tmp_path = tmp_path / "converted"
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])  # a folder of the earlier layout
    config_file.write_text(json.dumps(config))
    os.mkfifo(tmp_path / "extra.safetensors")
    with no_hang(tmp_path / "extra.safetensors"), pytest.raises(ValueError, match=r"model file .*extra\.safetensors is a FIFO \(named pipe\), not a regular file"):
        from_pretrained(tmp_path)
    (tmp_path / "extra.safetensors").unlink()
    config_file.write_text(DEEP)
    with pytest.raises(JSONError, match=r"config\.json is not a JSON document flt can read: it nests"):
        from_pretrained(tmp_path)


def test_a_step_folder_that_links_out_of_the_run_is_neither_used_nor_pruned(tmp_path, finished):  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run / "checkpoints" / "step-00000003", elsewhere / "step-00000001")
    before = sorted(p.name for p in (elsewhere / "step-00000001").iterdir())
    os.symlink(elsewhere / "step-00000001", run / "checkpoints" / "step-00000001")
    # Steps 5 and 6: the checkpoint at step 6 prunes all but the newest two of the run's own.
    loop.train(tiny_lm(steps=6), str(run), resume=True, progress=False, plots=False)
    kept = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept == ["step-00000001", "step-00000004", "step-00000006"]
    assert (run / "checkpoints" / "step-00000001").is_symlink()
    assert sorted(p.name for p in (elsewhere / "step-00000001").iterdir()) == before
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


def test_a_refused_pickle_in_a_trainer_state_is_one_line_naming_the_file_and_the_global(tmp_path):
    from flt.train.checkpoint import CheckpointError, load_trainer_state

    torch.save({"step": 1, "hook": contextlib.nullcontext()}, tmp_path / "trainer.pt")
    with pytest.raises(CheckpointError) as caught:
        load_trainer_state(str(tmp_path))
    message = str(caught.value)
    assert "\n" not in message and "\x1b" not in message and len(message) < 400, message
    assert message.startswith(f"checkpoint file {tmp_path / 'trainer.pt'} is corrupt: torch.load with weights_only=True refused")
    assert "contextlib.nullcontext" in message


# --- benchmarks and flt approx --------------------------------------------------------------


def test_benchmark_json_is_atomic_replaces_links_and_writes_nan_as_null(tmp_path):
    from flt.bench import write_json

    notes = outside_file(tmp_path)
    path = tmp_path / "out" / "speed.json"
    path.parent.mkdir()
    plant_link(path, notes)
    write_json(path, {"rows": [{"spread": math.inf, "error": math.nan, "ms": 1.5}]})
    assert notes.read_text() == NOTES and not path.is_symlink()
    assert json.loads(path.read_text(), parse_constant=pytest.fail) == {"rows": [{"spread": None, "error": None, "ms": 1.5}]}


@pytest.mark.cli
def test_flt_approx_spatial_replaces_a_link_of_its_json(tmp_path, isolated_cli, monkeypatch):
    from flt.bench import approx
    from flt.cli import main

    monkeypatch.setattr(approx, "spatial_fidelity_errors", lambda *a, **k: [])
    notes = outside_file(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    plant_link(out / "spatial.json", notes)
    assert main(["approx", "--spatial", "--quick", "--out-dir", str(out)]) == 0
    assert notes.read_text() == NOTES
    assert json.loads((out / "spatial.json").read_text()) == {"spatial": []}


# --- a model without attention is named as itself ----------------------------------------------


@pytest.mark.cli
def test_a_schnet_run_names_its_model_not_an_attention_it_does_not_use(tmp_path, capsys, isolated_cli):
    pytest.importorskip("torch_geometric")
    from flt.cli import main

    out = tmp_path / "run"
    assert main(["train", "nbody", "--preset", "smoke", "--model", "schnet", "--steps", "2", "--run-opt", "eval_every=2",
                 "--out-dir", str(out), "--no-progress", "--no-plots"]) == 0
    printed = capsys.readouterr()
    header = next(line for line in (printed.out + printed.err).splitlines() if line.startswith("nbody: "))
    assert header.startswith("nbody: schnet, ") and "flt" not in header
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["attention"], summary["posenc"], summary["model"]) == (None, None, "schnet")


def test_model_labels_name_attention_for_attention_models_and_the_encoder_otherwise():
    from flt.baselines.particles import ParticleConfig
    from flt.baselines.qm9 import QM9Config
    from flt.graphs.link import TASK_ENCODERS
    from flt.tasks.graph import GraphConfig

    assert loop.model_label(ParticleConfig()) == "flt + none" if ParticleConfig().attention == "flt" else True
    for cfg in (ParticleConfig(encoder="transformer+lr"), QM9Config(encoder="transformer"), QM9Config(encoder="transformer+lr"),
                GraphConfig()):
        assert loop.model_label(cfg) == f"{cfg.attention} + {cfg.posenc}" and loop.uses_attention(cfg)
    for cfg in (ParticleConfig(encoder="schnet+lr"), QM9Config(encoder="schnet"), QM9Config(encoder="dimenet++lr"),
                *(GraphConfig(encoder=e) for e in TASK_ENCODERS if e != "transformer")):
        assert loop.model_label(cfg) == cfg.encoder and not loop.uses_attention(cfg)
        assert loop._mechanism(cfg) == {"attention": None, "posenc": None, "model": cfg.encoder}
