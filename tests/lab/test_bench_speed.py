"""The benchmark runner works and its output is well-formed (no timing is asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from flt.bench import measure, report, speed
from flt.cli import main as cli_main

TINY = {"shape": "tiny", "threads": torch.get_num_threads(), "warmup": 1, "repeats": 2, "min_repeats": 2, "budget_s": 0.1}


def _config(variant, N=40, mode="fwd", causal=False):
    return measure.Config(variant, N=N, mode=mode, causal=causal, **TINY)


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
    _well_formed(measure.measure(_config(variant, mode=mode, causal=causal)))


def test_op_level_kronecker_configuration():
    _well_formed(measure.measure(_config("op:kronecker/m16/R4", N=300, causal=True)))


def test_a_failing_reference_check_refuses_to_time(monkeypatch):
    monkeypatch.setattr(measure, "CHECK_TOLERANCE", -1.0)  # no error can pass
    result = measure.measure(_config("performer/m64"))
    assert result["status"] == "refused" and not result["check"]["passed"]
    assert "wall_s" not in result and "median_s" not in result


def test_reference_check_catches_a_wrong_fast_path(monkeypatch):
    from flt.layers import kernel

    real = kernel.linear_attention
    monkeypatch.setattr(kernel, "linear_attention", lambda *a, **k: real(*a, **k) * 1.001)
    check = measure.reference_check("flt-logit/m64/R8", causal=False)
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


@pytest.mark.cli
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


@pytest.mark.cli
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
    # Met or missed, unless a timing it rests on is flagged unreliable (a busy machine).
    assert all(r["passed"] in (True, False) or "unreliable timing" in r["note"] for r in rows if r["measured"] is not None)
    assert all(isinstance(r["reliable"], bool) and r["spread"] >= 0 for r in results)
    assert all(r["ceiling_gflops"] > 0 and len(r["ceiling_s"]) == 2 for r in results if r["config"]["variant"].startswith("op:"))
    text = (tmp_path / "speed.md").read_text()
    assert "## Targets at N = 48" in text and "| flt-logit/m64/R8 | yes |" in text and "fraction of matmul" in text
    assert (tmp_path / "speed.png").stat().st_size > 10_000
    # Timed with freed memory kept for reuse (the default), said in the JSON and the report.
    assert data["machine"]["allocator"] == "keep" and "freed memory kept" in text
    assert all(r["config"]["allocator"] == "keep" and "allocator_kept" in r for r in results)


@pytest.mark.cli
def test_cli_rejects_an_unknown_allocator_or_variant(tmp_path, capsys):
    assert cli_main(["bench", "speed", "--quick", "--allocator", "jemalloc", "--out-dir", str(tmp_path)]) == 2
    assert "--allocator must be 'keep' or 'default', got 'jemalloc'" in capsys.readouterr().err
    assert not (tmp_path / "speed.json").exists()
    assert cli_main(["bench", "speed", "--variants", "nope", "--out-dir", str(tmp_path)]) == 2


# -- unreliable timings (a busy machine), from injected timings: independent of this machine's load ---------------


def _result(variant, N, wall, *, mode="fwd", causal=False, shape="tiny", **extra):
    import statistics

    q1, _, q3 = statistics.quantiles(wall, n=4, method="inclusive")
    return {
        "config": {"variant": variant, "shape": shape, "N": N, "mode": mode, "causal": causal}, "status": "ok", "note": "",
        "wall_s": list(wall), "cpu_s": list(wall), "median_s": statistics.median(wall), "q1_s": q1, "q3_s": q3, "min_s": min(wall),
        "peak_mb": N / 64, "variant_note": "", **speed.timing_flags(wall), **extra,
    }


def _data(results, matmul_gflops=10.0):
    machine = {"cpu": "test", "cpu_count": 2, "threads": 2, "mem_total_gb": 1, "platform": "test", "python": "3", "torch": "2",
               "commit": "0" * 40, "dirty": False, "date": "today", "loadavg_start": (0, 0, 0), "loadavg_end": (0, 0, 0)}
    probe = {"status": "ok", "gflops": matmul_gflops, "gflops_best": matmul_gflops}
    return {"machine": machine, "preset": speed.dataclasses.asdict(speed.PRESETS["quick"]), "matmul": probe, "matmul_kronecker": probe,
            "results": results}


def test_timing_flags_from_the_spread_of_repeats():
    quiet = speed.timing_flags([1.00, 1.04, 0.98])
    assert quiet["reliable"] and quiet["unreliable"] == "" and math.isclose(quiet["spread"], 0.06 / 1.00)
    busy = speed.timing_flags([1.0, 2.9, 1.1])
    assert not busy["reliable"] and math.isclose(busy["spread"], 1.9 / 1.1) and "spread 173%" in busy["unreliable"]
    assert not speed.timing_flags([])["reliable"]


def test_measure_flags_a_run_whose_repeats_spread_with_an_injected_clock(monkeypatch):
    durations = iter([0.010, 0.030, 0.011])

    class Clock:  # perf_counter: start, then start + the next duration
        now, started = 0.0, False

        def perf_counter(self):
            if self.started:
                self.now += next(durations)
            self.started = not self.started
            return self.now

        process_time = staticmethod(speed.time.process_time)

    monkeypatch.setattr(measure, "time", Clock())  # the timed calls live in flt.bench.measure
    cfg = measure.Config("matmul", "-", 32, "matmul", False, threads=torch.get_num_threads(), warmup=0, repeats=3, min_repeats=3, budget_s=10.0, ceiling_n=16)
    result = measure.measure(cfg)
    assert result["wall_s"] == pytest.approx([0.010, 0.030, 0.011])
    assert not result["reliable"] and math.isclose(result["spread"], 0.020 / 0.011) and "machine busy" in result["unreliable"]
    assert result["ceiling_gflops"] > 0 and len(result["ceiling_s"]) == 2  # matmul ceiling timed before and after
    assert "UNRELIABLE" in speed._log_line(result)


def test_exponents_leave_out_unreliable_sizes_and_omit_impossible_ones():
    quiet = lambda t: [t, t * 1.02, t * 0.99]  # noqa: E731
    busy = lambda t: [t, t * 3, t * 1.1]  # noqa: E731
    # Linear in N, but N = 4096 measured on a busy machine (and far too slow).
    by_n = {n: _result("performer/m64", n, (busy if n == 4096 else quiet)(1e-6 * n * (5 if n == 4096 else 1))) for n in (256, 1024, 4096, 16384)}
    fit, note = report.fit_time_exponent(by_n, min_n=256)
    assert math.isclose(fit[0], 1.0, abs_tol=0.02) and fit[1] == 3 and note == "without unreliable N = 4096"
    # Two sizes, one unreliable: no exponent.
    fit, note = report.fit_time_exponent({n: by_n[n] for n in (1024, 4096)}, min_n=256)
    assert fit is None and note.startswith("unreliable")
    # Consistent repeats, but the load dropped between sizes: time falls as N grows.
    falling = {64: _result("performer/m64", 64, quiet(2e-3)), 256: _result("performer/m64", 256, quiet(1e-3))}
    fit, note = report.fit_time_exponent(falling, min_n=64)
    assert fit is None and "time falling as N grows" in note
    ex = report.exponents(list(falling.values()), 64)[("performer/m64", "tiny", False, "fwd")]
    assert ex["time"] is None and ex["memory"] is not None  # memory does not depend on the load
    text = report.markdown(_data(list(falling.values())))
    assert "| unreliable |" in text and "## Unreliable timings" in text and "-1.00" not in text


def test_throughput_above_the_matmul_ceiling_is_flagged_not_printed():
    # op:kronecker/m16/R4 at N = 256, tiny shape: 4 * 2 * 256 * 8 * 16 * 17 = 4.46 MFLOP.
    flops = 4 * 1 * 2 * 256 * 2 * 4 * 16 * 17
    fast = _result("op:kronecker/m16/R4", 256, [flops / 28.3e9] * 3, ceiling_gflops=9.0)  # 283% of a 10 GFLOP/s ceiling
    fair = _result("op:kronecker/m16/R4", 256, [flops / 5e9] * 3, ceiling_gflops=4.0)
    rows = report.kronecker_model(_data([fast, fair], matmul_gflops=10.0))
    over, ok = rows
    assert math.isclose(over["ceiling_gflops"], 10.0) and over["fraction_of_matmul"] > 2.8  # best of probe and in-run ceiling
    assert not over["reliable"] and "impossible" in over["unreliable"]
    assert ok["reliable"] and math.isclose(ok["fraction_of_matmul"], 0.5)
    text = report.markdown(_data([fast, fair], matmul_gflops=10.0))
    assert "283%" not in text and "| unreliable | unreliable: above the matmul ceiling (10 GFLOP/s)" in text and "| 5 | 50% of 10 |" in text


def test_targets_are_not_judged_from_unreliable_timings(tmp_path):
    N = speed.PRESETS["quick"].target_n
    results = [_result("softmax+t5", N, [2e-3, 2.01e-3, 1.99e-3]), _result("flt-logit/m64/R8", N, [1e-3, 4e-3, 1.1e-3]),
               _result("softmax+t5", N // 4, [1e-3] * 3), _result("flt-logit/m64/R8", N // 4, [0.5e-3] * 3)]
    rows = report.targets(_data(results))
    (row,) = [r for r in rows if r["name"].startswith("fwd: softmax+t5 time")]
    assert row["measured"] > 0 and row["passed"] is None and "unreliable timing: flt-logit/m64/R8 fwd" in row["note"]
    text = report.markdown(_data(results))
    assert "(unreliable)" in text  # the cell itself says so
    report.plot(_data(results), tmp_path / "speed.png")
    assert (tmp_path / "speed.png").stat().st_size > 10_000


def test_flop_model_matches_a_hand_count_for_the_targets_shape():
    from flt.bench.flops import forward_parts, model_flops

    # B = 1, H = 4, D = 64 (model width 256), N = 16384, m = 256, 2R = 64, counted by hand:
    projections = 4 * (2 * 16384 * 256 * 256)  # q, k, v, out: 8.59 GFLOP
    feature_maps = 2 * (2 * 4 * 16384 * 256 * (64 + 64))  # queries and keys, on [x, a(r)]: 8.59 GFLOP
    state_and_read = 2 * (2 * 4 * 16384 * 256 * 65)  # kf^T [v, 1], then qf S: 4.36 GFLOP
    assert forward_parts("flt-logit/m256/R32", "lm", 16384, False) == {
        "projections": projections, "feature maps": feature_maps, "state and read-out": state_and_read}
    assert model_flops("flt-logit/m256/R32", "lm", 16384, "fwd", False) == projections + feature_maps + state_and_read
    # Backward: twice every product, except the feature maps (their projection is a buffer).
    assert model_flops("flt-logit/m256/R32", "lm", 16384, "fwd+bwd", False) == 3 * projections + 2 * feature_maps + 3 * state_and_read
    assert round(model_flops("flt-logit/m256/R32", "lm", 16384, "fwd", False) / 1e9, 1) == 21.5
    # Multiplicative: features on x alone, 2R times the state and read-out.
    mult = forward_parts("flt-mult/m64/R8", "lm", 16384, False)
    assert mult["feature maps"] == 2 * 2 * 4 * 16384 * 64 * 64 and mult["state and read-out"] == 2 * 2 * 4 * 16384 * 16 * 64 * 65
    # Learned hedgehog features (the catalysis estimator): W [m/2, D] on queries and keys, and
    # its backward is two products (W is a parameter); 2R = 512 times the state.
    hh = forward_parts("flt-mult-hedgehog/m32/R256", "lm", 4096, False)
    assert hh == {"projections": 4 * 2 * 4096 * 256 * 256, "learned feature maps": 2 * 2 * 4 * 4096 * 16 * 64,
                  "state and read-out": 2 * 2 * 4 * 4096 * 512 * 32 * 65}
    assert model_flops("flt-mult-hedgehog/m32/R256", "lm", 4096, "fwd+bwd", False) == 3 * sum(hh.values())
    # Compiled and bf16 variants share their layer's model; variants without one give None.
    assert model_flops("flt-logit/m256/R32+compile+bf16", "lm", 4096, "fwd", True) == model_flops("flt-logit/m256/R32", "lm", 4096, "fwd", True)
    assert model_flops("toeplitz/m64", "lm", 4096, "fwd", False) is None
    with pytest.raises(ValueError, match="mode must be"):
        model_flops("flt-logit/m256/R32", "lm", 4096, "backward", False)


def test_x_floor_column_from_the_ceiling_of_the_same_run():
    from flt.bench.flops import model_flops

    N = speed.PRESETS["quick"].target_n
    flops = model_flops("flt-logit/m64/R8", "tiny", N, "fwd", False)
    at_3x = _result("flt-logit/m64/R8", N, [3 * flops / 20e9] * 3, ceiling_gflops=20.0)  # 3x the floor at 20 GFLOP/s
    causal_flops = model_flops("flt-logit/m64/R8", "tiny", N, "fwd", True)
    too_fast = _result("flt-logit/m64/R8", N, [0.5 * causal_flops / 20e9] * 3, causal=True, ceiling_gflops=20.0)
    rows = {r["causal"]: r for r in report.floor_rows(_data([at_3x, too_fast], matmul_gflops=5.0))}
    assert math.isclose(rows[False]["x_floor"], 3.0)  # the run's own ceiling, not the runner's probe
    assert math.isclose(rows[False]["bytes_per_token"], (N / 64) * 2**20 / N)
    assert rows[True]["x_floor"] is None and "faster than its floor" in rows[True]["unreliable"]
    text = report.markdown(_data([at_3x, too_fast]))
    assert "| 3.00 |" in text and "unreliable (0.50)" in text
    # A bf16 run is held to the float32 floor: beating it is the point, not a busy machine.
    bf16_flops = model_flops("flt-logit/m256/R32+compile+bf16", "lm", N, "fwd", False)
    bf16 = _result("flt-logit/m256/R32+compile+bf16", N, [0.5 * bf16_flops / 20e9] * 3, shape="lm", ceiling_gflops=20.0)
    (row,) = report.floor_rows(_data([bf16]))
    assert row["reliable"] and math.isclose(row["x_floor"], 0.5)


def test_bf16_variant_reports_its_accuracy_against_float64():
    result = measure.measure(_config("flt-logit/m256/R32+bf16", N=64, mode="fwd+bwd"))
    _well_formed(result)
    acc = result["accuracy"]
    assert acc["dtype"] == "bfloat16"
    # bf16 rounding (2^-8) shows, and nothing worse than a few percent.
    assert 1e-4 < acc["output_rel_error"] < 0.05 and 1e-4 < acc["grad_rel_error"] < 0.1
    assert result["first_call_s"] > 0


def test_exact_variants_are_the_layers_of_exact_mechanisms_and_declare_quadratic_time():
    from flt.bench.variants import VARIANTS

    exact = {name for name, v in VARIANTS.items() if v.exact}
    assert exact and all(VARIANTS[name].time_order == 2 for name in exact)
    assert all(v.kind == "layer" for v in map(VARIANTS.get, exact))
    assert not VARIANTS["op:kronecker/m16/R4"].exact and not VARIANTS["performer-pytorch/m32"].exact
