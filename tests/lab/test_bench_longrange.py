"""``python -m flt.bench.longrange``: SchNet alone and with each block, timed in one process,
a ratio per block and the exponent of each model's step time in N."""

from __future__ import annotations

import json
import math

import pytest

from flt.bench import longrange


def test_the_bench_reports_ratios_and_exponents(capsys):
    longrange.main(["--n", "64", "128", "--repeats", "2", "--exact-max", "64", "--wide", "0", "--only", "radial", "exact radial"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    first, second, last = lines
    assert first["N"] == 64 and set(first["seconds"]) == {"schnet", "radial", "exact radial"}
    assert set(second["seconds"]) == {"schnet", "radial"}  # the exact block stops at --exact-max
    assert all(r > 0 for r in first["ratio_to_schnet"].values())
    lo, hi = first["ratio_range"]["radial"]
    assert lo <= first["ratio_to_schnet"]["radial"] <= hi
    assert set(last["exponent"]) == {"schnet", "radial"} and last["to"]["exact radial"] == 64
    assert all(math.isfinite(e) for e in last["exponent"].values())


def test_exponent_is_the_power_of_n():
    assert longrange.exponent(1000, 2.0, 4000, 32.0) == pytest.approx(2.0)
    assert longrange.exponent(1024, 1.0, 16384, 16.0) == pytest.approx(1.0)


def test_every_default_block_builds_on_schnet():
    models = longrange.models(dim=8, depth=1, cutoff=2.0, blocks=longrange.BLOCKS, wide=6.0)
    assert set(models) == {"schnet", "schnet cutoff=6", *longrange.BLOCKS}
    assert models["schnet cutoff=6"].radius == 6.0 and models["schnet"].radius == 2.0
