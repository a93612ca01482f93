"""The Python blocks of docs/integrations.md run, in order, in one namespace (the page's
own assertions are the checks: the core against its layer, the converted model's float64
identity, the save/load round trip); so do the README's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[str]:
    return [m.group(1) for m in _BLOCK.finditer(text)]


def test_block_parser_finds_fenced_python_only():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\n"]


def run_blocks(blocks: list[str], page: str) -> dict:
    """Run ``blocks`` in order in one namespace; a failing block fails naming ``page`` and
    its number. Returns the namespace, for the caller's checks."""
    namespace: dict = {"__name__": page}
    for number, block in enumerate(blocks, 1):
        try:
            exec(compile(block, f"{page}, block {number}", "exec"), namespace)  # noqa: S102
        except Exception as error:
            raise AssertionError(f"{page}: Python block {number} failed: {error!r}\n{block}") from error
    return namespace


def test_integrations_page_snippets_run(one_thread):
    pytest.importorskip("transformers")
    blocks = python_blocks(PAGE.read_text(encoding="utf-8"))
    assert len(blocks) >= 6
    run_blocks(blocks, PAGE.name)


def test_readme_python_blocks_run(one_thread):
    """The README's Python blocks run in order in one namespace, all but the Hugging Face
    one (it needs a downloaded decoder, ``model``; this page's test above runs its calls)."""
    readme = PAGE.parents[1] / "README.md"
    blocks = [b for b in python_blocks(readme.read_text(encoding="utf-8")) if "flt.integrations.transformers" not in b]
    assert len(blocks) >= 3
    namespace = run_blocks(blocks, readme.name)
    assert namespace["h"].shape == (2, 4096, 64)
