"""``flt bench speed --device cuda``: time and peak memory of the attention layers on one GPU.

The exact-RPE baseline a GPU user would pick (softmax with a T5 bias through
FlexAttention's ``score_mod``, compiled) next to FLT (eager, ``torch.compile``, the Triton
kernels of :mod:`flt.ops.triton`), banded FLT, Performer and SDPA without a bias, at the
``lm`` shape of :data:`flt.bench.variants.SHAPES` by default. Every row is one
``ATTENTION`` entry, named by the :data:`flt.bench.variants.VARIANTS` entry whose options
and FLOP model (:mod:`flt.bench.flops`) it shares, plus the options of :data:`GPU_ROWS`.

Per row, before any timing: the layer's fast path against its O(N^2) ``reference`` in
float64 on the GPU (forward, ``N = 300``); a row that fails is reported as such and not
timed. Per configuration ``(row, precision, N, mode)``: ``warmup`` calls (compilation
happens there), then ``repeats`` calls timed with CUDA events; median and quartiles.
``bf16`` runs the call under bfloat16 autocast (the parameters stay float32, as in
``flt train --precision bf16``), ``fp32`` without autocast. Peak memory: one more call after
``torch.cuda.reset_peak_memory_stats``, ``max_memory_allocated`` less what was allocated
before it. "x bf16 floor": the median over the time the row's model FLOPs would take at
the bfloat16 matmul throughput measured in the same process (``MATMUL_N``-cube products,
before and after the rows; the best is used).
"""

from __future__ import annotations

import copy
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import cast

import torch

from flt._io import atomic_savefig
from flt.bench.flops import floor_ratio, model_flops
from flt.bench.variants import SHAPES, VARIANTS

#: Side of the square bfloat16 matmul that measures the floor.
MATMUL_N = 8192
PRECISIONS = ("bf16", "fp32")
MODES = ("fwd", "fwd+bwd")


@dataclass(frozen=True)
class GpuRow:
    """One timed layer: a :data:`flt.bench.variants.VARIANTS` entry (its options and FLOP
    model), extra layer options, and whether it runs through ``torch.compile``."""

    variant: str
    options: tuple = ()
    compile: bool = False
    note: str = ""

    @property
    def kwargs(self) -> dict:
        return {**VARIANTS[self.variant].kwargs, **dict(self.options)}


GPU_ROWS: dict[str, GpuRow] = {
    "flt-logit eager": GpuRow("flt-logit/m256/R32", note="PyTorch ops, chunked"),
    "flt-logit compiled": GpuRow("flt-logit/m256/R32", compile=True, note="torch.compile (inductor)"),
    "flt-logit triton": GpuRow("flt-logit/m256/R32", (("backend", "triton"),), note="Triton kernel forward; backward recomputed by the PyTorch ops"),
    "flt-mult eager": GpuRow("flt-mult/m64/R8", (("check_condition", False),), note="PyTorch ops (Kronecker)"),
    "flt-mult triton": GpuRow("flt-mult/m64/R8", (("backend", "triton"), ("check_condition", False)), note="Triton kernel, one program per spectral index"),
    "flt-mult triton-split": GpuRow("flt-mult/m64/R8", (("backend", "triton-split"), ("check_condition", False)),
                                    note="feature-split kernels on values widened by c (2R (Dv + 1) columns), read with a"),
    "flt-logit band8 compiled": GpuRow("flt-logit/m256/R32/band8", compile=True, note="exact band of 17 tokens + far field"),
    "flt-logit band8 triton": GpuRow("flt-logit/m256/R32/band8", (("backend", "triton"),), note="band kernel, far-field features made in it"),
    "flt-logit band8 triton-split": GpuRow("flt-logit/m256/R32/band8", (("backend", "triton-split"),),
                                           note="far field on the feature-split kernels, exact band by the PyTorch blocks"),
    "performer compiled": GpuRow("performer/m256", compile=True),
    "performer triton": GpuRow("performer/m256", (("backend", "triton"),)),
    "flt-logit triton-split": GpuRow("flt-logit/m256/R32", (("backend", "triton-split"),),
                                     note="feature-split kernels (64 features x 64 tokens x 64 columns a program), forward and backward"),
    "performer triton-split": GpuRow("performer/m256", (("backend", "triton-split"),), note="feature-split kernels, forward and backward"),
    "sdpa": GpuRow("softmax", note="exact softmax, no bias (flash kernels)"),
    "softmax+t5 flex compiled": GpuRow("softmax+t5", (("backend", "flex"),), compile=True,
                                       note="exact softmax + T5 bias as a FlexAttention score_mod, no N x N tensor"),
}

QUICK_LENGTHS = (512,)
DEFAULT_LENGTHS = (1024, 4096, 16384)


def check_cuda() -> None:
    """Refuse to start without a CUDA device, saying why."""
    if not torch.cuda.is_available():
        built = "built without CUDA" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}, but no GPU is visible"
        raise ValueError(f"--device cuda needs a CUDA GPU: this torch {torch.__version__} is {built}. "
                         "Use --device cpu (the default) here.")


def matmul_tflops(dtype: torch.dtype, n: int = MATMUL_N, repeats: int = 10) -> float:
    """Throughput of an ``n x n x n`` matmul in ``dtype`` on the current GPU, TFLOP/s (best of ``repeats``)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    best = min(cuda_times(lambda: a @ b, warmup=2, repeats=repeats))
    return matmul_flops(n) / best / 1e12


def matmul_flops(n: int) -> float:
    """FLOPs of an ``n x n`` by ``n x n`` product (a multiply-add is 2)."""
    return 2.0 * n**3


def cuda_times(fn: Callable[[], object], *, warmup: int, repeats: int) -> list[float]:
    """Seconds per call of ``fn`` by CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def build_row(name: str, shape: str, *, causal: bool, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The layer of row ``name`` at ``shape`` (not compiled)."""
    from flt.layers.registry import ATTENTION

    row, s = GPU_ROWS[name], SHAPES[shape]
    torch.manual_seed(0)
    return ATTENTION[VARIANTS[row.variant].mechanism].from_options(s.H * s.D, s.H, causal=causal, device=device, dtype=dtype, **row.kwargs)


def check_row(name: str, shape: str, causal: bool, n: int = 300) -> str:
    """The row's forward against its O(N^2) reference in float64 on the GPU: ``""`` if they
    agree to 1e-6 relative, else what went wrong. A Triton row whose float64 kernel does
    not fit the GPU's shared memory (float64 tiles take twice the bytes) is checked in
    float32 against the same float64 reference, to 1e-4."""
    layer = build_row(name, shape, causal=causal, device="cuda", dtype=torch.float64).eval()
    with torch.no_grad():
        for p in layer.parameters():  # zero-initialised relative terms act
            p.add_(0.02 * torch.randn_like(p))
        x = torch.randn(2, n, SHAPES[shape].H * SHAPES[shape].D, device="cuda", dtype=torch.float64)
        reference = cast(Callable[[torch.Tensor], torch.Tensor], layer.reference)  # every row's layer has one
        ref, tolerance, label = reference(x), 1e-6, ""
        try:
            out = layer(x)
        except ValueError as err:
            if "shared memory" not in str(err):
                raise
            out, tolerance, label = copy.deepcopy(layer).float()(x.float()).double(), 1e-4, " (float32 kernel: float64 does not fit)"
    error = float((out - ref).norm() / ref.norm())
    return "" if error < tolerance else f"relative error {error:.2e} against the reference{label}"


def time_row(name: str, shape: str, N: int, precision: str, mode: str, causal: bool, *, warmup: int, repeats: int) -> dict:
    """One configuration: median/quartile seconds and peak MiB of a call."""
    s = SHAPES[shape]
    layer = build_row(name, shape, causal=causal, device="cuda")
    module = torch.compile(layer) if GPU_ROWS[name].compile else layer
    x = torch.randn(s.B, N, s.H * s.D, device="cuda", requires_grad=mode == "fwd+bwd")
    grad = torch.randn_like(x)

    def call() -> torch.Tensor | None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            if mode == "fwd":
                with torch.no_grad():
                    return module(x)
            out = module(x)
        out.backward(grad.to(out.dtype))
        layer.zero_grad(set_to_none=True)
        x.grad = None
        return None

    layer.train(mode == "fwd+bwd")
    times = cuda_times(call, warmup=warmup, repeats=repeats)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_s": statistics.median(times), "q1_s": q[0], "q3_s": q[2],
            "peak_mib": (torch.cuda.max_memory_allocated() - before) / 2**20}


def run(*, rows: Sequence[str] | None = None, lengths: Sequence[int] = DEFAULT_LENGTHS, precisions: Sequence[str] = PRECISIONS,
        modes: Sequence[str] = MODES, shape: str = "lm", causal: bool = True, warmup: int = 3, repeats: int = 10,
        log: Callable[[str], object] = print, on_result: Callable[[dict], object] | None = None) -> dict:
    """Measure; returns ``{"machine", "matmul_bf16_tflops", "results", ...}`` (JSON-able).
    ``on_result`` receives each result as soon as it is measured (the CLI appends it to
    ``speed-cuda.jsonl``, so a run stopped by a time limit keeps what it measured)."""
    check_cuda()
    rows = list(rows or GPU_ROWS)
    unknown = sorted(set(rows) - set(GPU_ROWS))
    if unknown:
        raise ValueError(f"unknown GPU rows {unknown}; known: {list(GPU_ROWS)}")
    start = matmul_tflops(torch.bfloat16)
    log(f"bfloat16 matmul {MATMUL_N}^3: {start:.0f} TFLOP/s")
    results = []
    for name in rows:
        row = GPU_ROWS[name]
        try:
            problem = check_row(name, shape, causal)
        except Exception as err:  # noqa: BLE001 (reported in the table: a row that cannot run here is a result too)
            problem = f"{type(err).__name__}: {err}"
        for precision in precisions:
            for mode in modes:
                for N in lengths:
                    r = {"row": name, "variant": row.variant, "precision": precision, "mode": mode, "N": N, "causal": causal,
                         "shape": shape, "flops": model_flops(row.variant, shape, N, mode, causal)}
                    if problem:
                        r.update(status="refused", note=f"reference check: {problem}")
                    else:
                        try:
                            r.update(status="ok", **time_row(name, shape, N, precision, mode, causal, warmup=warmup, repeats=repeats))
                        except torch.cuda.OutOfMemoryError:
                            r.update(status="oom", note="out of GPU memory")
                        except Exception as err:  # noqa: BLE001 (a configuration that fails here is a result; the others still run)
                            r.update(status="failed", note=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}")
                        torch.cuda.empty_cache()
                    results.append(r)
                    log(_line(r))
                    if on_result is not None:
                        on_result(r)
    end = matmul_tflops(torch.bfloat16)
    add_floors(results, max(start, end))
    return {"machine": gpu_machine(), "matmul_bf16_tflops": [start, end], "results": results, "shape": asdict(SHAPES[shape]) | {"name": shape},
            "rows": {n: asdict(GPU_ROWS[n]) for n in rows}, "warmup": warmup, "repeats": repeats}


def add_floors(results: list[dict], bf16_tflops: float) -> None:
    """Set ``x_bf16_floor`` of every timed result: its median over the time its model FLOPs
    take at ``bf16_tflops`` (None for rows without a FLOP model)."""
    for r in results:
        if r["status"] == "ok":
            r["x_bf16_floor"] = floor_ratio(r["median_s"], r["flops"], bf16_tflops * 1e3)


def gpu_machine() -> dict:
    from flt.bench.speed import machine_info

    info = machine_info(torch.get_num_threads())
    info["gpu"] = torch.cuda.get_device_name()
    info["cuda"] = torch.version.cuda
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def _line(r: dict) -> str:
    head = f"{r['row']:<26} {r['precision']} {r['mode']:<7} N={r['N']:<6}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r.get('note', '')}"
    return f"{head} {1e3 * r['median_s']:9.3f} ms  {r['peak_mib']:8.1f} MiB"


def markdown(data: dict, command: str) -> str:
    """The report: machine, floor, one table per precision and mode (rows x N)."""
    m = data["machine"]
    lines = ["# flt bench speed --device cuda", "", f"Command: `{command}`", "",
             f"GPU: {m['gpu']} (CUDA {m['cuda']}), torch {m['torch']}, triton {m['triton']}; commit {m['commit'][:12]}"
             f"{' (dirty)' if m['dirty'] else ''}; {m['date']}. bfloat16 matmul {MATMUL_N}^3: "
             + " / ".join(f"{t:.0f}" for t in data["matmul_bf16_tflops"]) + " TFLOP/s (start / end).", "",
             *([f"Shape {data['shape']['name']}: batch {data['shape']['B']}, {data['shape']['H']} heads of {data['shape']['D']}.", ""] if "shape" in data else []),
             "Cells: median ms per call (peak MiB, x bf16 floor). Causal, CUDA events after "
             f"{data['warmup']} warm-up calls, {data['repeats']} repeats.", ""]
    results = data["results"]
    lengths = sorted({r["N"] for r in results})
    for precision in sorted({r["precision"] for r in results}):
        for mode in [m for m in MODES if any(r["mode"] == m for r in results)]:
            lines += [f"## {precision}, {mode}", "", "| row | " + " | ".join(f"N = {n}" for n in lengths) + " |",
                      "|---|" + "---|" * len(lengths)]
            for name in data["rows"]:
                cells = []
                for n in lengths:
                    r = next((r for r in results if (r["row"], r["precision"], r["mode"], r["N"]) == (name, precision, mode, n)), None)
                    cells.append(_cell(r))
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
            lines.append("")
    notes = [f"- {n}: {row['note']}" for n, row in data["rows"].items() if row["note"]]
    return "\n".join([*lines, "Rows:", "", *notes, ""])


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    floor = r.get("x_bf16_floor")
    return f"{1e3 * r['median_s']:.3f} ({r['peak_mib']:.0f} MiB" + (f", {floor:.1f}x" if floor else "") + ")"


def plot(data: dict, path: str | os.PathLike) -> None:
    """Log-log median time against N per row, one panel per precision and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in data["results"] if r["status"] == "ok"]
    panels = sorted({(r["precision"], r["mode"]) for r in results})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4), squeeze=False)
    for ax, (precision, mode) in zip(axes[0], panels, strict=False):
        for name in data["rows"]:
            pts = sorted((r["N"], 1e3 * r["median_s"]) for r in results if (r["row"], r["precision"], r["mode"]) == (name, precision, mode))
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="N (tokens)", ylabel="ms per call", title=f"{precision}, {mode}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    atomic_savefig(fig, os.fspath(path), dpi=120)
    plt.close(fig)
