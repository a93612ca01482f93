"""``flt approx``: how well FLT approximates its exact targets, measured live.

Prints the mask error ``max |a.c - f|`` per spectrum and sampler for R = 8..1024, the
FAVOR+ error at realistic query/key scales, and FLT attention's error against its exact
O(N^2) attention; saves a PNG of each f against its estimate and the numbers as JSON.

``flt approx --spatial`` measures instead a strong Gaussian bump on 2-D and 3-D point sets
(atoms, patches) against f(0), per estimator: concatenation, the multiplicative coupling
and the k-nearest-keys near set (``flt:near_neighbors=k``); writes spatial.json.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from flt.bench import write_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("approx", help="approximation error of the spectral masks and FLT attention", description=__doc__)
    p.add_argument("--out-dir", default="flt-out/approx", help="where the PNG and JSON go (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and seeds (seconds instead of a minute)")
    p.add_argument("--spatial", action="store_true",
                   help="only the strong-bump sweep on 2-D/3-D point sets per estimator (near_neighbors among them)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from flt.bench import approx
    from flt.commands.outputs import check_output_dir, plots_available

    check_output_dir(args.out_dir)
    plots = not args.spatial and plots_available("approx", silence=None)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.spatial:
        return run_spatial(args, out, t0)
    Rs = (8, 64, 512) if args.quick else (8, 32, 128, 512, 1024)
    seeds = (0,) if args.quick else (0, 1, 2)
    masks = approx.mask_errors(Rs=Rs, seeds=seeds, pos_dims=(1,) if args.quick else (1, 2))
    print("## Mask error max|a.c - f| / |f(0)| over offsets in [-32, 32] (mean over seeds)\n")
    print(approx.mask_error_pivot(masks))
    scales = approx.kernel_scale_errors(ms=(256,) if args.quick else (256, 4096))
    print("\n## FAVOR+ error of the attention matrix at realistic scales (D = 64, N = 256)\n")
    print(approx.markdown_table(scales))
    settings = ((32, 8), (256, 64)) if args.quick else ((64, 8), (256, 32), (1024, 128))
    attn = approx.attention_errors(settings, seeds=seeds)
    print("\n## FLTAttention vs its exact O(N^2) attention (N = 65, dim 32, 2 heads; relative error)\n")
    print(approx.markdown_table(attn))
    plot = out / "masks.png"
    if plots:
        approx.plot_masks(plot)
    write_json(out / "approx.json", {"masks": [asdict(r) for r in masks], "favor_scales": [asdict(r) for r in scales],
                                     "attention": [asdict(r) for r in attn]})
    saved = f"{plot} and {out / 'approx.json'}" if plots else str(out / "approx.json")
    print(f"\nsaved {saved} ({time.perf_counter() - t0:.1f} s)")
    return 0


def run_spatial(args: argparse.Namespace, out: Path, t0: float) -> int:
    from flt.bench import approx

    amplitudes = (0.0, 3.5) if args.quick else (0.0, 1.0, 2.0, 3.5, 5.0)
    settings = ((64, 16),) if args.quick else ((64, 16), (256, 32))
    rows = approx.spatial_fidelity_errors(amplitudes, settings, seeds=(0,) if args.quick else (0, 1))
    print("## A Gaussian bump f(0) exp(-|Delta|^2 / 2) on point sets of unit spacing: relative error of FLTAttention")
    print("## against its exact(), and against softmax with the bump on every pair (full_mask_error); dim 128, 2 heads\n")
    print(approx.markdown_table(rows))
    write_json(out / "spatial.json", {"spatial": [asdict(r) for r in rows]})
    print(f"\nsaved {out / 'spatial.json'} ({time.perf_counter() - t0:.1f} s)")
    return 0
