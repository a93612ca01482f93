"""The Triton kernels compiled for a GPU target on a machine without one (to Triton's
intermediate form; nothing launches). The interpreter tests cannot see what only the
compiler does: a compiled kernel turns an integer argument equal to 1 into a compile-time
constant (``num_features=1`` made ``M`` one, and ``M.to(...)`` then failed to compile) and
receives a Python float as float32. Runs in a subprocess without ``TRITON_INTERPRET``,
which ``conftest.py`` sets on machines without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (the optional extra 'triton')")

SCRIPT = r'''
import inspect
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton._C.libtriton import ir
from flt.ops.triton import kernels, split_kernels

FLAGS = dict(CAUSAL=True, HAS_EXTRA=True, HAS_MASK=False, HAS_KEEP=False, ATOMIC=False, LOW=False, PREC="ieee",
             STATES_ONLY=False, HAS_INIT=False, BC=16, BD=16, BE=16, BM=16, BV=16)

def compile_ir(fn, ints_are_one, dtype):
    params = list(inspect.signature(fn.fn).parameters)
    signature, constants = {}, {}
    for i, name in enumerate(params):
        if name in FLAGS:
            signature[name], constants[(i,)] = "constexpr", FLAGS[name]
        elif name.isupper() and name not in ("H", "N", "D", "EDIM", "M", "DV", "R2", "WIDTH", "SEG", "NSEG", "NVB", "NMB"):
            signature[name] = f"*{dtype}"
        elif ints_are_one:
            signature[name], constants[(i,)] = "constexpr", 1
        else:
            signature[name] = "i32"
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    ASTSource(fn, signature, constants).make_ir(target, options, backend.get_codegen_implementation(options),
                                                backend.get_module_map(), context)

SPLIT = ("favor_split_kernel", "favor_split_dq_kernel", "favor_split_dkv_kernel")
for module, name in ((kernels, "favor_attention_kernel"), (kernels, "band_attention_kernel"), *((split_kernels, n) for n in SPLIT)):
    for ints_are_one in (False, True):
        for dtype in ("fp32", "fp64"):
            compile_ir(getattr(module, name), ints_are_one, dtype)
            print(name, ints_are_one, dtype, "ok")
# The feature-split kernels at their GPU tile (64 tokens, 64 features, 64 value columns), both directions.
for causal in (True, False):
    FLAGS.update(CAUSAL=causal, BC=64, BD=64, BE=64, BM=64, BV=64)
    for name in SPLIT:
        compile_ir(getattr(split_kernels, name), False, "fp32")
        print(name, "64-tile", "causal" if causal else "bidirectional", "ok")
# Their segment launches: a segment's states only, and a segment started from the combined states.
for flags in ({"STATES_ONLY": True, "HAS_INIT": False}, {"STATES_ONLY": False, "HAS_INIT": True}):
    FLAGS.update(CAUSAL=True, BC=16, BD=16, BE=16, BM=16, BV=16, **flags)
    for name in SPLIT:
        compile_ir(getattr(split_kernels, name), False, "fp32")
        print(name, flags, "ok")
'''


def test_kernels_compile_for_a_gpu_with_integer_arguments_that_are_one():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode and "make_backend" in done.stderr and "ImportError" in done.stderr:
        pytest.skip("this triton has no compiler API for a GPU target here")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count(" ok") == 32, done.stdout


SHARED_SCRIPT = r'''
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flt.ops.triton import split_kernels

for name, causal, dtype, stages in (("favor_split_kernel", True, "fp32", 2), ("favor_split_kernel", False, "fp32", 2),
                                   ("favor_split_kernel", True, "fp64", 1), ("favor_split_dkv_kernel", True, "fp32", 2),
                                   ("favor_split_dkv_kernel", True, "fp64", 1), ("favor_split_dq_kernel", True, "fp64", 1)):
    fn = getattr(split_kernels, name)
    flags = dict(CAUSAL=causal, HAS_EXTRA=True, HAS_KEEP=False, LOW=False, PREC="ieee", STATES_ONLY=False, HAS_INIT=False,
                 BC=64, BD=64, BE=64, BM=64, BV=64)
    params = list(inspect.signature(fn.fn).parameters)
    pointers = params[: params.index("H")]  # the tensors come first, then the integers, then the flags
    signature = {name: "constexpr" if name in flags else f"*{dtype}" if name in pointers else "i32" for name in params}
    constants = {(i,): flags[name] for i, name in enumerate(params) if name in flags}
    kernel = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32), options={"num_stages": stages})
    print("shared", name, causal, dtype, stages, kernel.metadata.shared)
'''


@pytest.mark.slow
def test_split_kernel_default_tile_fits_hopper_shared_memory():
    """The feature-split kernels' GPU tile (64 tokens, features, value columns; head dim
    and spectral width 64) compiled to sm_90 machine code (ptxas, shipped with triton) fits
    the 232,448 bytes of shared memory a block may use on an H100/H200, at the stages the
    launchers try first: 2 in float32, 1 in float64 (:func:`flt.ops.triton.split.split_tile_candidates`);
    forward both ways, the larger (causal) backward kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SHARED_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode and ("ptxas" in done.stderr.lower() or "make_backend" in done.stderr):
        pytest.skip(f"no sm_90 compiler here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-2000:]
    sizes = [int(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("shared")]
    assert len(sizes) == 6 and all(0 < size <= 232_448 for size in sizes), done.stdout
