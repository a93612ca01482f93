"""One measured configuration of ``flt bench speed``, in its own process: the float64
reference check, the timed calls, the peak memory and the reliability flags
(:mod:`flt.bench.speed` describes the protocol; the runner and the CLI live there)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import torch

from flt.bench.variants import SHAPES, VARIANTS, Shape, Variant
from flt.perf import compile as compile_module, keep_freed_memory

#: Relative error (max abs difference / max abs reference) above which a fast path is refused.
CHECK_TOLERANCE = 1e-8
CHECK_SIZE = {"B": 2, "N": 300, "dim": 32, "heads": 2}
#: How the timed calls allocate memory (``Config.allocator``): ``keep`` freed memory for reuse
#: (:func:`flt.perf.keep_freed_memory`) or glibc's ``default`` thresholds.
ALLOCATORS = ("keep", "default")


def check_allocator(name: str, value: object) -> None:
    if value not in ALLOCATORS:
        raise ValueError(f"{name} must be 'keep' or 'default', got {value!r}")


#: ``(max - min) / median`` of a configuration's repeats above which its timing is unreliable.
SPREAD_LIMIT = 0.5


@dataclass(frozen=True)
class Config:
    """One measured configuration, passed to a worker as JSON."""

    variant: str
    shape: str
    N: int
    mode: str  # "fwd" or "fwd+bwd"; "matmul" for the throughput probe
    causal: bool
    threads: int
    warmup: int
    repeats: int
    min_repeats: int
    budget_s: float
    mem_limit_bytes: int = 0
    allocator: str = "keep"  # "keep": freed memory kept for reuse in the timed calls (flt.perf.keep_freed_memory); "default": glibc's
    memory_call: bool = True  # measure peak memory in one extra call (see measure)
    ceiling_n: int = 0  # > 0: time an n x n float32 matmul before and after the timed calls


def timing_flags(wall: list[float], limit: float = SPREAD_LIMIT) -> dict:
    """``{"spread", "reliable", "unreliable"}`` of one configuration's repeated wall times.

    ``spread = (max - min) / median``; above ``limit`` the repeats disagree too much for
    their median to mean anything (the machine was busy), and ``unreliable`` says so.
    """
    if not wall:
        return {"spread": None, "reliable": False, "unreliable": "no timed calls"}
    median = statistics.median(wall)
    spread = (max(wall) - min(wall)) / median if median > 0 else math.inf
    if spread > limit:
        return {"spread": spread, "reliable": False,
                "unreliable": f"repeats spread {spread:.0%} of their median (> {limit:.0%}): machine busy"}
    return {"spread": spread, "reliable": True, "unreliable": ""}


# -- worker side -------------------------------------------------------------------------


def _status_mb() -> dict[str, float]:
    text = Path("/proc/self/status").read_text()
    out = {}
    for key in ("VmRSS", "VmHWM", "VmSize"):
        found = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
        if found is None:
            raise RuntimeError(f"/proc/self/status has no {key} line")
        out[key] = int(found.group(1)) / 1024
    return out


def _reset_peak() -> bool:
    """Reset the resident high-water mark (Linux >= 4.0); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _fix_mmap_threshold() -> bool:
    """glibc only: serve every allocation of 128 KiB or more by ``mmap`` from now on and
    return freed heap memory, so that resident memory follows the live tensors. (By default
    glibc raises its ``mmap`` threshold up to 32 MiB as large blocks are freed and keeps
    freed blocks below it for reuse, and the timed calls run with freed memory kept
    (:func:`flt.perf.keep_freed_memory`): fast, but the resident peak then includes retained
    memory that depends on the order of allocations.) False where that is unavailable."""
    return keep_freed_memory(False)


def _randomise_zeros(module: torch.nn.Module) -> None:
    """Give all-zero parameters (fresh biases, zero-amplitude spectra) something to do."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            if p.abs().sum() == 0:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def build_module(variant: str, shape: Shape, causal: bool, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The module a variant names, at a shape: ``forward(x [B, N, H*D]) -> [B, N, H*D]``."""
    from flt.bench.peers import build_peer
    from flt.layers import ATTENTION

    v = VARIANTS[variant]
    dim = shape.H * shape.D
    if v.kind == "peer":
        return build_peer(v.mechanism, dim, shape.H, causal=causal, dtype=dtype, **v.kwargs)
    return ATTENTION[v.mechanism].from_options(dim, shape.H, causal=causal, dtype=dtype, **v.kwargs)


def _maybe_compile(module: torch.nn.Module, v: Variant) -> torch.nn.Module:
    """:func:`flt.perf.compile` (inductor, ``dynamic=False``) for a compiled variant: every
    timed configuration has one shape, and the float64 check before it another; with
    automatic dynamic shapes the second compile of the causal layer's backward failed in
    inductor at N = 16384 (``ValueRangeError``). The allocator is the configuration's
    (``Config.allocator``), set for every variant alike."""
    return compile_module(module, keep_memory=False) if v.compile else module


def _autocast(v: Variant) -> contextlib.AbstractContextManager[object]:
    """The autocast context of a variant (a no-op context for float32)."""
    if not v.autocast:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=getattr(torch, v.autocast))


def autocast_accuracy(module: torch.nn.Module, fast: torch.nn.Module, v: Variant, x: torch.Tensor, backward: bool) -> dict:
    """Relative error (max abs difference / max abs reference) of a variant under autocast
    against a float64 copy of the same module, at the timed input: the output, and for
    ``fwd+bwd`` the input gradient."""
    import copy

    gen = torch.Generator().manual_seed(2)
    ref_module = copy.deepcopy(module).double()
    x64 = x.detach().double().requires_grad_(backward)
    xs = x.detach().clone().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        with _autocast(v):
            out = fast(xs)
        ref = ref_module(x64)
        result = {"dtype": v.autocast, "output_rel_error": _relative(out.detach().double(), ref.detach())}
        if backward:
            up = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
            out.backward(up.to(out.dtype))
            ref.backward(up)
            assert xs.grad is not None and x64.grad is not None  # both require grad
            result["grad_rel_error"] = _relative(xs.grad.double(), x64.grad)
    return result


def _kronecker_inputs(shape: Shape, N: int, m: int, R: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    B, H, D = shape.B, shape.H, shape.D
    qf = torch.rand(B, H, N, m, generator=gen, dtype=dtype) + 0.05
    kf = torch.rand(B, H, N, m, generator=gen, dtype=dtype) + 0.05
    v = torch.randn(B, H, N, D, generator=gen, dtype=dtype)
    a = torch.rand(1, H, N, 2 * R, generator=gen, dtype=dtype)
    c = torch.rand(1, H, N, 2 * R, generator=gen, dtype=dtype)
    kls = torch.randn(B, H, N, generator=gen, dtype=dtype)
    return [qf, kf, v, a, c, kls]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def reference_check(variant: str, causal: bool) -> dict:
    """Fast path against its O(N^2) reference in float64 at a small size, forward and grad."""
    from flt.bench.peers import peer_reference
    from flt.ops import flt_attention, flt_attention_reference

    v = VARIANTS[variant]
    gen = torch.Generator().manual_seed(0)
    B, N = CHECK_SIZE["B"], CHECK_SIZE["N"]
    if v.kind == "op":
        shape = Shape(B, CHECK_SIZE["heads"], CHECK_SIZE["dim"] // CHECK_SIZE["heads"])
        tensors = [t.requires_grad_() for t in _kronecker_inputs(shape, N, v.kwargs["num_features"], v.kwargs["num_frequencies"], torch.float64, gen)]
        fast_fn = lambda: flt_attention(*tensors[:5], causal=causal, key_log_scale=tensors[5])  # noqa: E731
        ref_fn = lambda: flt_attention_reference(*tensors[:5], causal=causal, key_log_scale=tensors[5])  # noqa: E731
        wrt = tensors
        against = "flt_attention_reference"
    else:
        shape = Shape(B, CHECK_SIZE["heads"], CHECK_SIZE["dim"] // CHECK_SIZE["heads"])
        torch.manual_seed(0)
        module = build_module(variant, shape, causal, dtype=torch.float64)
        _randomise_zeros(module)
        x = torch.randn(B, N, CHECK_SIZE["dim"], generator=gen, dtype=torch.float64, requires_grad=True)
        # A compiled variant is checked compiled (in float64); an autocast one without
        # autocast (the same code; its bfloat16 accuracy is measured at the timed size).
        fast = _maybe_compile(module, v)
        fast_fn = lambda: fast(x)  # noqa: E731
        reference = cast(Callable[[torch.Tensor], torch.Tensor], getattr(module, "reference", None))  # every non-peer layer has one
        ref_fn = (lambda: peer_reference(module, x)) if v.kind == "peer" else (lambda: reference(x))
        wrt = [x]
        against = "quadratic formula of its own features" if v.kind == "peer" else "layer.reference"
    fast_out = fast_fn()
    up = torch.randn(fast_out.shape, generator=gen, dtype=torch.float64)
    g_fast = torch.autograd.grad((fast_out * up).sum(), wrt)
    ref = ref_fn()
    g_ref = torch.autograd.grad((ref * up).sum(), wrt)
    out_err = _relative(fast_out.detach(), ref.detach())
    grad_err = max(_relative(a, b) for a, b in zip(g_fast, g_ref, strict=True))
    ok = math.isfinite(out_err) and math.isfinite(grad_err) and max(out_err, grad_err) <= CHECK_TOLERANCE
    return {"passed": ok, "output_rel_error": out_err, "grad_rel_error": grad_err, "tolerance": CHECK_TOLERANCE, "against": against, "N": N}


@dataclass(frozen=True)
class _LayerStep:
    """One timed call of a layer (``run``) and what :func:`autocast_accuracy` needs of it."""

    run: Callable[[], None]
    module: torch.nn.Module
    fast: torch.nn.Module
    x: torch.Tensor

    def __call__(self) -> None:
        self.run()


def _timed_step(cfg: Config) -> Callable[[], None]:
    """A closure running one timed call of the configuration, and what it computes."""
    from flt.ops import flt_attention

    v = VARIANTS[cfg.variant]
    shape = SHAPES[cfg.shape]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    backward = cfg.mode == "fwd+bwd"
    if v.kind == "op":
        tensors = _kronecker_inputs(shape, cfg.N, v.kwargs["num_features"], v.kwargs["num_frequencies"], torch.float32, gen)
        if not backward:
            def op_forward() -> None:
                with torch.no_grad():
                    flt_attention(*tensors[:5], causal=cfg.causal, key_log_scale=tensors[5])
            return op_forward
        for t in tensors[:5]:
            t.requires_grad_()
        up = torch.randn(shape.B, shape.H, cfg.N, shape.D, generator=gen)

        def op_backward() -> None:
            flt_attention(*tensors[:5], causal=cfg.causal, key_log_scale=tensors[5]).backward(up)
            for t in tensors[:5]:
                t.grad = None
        return op_backward
    module = build_module(cfg.variant, shape, cfg.causal)
    fast = _maybe_compile(module, v)
    x = torch.randn(shape.B, cfg.N, shape.H * shape.D, generator=gen)
    if not backward:
        module.eval()

        def forward() -> None:
            with torch.no_grad(), _autocast(v):
                fast(x)
        return _LayerStep(forward, module, fast, x)
    module.train()
    x.requires_grad_()
    up = torch.randn(x.shape, generator=gen)
    params = [p for p in module.parameters() if p.requires_grad]

    def forward_backward() -> None:
        with _autocast(v):
            out = fast(x)
        out.backward(up.to(out.dtype))
        x.grad = None
        for p in params:
            p.grad = None
    return _LayerStep(forward_backward, module, fast, x)


def _matmul_step(n: int) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    return lambda: torch.mm(a, b)


def _matmul_best_s(n: int, calls: int = 3, clock: Callable[[], float] = time.perf_counter) -> float:
    """Fastest of ``calls`` timed ``n x n`` float32 matmuls after one warm-up call."""
    step = _matmul_step(n)
    step()
    best = math.inf
    for _ in range(calls):
        t0 = clock()
        step()
        best = min(best, clock() - t0)
    return best


def ceiling_gflops(n: int, seconds: list[float]) -> float:
    """float32 matmul throughput from the fastest of several ``n x n`` timings (GFLOP/s)."""
    return 2 * n**3 / min(seconds) / 1e9


def measure(cfg: Config) -> dict:
    """Run one configuration in this process (a fresh one): check, then time and measure."""
    torch.set_num_threads(cfg.threads)
    if cfg.mem_limit_bytes:
        soft_hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = int(_status_mb()["VmSize"] * 2**20) + cfg.mem_limit_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, soft_hard[1]))
    result: dict[str, Any] = {"config": asdict(cfg), "status": "ok", "note": ""}
    check_allocator("allocator", cfg.allocator)
    result["allocator_kept"] = keep_freed_memory() if cfg.allocator == "keep" else False
    ceiling = []
    try:
        if cfg.ceiling_n:
            ceiling.append(_matmul_best_s(cfg.ceiling_n))
        if cfg.mode == "matmul":
            step = _matmul_step(cfg.N)
        else:
            check = reference_check(cfg.variant, cfg.causal)
            result["check"] = check
            if not check["passed"]:
                result.update(status="refused", note=f"reference check failed: {check}")
                return result
            step = _timed_step(cfg)
        base = _status_mb()["VmRSS"]
        exact_peak = _reset_peak()
        first = None
        for _ in range(cfg.warmup):
            t0 = time.perf_counter()
            step()
            first = time.perf_counter() - t0 if first is None else first
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
        wall: list[float] = []
        cpu: list[float] = []
        while len(wall) < cfg.repeats and (len(wall) < cfg.min_repeats or sum(wall) < cfg.budget_s):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - switches
        timed_peak = _status_mb()["VmHWM"] - base
        method = "RSS high-water mark over warm-up and timed calls, allocator as timed, above the RSS before them"
        peak = timed_peak
        if cfg.memory_call and cfg.mode != "matmul" and exact_peak and _fix_mmap_threshold():
            base = _status_mb()["VmRSS"]
            _reset_peak()
            step()
            peak = _status_mb()["VmHWM"] - base
            method = "RSS high-water mark of one extra call after the timed ones, glibc mmap threshold fixed at 128 KiB, above the RSS before it"
        elif not exact_peak:
            method += " (high-water mark could not be reset: includes setup)"
        if cfg.ceiling_n:
            ceiling.append(_matmul_best_s(cfg.ceiling_n))
        v = VARIANTS.get(cfg.variant)
        if v is not None and v.autocast and isinstance(step, _LayerStep):
            result["accuracy"] = autocast_accuracy(step.module, step.fast, v, step.x, cfg.mode == "fwd+bwd")
    except (RuntimeError, MemoryError) as err:  # allocation refused under the address-space limit, or a kernel error
        result.update(status="error", note=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
        return result
    q1, _, q3 = statistics.quantiles(wall, n=4, method="inclusive") if len(wall) > 1 else (wall[0],) * 3
    result.update(
        wall_s=wall, cpu_s=cpu, median_s=statistics.median(wall), q1_s=q1, q3_s=q3, min_s=min(wall),
        first_call_s=first, involuntary_switches=switches, peak_mb=peak, peak_timed_mb=timed_peak, baseline_rss_mb=base, peak_method=method,
        **timing_flags(wall),
    )
    if ceiling:
        result.update(ceiling_n=cfg.ceiling_n, ceiling_s=ceiling, ceiling_gflops=ceiling_gflops(cfg.ceiling_n, ceiling))
    return result


def _child(cfg_json: str, conn: Connection) -> None:
    # Anything printed goes to stderr; the result goes through the pipe.
    sys.stdout = sys.stderr
    cfg = Config(**json.loads(cfg_json))
    try:
        result = measure(cfg)
    except Exception as err:  # noqa: BLE001 (reported as this configuration's error row, with the message)
        result = {"config": asdict(cfg), "status": "error", "note": f"{type(err).__name__}: {err}"}
    except KeyboardInterrupt:
        # Ctrl-C reaches every process of the terminal: the parent reports it in one line,
        # a worker leaves without a traceback of its own.
        conn.close()
        os._exit(130)
    conn.send(result)
    conn.close()
