"""An empty ``--out-dir`` is refused (exit 2, naming the flag) by every command that takes
one, before anything is written: it used to read as "not given" and write into the
default folder of the current directory."""

from __future__ import annotations

import pytest

from flt.cli import main

pytestmark = pytest.mark.cli

#: One command line of every command with an --out-dir, without it.
COMMANDS = {
    "train": ["train", "lm", "--preset", "smoke", "--steps", "1"],
    "compare": ["compare", "lm", "--attention", "flt,softmax", "--preset", "smoke", "--steps", "1"],
    "search": ["search", "lm", "--candidates", "flt,softmax", "--preset", "smoke", "--steps", "1"],
    "fit": ["fit", "signal", "--preset", "smoke"],
    "approx": ["approx", "--quick"],
    "bench speed": ["bench", "speed", "--quick"],
    "bench approx": ["bench", "approx", "--quick"],
    "linearize": ["linearize", "no-such-model"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_out_dir_is_refused(command, value, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*COMMANDS[command], "--out-dir", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"flt {command}: error: --out-dir is empty; give the directory to write into"
    assert list(tmp_path.iterdir()) == []
