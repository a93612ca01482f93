"""Tasks: one file per task, one registry, :data:`TASKS`.

A task file (``lm.py``, ``image.py``, ``molecule.py``) holds everything about its task: a
:class:`~flt.tasks.base.Task` subclass that names its model config and model class (the
model builder), loads its data, computes its loss and metrics and labels its plots, and the
task's presets with their mechanism defaults. :data:`TASKS` is the only list of tasks: the
CLI choices of ``flt train`` and ``flt compare``, the preset tables, checkpoint loading and
the docs table (:func:`task_table`) read it. Adding a task is one file here and one entry
in :data:`TASKS` (docs/extending.md).

Presets: ``TASKS[task].presets[name](attention, posenc) -> Preset``. Every preset states
its command, its run time and the metric it reaches with FLT (the default mechanism, seed
0), measured with ``--threads 1`` on a 2-core VM that other jobs shared (torch 2.13 CPU;
wall time of the whole command, data loading included). On that busy machine two torch
threads were often many times slower than one (OpenMP threads waiting for a descheduled
peer); on an idle 2-core laptop two threads are faster. Metrics are deterministic for a
seed on one machine. ``smoke`` runs in seconds (tests, CI), ``small`` in a few minutes,
``base`` is larger. Since training redraws the random features every step by default
(``RunConfig.redraw_interval``, :mod:`flt.train.drawgap`), metrics are on the fixed
evaluation draw; numbers that say "one fixed draw" were measured before that default
(``--run-opt redraw_interval=0`` reproduces them) and hold on that draw only.

Mechanism options: a mechanism is chosen by name; options that only make sense for a
given mechanism and task live in the task's ``attention_defaults`` and
``posenc_defaults``, keyed by name, and a user's ``--attn-opt`` / ``--posenc-opt``
override them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from flt._checks import check_choice
from flt.models.config import TrunkConfig, config_from_fields
from flt.options import check_keyword_types
from flt.tasks.base import Task, mechanism_options, step_generator
from flt.tasks.graph import GraphTask
from flt.tasks.image import ImageTask
from flt.tasks.listops import ListOpsTask
from flt.tasks.lm import LMTask, generate_text, tokenizer_from_extra
from flt.tasks.longlm import LongLMTask
from flt.tasks.molecule import MoleculeTask
from flt.tasks.nbody import NBodyTask
from flt.tasks.offsets import OffsetsTask
from flt.tasks.preset import (
    Preset,
    RunConfig,
    preset_differences,
    preset_to_dict,
    run_config_from_dict,
)
from flt.tasks.qm9 import QM9Task
from flt.tasks.separation import SeparationTask

#: Every task, by name, in the order the CLI lists them.
TASKS: dict[str, type[Task]] = {task.name: task for task in (LMTask, ImageTask, MoleculeTask, GraphTask, ListOpsTask, LongLMTask, NBodyTask, OffsetsTask, QM9Task, SeparationTask)}


def config_keys() -> dict[type[TrunkConfig], str]:
    """The key (``"task"``) under which each registered task's config class is saved
    (:func:`config_to_dict`; checkpoints of every version carry it): the task's
    :attr:`~Task.config_key`, else its name. Two tasks that share a config class must agree
    on its key. Read from :data:`TASKS` at each call, so a task registered later counts."""
    keys: dict[type[TrunkConfig], str] = {}
    for task in TASKS.values():
        key = task.config_key or task.name
        if keys.setdefault(task.config, key) != key:
            raise TypeError(f"{task.__name__}.config {task.config.__name__} is saved as {keys[task.config]!r} by another "
                            f"task; set {task.__name__}.config_key = {keys[task.config]!r}")
    return keys


def get_task(name: str) -> type[Task]:
    """``TASKS[name]`` with a clear error for unknown names."""
    check_choice("task", name, TASKS)
    return TASKS[name]


def load_task(name: str, options: dict[str, Any]) -> Task:
    """Load the data of task ``name`` with loader ``options`` (the task's ``options``)."""
    cls = get_task(name)
    _check_known(cls, options)
    return cls(**options)


def _check_known(cls: type[Task], options: dict[str, Any], source: str | None = None) -> None:
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        fields = {f.name for f in dataclasses.fields(cls.config)} & set(unknown)
        hint = (f"; {sorted(fields)} {'is a field' if len(fields) == 1 else 'are fields'} of the model "
                f"({cls.config.__name__}, set when it is trained: flt train --model-opt), not data") if fields else ""
        if "path" in unknown:
            hint += f"; {cls.name!r} reads only its bundled data (no --data PATH)"
        prefix = f"{source}: " if source else ""
        raise ValueError(f"{prefix}unknown data options for {cls.name!r}: {unknown}; known: {sorted(cls.options)}{hint}")
    # Types from the loader's annotations: require_utf8=maybe is no bool, num_train=true no int.
    check_keyword_types(cls, options, f"{source + ': ' if source else ''}data options of {cls.name!r}")


def _same_path(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return os.path.realpath(os.fspath(a)) == os.path.realpath(os.fspath(b))


def set_data_path(changes: dict[str, Any], path: str) -> None:
    """Put the ``--data PATH`` flag into the ``--data-opt`` ``changes``; a different
    ``path=`` among them names a second dataset and is refused."""
    if "path" in changes and changes["path"] != path:
        raise ValueError(f"--data {path!r} and --data-opt path={changes['path']!r} name two datasets; give one")
    changes["path"] = path


def change_data(name: str, data: dict[str, Any], changes: dict[str, Any], source: str = "--data-opt") -> dict[str, Any]:
    """Task ``name``'s data options ``data`` with ``changes`` (given by ``source``, named in
    errors) applied on top.

    A new ``path`` (another file, compared after resolving links and relative spellings, or
    None: the bundled data again) is another dataset: the options bound to the old one are
    dropped from ``data``, namely the companions of the old path (``path_options``, e.g. an
    LM's ``valid_path``) and, for a path, the bundled data's options (``bundled_options``).
    Changes of bundled options together with a path are refused: the dataset's loader would
    ignore them."""
    cls = get_task(name)
    _check_known(cls, changes, source)
    out = dict(data)
    if "path" in changes and not _same_path(changes["path"], data.get("path")):
        dropped = set(cls.path_options) | (set(cls.bundled_options) if changes["path"] is not None else set())
        out = {k: v for k, v in out.items() if k not in dropped}
    out.update(changes)
    bundled = sorted(set(changes) & set(cls.bundled_options))
    if out.get("path") is not None and bundled:
        raise ValueError(f"{source} {', '.join(bundled)}: options of the bundled data, which the dataset at "
                         f"{out['path']!r} does not take")
    return out


def holdout_tasks() -> list[str]:
    """The tasks that declare a held-out part of their training split
    (:meth:`Task.holdout_split`): those ``flt search`` can search, in registry order."""
    return [name for name, task in TASKS.items() if task.holdout_split is not Task.holdout_split]


def get_preset(task: str, name: str, attention: str = "flt", posenc: str = "none") -> Preset:
    """``TASKS[task].presets[name](attention, posenc)`` with clear errors for unknown names."""
    presets = get_task(task).presets
    if name not in presets:
        raise ValueError(f"preset must be one of {sorted(presets)}, got {name!r}")
    return presets[name](attention, posenc)


def preset_names() -> list[str]:
    """Every preset name of some task, in the order the tasks list them."""
    return list(dict.fromkeys(name for task in TASKS.values() for name in task.presets))


def check_preset(preset: Preset) -> type[Task]:
    """The task of ``preset``, after checking that it is registered and that the model
    config is that task's."""
    task = get_task(preset.task)
    if not isinstance(preset.model, task.config):
        raise TypeError(f"the preset of task {preset.task!r} needs model={task.config.__name__}(...), got {type(preset.model).__name__}")
    return task


def config_to_dict(cfg: TrunkConfig) -> dict[str, Any]:
    """``{"task": key, **fields}``: the fields of ``cfg`` (JSON-serialisable when the option
    dicts are) under the key of its class (:func:`config_keys`; a subclass of a registered
    config is saved under that config's key)."""
    keys = config_keys()
    key = next((keys[c] for c in type(cfg).__mro__ if c in keys), None)
    if key is None:
        raise ValueError(f"{type(cfg).__name__} is the config of no registered task (flt.tasks.TASKS)")
    return {"task": key, **dataclasses.asdict(cfg)}


def config_from_dict(data: dict[str, Any]) -> TrunkConfig:
    """Inverse of :func:`config_to_dict`: the config of the registered task class whose key
    is ``data["task"]``; unknown or missing keys and unknown fields raise ``ValueError``."""
    if not isinstance(data, dict) or "task" not in data:
        raise ValueError("a model config dict needs a 'task' key")
    classes = {key: cls for cls, key in config_keys().items()}
    check_choice("task", data["task"], classes)
    return config_from_fields(classes[data["task"]], {k: v for k, v in data.items() if k != "task"})


def preset_from_dict(data: dict[str, Any]) -> Preset:
    """Inverse of :func:`flt.tasks.preset.preset_to_dict`."""
    try:
        task, model, run, options = data["task"], data["model"], data["run"], data["data"]
    except (KeyError, TypeError):
        raise ValueError("a saved run configuration needs 'task', 'model', 'run' and 'data' entries") from None
    preset = Preset(task=task, model=config_from_dict(model), run=run_config_from_dict(run), data=dict(options))
    check_preset(preset)
    return preset


def task_table() -> str:
    """The Markdown table of the registered tasks (docs/extending.md shows it; a test keeps
    the two equal)."""
    lines = ["| task | what | metric | presets | model |", "|---|---|---|---|---|"]
    for name, task in TASKS.items():
        better = "higher" if task.higher_is_better else "lower"
        lines.append(f"| `{name}` | {task.description} | {task.metric} ({better} is better) | "
                     f"{', '.join(task.presets)} | `{task.model.__name__}` |")
    return "\n".join(lines)


__all__ = [
    "TASKS",
    "ImageTask",
    "LMTask",
    "MoleculeTask",
    "Preset",
    "RunConfig",
    "Task",
    "change_data",
    "check_preset",
    "config_from_dict",
    "config_keys",
    "config_to_dict",
    "generate_text",
    "get_preset",
    "get_task",
    "holdout_tasks",
    "load_task",
    "mechanism_options",
    "preset_differences",
    "preset_from_dict",
    "preset_names",
    "preset_to_dict",
    "set_data_path",
    "step_generator",
    "task_table",
    "tokenizer_from_extra",
]
