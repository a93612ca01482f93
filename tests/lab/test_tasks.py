"""The task registry: every task is complete, and a task registered with one entry (a toy
task defined in this file) is trained, compared, plotted and reloaded with no other edit."""

from __future__ import annotations

import copy
import inspect
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flt.cli import build_parser, main
from flt.models import Trunk, build_posenc
from flt.tasks import TASKS, Preset, RunConfig, Task, change_data, check_preset, get_preset, preset_from_dict, preset_to_dict, task_table
from flt.tasks.base import epoch_indices, eval_slices, mechanism_options, shard

ROOT = Path(__file__).resolve().parents[2]

#: What every task must define beyond the interface's defaults.
REQUIRED = ("configure", "train_batch", "batch_items", "loss", "eval_batches", "eval_sums", "metrics", "rpe_extent")


@pytest.mark.parametrize("name", list(TASKS))
def test_every_task_has_presets_a_model_builder_data_and_a_metric(name):
    task = TASKS[name]
    assert task.name == name and task.description
    assert "smoke" in task.presets
    for preset_name, make in task.presets.items():
        preset = make()
        assert preset.task == name and check_preset(preset) is task
        assert f"flt train {name} --preset {preset_name}" in make.__doc__ and "About" in make.__doc__
        assert preset_from_dict(json.loads(json.dumps(preset_to_dict(preset)))) == preset
    model = task.build_model(task.presets["smoke"]().model)
    assert isinstance(model, task.model) and isinstance(model, nn.Module)
    assert callable(task.dataset)
    assert set(inspect.signature(task.__init__).parameters) - {"self"} == set(task.options)
    assert set(task.bundled_options) <= set(task.options) and set(task.path_options) <= set(task.options)
    assert not set(task.bundled_options) & set(task.path_options)
    assert {"loss", task.metric, "offset", *task.compare_metrics} <= set(task.axes)
    assert all(getattr(task, m) is not getattr(Task, m) for m in REQUIRED), name


def test_a_new_dataset_path_drops_the_options_bound_to_the_old_data():
    # The bundled data's size options go with a path; a user's changes apply on top.
    assert change_data("listops", {"num_train": 5, "bucket": 4}, {"path": "a"}) == {"bucket": 4, "path": "a"}
    # An LM's validation file belongs to its training file: another path drops it, unless given again.
    trained = {"path": "old.txt", "valid_path": "old-valid.txt", "tokenizer": "char"}
    assert change_data("lm", trained, {"path": "new.txt"}) == {"path": "new.txt", "tokenizer": "char"}
    assert change_data("lm", trained, {"path": "new.txt", "valid_path": "v.txt"})["valid_path"] == "v.txt"
    assert change_data("lm", trained, {"path": "old.txt"}) == trained  # the same dataset keeps its companions
    # The same file under another spelling is the same dataset; None is the bundled data again.
    assert change_data("lm", trained, {"path": "./old.txt"})["valid_path"] == "old-valid.txt"
    assert change_data("lm", trained, {"path": None}) == {"path": None, "tokenizer": "char"}
    # An image folder's validation folder goes with it; the input size is the model's and stays.
    assert change_data("image", {"path": "a", "valid_dir": "b", "size": [8, 8]}, {"path": "c"}) == {"path": "c", "size": [8, 8]}
    assert change_data("graph", {"graph": "communities", "task": "pair"}, {"path": "g.txt"}) == {"task": "pair", "path": "g.txt"}
    # Bundled options given with a path would be ignored by its loader: refused by name and flag.
    with pytest.raises(ValueError, match=r"--data-opt max_length: options of the bundled data, which the dataset at 'a'"):
        change_data("listops", {}, {"path": "a", "max_length": 100})
    with pytest.raises(ValueError, match=r"--data-opt num_samples: options of the bundled data"):
        change_data("molecule", {"path": "m.db"}, {"num_samples": 10})
    # Unknown options name the flag, and a model field among them is pointed at.
    with pytest.raises(ValueError, match=r"^--data-opt: unknown data options for 'lm': \['max_len'\]; known: .*"
                                         r"\['max_len'\] is a field of the model \(LMConfig, set when it is trained"):
        change_data("lm", {}, {"max_len": 64})
    with pytest.raises(ValueError, match=r"unknown data options for 'longlm': \['path'\]; .*'longlm' reads only its bundled data"):
        change_data("longlm", {}, {"path": "x"}, "--data-opt/--data")
    with pytest.raises(ValueError, match=r"^--x: unknown data options for 'graph': \['nope'\]; known: \[[^;]*\]$"):
        change_data("graph", {}, {"nope": 1}, "--x")


def test_the_cli_choices_and_preset_views_come_from_the_registry():
    from flt.train import PRESETS, TASK_CLASSES
    from flt.train.presets import ATTENTION_DEFAULTS, POSENC_DEFAULTS

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for command in ("train", "compare"):
        task_arg = next(a for a in sub.choices[command]._actions if a.dest == "task")
        assert list(task_arg.choices) == list(TASKS)
    assert TASK_CLASSES is TASKS
    assert PRESETS == {n: t.presets for n, t in TASKS.items()}
    assert ATTENTION_DEFAULTS == {n: t.attention_defaults for n, t in TASKS.items()}
    assert POSENC_DEFAULTS == {n: t.posenc_defaults for n, t in TASKS.items()}


def test_unknown_tasks_and_presets_are_named_in_the_error():
    with pytest.raises(ValueError, match="task must be one of"):
        get_preset("no-such-task", "smoke")
    with pytest.raises(ValueError, match="preset must be one of"):
        get_preset("lm", "no-such-preset")
    smoke = get_preset("lm", "smoke")
    with pytest.raises(TypeError, match="needs model=ImageConfig"):
        check_preset(Preset("image", smoke.model, smoke.run, {}))


def test_the_docs_table_is_the_registry():
    text = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    assert task_table() in text, "docs/extending.md: paste flt.tasks.task_table() over the task table"


def test_the_registry_and_the_task_commands_import_no_optional_dependency():
    code = ("import sys, flt.tasks, flt.commands.train, flt.commands.compare; "
            "print(sorted(m for m in ('sklearn', 'ase', 'PIL', 'matplotlib', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- a toy task: this file and one registry entry -----------------------------------------


@dataclass(frozen=True)
class ToyConfig:
    """Sum of a sequence of numbers, read by a one-block Transformer."""

    length: int = 8
    dim: int = 16
    depth: int = 1
    heads: int = 2
    attention: str = "flt"
    attention_options: dict[str, Any] = field(default_factory=dict)
    posenc: str = "none"
    posenc_options: dict[str, Any] = field(default_factory=dict)


class ToyModel(nn.Module):
    """``x [B, N] -> y [B]``, positions ``0 .. N-1``."""

    def __init__(self, *, length, dim, depth, heads, attention, attention_options, posenc, posenc_options, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.embed = nn.Linear(1, dim, **fk)
        self.posenc = build_posenc(posenc, dim, 1, posenc_options, **fk)
        self.trunk = Trunk(dim, depth, heads, attention=attention, attention_options=attention_options, pos_dim=1,
                           causal=False, mlp_ratio=2.0, dropout=0.0, **fk)
        self.head = nn.Linear(dim, 1, **fk)

    def forward(self, x: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        B, N = x.shape
        pos = torch.arange(N, device=x.device, dtype=x.dtype).view(1, N, 1).expand(B, N, 1)
        h = self.embed(x.unsqueeze(-1)) + self.posenc(pos).to(x.dtype)
        return self.head(self.trunk(h, pos, exact=exact).mean(dim=1)).squeeze(-1)


def toy_data(samples: int = 48, length: int = 8):
    """``(x, y)`` train and valid splits: uniform numbers and their sums."""
    x = torch.rand(samples, length, generator=torch.Generator().manual_seed(0)) * 2 - 1
    y = x.sum(-1)
    cut = samples * 3 // 4
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def toy_smoke(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train toy --preset smoke``: 4 steps of 8 sequences. About 1 s."""
    run = RunConfig(steps=4, batch_size=8, warmup_steps=1, eval_every=2, checkpoint_every=2, log_every=1)
    return Preset("toy", ToyConfig(**mechanism_options(ToyTask, attention, posenc)), run, {})


class ToyTask(Task):
    name = "toy"
    description = "sum of a sequence (a task defined in a test)"
    config, model = ToyConfig, ToyModel
    metric, higher_is_better, compare_metrics, unit = "mae", False, ("loss",), "seq"
    options = ("samples",)
    dataset = staticmethod(toy_data)
    presets = {"smoke": toy_smoke}
    attention_defaults = {"flt": {"num_features": 8, "num_frequencies": 4}, "performer": {"num_features": 8}}
    axes = {"loss": "MSE (units squared)", "mae": "MAE (toy units)", "offset": "positions"}

    def __init__(self, *, samples: int = 48):
        (self.train_x, self.train_y), (self.valid_x, self.valid_y) = toy_data(samples)

    def configure(self, cfg):
        return cfg

    def train_batch(self, step, batch_size, seed, rank, world):
        idx = epoch_indices(len(self.train_x), batch_size, seed, step)[shard(batch_size, rank, world)]
        return self.train_x[idx], self.train_y[idx]

    def batch_items(self, batch):
        return batch[0].shape[0]

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)

    def eval_batches(self, batch_size, max_batches, rank, world):
        for sl in eval_slices(len(self.valid_x), batch_size, max_batches, rank, world):
            yield self.valid_x[sl], self.valid_y[sl]

    def eval_sums(self, model, batch):
        x, y = batch
        err = (model(x) - y).double()
        return {"sq": float((err**2).sum()), "abs": float(err.abs().sum()), "count": float(err.numel())}

    def metrics(self, sums):
        return {"loss": sums["sq"] / sums["count"], "mae": sums["abs"] / sums["count"]}

    def rpe_extent(self, cfg):
        return float(cfg.length), False

    def longest_sequence(self, cfg):
        return cfg.length


@pytest.fixture
def toy(monkeypatch):
    """The one registry line of a new task."""
    monkeypatch.setitem(TASKS, ToyTask.name, ToyTask)
    torch.set_num_threads(1)
    return ToyTask


def test_a_new_task_meets_the_same_requirements(toy):
    test_every_task_has_presets_a_model_builder_data_and_a_metric(toy.name)


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_registered_task_appears_in_the_help_of_train_and_compare(toy, capsys, command):
    text = _help(capsys, command)
    assert "{" + ",".join(TASKS) + "}" in text and ",toy}" in text
    assert any(line.split()[:1] == ["toy"] and ToyTask.description in line for line in text.splitlines()), text


@pytest.mark.cli
def test_a_registered_task_trains_resumes_and_reloads_through_the_cli(toy, tmp_path, capsys):
    from flt.train import load_checkpoint_model
    from flt.train.metrics import read_metrics
    from flt.train.plots import axis_label

    out = tmp_path / "toy"
    args = ["train", "toy", "--preset", "smoke", "--out-dir", str(out), "--no-progress", "--no-plots"]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    valid = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["split"] == "valid"]
    assert summary["metric"] == "mae" and summary["final"]["mae"] == valid[-1]["mae"]
    assert set(summary["draw_gap"]) >= {"own", "fresh_mean", "exact"} and summary["draw_gap"]["exact"] is not None
    model, meta = load_checkpoint_model(str(out))
    assert isinstance(model, ToyModel) and meta["preset"]["task"] == "toy"
    assert main([*args, "--resume", "--steps", "6"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
    assert axis_label("mae", "toy") == "MAE (toy units)" and axis_label("mae") == "MAE (target units, eV by default)"
    capsys.readouterr()


@pytest.mark.cli
def test_a_registered_task_is_compared_with_its_metric_and_columns(toy, tmp_path, monkeypatch, capsys):
    import flt.commands.compare as compare

    def run_in_this_process(argv, stdout, stderr, check):  # the child `flt train` sees the toy task too
        assert argv[1:3] == ["-m", "flt.cli"]
        return subprocess.CompletedProcess(argv, main(argv[3:]))

    monkeypatch.setattr(compare.subprocess, "run", run_in_this_process)
    out = tmp_path / "cmp"
    code = main(["compare", "toy", "--attention", "flt,performer", "--preset", "smoke", "--out-dir", str(out), "--no-plots"])
    assert code == 0
    result = json.loads((out / "compare.json").read_text())
    assert result["task"] == "toy" and result["metric"] == "mae"
    assert [r["label"] for r in result["rows"]] == ["flt", "performer"] and not any(r["failed"] for r in result["rows"])
    assert "| mae (mean ± std) | loss |" in (out / "compare.md").read_text()
    assert "mae: lower is better" in capsys.readouterr().out


class SearchableToyTask(ToyTask):
    """The toy task with a held-out part of its training split: what ``flt search`` needs."""

    def holdout_split(self, fraction, seed):
        cut = len(self.train_x) - max(1, round(fraction * len(self.train_x)))
        weights, alpha = copy.copy(self), copy.copy(self)
        weights.train_x, weights.train_y = self.train_x[:cut], self.train_y[:cut]
        alpha.train_x, alpha.train_y = alpha.valid_x, alpha.valid_y = self.train_x[cut:], self.train_y[cut:]
        return weights, alpha

    def fit_batch_size(self, batch_size):
        return min(batch_size, len(self.train_x))


def test_flt_search_offers_the_tasks_that_declare_a_held_out_part(monkeypatch, tmp_path, capsys):
    from flt.search import SearchConfig, parse_candidates, search
    from flt.search.holdout import split_task
    from flt.tasks import holdout_tasks

    monkeypatch.setitem(TASKS, ToyTask.name, ToyTask)
    assert "toy" not in holdout_tasks() and ",toy}" not in _help(capsys, "search")
    with pytest.raises(ValueError, match="declares no held-out part"):
        split_task(ToyTask(), 0.2)
    monkeypatch.setitem(TASKS, ToyTask.name, SearchableToyTask)
    torch.set_num_threads(1)
    assert "toy" in holdout_tasks() and ",toy}" in _help(capsys, "search")
    # One file and one registry line: the toy task's search runs and decides its layer.
    config = SearchConfig(tuple(parse_candidates("flt,softmax", SearchableToyTask)), tune_steps=1)
    result = search(toy_smoke(), config, str(tmp_path / "s"), progress=False, plots=False)
    assert result["complete"] and result["perturbation"][0] in ("flt", "softmax") and result["task"] == "toy"
