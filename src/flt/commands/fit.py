"""``flt fit {signal,image}``: fit a coordinate network to rows of an image or to a whole
image with any positional encoding, and report train and test PSNR (docs/fit.md).

Examples::

    flt fit signal --preset smoke                                  # seconds
    flt fit signal --posenc shifted_basis:kind=gaussian:width=0.02     # the paper's 1-D setting, 8 rows
    flt fit signal --posenc shifted_basis:kind=rff:width=0.0318        # RFF, sigma = 5 cycles (w = 1/(2 pi sigma))
    flt fit signal --model linear --dim 10000 --posenc shifted_basis --sweep width=0.0003,0.002
    flt fit image --posenc shifted_basis:kind=gaussian:width=0.02 --dim 4096 --axes product
    flt fit image --image photo.jpg --mode rgb --size 128 --posenc fourier:gamma=0.05

The network trains on the even samples (even pixels of both axes for an image) and is
tested on all of them (``psnr_test``) and on the odd ones alone (``psnr_odd``). Encodings:
every encoding of ``flt train --posenc`` plus ``raw`` (the coordinates) and ``basic``
(``[sin 2 pi x, cos 2 pi x]``); their options go after the name or in ``--posenc-opt``, as in
``flt train``. ``--sweep KEY=V1,V2,...`` fits once per value of an encoding option (or of
``dim``) and draws test PSNR against it with the stable rank and distance preservation.
Results are written when the fit (or the whole sweep) ends; Ctrl-C leaves nothing behind
and exits with status 130.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from flt.commands import THREADS_HELP, default_threads

if TYPE_CHECKING:
    from flt.fit import FitConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from flt.fit.config import PRESETS, TASKS
    from flt.posenc import POSENC

    p = subparsers.add_parser(
        "fit", help="fit a coordinate MLP to rows of an image or to an image with any positional encoding",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", choices=TASKS)
    presets = list(dict.fromkeys(name for task in PRESETS.values() for name in task))
    p.add_argument("--preset", default="paper", help=f"one of {', '.join(presets)} (default: paper; docs/fit.md)")
    p.add_argument("--image", help="a shipped scikit-image image (camera, astronaut, ...) or a PNG/JPEG path (default: camera)")
    p.add_argument("--posenc", default="basic", metavar="NAME[:KEY=VALUE...]",
                   help=f"encoding: raw, basic or one of {', '.join(POSENC)}, with options (default: basic)")
    p.add_argument("--posenc-opt", action="append", metavar="KEY=VALUE", help="encoding option (repeatable)")
    p.add_argument("--dim", type=int, help="number of features D (default 256; raw and basic: fixed)")
    p.add_argument("--axes", choices=("joint", "concat", "product"), help="2-D: the encoding as defined for P = 2 "
                   "(joint, default), per-axis encodings concatenated (concat) or multiplied out (product)")
    p.add_argument("--model", choices=("mlp", "linear"), help="the depth x width ReLU MLP (default) or one linear layer")
    p.add_argument("--depth", type=int, help="MLP layers (default 4)")
    p.add_argument("--width", type=int, help="MLP width (default: the preset's)")
    p.add_argument("--output", choices=("sigmoid", "linear"), help="output activation (default: sigmoid for an image MLP, else linear)")
    p.add_argument("--rows", help="signal: number of evenly spaced rows, or a list of row indices (0,64,128)")
    p.add_argument("--size", type=int, help="resize the image to SIZE x SIZE first")
    p.add_argument("--mode", choices=("gray", "rgb"), help="image: grey (default) or colour")
    p.add_argument("--epochs", type=int, help="full-batch Adam steps")
    p.add_argument("--lr", type=float, help="Adam learning rate (default 1e-3)")
    p.add_argument("--eval-every", type=int, help="epochs between PSNR evaluations")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...", help="one fit per value of an encoding option or of dim")
    p.add_argument("--seed", type=int, default=0, help="seed of the networks and of random encodings, a non-negative integer (default: 0)")
    p.add_argument("--dtype", choices=("float32", "float64"), help="default float32")
    p.add_argument("--out-dir", help="run directory (default: runs/fit-TASK-POSENC[-sweep-KEY])")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--threads", type=int, default=default_threads(), help=THREADS_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="no PNG figures")
    p.set_defaults(func=run)


def _rows(text: str) -> int | tuple[int, ...]:
    from flt.options import parse_value

    value = parse_value(text)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    items = value if isinstance(value, list) else [parse_value(v) for v in str(text).split(",")]
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"--rows must be a count or a list of row indices (0,64,128), got {text!r}")
    return tuple(items)


def config_from_args(args: argparse.Namespace) -> FitConfig:
    """The :class:`flt.fit.FitConfig` the arguments describe (options validated here, before
    any image is read)."""
    from flt.fit.config import get_preset
    from flt.fit.encodings import check_encoding
    from flt.options import merge_options, parse_assignments, parse_attention

    name, entry = parse_attention(args.posenc, flag="--posenc")
    options = merge_options(entry, parse_assignments(args.posenc_opt, "--posenc-opt"),
                            entry_source=f"--posenc {args.posenc.strip()}", flag_source="--posenc-opt")
    check_encoding(name, options)
    changes = {"posenc": name, "posenc_options": options, "seed": args.seed}
    for field in ("image", "dim", "axes", "model", "depth", "width", "output", "size", "mode", "epochs", "lr", "eval_every", "dtype"):
        value = getattr(args, field)
        if value is not None:
            changes[field] = value
    if args.rows is not None:
        changes["rows"] = _rows(args.rows)
    return get_preset(args.task, args.preset, **changes)


def run(args: argparse.Namespace) -> int:
    import torch

    from flt.commands.outputs import check_output_dir, plots_available
    from flt.fit.run import parse_sweep, run_fit, run_sweep
    from flt.options import check_seed, check_threads, run_label

    if args.threads is not None:
        check_threads(args.threads)
        torch.set_num_threads(args.threads)
    check_seed(args.seed, "--seed")
    config = config_from_args(args)
    sweep = parse_sweep(args.sweep) if args.sweep else None
    label = run_label(args.posenc) + (f"-sweep-{run_label(sweep[0])}" if sweep else "")
    out_dir = args.out_dir or os.path.join("runs", f"fit-{args.task}-{label}")
    check_output_dir(out_dir)
    plots = not args.no_plots and plots_available("fit", extra="vision")
    kwargs = {"device": args.device, "progress": not args.no_progress, "plots": plots,
              "say": lambda text: print(text, file=sys.stdout, flush=True)}
    try:
        if sweep is None:
            run_fit(config, out_dir, **kwargs)
        else:
            run_sweep(config, *sweep, out_dir, **kwargs)
    except KeyboardInterrupt:
        # Results are written only at the end: an interrupted fit leaves no partial run.
        print(f"flt fit: interrupted; nothing was written to {out_dir}", file=sys.stderr, flush=True)
        return 130
    return 0
