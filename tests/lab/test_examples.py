"""Every script in examples/ runs at its smallest size (``--smoke``) and prints what its
docstring promises; a script without a test here fails the first test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}

#: Each script's smoke run and a line its output must contain. train_tiny_llama.py runs
#: inside linearize_hf.py.
EXPECTED = {
    "vit_digits.py": "test accuracy",
    "long_byte_lm.py": "decoding state:",
    "custom_spectrum.py": "done: loss",
    "qm9_flt_vs_schnet.py": "SchNet:",
    "linearize_hf.py": "perplexities:",
    "coulomb_sizes.py": "test nmse by size",
}
NEEDS = {"qm9_flt_vs_schnet.py": ["torch_geometric"], "coulomb_sizes.py": ["torch_geometric"], "linearize_hf.py": ["transformers"], "vit_digits.py": ["sklearn"]}


def test_every_example_has_a_smoke_test():
    scripts = {p.name for p in EXAMPLES.glob("*.py")} - {"train_tiny_llama.py"}
    assert scripts == set(EXPECTED), f"examples without a smoke test here: {sorted(scripts - set(EXPECTED))}"


@pytest.mark.parametrize(
    "script",
    [pytest.param(s, marks=pytest.mark.slow) if s == "linearize_hf.py" else s for s in EXPECTED],
)
def test_example_runs_at_its_smallest_size(script, tmp_path):
    for module in NEEDS.get(script, []):
        pytest.importorskip(module)
    done = subprocess.run([sys.executable, str(EXAMPLES / script), "--smoke"], capture_output=True, text=True,
                          env=ENV, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-3000:]}"
    assert EXPECTED[script] in done.stdout, f"{script} did not print {EXPECTED[script]!r}:\n{done.stdout[-2000:]}"
