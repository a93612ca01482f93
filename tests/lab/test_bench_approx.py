"""``flt bench approx``: the sweeps are well-formed and the plot is drawn."""

from __future__ import annotations

import json
import math

import pytest

from flt.bench import approx, convergence
from flt.cli import main as cli_main


def test_sweeps_cover_both_couplings_and_the_requested_sizes(tmp_path):
    sweeps = convergence.attention_error_sweeps((8, 32), (4, 8), fixed_R=4, fixed_m=16, seeds=(0,), N=9)
    assert sorted({(r.coupling, r.causal) for r in sweeps["vs_m"]}) == [("logit", False), ("logit", True), ("multiplicative", False), ("multiplicative", True)]
    assert sorted({r.m for r in sweeps["vs_m"]}) == [8, 32] and {r.R for r in sweeps["vs_m"]} == {4}
    assert sorted({r.R for r in sweeps["vs_R"]}) == [4, 8] and {r.m for r in sweeps["vs_R"]} == {16}
    assert all(math.isfinite(r.rel_error) and r.rel_error > 0 for rows in sweeps.values() for r in rows)
    masks = approx.mask_errors(names=["gaussian", "local"], Rs=(4, 16), seeds=(0,), pos_dims=(1, 2))
    assert {r.sampler for r in masks if r.pos_dim == 2} == {"iid", "qmc", "orthogonal"}
    convergence.plot_convergence(masks, sweeps, tmp_path / "approx.png")
    assert (tmp_path / "approx.png").stat().st_size > 10_000


def test_attention_error_falls_with_m():
    """Many features against few: the estimator converges (a loose identity, not a rate)."""
    rows = convergence.attention_error_sweeps((8, 512), (32,), fixed_R=32, fixed_m=8, seeds=(0, 1), N=9)["vs_m"]
    for coupling in ("logit", "multiplicative"):
        few, many = (r.rel_error for r in rows if r.coupling == coupling and not r.causal)
        assert many < few / 2, (coupling, few, many)



@pytest.mark.cli
def test_cli_approx_quick_writes_outputs(tmp_path, monkeypatch):
    # The CLI path with its sweeps shrunk: only the wiring is under test here.
    masks, attention = approx.mask_errors, approx.attention_errors
    monkeypatch.setattr(approx, "mask_errors", lambda **kw: masks(**{**kw, "names": ["gaussian"], "Rs": (4, 8)}))
    monkeypatch.setattr(convergence, "attention_errors", lambda settings, **kw: attention(settings[:2], N=9, seeds=(0,)))
    fidelity = approx.fidelity_errors
    monkeypatch.setattr(approx, "fidelity_errors", lambda **kw: fidelity(**{**kw, "amplitudes": (0.0, 3.5), "N": 24, "dim": 32}))
    assert cli_main(["bench", "approx", "--quick", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "approx.json").read_text())
    assert set(data) == {"masks", "fidelity", "vs_m", "vs_R"} and data["masks"] and data["vs_m"]
    assert {r["estimator"] for r in data["fidelity"]} == set(approx.FIDELITY_ESTIMATORS)
    assert "## Mask error" in (tmp_path / "approx.md").read_text()
    assert (tmp_path / "approx.png").exists()


def test_band_estimator_holds_a_strong_local_mask_where_concatenation_fails():
    # The measurement behind the near_field option (docs/math.md section 5.1), small.
    rows = approx.fidelity_errors(amplitudes=(0.0, 3.5), settings=((64, 16),), N=96, dim=64, seeds=(0,),
                                  estimators=["concat (logit, no band)", "band w=16, mask in f_near"])
    err = {(r.estimator, r.amplitude): r.rel_error for r in rows}
    plain = err[("concat (logit, no band)", 0.0)]
    assert err[("band w=16, mask in f_near", 3.5)] <= 2 * plain
    assert err[("concat (logit, no band)", 3.5)] > 3 * err[("band w=16, mask in f_near", 3.5)]
