"""``flt bench speed --device cuda`` (:mod:`flt.bench.gpu`) without a GPU: the options, the
rows (each builds and matches its reference on the CPU), the floor and the report."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from conftest import assert_close
from flt.bench import gpu
from flt.bench.variants import VARIANTS
from flt.commands.bench import add_parser, cuda_options


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", "speed", *argv])


def test_rows_cover_the_gpu_comparison():
    rows = gpu.GPU_ROWS
    for needed in ("flt-logit eager", "flt-logit compiled", "flt-logit triton", "flt-logit band8 compiled", "sdpa",
                   "softmax+t5 flex compiled"):
        assert needed in rows
    assert any(r.variant.startswith("performer") for r in rows.values())
    assert all(r.variant in VARIANTS for r in rows.values())  # options and FLOP model shared with the CPU runner
    assert rows["softmax+t5 flex compiled"].kwargs["backend"] == "flex" and rows["softmax+t5 flex compiled"].compile


@pytest.mark.parametrize("name", [n for n, r in gpu.GPU_ROWS.items() if not str(dict(r.options).get("backend")).startswith("triton")])
def test_rows_build_and_match_their_reference_on_cpu(name):
    """The same layer the GPU run times, in float64 on the CPU: the fast path equals the
    O(N^2) reference (what the GPU run checks before timing)."""
    layer = gpu.build_row(name, "tiny", causal=True, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.02 * torch.randn_like(p))
        x = torch.randn(2, 40, 32, dtype=torch.float64)
        assert_close(layer(x), layer.reference(x))


def test_floor_is_time_over_model_flops_at_the_matmul_rate():
    assert gpu.matmul_flops(1000) == 2e9
    results = [{"status": "ok", "median_s": 2e-3, "flops": 1e9}, {"status": "ok", "median_s": 1.0, "flops": None},
               {"status": "oom", "flops": 1e9}]
    gpu.add_floors(results, bf16_tflops=1.0)  # 1e9 FLOPs take 1 ms at 1 TFLOP/s
    assert math.isclose(results[0]["x_bf16_floor"], 2.0)
    assert results[1]["x_bf16_floor"] is None and "x_bf16_floor" not in results[2]


def test_cuda_options_and_refusals():
    options = cuda_options(_args("--device", "cuda"))
    assert options["rows"] == list(gpu.GPU_ROWS) and options["lengths"] == gpu.DEFAULT_LENGTHS
    assert options["precisions"] == ("bf16", "fp32") and options["modes"] == ("fwd", "fwd+bwd") and options["shape"] == "lm"
    wide = cuda_options(_args("--device", "cuda", "--modes", "fwd+bwd", "--shapes", "wide"))
    assert wide["modes"] == ("fwd+bwd",) and wide["shape"] == "wide"
    quick = cuda_options(_args("--device", "cuda", "--quick", "--rows", "sdpa", "--precisions", "bf16"))
    assert quick["rows"] == ["sdpa"] and quick["lengths"] == gpu.QUICK_LENGTHS and quick["precisions"] == ("bf16",)
    for argv, message in ((("--rows", "nope"), "unknown --rows"), (("--threads", "2"), "--threads"),
                          (("--variants", "softmax"), "--variants"), (("--preset", "full"), "quick or default")):
        with pytest.raises(ValueError, match=message):
            cuda_options(_args("--device", "cuda", *argv))


@pytest.mark.cli
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_device_cuda_without_a_gpu_says_so(tmp_path, capsys):
    from flt.cli import main

    assert main(["bench", "speed", "--device", "cuda", "--out-dir", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "--device cuda needs a CUDA GPU" in err and "--device cpu" in err
    assert not (tmp_path / "b").exists()
    assert main(["bench", "speed", "--rows", "sdpa", "--quick", "--out-dir", str(tmp_path / "c")]) == 2
    assert "--rows applies to --device cuda only" in capsys.readouterr().err
    assert main(["bench", "speed", "--modes", "fwd", "--quick", "--out-dir", str(tmp_path / "d")]) == 2
    assert "--modes applies to --device cuda only" in capsys.readouterr().err


def test_report_tables_every_row_and_length(tmp_path):
    data = {
        "machine": {"gpu": "Test GPU", "cuda": "12.4", "torch": "2.x", "triton": "3.x", "commit": "abc" * 5, "dirty": False,
                    "date": "today"},
        "matmul_bf16_tflops": [700.0, 710.0], "warmup": 3, "repeats": 10, "shape": {"name": "wide", "B": 1, "H": 8, "D": 64},
        "rows": {"sdpa": {"note": "exact"}, "flt-logit triton": {"note": ""}},
        "results": [
            {"row": "sdpa", "precision": "bf16", "mode": "fwd", "N": 1024, "status": "ok", "median_s": 1.5e-3, "peak_mib": 12.0,
             "x_bf16_floor": 3.2},
            {"row": "flt-logit triton", "precision": "bf16", "mode": "fwd", "N": 1024, "status": "oom"},
        ],
    }
    text = gpu.markdown(data, "flt bench speed --device cuda")
    assert "| sdpa | 1.500 (12 MiB, 3.2x) |" in text and "| flt-logit triton | oom |" in text
    assert "Test GPU" in text and "## bf16, fwd" in text and "Shape wide: batch 1, 8 heads of 64" in text
    pytest.importorskip("matplotlib")
    gpu.plot(data, tmp_path / "speed-cuda.png")
    assert (tmp_path / "speed-cuda.png").stat().st_size > 0


def test_each_result_is_handed_on_as_it_is_measured(monkeypatch):
    """``on_result`` sees every configuration the moment it is measured, in order, failures
    too (the CLI writes them to speed-cuda.jsonl, so a pass stopped by a time limit keeps
    its rows); the CUDA calls are replaced, so this runs anywhere."""
    monkeypatch.setattr(gpu, "check_cuda", lambda: None)
    monkeypatch.setattr(gpu, "matmul_tflops", lambda dtype: 700.0)
    monkeypatch.setattr(gpu, "check_row", lambda name, shape, causal: None)

    def fake_time(name, shape, N, precision, mode, causal, *, warmup, repeats):
        if N == 2048:
            raise RuntimeError("no tile fits")
        return {"median_s": 1e-3 * N / 1024, "q1_s": 0.0, "q3_s": 0.0, "peak_mib": 1.0}

    monkeypatch.setattr(gpu, "time_row", fake_time)
    monkeypatch.setattr(gpu.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(gpu, "gpu_machine", lambda: {"gpu": "none"})
    seen = []
    data = gpu.run(rows=["sdpa"], lengths=(1024, 2048), precisions=("bf16",), modes=("fwd",), log=lambda line: None,
                   on_result=lambda r: seen.append((r["N"], r["status"], r.get("median_s"))))
    assert seen == [(1024, "ok", 1e-3), (2048, "failed", None)]
    assert [r["N"] for r in data["results"]] == [1024, 2048]


def test_a_stopped_pass_keeps_its_measured_rows_on_disk(tmp_path, monkeypatch):
    """``flt bench speed --device cuda`` writes each result to speed-cuda.jsonl as it comes:
    a run that fails (or is killed) after two results leaves those two lines."""
    from flt.commands.bench import run_speed_cuda

    def two_then_fail(*, on_result, **options):
        on_result({"row": "sdpa", "N": 1024, "status": "ok"})
        on_result({"row": "sdpa", "N": 2048, "status": "ok"})
        raise RuntimeError("stopped")

    monkeypatch.setattr(gpu, "check_cuda", lambda: None)
    monkeypatch.setattr(gpu, "run", two_then_fail)
    out = tmp_path / "b"
    with pytest.raises(RuntimeError, match="stopped"):
        run_speed_cuda(_args("--device", "cuda", "--rows", "sdpa", "--out-dir", str(out)))
    lines = (out / "speed-cuda.jsonl").read_text().splitlines()
    assert [json.loads(line)["N"] for line in lines] == [1024, 2048]
    assert not (out / "speed-cuda.json").exists()
