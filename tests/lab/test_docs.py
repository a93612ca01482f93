"""The documentation is self-contained: no references outside the repository, every
citation of the mathematical reference names a section it has, every relative link and
every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MATH_DOC = ROOT / "docs" / "math.md"

#: What the repository ships and documents; build outputs and caches are skipped.
SCANNED = ["README.md", "pyproject.toml", "docs", "src", "tests", "scripts", ".ci"]
SKIPPED_DIRS = {"__pycache__", ".pytest_cache"}

# Built from pieces so that this file does not contain them itself.
FORBIDDEN = (".." + "/shared", "MATH" + ".md")

_NUMBER = r"\d+(?:\.\d+)*"
_KEYWORD = r"(?:sections?|identity|identities)"
#: The page's path followed by "section 4", "sections 2 and 4", "sections 3, 3.1 and
#: identity 10.2" or just "6"; the path alone cites the whole page. (Written without the
#: path here so that this file cites nothing itself.)
_CITATION = re.compile(r"docs/math\.md(?:'s)?(?P<tail>[^\n]{0,100})")
_NUMBERS = re.compile(
    rf"\s+(?:{_KEYWORD}\s+)?(?P<nums>{_NUMBER}(?:(?:\s*,\s*and\s+|\s*,\s*|\s+and\s+)(?:{_KEYWORD}\s+)?{_NUMBER})*)"
)
_KEYWORD_ONLY = re.compile(rf"\s+{_KEYWORD}\b")
_HEADING = re.compile(rf"^#{{1,6}}\s+(?P<num>{_NUMBER})\.?\s", re.MULTILINE)
_LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^()\s]+)(?:\s+\"[^\"]*\")?\)")


def text_files(entries=SCANNED):
    """``(path, text)`` of every text file under ``entries`` (binary files are skipped)."""
    for entry in entries:
        path = ROOT / entry
        if path.is_file():
            candidates = [path]
        elif path.is_dir():
            candidates = sorted(p for p in path.rglob("*") if p.is_file())
        else:
            continue
        for p in candidates:
            parts = p.relative_to(ROOT).parts
            if any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in parts):
                continue
            data = p.read_bytes()
            if b"\0" in data:
                continue
            try:
                yield p, data.decode("utf-8")
            except UnicodeDecodeError:
                continue  # images and other binary files


def math_headings() -> set[str]:
    return {m.group("num") for m in _HEADING.finditer(MATH_DOC.read_text(encoding="utf-8"))}


def citations(text: str):
    """``(line number, cited section numbers, the citation text)``; an empty list means the
    citation names no section (a bare reference to the page)."""
    for m in _CITATION.finditer(text):
        tail = m.group("tail")
        line = text.count("\n", 0, m.start()) + 1
        nums = _NUMBERS.match(tail)
        if nums:
            yield line, re.findall(_NUMBER, nums.group("nums")), m.group(0)
        elif _KEYWORD_ONLY.match(tail):
            yield line, None, m.group(0)  # "section" with no number after it
        else:
            yield line, [], m.group(0)


def strip_code(markdown: str) -> str:
    """Markdown without fenced code blocks and inline code spans (they hold no links)."""
    out, fenced = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def test_no_references_outside_the_repository():
    found = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, text.index(bad)) + 1}: {bad!r}"
        for path, text in text_files()
        for bad in FORBIDDEN
        if bad in text
    ]
    assert not found, "references to files outside the repository:\n" + "\n".join(found)


def test_math_reference_keeps_its_section_numbers():
    """Code comments cite these numbers: renumbering the page would silently break them."""
    expected = {str(n) for n in range(11)} | {"3.1"} | {f"10.{n}" for n in range(1, 7)}
    missing = expected - math_headings()
    assert not missing, f"docs/math.md lacks the numbered headings {sorted(missing, key=lambda s: [int(p) for p in s.split('.')])}"


def test_every_math_citation_names_an_existing_section():
    headings = math_headings()
    bad, count = [], 0
    for path, text in text_files(["src", "tests", "docs", "README.md"]):
        for line, nums, cited in citations(text):
            where = f"{path.relative_to(ROOT)}:{line}: {cited.strip()!r}"
            if nums is None:
                bad.append(f"{where} (no section number)")
                continue
            count += len(nums)
            bad.extend(f"{where} (no heading {n})" for n in nums if n not in headings)
    assert count > 0, "found no citation at all: is the citation pattern still right?"
    assert not bad, "citations of missing sections:\n" + "\n".join(bad)


def test_citation_parser():
    page = "docs/" + "math.md"
    sample = (
        f"{page} section 6. Next\n({page} 5)\n{page} sections 3, 3.1 and identity 10.2.\n"
        f"{page}'s form\n{page} section x\n{page} sections 2 and 4"
    )
    found = [nums for _, nums, _ in citations(sample)]
    assert found == [["6"], ["5"], ["3", "3.1", "10.2"], [], None, ["2", "4"]]


@pytest.mark.parametrize("doc", ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
def test_relative_links_point_to_existing_files(doc):
    path = ROOT / doc
    broken = []
    for m in _LINK.finditer(strip_code(path.read_text(encoding="utf-8"))):
        target = m.group("target")
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        if not (path.parent / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"{doc}: broken relative links {broken}"


def test_tests_named_in_the_math_reference_exist():
    text = MATH_DOC.read_text(encoding="utf-8")
    files = set(re.findall(r"tests/((?:library/|lab/)?test_\w+\.py|conftest\.py)", text))
    missing_files = sorted(f for f in files if not (ROOT / "tests" / f).is_file())
    assert not missing_files, f"docs/math.md names missing test files {missing_files}"
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^\s*def (test_\w+)\(", path.read_text(encoding="utf-8"), re.MULTILINE))
    named = set(re.findall(r"`(?:tests/(?:library/|lab/)test_\w+\.py::)?(test_\w+)`", text))
    assert named, "docs/math.md names no test"
    assert not sorted(named - defined), f"docs/math.md names tests that do not exist: {sorted(named - defined)}"
    for file, name in re.findall(r"tests/((?:library|lab)/test_\w+\.py)::(test_\w+)", text):
        body = (ROOT / "tests" / file).read_text(encoding="utf-8")
        assert re.search(rf"^\s*def {name}\(", body, re.MULTILINE), f"tests/{file} has no {name}"
