"""What a task needs lives in its own file: no module outside ``flt/tasks`` refers to a
registered task by its name.

The rule, over the string constants of every module of ``src/flt`` outside ``flt/tasks``
(read with ``ast``, so comments and docstrings, which are prose, do not count). Several task
names are also ordinary words with other meanings there (``"image"`` is a problem of
``flt fit``, ``"graph"`` an install extra, ``"offsets"`` an array of a data file, ``"lm"`` a
benchmark shape), so a constant equal to a task name counts only where it refers to a task:

1. compared with a task's name (``x.name == "graph"``, ``preset.task in ("lm", ...)``: the
   other side ends in ``.name`` or ``.task``, or is a variable called ``name`` or ``task``);
2. passed to a function that looks tasks up by name (:func:`flt.tasks.get_task`,
   :func:`flt.tasks.get_preset`, :func:`flt.tasks.load_task`, :func:`flt.tasks.change_data`,
   ``TASKS[...]``);
3. one of two or more task names in one dict, tuple, list or set display: a table or list
   of tasks (``{"image": 2, "molecule": 3}``, ``SUPPORTED = ("image", "lm", ...)``);
4. the value of a class attribute called ``task`` (a model config tagged with the task that
   trains it: the tasks name their configs, :attr:`flt.tasks.Task.config`, and the key of a
   config's saved form is theirs, :func:`flt.tasks.config_keys`).

Not counted: ``flt/fit``, whose own problems are called tasks (``FitConfig.task`` is
``"signal"`` or ``"image"``, a field of the fit command's config, not a registered task).

The keys of saved configs moved from the configs to the tasks without changing: the last
tests pin them and load a checkpoint's configuration written before the move.
"""

from __future__ import annotations

import ast
import json
import pathlib

from flt.tasks import TASKS, config_from_dict, config_keys, config_to_dict, preset_from_dict, preset_to_dict

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "flt"
LOOKUPS = {"get_task", "get_preset", "load_task", "change_data"}


def _names_task(node: ast.AST) -> bool:
    """Whether ``node`` reads a task's name: ``x.name``, ``x.task``, ``name`` or ``task``."""
    return (isinstance(node, ast.Attribute) and node.attr in ("name", "task")) or (
        isinstance(node, ast.Name) and node.id in ("name", "task"))


def _task_constants(node: ast.AST) -> list[ast.Constant]:
    """The task-name constants of ``node``: itself, or the elements of a tuple, list or set display."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [n for n in items if isinstance(n, ast.Constant) and n.value in TASKS]


def task_name_uses(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every use of a task's name in ``source`` under the rule above."""
    found: list[ast.Constant] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_task(side) for side in sides):
                found += [c for side in sides for c in _task_constants(side)]
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in LOOKUPS and node.args:
                found += _task_constants(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "TASKS":
            found += _task_constants(node.slice)
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign):
                    targets, value = stmt.targets, stmt.value
                elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                    targets, value = [stmt.target], stmt.value
                else:
                    continue
                if any(isinstance(t, ast.Name) and t.id == "task" for t in targets):
                    found += _task_constants(value)
        elif isinstance(node, (ast.Dict, ast.Tuple, ast.List, ast.Set)):
            items = node.keys if isinstance(node, ast.Dict) else node.elts
            constants = [c for item in items if item is not None for c in _task_constants(item)]
            if len({c.value for c in constants}) >= 2:
                found += constants
    return sorted({(c.lineno, c.value) for c in found})


def test_the_rule_finds_what_it_describes():
    names = sorted(TASKS)[:2]
    a, b = names
    assert task_name_uses(f"if task.name == {a!r}:\n    pass") == [(1, a)]
    assert task_name_uses(f"ok = preset.task in ({a!r}, 'other')") == [(1, a)]
    assert task_name_uses(f"get_preset({b!r}, 'smoke')") == [(1, b)]
    assert task_name_uses(f"SUPPORTED = ({a!r}, {b!r})") == [(1, a), (1, b)]
    assert task_name_uses(f"x = {{{a!r}: 2, {b!r}: 3}}.get(cfg.task, 1)") == [(1, a), (1, b)]
    assert task_name_uses(f'"""A {a} model."""\nclass C:\n    task: ClassVar[str] = {a!r}\n') == [(3, a)]
    assert task_name_uses(f"class C:\n    dim = 4\n    task = {b!r}\n") == [(3, b)]
    # Other meanings of the same words and prose do not count.
    assert task_name_uses(f"extra = {{'networkx': {a!r}}}\nfield = {a!r}\n") == []
    assert task_name_uses(f'"""A {a} model."""\nclass C:\n    kind = {a!r}\n') == []


def test_no_module_outside_the_tasks_refers_to_a_task_by_name():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] in ("tasks", "fit"):
            continue
        offenders += [f"{path.relative_to(SRC)}:{line}: {name!r}" for line, name in task_name_uses(path.read_text(encoding="utf-8"))]
    assert not offenders, "task names outside flt/tasks (declare what the code needs on the task instead):\n" + "\n".join(offenders)


#: The key of each task's config in saved configs, as checkpoints written before the tasks
#: named their configs carry it (the config's former ``task`` class attribute).
SAVED_KEYS = {"LMConfig": "lm", "ImageConfig": "image", "MoleculeConfig": "molecule", "GraphConfig": "graph",
              "ListOpsConfig": "listops", "ParticleConfig": "nbody", "OffsetsConfig": "offsets", "QM9Config": "qm9"}
FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


def test_configs_are_saved_under_the_keys_that_checkpoints_carry():
    assert {cls.__name__: key for cls, key in config_keys().items()} == SAVED_KEYS
    for name, task in TASKS.items():
        cfg = task.presets["smoke"]().model
        saved = config_to_dict(cfg)
        assert saved["task"] == SAVED_KEYS[type(cfg).__name__], name
        assert config_from_dict(json.loads(json.dumps(saved))) == cfg


def test_a_checkpoint_configuration_written_before_the_move_still_loads():
    # config.json of `flt train image --preset smoke` as written by the code before this change.
    meta = json.loads((FIXTURES / "image-smoke-checkpoint-config.json").read_text(encoding="utf-8"))
    cfg = config_from_dict(meta["model"])
    assert type(cfg).__name__ == "ImageConfig" and (cfg.dim, cfg.depth, cfg.num_classes) == (32, 2, 10)
    assert config_to_dict(cfg) == meta["model"]
    preset = preset_from_dict(meta["preset"])
    assert preset.task == "image" and preset_to_dict(preset) == meta["preset"]
