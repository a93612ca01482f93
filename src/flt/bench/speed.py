"""Speed and peak memory of every attention mechanism: ``flt bench speed``.

Registry x named shapes, one runner (STYLE.md item 11). Every configuration
``(variant, shape, N, mode, causal)`` runs in its own process:

1. **Reference check.** The variant is built in float64 at a small size (``B = 2``,
   ``N = 300`` so chunked paths see several chunks and a tail, width 32, 2 heads, zero
   parameters randomised so relative terms act) and its fast path is compared with its
   O(N^2) ``reference`` (layers) or quadratic formula (ops, peers), forward and input
   gradient. Relative error above ``CHECK_TOLERANCE`` refuses the configuration: no
   speed is reported for it.
2. **Timing.** float32, ``torch.set_num_threads(threads)``. ``fwd``: ``module(x)`` under
   ``torch.no_grad()`` in eval mode. ``fwd+bwd``: ``module(x).backward(g)`` with ``x``
   requiring grad, parameter gradients reset each call. Warm-up calls, then repeats until
   ``repeats`` or the per-configuration time budget (at least ``min_repeats``); wall time
   (``perf_counter``) and process CPU time of each call are kept; median, quartiles, min.
   Calls predicted to take over ``long_call_s`` get no warm-up and ``min_repeats_long``
   repeats.
3. **Peak memory.** Resident set size of one extra, untimed call made after the timed
   ones: glibc's ``mmap`` threshold is fixed at 128 KiB and retained heap memory released
   first (so resident memory follows the live tensors instead of what the allocator keeps
   for reuse, which depends on allocation order), the high-water mark is reset
   (``/proc/self/clear_refs``), and ``peak = VmHWM - VmRSS`` before the call. Timing runs
   with the default allocator, which is faster. Calls longer than ``long_call_s`` (the exact
   layers at large N) get no extra call: their peak is the high-water mark over the timed
   calls, whose tensors are far above any ``mmap`` threshold anyway. ``peak_method`` in
   the JSON says which; the timed calls' own peak is kept as ``peak_timed_mb``.
4. **Reliability.** A busy machine makes timings wrong, not just noisy. Every result
   carries ``spread = (max - min) / median`` of its repeats and ``reliable``: False (with
   the reason in ``unreliable``) when the spread exceeds ``SPREAD_LIMIT``. Op-level runs
   also time the float32 matmul ceiling in the same process just before and just after
   their timed calls (``ceiling_gflops``: the best of those); :mod:`flt.bench.report`
   flags a throughput above that ceiling, leaves unreliable sizes out of the fitted
   exponents and does not call a target met or missed from unreliable timings.

Processes are forked from a ``multiprocessing`` forkserver that has imported only torch
and flt (imports paid once, fresh address space per configuration);
``python -m flt.bench.speed --worker '<config json>'`` runs one configuration in a new
interpreter and prints its result as JSON. Before each configuration the runner predicts
its memory and time from the same variant at the previous ``N`` (exponent 2 for O(N^2)
memory or time, else 1.2 with margin) and skips it with a note when the memory would
exceed 80% of ``MemAvailable`` or a call would exceed ``max_call_s``; the child also gets
an address-space limit, so an underestimate fails with an error instead of the OOM killer.

Layer level (``x [B, N, H*D] -> [B, N, H*D]``, projections included) for every mechanism;
op level for the Kronecker cost model. Results: ``speed.json``, ``speed.md``,
``speed.png`` (see :mod:`flt.bench.report`).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import multiprocessing
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

#: Relative error (max abs difference / max abs reference) above which a fast path is refused.
CHECK_TOLERANCE = 1e-8
CHECK_SIZE = {"B": 2, "N": 300, "dim": 32, "heads": 2}
#: ``(max - min) / median`` of a configuration's repeats above which its timing is unreliable.
SPREAD_LIMIT = 0.5


@dataclass(frozen=True)
class Shape:
    """A named problem shape; ``N`` is swept separately. Model width is ``H * D``."""

    B: int
    H: int
    D: int


SHAPES = {
    "tiny": Shape(1, 2, 16),
    "lm": Shape(1, 4, 64),  # the targets' shape: B = 1, H = 4, D = 64
    "batch": Shape(4, 8, 64),
}


@dataclass(frozen=True)
class Variant:
    """A timed mechanism: an ``ATTENTION`` entry with fixed options, a peer, or an op.

    ``time_order`` / ``memory_order``: exponent of N that predicts the next size (2 for
    the exact layers' time and for a materialised ``[B, H, N, N]`` bias).
    """

    mechanism: str
    options: tuple = ()
    time_order: float = 1.0
    memory_order: float = 1.0
    kind: str = "layer"  # "layer", "peer" or "op"
    note: str = ""

    @property
    def kwargs(self) -> dict:
        return dict(self.options)


def _flt(coupling: str, m: int, R: int) -> Variant:
    return Variant("flt", (("coupling", coupling), ("num_features", m), ("num_frequencies", R)))


VARIANTS: dict[str, Variant] = {
    "softmax": Variant("softmax", time_order=2, note="exact, SDPA without bias: nothing N x N is materialised"),
    "softmax+t5": Variant("softmax", (("relative_bias", "t5"),), 2, 2, note="exact, learned T5 bias materialised as [B, H, N, N]"),
    "softmax+alibi": Variant("softmax", (("relative_bias", "alibi"),), 2, 2, note="exact, ALiBi bias materialised as [B, H, N, N]"),
    "softmax+spectrum": Variant("softmax", (("relative_bias", "spectrum"),), 2, 2, note="exact, FLT's exact f materialised (logit)"),
    "performer/m64": Variant("performer", (("num_features", 64),)),
    "performer/m256": Variant("performer", (("num_features", 256),)),
    "flt-logit/m64/R8": _flt("logit", 64, 8),
    "flt-logit/m128/R16": _flt("logit", 128, 16),
    "flt-logit/m256/R32": _flt("logit", 256, 32),
    "flt-logit/m256/R64": _flt("logit", 256, 64),
    "flt-mult/m32/R4": _flt("multiplicative", 32, 4),
    "flt-mult/m64/R8": _flt("multiplicative", 64, 8),
    "flt-mult/m128/R16": _flt("multiplicative", 128, 16),
    "flt-mult/m256/R32": _flt("multiplicative", 256, 32),
    "toeplitz/m16": Variant("toeplitz", (("num_features", 16),), 1.2),
    "toeplitz/m64": Variant("toeplitz", (("num_features", 64),), 1.2),
    "toeplitz/m256": Variant("toeplitz", (("num_features", 256),), 1.2),
    "performer-pytorch/m32": Variant("performer-pytorch", (("num_features", 32),), kind="peer", note="peer: lucidrains FAVOR+"),
    "performer-pytorch/m256": Variant("performer-pytorch", (("num_features", 256),), kind="peer", note="peer: lucidrains FAVOR+"),
}
for _m, _R in ((16, 4), (32, 4), (64, 8), (64, 32), (128, 16), (256, 32)):
    VARIANTS[f"op:kronecker/m{_m}/R{_R}"] = Variant(
        "kronecker", (("num_features", _m), ("num_frequencies", _R)), kind="op", note="flt_attention (multiplicative), op level"
    )


@dataclass(frozen=True)
class Run:
    """A variant in a preset: causal or not, which modes, up to which N (None: all)."""

    variant: str
    causal: bool = False
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    max_n: int | None = None


@dataclass(frozen=True)
class Preset:
    """What one ``flt bench speed`` run measures; see :data:`PRESETS` for run times."""

    shapes: tuple[str, ...]
    lengths: tuple[int, ...]
    runs: tuple[Run, ...]
    kronecker: tuple[str, ...] = ()  # op-level Kronecker variants for the cost model
    kronecker_lengths: tuple[int, ...] = ()
    warmup: int = 1
    repeats: int = 5
    min_repeats: int = 3
    min_repeats_long: int = 2
    budget_s: float = 6.0  # stop repeating after this much timed time (at least min_repeats)
    long_call_s: float = 10.0
    max_call_s: float = 90.0
    matmul_n: int = 2048
    target_n: int = 16384
    fit_min_n: int = 1024
    headline: tuple[str, str, str] = ("flt-logit/m256/R32", "softmax+t5", "performer/m256")  # FLT, exact, FAVOR+


def _both(*names, **kw):
    return tuple(Run(n, causal, **kw) for n in names for causal in (False, True))


PRESETS: dict[str, Preset] = {
    # flt bench speed --preset quick: CI smoke, ~20 s on 2 cores. Timings meaningless.
    "quick": Preset(
        shapes=("tiny",),
        lengths=(64, 256),
        runs=(Run("softmax"), Run("softmax+t5"), Run("performer/m64"), *_both("flt-logit/m64/R8"), Run("flt-mult/m32/R4"),
              Run("toeplitz/m16"), Run("performer-pytorch/m32")),
        kronecker=("op:kronecker/m16/R4",),
        kronecker_lengths=(256,),
        repeats=3, min_repeats=2, budget_s=1.0, matmul_n=256, target_n=256, fit_min_n=64,
        headline=("flt-logit/m64/R8", "softmax+t5", "performer/m64"),
    ),
    # flt bench speed: the targets' shape (B=1, H=4, D=64) up to N = 16384; 10-11 min measured
    # on a 2-core machine shared with other jobs, ~3 min of it the exact layers at N = 16384.
    # Expect at N = 16384: FLT-logit fwd ~0.5-1 s against ~25-40 s for exact softmax with a
    # materialised T5 bias (ratio ~35-50), fwd+bwd ~2 s.
    "default": Preset(
        shapes=("lm",),
        lengths=(256, 1024, 4096, 16384),
        runs=(
            Run("softmax+t5"), Run("softmax+alibi", modes=("fwd+bwd",)), Run("softmax", max_n=4096),
            *_both("performer/m256", "flt-logit/m256/R32", "flt-mult/m64/R8"),
            Run("toeplitz/m64", modes=("fwd",)), Run("toeplitz/m64", modes=("fwd+bwd",), max_n=4096),
            Run("performer-pytorch/m256"), Run("performer-pytorch/m256", causal=True, max_n=4096),
        ),
        kronecker=("op:kronecker/m64/R8", "op:kronecker/m64/R32", "op:kronecker/m256/R32"),
        kronecker_lengths=(16384,),
        max_call_s=60.0,
    ),
    # flt bench speed --preset full: more variants, N up to 65536, a batched shape; over 1 h.
    "full": Preset(
        shapes=("lm", "batch"),
        lengths=(256, 1024, 4096, 16384, 65536),
        runs=(
            Run("softmax"), Run("softmax", causal=True), Run("softmax+t5"), Run("softmax+alibi"), Run("softmax+spectrum"),
            *_both("performer/m64", "performer/m256", "flt-logit/m64/R8", "flt-logit/m128/R16", "flt-logit/m256/R32"),
            *_both("flt-logit/m256/R64", "flt-mult/m64/R8", "flt-mult/m128/R16", "flt-mult/m256/R32"),
            *_both("toeplitz/m64"), Run("toeplitz/m256"), *_both("performer-pytorch/m256"),
        ),
        kronecker=tuple(n for n in VARIANTS if n.startswith("op:kronecker/") and not n.endswith(("m16/R4", "m32/R4"))),
        kronecker_lengths=(4096, 16384, 65536),
        max_call_s=180.0,
    ),
}


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
    return {key: int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) / 1024 for key in ("VmRSS", "VmHWM", "VmSize")}


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
    freed blocks below it for reuse: fast, but the resident peak then includes retained
    memory that depends on the order of allocations.) False where that is unavailable."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_MMAP_THRESHOLD = -3
    ok = libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1
    libc.malloc_trim(0)
    return ok


def _randomise_zeros(module: torch.nn.Module) -> None:
    """Give all-zero parameters (fresh biases, zero-amplitude spectra) something to do."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            if p.abs().sum() == 0:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def build_module(variant: str, shape: Shape, causal: bool, dtype=torch.float32):
    """The module a variant names, at a shape: ``forward(x [B, N, H*D]) -> [B, N, H*D]``."""
    from flt.bench.peers import build_peer
    from flt.layers import ATTENTION

    v = VARIANTS[variant]
    dim = shape.H * shape.D
    if v.kind == "peer":
        return build_peer(v.mechanism, dim, shape.H, causal=causal, dtype=dtype, **v.kwargs)
    return ATTENTION[v.mechanism](dim, shape.H, causal=causal, dtype=dtype, **v.kwargs)


def _kronecker_inputs(shape: Shape, N: int, m: int, R: int, dtype, gen):
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
        fast_fn = lambda: module(x)  # noqa: E731
        ref_fn = (lambda: peer_reference(module, x)) if v.kind == "peer" else (lambda: module.reference(x))
        wrt = [x]
        against = "quadratic formula of its own features" if v.kind == "peer" else "layer.reference"
    fast = fast_fn()
    up = torch.randn(fast.shape, generator=gen, dtype=torch.float64)
    g_fast = torch.autograd.grad((fast * up).sum(), wrt)
    ref = ref_fn()
    g_ref = torch.autograd.grad((ref * up).sum(), wrt)
    out_err = _relative(fast.detach(), ref.detach())
    grad_err = max(_relative(a, b) for a, b in zip(g_fast, g_ref))
    ok = math.isfinite(out_err) and math.isfinite(grad_err) and max(out_err, grad_err) <= CHECK_TOLERANCE
    return {"passed": ok, "output_rel_error": out_err, "grad_rel_error": grad_err, "tolerance": CHECK_TOLERANCE, "against": against, "N": N}


def _timed_step(cfg: Config):
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
            def step():
                with torch.no_grad():
                    flt_attention(*tensors[:5], causal=cfg.causal, key_log_scale=tensors[5])
            return step
        for t in tensors[:5]:
            t.requires_grad_()
        up = torch.randn(shape.B, shape.H, cfg.N, shape.D, generator=gen)

        def step():
            flt_attention(*tensors[:5], causal=cfg.causal, key_log_scale=tensors[5]).backward(up)
            for t in tensors[:5]:
                t.grad = None
        return step
    module = build_module(cfg.variant, shape, cfg.causal)
    x = torch.randn(shape.B, cfg.N, shape.H * shape.D, generator=gen)
    if not backward:
        module.eval()

        def step():
            with torch.no_grad():
                module(x)
        return step
    module.train()
    x.requires_grad_()
    up = torch.randn(x.shape, generator=gen)
    params = [p for p in module.parameters() if p.requires_grad]

    def step():
        module(x).backward(up)
        x.grad = None
        for p in params:
            p.grad = None
    return step


def _matmul_step(n: int):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    return lambda: torch.mm(a, b)


def _matmul_best_s(n: int, calls: int = 3, clock=time.perf_counter) -> float:
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
    result = {"config": asdict(cfg), "status": "ok", "note": ""}
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
        for _ in range(cfg.warmup):
            step()
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
        wall, cpu = [], []
        while len(wall) < cfg.repeats and (len(wall) < cfg.min_repeats or sum(wall) < cfg.budget_s):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - switches
        timed_peak = _status_mb()["VmHWM"] - base
        method = "RSS high-water mark over warm-up and timed calls, default allocator, above the RSS before them"
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
    except (RuntimeError, MemoryError) as err:  # allocation refused under the address-space limit, or a kernel error
        result.update(status="error", note=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
        return result
    q1, _, q3 = statistics.quantiles(wall, n=4, method="inclusive") if len(wall) > 1 else (wall[0],) * 3
    result.update(
        wall_s=wall, cpu_s=cpu, median_s=statistics.median(wall), q1_s=q1, q3_s=q3, min_s=min(wall),
        involuntary_switches=switches, peak_mb=peak, peak_timed_mb=timed_peak, baseline_rss_mb=base, peak_method=method,
        **timing_flags(wall),
    )
    if ceiling:
        result.update(ceiling_n=cfg.ceiling_n, ceiling_s=ceiling, ceiling_gflops=ceiling_gflops(cfg.ceiling_n, ceiling))
    return result


def _child(cfg_json: str, conn) -> None:
    # Anything printed goes to stderr; the result goes through the pipe.
    sys.stdout = sys.stderr
    cfg = Config(**json.loads(cfg_json))
    try:
        result = measure(cfg)
    except Exception as err:  # reported as this configuration's error row, with the message
        result = {"config": asdict(cfg), "status": "error", "note": f"{type(err).__name__}: {err}"}
    conn.send(result)
    conn.close()


# -- runner side -------------------------------------------------------------------------


def mem_available_bytes() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _cpu_model() -> str:
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        match = None
    return match.group(1).strip() if match else platform.processor()


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info(threads: int) -> dict:
    """What the numbers depend on: hardware, software, commit, and how busy the machine was."""
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "mem_total_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mkldnn": torch.backends.mkldnn.is_available(),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg_start": os.getloadavg(),
    }


def plan(preset: Preset, variants=None, lengths=None, shapes=None) -> list[tuple[str, str, bool, str, int]]:
    """``(variant, shape, causal, mode, N)`` in the order they run (N ascending per series)."""
    runs = [r for r in preset.runs if variants is None or r.variant in variants]
    kron = [v for v in preset.kronecker if variants is None or v in variants]
    out = []
    for shape in shapes or preset.shapes:
        for r in runs:
            for mode in r.modes:
                out += [(r.variant, shape, r.causal, mode, n) for n in (lengths or preset.lengths) if r.max_n is None or n <= r.max_n]
    for variant in kron:
        for causal in (False, True):
            out += [(variant, (shapes or preset.shapes)[0], causal, "fwd", n) for n in (lengths or preset.kronecker_lengths)]
    return out


def _predict(previous: dict | None, variant: Variant, N: int) -> tuple[float, float] | None:
    """Predicted (peak MB, seconds per call) at N from the same series at a smaller N."""
    if previous is None:
        return None
    ratio = N / previous["config"]["N"]
    mem_order = 2.0 if variant.memory_order >= 2 else 1.2
    time_order = 2.0 if variant.time_order >= 2 else 1.2
    return previous["peak_mb"] * ratio**mem_order, previous["median_s"] * ratio**time_order


def run(preset: Preset, *, variants=None, lengths=None, shapes=None, threads: int | None = None, log=print) -> dict:
    """Measure a preset; returns ``{"machine", "preset", "matmul", "matmul_kronecker", "results"}``
    (the matmul probes: at the start, and just before the op-level Kronecker runs)."""
    from flt.bench.peers import peer_status

    threads = threads or os.cpu_count() or 1
    machine = machine_info(threads)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["flt.bench.speed"])
    peers = {}

    def launch(cfg: Config, timeout: float) -> dict:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(json.dumps(asdict(cfg)), send))
        proc.start()
        send.close()
        try:
            result = recv.recv() if recv.poll(timeout) else None
            timed_out = result is None
        except EOFError:  # the child died before sending anything
            result, timed_out = None, False
        proc.join(5 if result is not None else 1)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if result is None:
            why = f"timed out after {timeout:.0f} s" if timed_out else f"exit code {proc.exitcode}"
            if proc.exitcode == -9 and not timed_out:
                why += " (killed: most likely out of memory)"
            return {"config": asdict(cfg), "status": "error", "note": f"worker died: {why}"}
        return result

    common = dict(threads=threads, warmup=preset.warmup, repeats=preset.repeats, min_repeats=preset.min_repeats, budget_s=preset.budget_s)
    def probe() -> dict:
        """This machine's float32 matmul throughput now (the machine may be shared)."""
        r = launch(Config("matmul", "-", preset.matmul_n, "matmul", False, **common), 600)
        if r["status"] == "ok":
            r["gflops"] = 2 * preset.matmul_n**3 / r["median_s"] / 1e9
            r["gflops_best"] = 2 * preset.matmul_n**3 / r["min_s"] / 1e9
            log(f"float32 matmul {preset.matmul_n}^3: {r['gflops']:.1f} GFLOP/s median ({r['gflops_best']:.1f} best)")
        return r

    matmul, matmul_kronecker = probe(), None
    results, last = [], {}
    if shapes:
        preset = dataclasses.replace(preset, shapes=tuple(shapes))
    for variant, shape, causal, mode, N in plan(preset, variants, lengths):
        spec = VARIANTS[variant]
        if spec.kind == "op" and matmul_kronecker is None:
            matmul_kronecker = probe()  # measured next to the op-level runs it is compared with
        key = (variant, shape, causal, mode)
        # Op-level runs are compared with the matmul ceiling: measured in the same process, around them.
        cfg = Config(variant, shape, N, mode, causal, **common, ceiling_n=preset.matmul_n if spec.kind == "op" else 0)
        previous = last.get(key)
        note = ""
        if spec.kind == "peer":
            if spec.mechanism not in peers:
                peers[spec.mechanism] = peer_status(spec.mechanism)
            ok, info = peers[spec.mechanism]
            note = "" if ok else f"peer {spec.mechanism} {info}"
        if not note and previous is not None and previous["status"] != "ok":
            note = f"{previous['status']} at N = {previous['config']['N']}"
        budget = 0.8 * mem_available_bytes()
        guess = None if note or previous is None else _predict(previous, spec, N)
        if guess is not None:
            mem_mb, call_s = guess
            if mem_mb * 2**20 > budget:
                note = f"memory (predicted peak {mem_mb / 1024:.1f} GB > 80% of available {budget / 2**30:.1f} GB)"
            elif call_s > preset.max_call_s:
                note = f"time (predicted {call_s:.0f} s per call > {preset.max_call_s:.0f} s)"
            elif call_s > preset.long_call_s:
                # Allocations this large are mmap-ed whatever the threshold: the timed calls' peak is clean.
                cfg = dataclasses.replace(cfg, warmup=0, repeats=preset.min_repeats_long, min_repeats=preset.min_repeats_long, memory_call=False)
        if note:
            result = {"config": asdict(cfg), "status": "skipped", "note": note}
        else:
            cfg = dataclasses.replace(cfg, mem_limit_bytes=int(budget))
            expected = 60 if guess is None else guess[1] * (cfg.warmup + cfg.repeats) * 3
            result = launch(cfg, timeout=max(120.0, expected + 60))
        result["variant_note"] = spec.note
        results.append(result)
        last[key] = result
        log(_log_line(result))
    machine["loadavg_end"] = os.getloadavg()
    machine["peers"] = {name: info for name, (_, info) in peers.items()}
    return {"machine": machine, "preset": asdict(preset), "matmul": matmul, "matmul_kronecker": matmul_kronecker, "results": results}


def _log_line(r: dict) -> str:
    c = r["config"]
    head = f"{c['variant']:<24} {c['shape']:<6} N={c['N']:<6} {c['mode']:<7} {'causal' if c['causal'] else 'bidir ':<6}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['note']}"
    flag = "" if r.get("reliable", True) else f"  UNRELIABLE: {r['unreliable']}"
    return f"{head} {r['median_s'] * 1e3:10.2f} ms (IQR {r['q1_s'] * 1e3:.2f}-{r['q3_s'] * 1e3:.2f}) peak {r['peak_mb']:8.1f} MB{flag}"


def main(argv: list[str] | None = None) -> int:
    """``python -m flt.bench.speed --worker '<config json>'``: one configuration, JSON out."""
    parser = argparse.ArgumentParser(prog="python -m flt.bench.speed", description=main.__doc__)
    parser.add_argument("--worker", required=True, metavar="JSON", help="a Config as JSON")
    args = parser.parse_args(argv)
    stdout, sys.stdout = sys.stdout, sys.stderr
    result = measure(Config(**json.loads(args.worker)))
    sys.stdout = stdout
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
