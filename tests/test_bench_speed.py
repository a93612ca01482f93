"""The benchmark runner works and its output is well-formed (no timing is asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from flt.bench import report, speed
from flt.cli import main as cli_main

TINY = dict(shape="tiny", threads=torch.get_num_threads(), warmup=1, repeats=2, min_repeats=2, budget_s=0.1)


def _config(variant, N=40, mode="fwd", causal=False):
    return speed.Config(variant, N=N, mode=mode, causal=causal, **TINY)


def _well_formed(result, *, checked=True):
    assert result["status"] == "ok", result
    assert len(result["wall_s"]) == len(result["cpu_s"]) >= 2
    assert all(t > 0 for t in result["wall_s"])
    assert result["min_s"] <= result["q1_s"] <= result["median_s"] <= result["q3_s"]
    assert result["peak_mb"] >= 0 and result["baseline_rss_mb"] > 0
    if checked:
        check = result["check"]
        assert check["passed"] and max(check["output_rel_error"], check["grad_rel_error"]) <= check["tolerance"]


@pytest.mark.parametrize(
    "variant, mode, causal",
    [("flt-logit/m64/R8", "fwd+bwd", True), ("flt-mult/m32/R4", "fwd", False), ("toeplitz/m16", "fwd+bwd", False), ("softmax+t5", "fwd", False)],
)
def test_measure_checks_then_times_a_configuration(variant, mode, causal):
    _well_formed(speed.measure(_config(variant, mode=mode, causal=causal)))


def test_op_level_kronecker_configuration():
    _well_formed(speed.measure(_config("op:kronecker/m16/R4", N=300, causal=True)))


def test_a_failing_reference_check_refuses_to_time(monkeypatch):
    monkeypatch.setattr(speed, "CHECK_TOLERANCE", -1.0)  # no error can pass
    result = speed.measure(_config("performer/m64"))
    assert result["status"] == "refused" and not result["check"]["passed"]
    assert "wall_s" not in result and "median_s" not in result


def test_reference_check_catches_a_wrong_fast_path(monkeypatch):
    from flt.layers import kernel

    real = kernel.linear_attention
    monkeypatch.setattr(kernel, "linear_attention", lambda *a, **k: real(*a, **k) * 1.001)
    check = speed.reference_check("flt-logit/m64/R8", causal=False)
    assert not check["passed"] and check["output_rel_error"] > 1e-4


def test_every_preset_names_known_variants_and_shapes():
    for preset in speed.PRESETS.values():
        assert all(r.variant in speed.VARIANTS and set(r.modes) <= {"fwd", "fwd+bwd"} for r in preset.runs)
        assert all(v in speed.VARIANTS and speed.VARIANTS[v].kind == "op" for v in preset.kronecker)
        assert all(s in speed.SHAPES for s in preset.shapes)
        assert all(v in speed.VARIANTS for v in preset.headline)
        assert preset.target_n in preset.lengths


def test_fitted_exponent_recovers_a_power_law():
    slope, n = report.fit_exponent({N: 3.0 * N**1.7 for N in (256, 1024, 4096, 16384)}, min_n=1024)
    assert n == 3 and math.isclose(slope, 1.7, rel_tol=1e-9)
    assert report.fit_exponent({1024: 1.0}, min_n=1) is None


def test_worker_cli_prints_one_json_result():
    cfg = json.dumps(speed.dataclasses.asdict(_config("performer/m64", N=32)))
    out = subprocess.run([sys.executable, "-m", "flt.bench.speed", "--worker", cfg], capture_output=True, text=True, check=True, timeout=120)
    _well_formed(json.loads(out.stdout.strip().splitlines()[-1]))


def test_runner_skips_what_would_not_fit_in_memory(monkeypatch):
    monkeypatch.setattr(speed, "mem_available_bytes", lambda: 1)  # nothing predicted fits
    preset = speed.PRESETS["quick"]
    data = speed.run(preset, variants=["performer/m64"], lengths=[32, 64], log=lambda line: None)
    first, second = (r for r in data["results"] if r["config"]["mode"] == "fwd")
    assert first["status"] == "ok" and first["config"]["N"] == 32
    assert second["status"] == "skipped" and "memory" in second["note"]


def test_cli_quick_run_writes_well_formed_outputs(tmp_path):
    variants = ["flt-logit/m64/R8", "softmax+t5", "op:kronecker/m16/R4"]
    assert cli_main(["bench", "speed", "--quick", "--variants", *variants, "--lengths", "48", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "speed.json").read_text())
    assert set(data) >= {"machine", "preset", "matmul", "results", "command"}
    assert {"cpu", "threads", "torch", "commit", "loadavg_start", "loadavg_end"} <= set(data["machine"])
    assert data["matmul"]["status"] == "ok" and data["matmul"]["gflops"] > 0
    results = data["results"]
    # 2 layer variants x 2 modes, flt-logit also causal; the op bidirectional and causal (fwd).
    assert len(results) == (2 + 1) * 2 + 2
    for r in results:
        _well_formed(r)
    rows = report.targets(data)
    assert any(r["name"].startswith("fwd: softmax+t5 time") and r["measured"] > 0 for r in rows)
    assert all(r["passed"] in (True, False) for r in rows if r["measured"] is not None)
    text = (tmp_path / "speed.md").read_text()
    assert "## Targets at N = 48" in text and "| flt-logit/m64/R8 | yes |" in text and "fraction of matmul" in text
    assert (tmp_path / "speed.png").stat().st_size > 10_000
    assert cli_main(["bench", "speed", "--variants", "nope", "--out-dir", str(tmp_path)]) == 2
