"""The library apart from the lab, checked on the import graph of ``src/flt``.

The library is what ``import flt`` gives a user (ops, relative terms, encodings, layers,
models, the functional core and their private helpers); the lab is what trains, searches,
benchmarks and serves the CLI around it. Every import statement of every module counts,
at module level or inside a function, since a function-level import is still a
dependency: it only moves the failure from import time to call time.

Packages are the subpackages of ``flt`` and its top-level modules (``flt`` itself is the
package's ``__init__``). :data:`LAYERS` ranks them bottom to top; an import from a package
to one ranked higher is an *upward* import, and packages that import each other, directly
or through others, form an import *circle*. Modules form circles too, within a package:
two files that import each other, by any of these imports (one under ``if TYPE_CHECKING:``
included, since the annotations that need it tie the two files as much as a call does), or
a package's ``__init__`` and a module of it that imports that ``__init__``.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

#: Packages bottom to top; a package may import those at its rank or below. The first
#: LIBRARY_LAYERS rows are the library, the rest the lab.
LAYERS: list[tuple[str, ...]] = [
    ("_checks", "_dtype", "_extras", "_io", "perf"),  # helpers of every layer
    ("ops",),  # pure functions of tensors
    ("relative",),  # relative terms: tables, ALiBi, graph SPD, spectra
    ("posenc", "spectra", "_signatures", "_limits"),  # absolute encodings; the flt.spectra alias; option signatures; memory limits
    ("layers",),
    ("options", "functional"),  # option checks over the registries; the projection-free core
    ("models", "integrations"),
    ("flt",),  # the package's public names
    # the lab
    ("data",),
    ("graphs",),
    ("baselines",),  # the PyG baselines and the +lr models of the 3-D tasks, on the library's models
    ("tasks",),
    ("train",),
    ("search", "fit", "bench"),
    ("commands",),
    ("cli",),
    ("__main__",),
]
LIBRARY_LAYERS = 8
LIBRARY = frozenset(itertools.chain.from_iterable(LAYERS[:LIBRARY_LAYERS]))
LAB = frozenset(itertools.chain.from_iterable(LAYERS[LIBRARY_LAYERS:]))
RANK = {package: rank for rank, row in enumerate(LAYERS) for package in row}

#: Upward imports that are known and tolerated, as (importing module, imported module):
#: none today (the layers check their flat options with flt._signatures, below them).
ALLOWED_UPWARD: set[tuple[str, str]] = set()

#: Module imports that close a circle and are known and tolerated, as (importing module,
#: imported module), each with its reason. The registry of tasks (``flt.tasks``) imports
#: every task file and :mod:`flt.tasks.preset`, whose ``preset_to_dict`` asks that registry
#: for the key of a model config, at call time: a registry that its members consult.
ALLOWED_CIRCLE_IMPORTS: set[tuple[str, str]] = {("flt.tasks.preset", "flt.tasks")}


def module_names(src: Path = SRC) -> dict[str, Path]:
    """Dotted name -> file of every module under ``src/flt``."""
    names = {}
    for path in sorted((src / "flt").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(target: str, modules) -> str | None:
    """The longest prefix of ``target`` that is a module of flt (None: not flt's)."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in modules:
            return name
    return None


def imports_of(module: str, path: Path, modules) -> set[str]:
    """The flt modules that ``module`` imports anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from flt import perf` imports a module; `from flt import FLTAttention` a name of flt.
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


#: Deprecated alias modules left at a library path by a module that moved to the lab, each
#: with the module it re-exports (the aliases warn on import and are removed in 0.3.0, see
#: CHANGELOG.md). An alias is counted in its target's package: it is the lab's, at an old
#: address, so importing it from a library module is a lab import like any other.
LAB_ALIASES = {
    "flt.models.atom_graphs": "flt.baselines.atom_graphs",
    "flt.models.dimenet": "flt.baselines.dimenet",
    "flt.models.longrange": "flt.baselines.longrange",
    "flt.models.particles": "flt.baselines.particles",
    "flt.models.qm9": "flt.baselines.qm9",
}


def package_of(module: str) -> str:
    module = LAB_ALIASES.get(module, module)
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "flt"


def module_graph(src: Path = SRC) -> dict[str, set[str]]:
    modules = module_names(src)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def package_edges(graph, allowed=frozenset()) -> dict[tuple[str, str], set[tuple[str, str]]]:
    """``(package, imported package) -> {(module, imported module)}`` between packages,
    leaving out the ``allowed`` module edges."""
    edges: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = package_of(module), package_of(target)
            if a != b and (module, target) not in allowed:
                edges.setdefault((a, b), set()).add((module, target))
    return edges


def circles(edges) -> list[list[str]]:
    """The import circles: strongly connected groups of more than one package (Tarjan)."""
    succ: dict[str, list[str]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return groups


def upward(edges) -> dict[tuple[str, str], set[tuple[str, str]]]:
    return {pair: why for pair, why in edges.items() if RANK[pair[0]] < RANK[pair[1]]}


def _show(edges) -> str:
    return "; ".join(f"{a} -> {b} ({', '.join(sorted(f'{m} imports {t}' for m, t in why))})" for (a, b), why in sorted(edges.items()))


def test_every_package_has_a_place_in_the_layers():
    packages = {package_of(m) for m in module_names()}
    assert packages <= set(RANK), f"packages without a layer in LAYERS: {sorted(packages - set(RANK))}"
    assert len(RANK) == sum(map(len, LAYERS)), "a package is listed twice in LAYERS"


def test_the_lab_aliases_re_export_their_module_and_nothing_imports_them():
    graph = module_graph()
    for alias, target in LAB_ALIASES.items():
        assert alias in graph, f"{alias} is gone: remove it from LAB_ALIASES (and from CHANGELOG.md's aliases)"
        assert target in graph[alias] and {package_of(t) for t in graph[alias]} == {package_of(target)}, (alias, graph[alias])
    users = sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets if t in LAB_ALIASES)
    assert not users, f"modules import a deprecated alias instead of its module: {users}"


def test_no_library_module_imports_the_lab():
    graph = module_graph()
    bad = {(m, t) for m, targets in graph.items() for t in targets
           if package_of(m) in LIBRARY and package_of(t) in LAB}
    assert not bad, "library modules import the lab: " + ", ".join(f"{m} imports {t}" for m, t in sorted(bad))


def test_the_packages_form_no_import_circle():
    found = circles(package_edges(module_graph(), ALLOWED_UPWARD))
    assert not found, f"import circles between packages: {found}"


def _module_circles(graph, allowed=frozenset()) -> list[list[str]]:
    return circles({(m, t) for m, targets in graph.items() for t in targets if (m, t) not in allowed})


def test_the_modules_form_no_import_circle():
    graph = module_graph()
    found = _module_circles(graph, ALLOWED_CIRCLE_IMPORTS)
    ties = [sorted(f"{m} imports {t}" for m in group for t in graph[m] if t in group) for group in found]
    assert not found, f"import circles between modules: {ties}"
    unused = {(m, t) for m, t in ALLOWED_CIRCLE_IMPORTS if t not in graph.get(m, ())
              or not any(m in group and t in group for group in _module_circles(graph))}
    assert not unused, f"ALLOWED_CIRCLE_IMPORTS names imports that close no circle (remove them): {sorted(unused)}"


def test_at_most_one_upward_import_and_only_the_known_one():
    edges = package_edges(module_graph())
    up = upward(edges)
    assert len(up) <= 1, f"{len(up)} upward imports: {_show(up)}"
    unknown = {pair: why - ALLOWED_UPWARD for pair, why in up.items() if why - ALLOWED_UPWARD}
    assert not unknown, f"upward imports not in ALLOWED_UPWARD: {_show(unknown)}"


def test_the_checks_see_an_upward_import_a_circle_and_a_lab_import(tmp_path):
    # The checker on a small tree: a function-level import from ops up to layers (upward,
    # and a circle with layers -> ops), and a relative import from models into train.
    files = {
        "flt/__init__.py": "",
        "flt/ops/__init__.py": "def f():\n    from flt.layers import base\n",
        "flt/layers/__init__.py": "",
        "flt/layers/base.py": "from flt.ops import f\n",
        "flt/models/__init__.py": "from ..train import loop\n",
        "flt/train/__init__.py": "",
        "flt/train/loop.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = module_graph(tmp_path)
    assert graph["flt.ops"] == {"flt.layers.base"}
    assert graph["flt.models"] == {"flt.train.loop"}
    edges = package_edges(graph)
    assert circles(edges) == [["layers", "ops"]]
    assert set(upward(edges)) == {("ops", "layers"), ("models", "train")}
    assert package_of("flt.train.loop") in LAB and package_of("flt.models") in LIBRARY


def test_the_module_check_sees_a_circle_through_a_type_checking_or_a_function_level_import(tmp_path):
    # Two files of one package tied as flt.layers.flt and flt.layers.near were: one imports
    # the other at the top, the other imports it back for its annotations only; and a
    # package __init__ that a module of it imports back inside a function.
    files = {
        "flt/__init__.py": "",
        "flt/layers/__init__.py": "",
        "flt/layers/core.py": "from flt.layers.near import Band\n",
        "flt/layers/near.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flt.layers.core import Core\n",
        "flt/layers/apart.py": "from flt.layers import near\n",
        "flt/tasks/__init__.py": "from flt.tasks.preset import Preset\n",
        "flt/tasks/preset.py": "def f():\n    from flt.tasks import TASKS\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = module_graph(tmp_path)
    assert graph["flt.layers.near"] == {"flt.layers.core"} and graph["flt.layers.apart"] == {"flt.layers.near"}
    assert sorted(_module_circles(graph)) == [["flt.layers.core", "flt.layers.near"], ["flt.tasks", "flt.tasks.preset"]]
    assert _module_circles(graph, {("flt.tasks.preset", "flt.tasks")}) == [["flt.layers.core", "flt.layers.near"]]


#: Prepended to the scripts below: numpy is not installed, as far as imports can tell.
WITHOUT_NUMPY = """
import importlib.abc, sys

class _NoNumpy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoNumpy())
"""

#: Library modules that need an extra of their own, which brings numpy with it
#: (transformers, the hf extra, imports numpy itself).
NEEDS_AN_EXTRA = {"flt.integrations.transformers"}


def _run_without_numpy(script: str):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    # Triton's CPU interpreter (the triton extra, which conftest switches on) imports numpy.
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-W", "ignore", "-c", WITHOUT_NUMPY + script], check=False, capture_output=True, text=True,
                          timeout=300, env=env)


def test_the_library_imports_and_runs_without_numpy():
    library = sorted(m for m in module_names() if package_of(m) in LIBRARY and m not in NEEDS_AN_EXTRA)
    script = f"""
import importlib
for name in {library!r}:
    importlib.import_module(name)
import torch
from flt import FLTAttention
from flt.layers import SoftmaxAttention
from flt.models import LMConfig, build_model
from flt.relative import RELATIVE, SPECTRA

torch.manual_seed(0)
x, pos = torch.randn(2, 12, 16), torch.arange(12.0).view(1, 12, 1)
assert FLTAttention.from_options(16, 2, num_features=8, num_frequencies=4)(x, pos).shape == (2, 12, 16)
for name in ["spectrum", *(n for n in RELATIVE if n not in SPECTRA)]:
    assert SoftmaxAttention.from_options(16, 2, relative_bias=name)(x, pos).isfinite().all(), name
model = build_model(LMConfig(vocab_size=11, dim=16, depth=1, heads=2, max_len=12, attention="flt"))
logits = model(torch.randint(0, 11, (2, 12)))
assert logits.shape == (2, 12, 11) and logits.isfinite().all()
try:
    import numpy
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("numpy was importable: the test shows nothing")
assert "numpy" not in sys.modules
"""
    out = _run_without_numpy(script)
    assert out.returncode == 0, out.stderr[-3000:]



@pytest.mark.cli
def test_the_command_without_numpy_names_the_extra_to_install():
    # `flt --help` itself works without numpy (tests/lab/test_cli_without_extras.py); a command that needs it names the extra.
    out = _run_without_numpy("from flt.cli import main\nsys.exit(main(['train', 'lm']))")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "this needs numpy" in out.stderr and "[train]" in out.stderr
    assert "Traceback" not in out.stderr
