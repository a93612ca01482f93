"""``flt bench``: benchmarks. ``flt bench speed`` (time and memory) and ``flt bench approx``
(approximation error against the exact layers), each writing JSON, markdown and a PNG.

    flt bench speed --preset quick     # CI smoke, ~20 s: checks the runner, not the timings
    flt bench speed                    # targets' shape up to N = 16384, ~10 min on 2 cores
    flt bench speed --preset full      # N up to 65536, more variants and a batched shape, > 1 h
    flt bench approx [--quick]         # ~3 min (quick: ~30 s)
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from dataclasses import asdict
from pathlib import Path

from flt._io import atomic_write_text, dumps_json, open_append_text
from flt.bench import finite_or_null, write_json

SPEED_DESCRIPTION = """\
Time and peak memory of every attention variant of a preset, over named shapes and
sequence lengths N. Each configuration runs in its own process after a float64 check of
its fast path against its O(N^2) reference; a run whose repeats spread too widely, or
whose op-level throughput exceeds the float32 matmul ceiling measured next to it, is
flagged "unreliable" (a busy machine) rather than reported as a plain figure. Writes
speed.json, speed.md and speed.png to --out-dir.

    flt bench speed --quick            # CI smoke, ~20 s: checks the runner, not the timings
    flt bench speed --variants flt-logit/m256/R32 softmax+t5 --lengths 1024 4096
    flt bench speed --device cuda      # one GPU: FLT eager/compiled/Triton, Flex + T5, SDPA, ...

--device cuda times a fixed set of GPU rows instead (named in speed-cuda.md; CUDA events,
bf16 autocast and fp32, peak torch.cuda.max_memory_allocated, "x bf16 floor" against a
bfloat16 matmul timed in the same process); --rows, --precisions and --lengths choose
what runs, --preset quick shortens it.
"""

APPROX_DESCRIPTION = """\
Approximation error against the exact layers, in float64: the random-feature mask error
against R per spectrum and sampler, FLT's output error against m and R per coupling, and
strong local masks per estimator. Writes approx.md, approx.json and approx.png to --out-dir.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="speed/memory and approximation benchmarks", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bench = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    # Choices are checked in run_speed: importing the registries here would import torch
    # and slow down `flt --help`.
    s = bench.add_parser("speed", help="time and peak memory of every attention variant over named shapes",
                         description=SPEED_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--preset", default="default", help="quick, default or full (default: %(default)s)")
    s.add_argument("--quick", action="store_const", const="quick", dest="preset", help="same as --preset quick")
    s.add_argument("--variants", nargs="+", metavar="VARIANT", help="only these variants of the preset (names as in speed.md)")
    s.add_argument("--lengths", nargs="+", type=int, metavar="N", help="override the preset's sequence lengths")
    s.add_argument("--shapes", nargs="+", metavar="SHAPE", help="override the preset's named shapes (tiny, lm, batch)")
    s.add_argument("--threads", type=int, help="torch threads per worker (default: all CPUs)")
    s.add_argument("--allocator", default="keep",
                   help="keep: time with freed memory kept by malloc for reuse; default: glibc's thresholds "
                        "(default: %(default)s)")
    s.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: the process-per-configuration CPU runner; cuda: the GPU rows (default: %(default)s)")
    s.add_argument("--rows", nargs="+", metavar="ROW", help="--device cuda: only these rows (names as in speed-cuda.md; an unknown name is refused with the list)")
    s.add_argument("--precisions", nargs="+", choices=("bf16", "fp32"), help="--device cuda: bf16 (autocast) and/or fp32 (default: both)")
    s.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), help="--device cuda: forward and/or forward+backward (default: both)")
    s.add_argument("--out-dir", default="flt-out/bench", help="where speed.json/.md/.png go (default: %(default)s)")
    s.set_defaults(func=run_speed)

    a = bench.add_parser("approx", help="mask error vs R per spectrum and sampler, FLT error vs m and R per coupling",
                         description=APPROX_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--quick", action="store_true", help="fewer sizes and seeds")
    a.add_argument("--out-dir", default="flt-out/bench", help="where approx.json/.md/.png go (default: %(default)s)")
    a.set_defaults(func=run_approx)


def run_speed(args: argparse.Namespace) -> int:
    from flt.bench import report, speed
    from flt.commands.outputs import check_output_dir, plots_available

    if args.device == "cuda":
        return run_speed_cuda(args)
    for flag in ("rows", "precisions", "modes"):
        if getattr(args, flag, None):
            raise ValueError(f"--{flag} applies to --device cuda only")

    if args.preset not in speed.PRESETS:
        raise ValueError(f"--preset must be one of {sorted(speed.PRESETS)}, got {args.preset!r}")
    unknown = sorted(set(args.variants or ()) - set(speed.VARIANTS))
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {sorted(speed.VARIANTS)}")
    unknown = sorted(set(args.shapes or ()) - set(speed.SHAPES))
    if unknown:
        raise ValueError(f"unknown shapes {unknown}; known: {sorted(speed.SHAPES)}")
    preset = speed.PRESETS[args.preset]
    if args.lengths and any(n < 1 for n in args.lengths):
        raise ValueError(f"--lengths must be positive, got {args.lengths}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be positive, got {args.threads}")
    speed.check_allocator("--allocator", args.allocator)
    check_output_dir(args.out_dir)
    plots = plots_available("bench speed", extra="bench", silence=None)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data = speed.run(preset, variants=args.variants, lengths=args.lengths, shapes=args.shapes, threads=args.threads,
                     allocator=args.allocator)
    data["command"] = " ".join(
        ["flt bench speed --preset", args.preset]
        + (["--variants", *args.variants] if args.variants else [])
        + (["--lengths", *map(str, args.lengths)] if args.lengths else [])
        + (["--shapes", *args.shapes] if args.shapes else [])
        + ([f"--threads {args.threads}"] if args.threads else [])
        + ([f"--allocator {args.allocator}"] if args.allocator != "keep" else [])
    )
    data["elapsed_s"] = time.perf_counter() - t0
    write_json(out / "speed.json", data)
    text = report.markdown(data, data["command"])
    atomic_write_text(str(out / "speed.md"), text)
    if plots:
        report.plot(data, out / "speed.png")
    print()
    print(text)
    png = f", {out / 'speed.png'}" if plots else ""
    print(f"saved {out / 'speed.json'}, {out / 'speed.md'}{png} ({data['elapsed_s']:.0f} s)")
    return 0


def cuda_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of :func:`flt.bench.gpu.run` from ``flt bench speed --device cuda``
    arguments; refuses the CPU runner's options."""
    from flt.bench import gpu

    for flag, default in (("variants", None), ("threads", None), ("allocator", "keep")):
        if getattr(args, flag) != default:
            raise ValueError(f"--{flag} applies to the CPU runner; with --device cuda choose rows with --rows")
    if args.preset not in ("quick", "default"):
        raise ValueError(f"--device cuda takes --preset quick or default, got {args.preset!r}")
    unknown = sorted(set(args.rows or ()) - set(gpu.GPU_ROWS))
    if unknown:
        raise ValueError(f"unknown --rows {unknown}; known: {list(gpu.GPU_ROWS)}")
    if args.lengths and any(n < 1 for n in args.lengths):
        raise ValueError(f"--lengths must be positive, got {args.lengths}")
    if args.shapes and (len(args.shapes) != 1 or args.shapes[0] not in gpu.SHAPES):
        raise ValueError(f"--device cuda takes one --shapes entry of {sorted(gpu.SHAPES)}, got {args.shapes}")
    quick = args.preset == "quick"
    return {
        "rows": args.rows or list(gpu.GPU_ROWS),
        "lengths": tuple(args.lengths or (gpu.QUICK_LENGTHS if quick else gpu.DEFAULT_LENGTHS)),
        "precisions": tuple(args.precisions or gpu.PRECISIONS),
        "modes": tuple(args.modes or gpu.MODES),
        "shape": (args.shapes or ["lm"])[0],
        "warmup": 2 if quick else 3,
        "repeats": 3 if quick else 10,
    }


def run_speed_cuda(args: argparse.Namespace) -> int:
    from flt.bench import gpu
    from flt.commands.outputs import check_output_dir, plots_available

    options = cuda_options(args)
    gpu.check_cuda()
    check_output_dir(args.out_dir)
    plots = plots_available("bench speed", extra="bench", silence=None)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    partial_path = str(out / "speed-cuda.jsonl")
    if os.path.lexists(partial_path) and (os.path.islink(partial_path) or not os.path.isdir(partial_path)):
        # An earlier run's file is replaced, as the atomic writes replace theirs: its name
        # is removed (a link, not what it points to; one name of a hard-linked file).
        os.unlink(partial_path)
    with open_append_text(partial_path, "partial results file") as partial:
        def keep(result: dict) -> None:  # each result on disk as it comes: a stopped run keeps what it measured
            partial.write(dumps_json(finite_or_null(result), partial_path) + "\n")
            partial.flush()

        data = gpu.run(**options, on_result=keep)
    data["command"] = " ".join(["flt bench speed --device cuda --preset", args.preset, "--rows", *map(shlex.quote, options["rows"]),
                                "--lengths", *map(str, options["lengths"]), "--precisions", *options["precisions"],
                                "--modes", *options["modes"], "--shapes", options["shape"]])
    data["elapsed_s"] = time.perf_counter() - t0
    write_json(out / "speed-cuda.json", data)
    text = gpu.markdown(data, data["command"])
    atomic_write_text(str(out / "speed-cuda.md"), text)
    if plots:
        gpu.plot(data, out / "speed-cuda.png")
    print()
    print(text)
    print(f"saved {out / 'speed-cuda.json'}, {out / 'speed-cuda.md'} ({data['elapsed_s']:.0f} s)")
    return 0


def run_approx(args: argparse.Namespace) -> int:
    import torch

    from flt.bench import approx, convergence
    from flt.commands.outputs import check_output_dir, plots_available

    check_output_dir(args.out_dir)
    plots = plots_available("bench approx", extra="bench", silence=None)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    quick = args.quick
    Rs = (8, 32, 128) if quick else (8, 16, 32, 64, 128, 256, 512, 1024)
    seeds = (0,) if quick else (0, 1, 2)
    masks = approx.mask_errors(Rs=Rs, seeds=seeds, pos_dims=(1, 2))
    ms = (16, 64, 256) if quick else (16, 32, 64, 128, 256, 512, 1024, 2048)
    sweeps = convergence.attention_error_sweeps(
        ms, (4, 16, 64) if quick else (4, 8, 16, 32, 64, 128, 256), fixed_R=32 if quick else 128, fixed_m=256 if quick else 2048,
        seeds=(0,) if quick else (0, 1),
    )
    fidelity = approx.fidelity_errors(
        amplitudes=(0.0, 1.0, 3.5) if quick else (0.0, 1.0, 2.0, 3.5, 5.0),
        settings=((64, 16),) if quick else ((64, 16), (256, 32)), seeds=(0,) if quick else (0, 1),
    )
    lines = [
        "# flt bench approx", "",
        f"Command: `flt bench approx{' --quick' if quick else ''}`. float64, live against the exact references.", "",
        "## Mask error max|a.c - f| / |f(0)| over offsets in [-32, 32] (mean over seeds), per spectrum, sampler and P", "",
        approx.mask_error_pivot(masks), "",
        f"## FLT vs its exact O(N^2) layer (`FLTAttention.exact`), relative output error vs m (R = {sweeps['vs_m'][0].R})", "",
        approx.markdown_table(sweeps["vs_m"]), "",
        f"## ... vs R (m = {sweeps['vs_R'][0].m})", "",
        approx.markdown_table(sweeps["vs_R"]), "",
        "## Strong local masks: relative output error vs f(0), per estimator (N = 256, D = 64, default qk-norm)", "",
        approx.markdown_table(fidelity), "",
    ]
    text = "\n".join(lines)
    atomic_write_text(str(out / "approx.md"), text)
    write_json(out / "approx.json", {"masks": [asdict(r) for r in masks], "fidelity": [asdict(r) for r in fidelity],
                                     **{k: [asdict(r) for r in v] for k, v in sweeps.items()}})
    if plots:
        convergence.plot_convergence(masks, sweeps, out / "approx.png")
    print(text)
    png = f", {out / 'approx.png'}" if plots else ""
    print(f"saved {out / 'approx.md'}, {out / 'approx.json'}{png} ({time.perf_counter() - t0:.0f} s)")
    return 0
