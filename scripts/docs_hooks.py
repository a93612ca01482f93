"""MkDocs hooks: the command-line reference (docs/cli.md) is rendered from flt's own
argparse parsers at build time, so it cannot drift from ``flt --help``."""

from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- flt-cli-reference -->"


def _commands(parser: argparse.ArgumentParser, path: list[str]) -> list[tuple[list[str], argparse.ArgumentParser]]:
    """``(words, parser)`` for the parser and every subcommand below it, depth first."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.extend(_commands(sub, [*path, name]))
    return found


def cli_reference() -> str:
    """Markdown: one section per command with its ``--help`` text."""
    from flt.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal width; fix it for the page
    parts = []
    for words, parser in _commands(build_parser(), ["flt"]):
        parser.prog = " ".join(words)
        title = " ".join(words)
        parts.append(f"## `{title}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
