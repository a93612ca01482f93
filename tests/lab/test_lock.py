"""constraints.txt is a full lock: every distribution that the README's commands install
into this environment is pinned there, at the version installed (scripts/lock.py writes it)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _lock_script():
    spec = importlib.util.spec_from_file_location("flt_lock_script", ROOT / "scripts" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lock = _lock_script()


def pins(path: Path, environment: dict[str, str] | None = None) -> dict[str, Requirement]:
    """The requirement lines of a constraints file that apply under ``environment`` (the
    running Python's by default), by canonical name; a name pinned twice there is an error."""
    found: dict[str, Requirement] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(environment or {}):
            continue
        name = canonicalize_name(req.name)
        assert name not in found, f"{path.name}:{number}: {req.name} is pinned twice for this Python"
        found[name] = req
    return found


def applies(req: Requirement, extras: set[str]) -> bool:
    """Whether a Requires-Dist line is installed along with ``extras`` ("" for none)."""
    return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras)


def install_closure(root: str, extras: list[str]) -> dict[str, str]:
    """{canonical name: version} of the installed distributions that ``root`` with
    ``extras`` pulls in, transitively (through the requirements' own extras too); a
    requirement that is not installed is not followed."""
    seen: dict[str, str] = {}
    todo = [(canonicalize_name(root), frozenset({"", *extras}))]
    visited = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in visited:
            continue
        visited.add((name, wanted))
        dist = md.distribution(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if not applies(req, wanted):
                continue
            dep = canonicalize_name(req.name)
            try:
                version = md.version(dep)
            except md.PackageNotFoundError:
                continue
            todo.append((dep, frozenset({"", *req.extras})))
            seen[dep] = version
    seen.pop(canonicalize_name(root), None)
    return seen


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12"])
def test_constraints_are_exact_pins_one_per_name(python):
    """Each line of constraints.txt is an ``==`` pin, and no name has two for one Python."""
    env = {**default_environment(), "python_version": python, "python_full_version": f"{python}.0"}
    found = pins(ROOT / "constraints.txt", env)
    assert "torch" in found and "pytest" in found
    loose = [str(r) for r in found.values() if [s.operator for s in r.specifier] != ["=="]]
    assert not loose, f"constraints.txt: not exact pins for Python {python}: {loose}"


def test_every_installed_distribution_of_the_install_path_is_pinned():
    """The distributions that flt with scripts/test.sh's extras brings into this environment,
    transitively, are pinned in constraints.txt at their installed versions: a new release
    of any of them cannot change what the README's commands install."""
    name = lock.project_name()
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        pytest.skip(f"{name} is not installed as a distribution: the lock is checked after the README's "
                    "`pip install -c constraints.txt -e .[...]` (scripts/test.sh)")
    locked = pins(ROOT / "constraints.txt")
    installed = install_closure(name, lock.script_extras())
    assert "torch" in installed
    unpinned = sorted(f"{n}=={v}" for n, v in installed.items() if n not in locked)
    other = sorted(f"{n}=={v} (pinned {locked[n].specifier})" for n, v in installed.items()
                   if n in locked and not locked[n].specifier.contains(Version(v), prereleases=True))
    assert not unpinned and not other, (
        f"installed but not pinned in constraints.txt: {unpinned}; installed at another version than "
        f"pinned: {other} (run scripts/test.sh to install the lock, or scripts/lock.py to renew it)")


def test_lock_script_merges_the_pythons_pins_with_markers():
    """A version all Pythons resolved is one plain pin; others are pinned per Python, the
    newest one's pin covering later Pythons; pip and the hand pins are left out."""
    per_python = {"3.11": {"a": "1", "b": "3", "c": "4", "pip": "25", "torch": "2"},
                  "3.10": {"a": "1", "b": "2", "pip": "23", "torch": "2"}}
    head = "# why\ntorch==2  # the CPU build\n"
    skip = lock.pinned_names(head) | lock.NOT_LOCKED
    assert lock.generated_lines(per_python, skip) == [
        "a==1", 'b==2; python_version < "3.11"', 'b==3; python_version >= "3.11"', 'c==4; python_version >= "3.11"']
    assert lock.script_extras() == ["dev", "docs", "train", "mol", "graph", "vision", "triton", "hf", "qm9"]
