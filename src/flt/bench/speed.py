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
   repeats. Allocator (``--allocator``, every variant alike): ``keep`` (default), freed
   memory kept for reuse (:func:`flt.perf.keep_freed_memory`), so that large temporaries
   are not mapped and page-faulted afresh on every call; ``default``, glibc's own
   thresholds.
3. **Peak memory.** Resident set size of one extra, untimed call made after the timed
   ones: glibc's ``mmap`` threshold is fixed at 128 KiB and retained heap memory released
   first (so resident memory follows the live tensors instead of what the allocator keeps
   for reuse, which depends on allocation order), the high-water mark is reset
   (``/proc/self/clear_refs``), and ``peak = VmHWM - VmRSS`` before the call. Calls longer than ``long_call_s`` (the exact
   layers at large N) get no extra call: their peak is the high-water mark over the timed
   calls, whose tensors are far above any ``mmap`` threshold anyway. ``peak_method`` in
   the JSON says which; the timed calls' own peak is kept as ``peak_timed_mb``.
4. **Reliability.** A busy machine makes timings wrong, not just noisy. Every result
   carries ``spread = (max - min) / median`` of its repeats and ``reliable``: False (with
   the reason in ``unreliable``) when the spread exceeds ``SPREAD_LIMIT``. Every run
   also times the float32 matmul ceiling in the same process just before and just after
   its timed calls (``ceiling_gflops``: the best of those), against which
   :mod:`flt.bench.flops` turns its time into "x floor"; :mod:`flt.bench.report`
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
import dataclasses
import json
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from flt.bench.measure import (  # noqa: F401
    CHECK_SIZE,
    CHECK_TOLERANCE,
    SPREAD_LIMIT,
    Config,
    _child,
    check_allocator,
    measure,
    timing_flags,
)
from flt.bench.variants import PRESETS, SHAPES, VARIANTS, Preset, Run, Shape, Variant  # noqa: F401

# -- runner side -------------------------------------------------------------------------


def mem_available_bytes() -> int:
    text = Path("/proc/meminfo").read_text()
    found = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    if found is None:
        raise RuntimeError("/proc/meminfo has no MemAvailable line")
    return int(found.group(1)) * 1024


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


def plan(preset: Preset, variants: Sequence[str] | None = None, lengths: Sequence[int] | None = None,
         shapes: Sequence[str] | None = None) -> list[tuple[str, str, bool, str, int]]:
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


def run(preset: Preset, *, variants: Sequence[str] | None = None, lengths: Sequence[int] | None = None,
        shapes: Sequence[str] | None = None, threads: int | None = None, allocator: str = "keep",
        log: Callable[[str], object] = print) -> dict:
    """Measure a preset; returns ``{"machine", "preset", "matmul", "matmul_kronecker", "results"}``
    (the matmul probes: at the start, and just before the op-level Kronecker runs)."""
    from flt.bench.peers import peer_status

    check_allocator("allocator", allocator)
    threads = threads or os.cpu_count() or 1
    machine = machine_info(threads)
    machine["allocator"] = allocator
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

    common: dict[str, Any] = {"threads": threads, "warmup": preset.warmup, "repeats": preset.repeats,
                              "min_repeats": preset.min_repeats, "budget_s": preset.budget_s, "allocator": allocator}

    def probe() -> dict:
        """This machine's float32 matmul throughput now (the machine may be shared)."""
        r = launch(Config("matmul", "-", preset.matmul_n, "matmul", False, **common), 600)
        if r["status"] == "ok":
            r["gflops"] = 2 * preset.matmul_n**3 / r["median_s"] / 1e9
            r["gflops_best"] = 2 * preset.matmul_n**3 / r["min_s"] / 1e9
            log(f"float32 matmul {preset.matmul_n}^3: {r['gflops']:.1f} GFLOP/s median ({r['gflops_best']:.1f} best)")
        return r

    matmul, matmul_kronecker = probe(), None
    results: list[dict] = []
    last: dict[tuple, dict] = {}
    if shapes:
        preset = dataclasses.replace(preset, shapes=tuple(shapes))
    for variant, shape, causal, mode, N in plan(preset, variants, lengths):
        spec = VARIANTS[variant]
        if spec.kind == "op" and matmul_kronecker is None:
            matmul_kronecker = probe()  # measured next to the op-level runs it is compared with
        key = (variant, shape, causal, mode)
        # Every run is compared with the matmul ceiling ("x floor"): measured in the same process, around it.
        cfg = Config(variant, shape, N, mode, causal, **common, ceiling_n=preset.matmul_n)
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
            elif call_s > preset.long_call_s and not spec.compile:  # a compiled variant's first call compiles
                # Allocations this large are mmap-ed whatever the threshold: the timed calls' peak is clean.
                cfg = dataclasses.replace(cfg, warmup=0, repeats=preset.min_repeats_long, min_repeats=preset.min_repeats_long, memory_call=False)
        if note:
            result = {"config": asdict(cfg), "status": "skipped", "note": note}
        else:
            cfg = dataclasses.replace(cfg, mem_limit_bytes=int(budget))
            expected = 60 if guess is None else guess[1] * (cfg.warmup + cfg.repeats) * 3
            result = launch(cfg, timeout=max(120.0, expected + 60) + (600.0 if spec.compile else 0.0))
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
