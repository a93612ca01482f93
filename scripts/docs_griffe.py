"""A griffe extension for the API reference: the docstrings are written with Sphinx roles
(``:class:`~flt.layers.FLTAttention```) and reST literal blocks (``Examples::``), which
Markdown would print verbatim; this turns them into Markdown code spans and code blocks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const):`(?P<body>[^`]+)`")


def _role(match: re.Match[str]) -> str:
    body = match.group("body")
    if "<" in body and body.endswith(">"):  # :class:`text <target>`
        return f"`{body[: body.index('<')].strip()}`"
    return f"`{body.lstrip('~').split('.')[-1] if body.startswith('~') else body}`"


def markdown(text: str) -> str:
    """``text`` with roles as code spans and ``word::`` literal-block openers as ``word:``."""
    text = _ROLE.sub(_role, text)
    # "Examples::" opens an indented literal block in reST; in Markdown the indented block
    # after a blank line is already code, so only the second colon goes.
    text = re.sub(r"(?m)(\S)::[ \t]*$", r"\1:", text)
    return re.sub(r"(?m)^[ \t]*::[ \t]*$", "", text)


def comment_above(lines: list[str], lineno: int) -> str:
    """The ``#:`` comment lines right above line ``lineno`` (1-based), joined."""
    found: list[str] = []
    for line in reversed(lines[: lineno - 1]):
        if not line.lstrip().startswith("#:"):
            break
        found.insert(0, line.lstrip()[2:].strip())
    return " ".join(found)


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring as it is loaded, and gives module data documented by a
    ``#:`` comment (the registries) that comment as its docstring."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is None and attr.lineno is not None and isinstance(attr.filepath, Path):
            text = comment_above(attr.filepath.read_text(encoding="utf-8").splitlines(), attr.lineno)
            if text:
                attr.docstring = griffe.Docstring(markdown(text), lineno=attr.lineno, parent=attr)

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
