"""Help for a terminal: the commands' descriptions are their module docstrings, written in
reStructuredText like every docstring of flt (double-backtick literals, ``Examples::``
before a literal block, cross-reference roles). :func:`plain_parser` turns the description,
epilog and argument help of every parser of ``flt`` into plain text, once, when
:func:`flt.cli.build_parser` has built them, so that no command formats its own."""

from __future__ import annotations

import argparse
import re
import textwrap

#: Prose is filled to this width, the width of the docstrings it comes from.
WIDTH = 88

_ROLE = r":[a-z]+(?::[a-z]+)?:`([^`]+)`"
# A role alone in parentheses, "(:mod:`flt.options`)": a link for the docs site, nothing
# a terminal can follow, so it goes with its parentheses.
_REFERENCE = re.compile(r"\s*\(" + _ROLE + r"\)")
_ROLE_RE = re.compile(_ROLE)
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


def _role_text(match: re.Match[str]) -> str:
    """The text a role shows: its title (``text <target>``), or its target, of which ``~``
    keeps the last component."""
    target = match.group(1)
    titled = re.fullmatch(r"(.+?)\s*<[^>]+>", target, re.DOTALL)
    if titled:
        return titled.group(1)
    return target.rsplit(".", 1)[-1] if target.startswith("~") else target


def plain_inline(text: str) -> str:
    """``text`` without inline markup: literals and roles become their text, and a role
    alone in parentheses goes."""
    text = _REFERENCE.sub("", text)
    text = _ROLE_RE.sub(_role_text, text)
    return _LITERAL.sub(r"\1", text)


def plain(text: str, width: int = WIDTH) -> str:
    """reStructuredText ``text`` as plain text: inline markup as :func:`plain_inline`, prose
    paragraphs filled to ``width``, and the ``::`` that introduces a literal block as the
    colon it reads as (``Examples::`` -> ``Examples:``; alone, or after a space, it goes).
    A paragraph with an indented line (a literal block, a table) keeps its lines. ``text``
    is dedented as a whole, as a module docstring; :func:`inspect.cleandoc` a function's
    docstring first."""
    paragraphs = []
    for paragraph in re.split(r"\n(?:[ \t]*\n)+", textwrap.dedent(text).strip("\n")):
        lines = paragraph.rstrip().splitlines()
        if any(line[:1].isspace() for line in lines):
            paragraphs.append("\n".join(line.rstrip() for line in lines))
            continue
        prose = plain_inline(" ".join(line.strip() for line in lines))
        if prose.endswith("::"):
            head = prose[:-2]
            prose = head.rstrip() if not head or head.endswith(" ") else head + ":"
        if prose:
            paragraphs.append(textwrap.fill(prose, width, break_long_words=False, break_on_hyphens=False))
    return "\n\n".join(paragraphs)


def plain_parser(parser: argparse.ArgumentParser) -> None:
    """Make the help of ``parser`` and of every subcommand below it plain text, in place:
    the description and the epilog through :func:`plain`, every argument's help (and each
    subcommand's line in its parent's list) through :func:`plain_inline`."""
    if parser.description:
        parser.description = plain(parser.description)
    if parser.epilog:
        parser.epilog = plain(parser.epilog)
    for action in parser._actions:
        if action.help:
            action.help = plain_inline(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = plain_inline(choice.help) if choice.help else choice.help
            for sub in {id(p): p for p in action.choices.values()}.values():
                plain_parser(sub)
