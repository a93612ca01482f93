"""The library-only install (``pip install -e .``: torch and einops): ``flt --version`` and
``flt --help`` work, commands whose own code needs nothing more show their help, and a
command that needs an extra names it. Run in a subprocess whose imports cannot find any
optional dependency (:data:`flt._extras.EXTRA_OF_MODULE`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flt._extras import EXTRA_OF_MODULE
from flt.cli import version

pytestmark = pytest.mark.cli

SRC = Path(__file__).resolve().parents[2] / "src"

#: Prepended to every script: no optional dependency is installed, as far as imports can tell.
WITHOUT_EXTRAS = f"""
import importlib.abc, sys

class _NoExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {sorted(EXTRA_OF_MODULE)!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NoExtras())
"""


def run_flt(*argv: str) -> subprocess.CompletedProcess:
    """``python -m flt ARGV`` with no optional dependency importable."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)  # Triton's CPU interpreter, which conftest switches on, imports numpy
    script = WITHOUT_EXTRAS + f"import runpy\nsys.argv = ['flt', *{list(argv)!r}]\nrunpy.run_module('flt', run_name='__main__')\n"
    return subprocess.run([sys.executable, "-W", "ignore", "-c", script], check=False, capture_output=True, text=True,
                          timeout=300, env=env)


def test_version_works_without_the_extras():
    out = run_flt("--version")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == f"flt {version()}"


def test_help_lists_every_command_and_names_the_extra_of_those_that_need_one():
    out = run_flt("--help")
    assert out.returncode == 0, out.stderr[-3000:]
    for command in ("approx", "train", "evaluate", "linearize"):
        assert command in out.stdout
    assert "(unavailable) this needs numpy" in out.stdout and "[train]" in out.stdout


def test_a_command_without_needs_shows_its_help():
    out = run_flt("approx", "--help")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage: flt approx" in out.stdout


@pytest.mark.parametrize("argv", [("train", "--help"), ("train", "lm", "--preset", "smoke"), ("linearize", "--help")])
def test_a_command_that_needs_an_extra_names_it_in_one_line(argv):
    out = run_flt(*argv)
    assert out.returncode == 1, out.stderr[-3000:]
    line = out.stderr.strip()
    assert "\n" not in line and line.startswith(f"flt {argv[0]}: error: this needs numpy"), line
    assert "[train]" in line and "Traceback" not in out.stderr


def test_unknown_arguments_of_an_available_command_are_still_refused():
    out = run_flt("approx", "--no-such-flag")
    assert out.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in out.stderr
