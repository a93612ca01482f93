"""What the CLI tells its user: help texts, error messages, and what it declines to write."""

from __future__ import annotations

import subprocess

import pytest

from flt.cli import build_parser, main


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.cli
def test_compare_with_every_run_failed_writes_no_plot_and_says_why(tmp_path, monkeypatch, capsys):
    import flt.commands.compare as compare

    def failing_run(argv, stdout, stderr, check):  # every child `flt train` fails at once
        stdout.write("Traceback ...\nValueError: the child failed\n")
        return subprocess.CompletedProcess(argv, 1)

    monkeypatch.setattr(compare.subprocess, "run", failing_run)
    out = tmp_path / "cmp"
    code = main(["compare", "lm", "--attention", "flt,softmax", "--seeds", "0,1", "--preset", "smoke", "--out-dir", str(out)])
    text = capsys.readouterr().out
    assert code == 1
    assert not (out / "compare.png").exists()
    assert "no compare.png: every run failed" in text
    assert text.count("FAILED: seed 0: ValueError: the child failed") == 2
    assert (out / "compare.md").exists() and (out / "compare.json").exists()


def test_bench_help_keeps_its_examples_on_separate_lines(capsys):
    text = _help(capsys, "bench")
    lines = text.splitlines()
    for example in ("flt bench speed --preset quick", "flt bench speed --preset full", "flt bench approx [--quick]"):
        assert any(line.strip().startswith(example) for line in lines), (example, text)
    assert any(line.strip().startswith("flt bench speed") and "--preset" not in line for line in lines)


@pytest.mark.parametrize("which", ["speed", "approx"])
def test_bench_subcommands_have_a_description(capsys, which):
    text = _help(capsys, "bench", which)
    usage, _, rest = text.partition("\n\n")
    description = rest.split("\n\n")[0]
    assert usage.startswith("usage: flt bench " + which)
    assert not description.startswith(("options:", "optional arguments:")) and len(description.split()) >= 8, text


@pytest.mark.cli
def test_generate_names_the_wrong_task_with_the_right_article(monkeypatch, tmp_path, capsys):
    import flt.train

    monkeypatch.setattr(flt.train, "load_checkpoint_model", lambda path, device=None: (None, {"model": {"task": "image"}}))
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "an 'image' model" in err and "a 'image'" not in err


def test_non_utf8_text_error_names_the_cli_option_and_the_python_keyword(tmp_path):
    from flt.data.errors import DataError
    from flt.data.text import load_text_files

    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 au lait ".encode("latin-1") * 20)
    with pytest.raises(DataError) as err:
        load_text_files(path)
    message = str(err.value)
    assert "latin1.txt" in message and "UTF-8" in message
    assert "--data-opt require_utf8=false" in message and "require_utf8=False" in message


def test_the_cli_accepts_the_option_the_utf8_error_names():
    from flt.commands.train import parse_assignments

    assert parse_assignments(["require_utf8=false"], "--data-opt") == {"require_utf8": False}
