"""``flt train``, ``flt generate`` and ``flt compare`` through the console entry point."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from flt.cli import main
from flt.train import get_preset, load_checkpoint_model, train
from flt.train.metrics import read_metrics


pytestmark = pytest.mark.usefixtures("isolated_cli")


SMOKE = {
    "lm": ["--data-opt", "max_bytes=60000"],
    "image": [],
    "molecule": ["--data-opt", "num_samples=96", "--data-opt", "progress=false"],
}


@pytest.mark.cli
@pytest.mark.parametrize("task", ["lm", "image", "molecule"])
def test_smoke_training_writes_metrics_checkpoints_plots(task, tmp_path, capsys):
    out = tmp_path / task
    code = main(["train", task, "--preset", "smoke", "--out-dir", str(out), "--no-progress", *SMOKE[task]])
    assert code == 0
    records = read_metrics(str(out / "metrics.jsonl"))
    train_losses = [r["loss"] for r in records if r["split"] == "train"]
    valid = [r for r in records if r["split"] == "valid"]
    assert len(train_losses) >= 4 and len(valid) == 2
    assert sum(train_losses[-2:]) / 2 < sum(train_losses[:2]) / 2
    latest = (out / "checkpoints" / "latest").read_text().strip()
    ckpt = out / "checkpoints" / latest
    assert {p.name for p in ckpt.iterdir()} == {"model.safetensors", "trainer.pt", "config.json"}
    for png in ("learning_curves.png", "rpe_functions.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    metric = {"lm": "ppl", "image": "accuracy", "molecule": "mae"}[task]
    assert summary["metric"] == metric and summary["final"][metric] == valid[-1][metric]
    text = capsys.readouterr().out
    assert "done:" in text
    if task == "lm":
        assert "sample (prompt 'def '" in text


@pytest.mark.cli
def test_generate_from_checkpoint_with_and_without_the_recurrent_state(tmp_path, capsys):
    out = tmp_path / "lm"
    preset = get_preset("lm", "smoke")
    preset = dataclasses.replace(preset, run=dataclasses.replace(preset.run, steps=4), data={"max_bytes": 20_000})
    train(preset, str(out), progress=False, plots=False)
    capsys.readouterr()
    args = ["generate", str(out), "--prompt", "import os", "--max-new-tokens", "30", "--temperature", "0"]
    assert main(args) == 0
    recurrent = capsys.readouterr().out
    assert main([*args, "--recompute"]) == 0
    assert capsys.readouterr().out == recurrent
    assert recurrent.startswith("import os")


@pytest.mark.cli
def test_resume_through_the_cli_matches_an_uninterrupted_run(tmp_path):
    common = ["train", "image", "--preset", "smoke", "--steps", "8", "--checkpoint-every", "3", "--no-progress", "--no-plots"]
    assert main([*common, "--out-dir", str(tmp_path / "a")]) == 0
    assert main([*common, "--out-dir", str(tmp_path / "b"), "--steps", "8"]) == 0
    # Simulate a run killed after step 7 of 8: drop the final checkpoint, point latest at step 6.
    ckpts = tmp_path / "b" / "checkpoints"
    for d in ckpts.iterdir():
        if d.name == "step-00000008":
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
    (ckpts / "latest").write_text("step-00000006\n")
    assert main([*common, "--out-dir", str(tmp_path / "b"), "--resume"]) == 0
    a = load_checkpoint_model(str(tmp_path / "a"))[0].state_dict()
    b = load_checkpoint_model(str(tmp_path / "b"))[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.cli
def test_compare_prints_a_table(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main(["compare", "image", "--attention", "flt:coupling=multiplicative:near_neighbors=0", "--seeds", "0,1",
                 "--preset", "smoke", "--steps", "4", "--out-dir", str(out), "--threads", "1"])
    text = capsys.readouterr().out
    assert code == 0, text
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table[0] == "| attention | seeds | accuracy (mean ± std) | loss | ms/step | peak MiB | params |"
    assert len(table) == 3 and table[2].startswith("| flt:coupling=multiplicative:near_neighbors=0 | 2 | ") and "±" in table[2]
    assert (out / "compare.png").exists() and (out / "compare.md").exists()
    data = json.loads((out / "compare.json").read_text())
    assert [len(r["runs"]) for r in data["rows"]] == [2]
    assert os.path.exists(out / "flt_coupling=multiplicative_near_neighbors=0" / "seed-1" / "summary.json")
    capsys.readouterr()
    assert main(["compare", "image", "--attention", "flt:coupling=multiplicative:near_neighbors=0", "--out-dir", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_compare_plot_with_log_axis_and_with_every_run_failed(tmp_path):
    import warnings

    from flt.train.plots import plot_comparison

    curves = {"a": [[(10, 30.0), (20, 9.0)], [(10, 25.0), (20, 8.0)]], "b": [[(10, 12.0), (20, 7.0)]]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_comparison(curves, str(tmp_path / "ppl.png"), metric="ppl")
        assert plot_comparison({"a": []}, str(tmp_path / "none.png"), metric="accuracy") is None
    assert (tmp_path / "ppl.png").stat().st_size > 0 and not (tmp_path / "none.png").exists()


def test_compare_table_and_entries():
    from flt.commands.compare import _mean_std, _table, parse_entries, parse_seeds

    assert parse_entries("flt,softmax:relative_bias=alibi:max_distance=8") == [
        ("flt", "flt", {}), ("softmax:relative_bias=alibi:max_distance=8", "softmax", {"relative_bias": "alibi", "max_distance": 8})
    ]
    with pytest.raises(ValueError, match="twice"):
        parse_entries("flt,flt")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_entries("flt:coupling")
    assert parse_seeds("0,1,2") == [0, 1, 2]
    with pytest.raises(ValueError, match="seeds"):
        parse_seeds("0,a")
    mean, std = _mean_std([1.0, 2.0, 3.0])
    assert mean == 2.0 and std == pytest.approx(1.0)
    assert _mean_std([4.0]) == (4.0, None)
    ok = {"label": "a", "seeds": [0, 1], "failed": "", "metric": (0.5, 0.1), "extra": {"bpb": 2.0},
          "time_per_step_s": 0.012, "peak_memory_mib": 300.0, "parameters": 1234}
    bad = {"label": "b", "seeds": [], "failed": "seed 0: boom"}
    lines = _table([ok, bad], "ppl", ["bpb"]).splitlines()
    assert lines[2] == "| a | 2 | 0.5 ± 0.1 | 2 | 12.0 | 300 | 1,234 |"
    assert "FAILED: seed 0: boom" in lines[3]


@pytest.mark.cli
@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "lm", "--attention", "nope"], "attention must be one of"),
        (["train", "lm", "--posenc", "nope"], "posenc must be one of"),
        (["train", "lm", "--preset", "huge"], "preset must be one of"),
        (["train", "lm", "--data", "/no/such/corpus.txt", "--preset", "smoke"], "not found: /no/such/corpus.txt"),
        (["train", "lm", "--attn-opt", "spectrum"], "KEY=VALUE"),
        (["train", "lm", "--model-opt", "depht=2"], "unknown LMConfig fields"),
        (["train", "lm", "--resume", "--out-dir", "/no/such/run"], "checkpoint"),
        # Recorded as an absolute path (so --resume works from anywhere), and named in the error.
        (["train", "lm", "--preset", "smoke", "--init-from", "no/such/run", "--data-opt", "max_bytes=20000"],
         f"checkpoint directory not found: {os.path.abspath('no/such/run')}"),
        (["generate", "/no/such/run"], "not found"),
        (["compare", "lm", "--attention", "flt,,softmax"], "empty entry"),
        # Checked before any data is read: bundled options with a dataset path, unknown options.
        (["train", "listops", "--data", "/no/such/dir", "--data-opt", "num_train=5"],
         "--data-opt/--data num_train: options of the bundled data, which the dataset at '/no/such/dir' does not take"),
        (["train", "listops", "--data-opt", "max_len=5"], "--data-opt: unknown data options for 'listops': ['max_len']"),
        (["train", "lm", "--data", "a.txt", "--data-opt", "path=b.txt"], "--data 'a.txt' and --data-opt path='b.txt' name two datasets"),
        (["evaluate", "/no/run", "--data", "a.txt", "--data-opt", "path=b.txt"], "name two datasets"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def _text_file(folder):
    path = folder / "corpus.txt"
    path.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(600)))
    return path


def _image_folder(folder):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for label in ("a", "b"):
        (folder / "imgs" / label).mkdir(parents=True)
        for i in range(12):
            pixels = (torch.rand(8, 8, 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(folder / "imgs" / label / f"{i}.png")
    return folder / "imgs"


def _structure_file(folder):
    import ase.io
    from ase import Atoms

    g = torch.Generator().manual_seed(0)
    frames = []
    for i in range(24):
        n = 3 + i % 4
        atoms = Atoms(numbers=[1 + (i + k) % 8 for k in range(n)], positions=(3 * torch.rand(n, 3, generator=g)).numpy())
        atoms.info["energy"] = float(i % 5)
        frames.append(atoms)
    path = folder / "structures.xyz"
    ase.io.write(path, frames, format="extxyz")
    return path


@pytest.mark.cli
@pytest.mark.parametrize("task, make_data, options", [
    ("lm", _text_file, []),
    ("image", _image_folder, ["--data-opt", "valid_fraction=0.25"]),
    ("molecule", _structure_file, ["--data-opt", "valid_fraction=0.25"]),
])
def test_real_loaders_through_data_path(task, make_data, options, tmp_path):
    data = make_data(tmp_path)
    out = tmp_path / "run"
    argv = ["train", task, "--preset", "smoke", "--data", str(data), "--steps", "3", "--batch-size", "8",
            "--out-dir", str(out), "--no-progress", "--no-plots", *options]
    assert main(argv) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["preset"]["data"]["path"] == str(data)
    assert json.loads((out / "summary.json").read_text())["final"]


@pytest.mark.cli
def test_list_presets_prints_every_preset_with_its_budget_and_trains_nothing(tmp_path, monkeypatch, capsys):
    from flt.tasks import get_task

    monkeypatch.chdir(tmp_path)
    assert main(["train", "listops", "--list-presets"]) == 0
    out = capsys.readouterr().out
    for name, make in get_task("listops").presets.items():
        run = make().run
        assert f"\n{name}\n" in f"\n{out}" and f"flt train listops --preset {name}:" in out
        assert f"budget: {run.steps} steps of {run.batch_size}, peak lr {run.lr:g}" in out
    assert "About" in out and max(map(len, out.splitlines())) <= 90
    assert not (tmp_path / "runs").exists()
