"""``scripts/nbody_step_time.py``: times every mechanism it is given against the reference,
in one process, and reports the reference's own ratio as 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "nbody_step_time.py"


def test_step_time_reports_a_ratio_per_mechanism():
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
    out = subprocess.run([sys.executable, str(SCRIPT), "--particles", "64", "--repeats", "2", "--attention", "flt",
                          "--attention", "flt:near_neighbors=8"], capture_output=True, text=True, env=env, check=True).stdout
    rows = [line.split() for line in out.splitlines() if " s  ratio " in line]
    assert [r[-1] for r in rows] == ["flt", "flt:near_neighbors=8", "softmax"]
    ratios = [float(r[3]) for r in rows]
    assert ratios[-1] == 1.0 and all(0 < r < 100 for r in ratios)
    assert "N = 64" in out
