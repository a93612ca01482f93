"""Every task's bundled dataset (``TASKS[name].dataset``), and that importing the data package does no work."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from flt.tasks import TASKS


def _small_kwargs(task, tmp_path):
    return {
        "lm": {"max_bytes": 50_000},
        "image": {},
        "molecule": {"num_samples": 3, "relax_steps": 1, "cache_dir": tmp_path, "progress": False},
        "graph": {},
        "listops": {"num_train": 3, "num_valid": 2, "cache_dir": tmp_path},
        "longlm": {"max_bytes": 200_000},
        "nbody": {"num_particles": 8, "num_train": 2, "num_valid": 1, "num_test": 1},
        "offsets": {"length": 32, "num_train": 2, "num_valid": 1, "num_test": 1, "centers": [4.0], "width": 2.0},
        "qm9": {"cache_dir": tmp_path},
        "separation": {"cluster_particles": 4, "num_train": 2, "num_valid": 2, "num_test": 2},
    }[task]


# qm9 parses the 130,831 molecules of qm9pack into a fresh cache: about 10 s.
@pytest.mark.parametrize("task", [pytest.param(t, marks=pytest.mark.slow) if t == "qm9" else t for t in sorted(TASKS)])
def test_default_datasets_have_train_and_valid(task, tmp_path):
    pytest.importorskip({"lm": "flt", "image": "sklearn", "molecule": "ase", "graph": "networkx", "listops": "flt", "longlm": "flt",
                        "nbody": "flt", "offsets": "flt", "qm9": "flt", "separation": "flt"}[task])
    if task == "qm9" and importlib.util.find_spec("qm9pack") is None:  # found, not imported: its import needs pandas
        pytest.skip("qm9pack is not installed (the qm9 extra)")
    splits = TASKS[task].dataset(**_small_kwargs(task, tmp_path))
    assert len(splits.train) > 0 and len(splits.valid) > 0


def test_registry_names():
    assert set(TASKS) == {"lm", "image", "molecule", "graph", "listops", "longlm", "nbody", "offsets", "qm9", "separation"}


def test_import_loads_no_optional_dependency():
    code = "import sys, flt.data; print(sorted(m for m in ('sklearn', 'ase', 'PIL') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
