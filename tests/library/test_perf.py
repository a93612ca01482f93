"""flt.perf: the allocator switch keeps large temporaries mapped between calls, and
flt.compile is torch.compile with the library's settings (equal to eager in float64)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import flt
from flt.perf import _libc

glibc = pytest.mark.skipif(_libc() is None, reason="malloc is not glibc's")

# A 64 MiB tensor made and freed each call, in a fresh interpreter (the setting is process-wide).
_FAULTS = """
import json, resource, sys, torch
import flt
applied = flt.keep_freed_memory() if sys.argv[1] == "keep" else None
x = torch.randn(4, 16384, 256)
f = lambda: (x * 2).exp_().sum()
f()
f()
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# The steady state: the fewest faults of a call (an unrelated burst, e.g. the kernel moving
# pages, once made one kept call fault the whole block).
print(json.dumps({"applied": applied, "faults": min(faults)}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_kept_memory_removes_the_page_faults_of_large_temporaries():
    default, kept = _faults("default"), _faults("keep")
    assert kept["applied"] is True
    # 64 MiB = 16384 pages of 4 KiB: glibc maps such a block afresh on every call by default.
    assert default["faults"] >= 4096
    assert kept["faults"] < 64


def test_keep_freed_memory_sets_both_thresholds_and_can_be_turned_back(monkeypatch):
    calls = []
    monkeypatch.setattr("flt.perf._libc", lambda: type("L", (), {
        "mallopt": staticmethod(lambda p, v: calls.append((p, v)) or 1),
        "malloc_trim": staticmethod(lambda n: calls.append(("trim", n)) or 1),
    })())
    assert flt.keep_freed_memory(True) is True
    assert calls == [(-3, 1 << 30), (-1, 1 << 30)]
    calls.clear()
    assert flt.keep_freed_memory(False) is True
    assert calls == [(-3, 128 * 1024), (-1, 128 * 1024), ("trim", 0)]


def test_keep_freed_memory_says_false_without_glibc(monkeypatch):
    monkeypatch.setattr("flt.perf._libc", lambda: None)
    assert flt.keep_freed_memory() is False


@pytest.mark.parametrize("causal", [False, True])
def test_flt_compile_equals_eager_in_float64(causal, monkeypatch):
    kept = []
    monkeypatch.setattr("flt.perf.keep_freed_memory", lambda enable=True: kept.append(enable) or True)
    torch.manual_seed(0)
    layer = flt.FLTAttention.from_options(16, 2, num_features=8, num_frequencies=4, causal=causal, dtype=torch.float64)
    x = torch.randn(2, 40, 16, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    fast = flt.compile(layer, backend="aot_eager")
    assert kept == [True]
    out = fast(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    ref = layer(x)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert {id(p) for p in fast.parameters()} == {id(p) for p in layer.parameters()}  # shared, not copied
    flt.compile(layer, keep_memory=False, backend="aot_eager")
    assert kept == [True]  # keep_memory=False leaves the allocator alone
