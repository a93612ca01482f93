"""``--help`` is written for a terminal: the commands' docstrings are reStructuredText for
the docs site, and their help shows them as plain text, in user terms; the presets a help
names are those the task has."""

from __future__ import annotations

import argparse
import inspect
import re

import pytest

from flt.cli import build_parser
from flt.tasks import TASKS

#: Python names of flt's own code, which a user of the command line does not meet.
INTERNAL = ("RunConfig", "lr_at", "flt.tasks.TASKS", "flt.ATTENTION", "flt.POSENC", "GPU_ROWS", "FLTAttention",
            "keep_freed_memory")
# Any dotted name inside flt; flt.cli is the module `python -m flt.cli` and torchrun run.
FLT_NAME = re.compile(r"\bflt\.(?!cli\b)\w")
ROLE = re.compile(r":(?:mod|class|func|meth|data|attr|exc|obj|py:\w+):`")


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [words]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name in action.choices:
                found += _commands(action.choices[name], (*words, name))
    return found


COMMANDS = _commands(build_parser())


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _parser(*words: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def _markup(text: str) -> list[str]:
    """What in ``text`` is reStructuredText or a Python name of flt's code."""
    found = [line for line in text.splitlines() if "``" in line or line.rstrip().endswith("::") or ROLE.search(line)]
    found += [name for name in INTERNAL if name in text]
    found += [m.string[max(m.start() - 20, 0):m.end() + 20] for m in FLT_NAME.finditer(text)]
    return found


def test_every_command_is_checked():
    assert ("train",) in COMMANDS and ("bench", "speed") in COMMANDS and len(COMMANDS) >= 12


@pytest.mark.parametrize("words", COMMANDS, ids=lambda w: " ".join(("flt", *w)))
def test_help_is_plain_text_in_user_terms(capsys, words):
    if _parser(*words).get_default("unavailable"):
        pytest.skip(f"flt {' '.join(words)} needs an extra that is not installed")
    text = _help(capsys, *words)
    assert not _markup(text), text


@pytest.mark.cli
def test_preset_listing_is_plain_text(capsys):
    for task in TASKS:
        _, out = _list_presets(capsys, task)
        assert "`" not in out and not _markup(out), out


def _list_presets(capsys, task: str) -> tuple[list[str], str]:
    from flt.cli import main

    assert main(["train", task, "--list-presets"]) == 0
    out = capsys.readouterr().out
    return [line for line in out.splitlines() if line and not line[0].isspace()], out


@pytest.mark.cli
@pytest.mark.parametrize("task", list(TASKS))
def test_list_presets_names_the_task_s_presets(capsys, task):
    names, _ = _list_presets(capsys, task)
    assert names == list(TASKS[task].presets)


def _presets_in_help(text: str) -> dict[str, list[str]]:
    """``{task: presets}`` read from the help of ``--preset``: groups ``TASK, ...: PRESET, ...``
    separated by semicolons, the first after a preamble that ends with a colon."""
    found: dict[str, list[str]] = {}
    for group in text.split(";"):
        parts = group.split(":")
        for task in re.findall(r"[\w-]+", parts[-2]) if len(parts) > 1 else []:
            found[task] = re.findall(r"[\w-]+", parts[-1])
    return found


@pytest.mark.parametrize("command", ["train", "compare"])
def test_preset_help_names_each_task_s_own_presets(command):
    action = next(a for a in _parser(command)._actions if a.dest == "preset")
    listed = _presets_in_help(action.help)
    assert {task: listed.get(task) for task in TASKS} == {task: list(t.presets) for task, t in TASKS.items()}, action.help
    assert all(action.default in t.presets for t in TASKS.values())


@pytest.mark.cli
def test_preset_help_and_the_failure_of_a_preset_the_task_lacks_agree(capsys):
    from flt.cli import main

    action = next(a for a in _parser("train")._actions if a.dest == "preset")
    assert "long" not in _presets_in_help(action.help)["lm"]
    assert main(["train", "lm", "--preset", "long"]) == 2
    assert "preset must be one of" in capsys.readouterr().err


def _token_range(task: type, preset) -> str:
    defaults = inspect.signature(task.__init__).parameters
    lo = preset.data.get("min_length", defaults["min_length"].default)
    hi = preset.data.get("max_length", defaults["max_length"].default)
    return f"{lo}-{hi}"


def test_listops_description_gives_each_preset_its_lengths(capsys):
    task = TASKS["listops"]
    line = next(line for line in _help(capsys, "train").splitlines() if line.split()[:1] == ["listops"])
    for name, make in task.presets.items():
        span = _token_range(task, make())
        found = re.search(re.escape(span) + r"[^()]*\(([^)]*)\)", line)
        assert found and name in re.findall(r"[\w-]+", found.group(1)), (name, span, line)


def test_plain_text_of_restructured_text():
    from flt.commands.helptext import plain, plain_inline

    assert plain_inline("a ``--flag`` and :class:`~flt.layers.FLTAttention`") == "a --flag and FLTAttention"
    assert plain_inline("checked (:mod:`flt.options`) first") == "checked first"
    assert plain_inline(":func:`the docs <flt.train.train>` say") == "the docs say"
    text = plain("Title ``x``\nwraps here.\n\nExamples::\n\n    flt train lm   # ``kept``\n\nAfter ::\n\n    y\n\n::\n\n    z\n")
    assert text == "Title x wraps here.\n\nExamples:\n\n    flt train lm   # ``kept``\n\nAfter\n\n    y\n\n    z"
    long = plain(" ".join(["word"] * 40) + " --a-long-flag", width=30)
    assert max(map(len, long.splitlines())) <= 30 and "--a-long-flag" in long.splitlines()[-1]
