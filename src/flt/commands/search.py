"""``flt search TASK --candidates a,b,c``: choose the attention mechanism of every layer.

A supernet (every layer's attention a mixed op ``sum_o softmax(alpha)_o o(x)`` over the
candidates) trains for the preset's steps: its weights on the training split, ``alpha`` on
a held-out part of it (first order). Then, in a random order drawn from the seed, each
layer is decided by perturbation (DARTS-PT): every candidate is removed in turn and the
held-out metric measured; the one whose removal hurts most is kept, the layer becomes
one-hot, and the supernet is fine-tuned for ``--tune-steps`` steps. The magnitude choice
(``argmax alpha``) is recorded alongside.

Candidates take options as ``flt train --attention`` does, on top of the task's defaults
for the name: ``flt,flt:spectrum=local,performer,softmax:relative_bias=t5``. Every
candidate is built once at the model's width before any data loads: an entry that does
not construct is an error naming it.

Output in ``--out-dir`` (default ``runs/search-TASK-PRESET-sSEED``): ``search.json`` (per
layer: softmax(alpha), the held-out metric with each candidate removed, the chosen
candidate and the magnitude choice; with ``--posenc-candidates`` the same for the model's
absolute positional encoding, one more slot), ``search.png``, ``checkpoints/``. ``--resume``
continues a stopped search. ``flt train TASK --arch OUT/search.json`` then trains the
selected architecture from scratch (``--arch-select magnitude`` the magnitude one).

Examples::

    flt search image --candidates flt,performer,softmax --preset smoke
    flt search lm --candidates flt,performer,softmax --preset small --out-dir runs/search-lm
    flt search molecule --candidates flt,performer,softmax --posenc-candidates none,fourier --preset smoke
    flt search graph --candidates flt,performer,softmax --preset smoke
    flt train lm --arch runs/search-lm/search.json --preset small
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import TYPE_CHECKING

from flt.commands import THREADS_HELP, default_threads
from flt.commands.train import preset_from_args, run_option_help
from flt.tasks import holdout_tasks

if TYPE_CHECKING:
    from flt.search import SearchConfig
    from flt.train import Preset


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "search", help="choose the attention mechanism of every layer (DARTS-PT perturbation selection)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The tasks that declare a held-out part of their training split.
    p.add_argument("task", choices=holdout_tasks())
    p.add_argument("--candidates", required=True, metavar="A,B[:KEY=VALUE...],...",
                   help="comma-separated mechanisms every layer chooses from (at least two)")
    p.add_argument("--posenc-candidates", metavar="E,F[:KEY=VALUE...],...",
                   help="also choose the model's absolute positional encoding among these (at least two, e.g. none,sinusoidal,fourier; "
                        "default: the preset's encoding, not searched)")
    p.add_argument("--preset", default="small", help="smoke or small (the model and budget of one training run; default: small)")
    p.add_argument("--steps", type=int, help="supernet training steps (default: the preset's)")
    p.add_argument("--batch-size", type=int, help="batch size")
    p.add_argument("--lr", type=float, help="peak learning rate of the weights")
    p.add_argument("--eval-every", type=int, help="steps between progress lines (held-out metric and alpha)")
    p.add_argument("--checkpoint-every", type=int, help="supernet steps between checkpoints (and one after every decision)")
    p.add_argument("--tune-steps", type=int, help="fine-tuning steps after each decision (default: steps / 20, at least 1)")
    p.add_argument("--alpha-lr", type=float, default=3e-3, help="Adam learning rate of alpha (default: 3e-3)")
    p.add_argument("--fixed-alpha", action="store_true", help="keep alpha uniform (the supernet mixes every candidate equally)")
    p.add_argument("--holdout", type=float, default=0.2, help="fraction of the training split held out for alpha and selection (default: 0.2)")
    p.add_argument("--model-opt", action="append", metavar="KEY=VALUE", help="model config field (repeatable)")
    p.add_argument("--run-opt", action="append", metavar="KEY=VALUE", help=run_option_help())
    p.add_argument("--data-opt", action="append", metavar="KEY=VALUE", help="data loader option (repeatable)")
    p.add_argument("--seed", type=int, help="seed of initialisation, data order, noise and the order of decisions, a non-negative "
                   "integer (default: the preset's, 0; the same as --run-opt seed=N)")
    p.add_argument("--out-dir", help="search directory (default: runs/search-TASK-PRESET-sSEED)")
    p.add_argument("--resume", action="store_true", help="continue the search in --out-dir from its latest checkpoint, with the same options")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--threads", type=int, default=default_threads(), help=THREADS_HELP)
    p.add_argument("--no-plots", action="store_true", help="no search.png")
    p.set_defaults(func=run)


def build(args: argparse.Namespace) -> tuple[Preset, SearchConfig]:
    """``(preset, SearchConfig)`` from the arguments, every candidate checked (no data loaded)."""
    from flt.search import SearchConfig, check_search, parse_candidates, parse_posenc_candidates
    from flt.tasks import get_task

    if args.preset not in ("smoke", "small"):
        raise ValueError(f"--preset must be smoke or small for flt search, got {args.preset!r}")
    candidates = parse_candidates(args.candidates, get_task(args.task))
    posenc = getattr(args, "posenc_candidates", None)
    posenc_candidates = parse_posenc_candidates(posenc, get_task(args.task)) if posenc is not None else []
    # The preset's model and run (built for the first candidate; the supernet replaces every attention).
    ns = argparse.Namespace(task=args.task, posenc="none", preset=args.preset, steps=args.steps, batch_size=args.batch_size,
                            lr=args.lr, eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                            attn_opt=None, posenc_opt=None, model_opt=args.model_opt, run_opt=args.run_opt,
                            data=None, data_opt=args.data_opt, seed=args.seed)
    preset = preset_from_args(ns, candidates[0].name, {})
    if preset.run.init_from is not None:
        raise ValueError("flt search trains its supernet from a random initialisation: init_from is not supported "
                         "(train the chosen architecture with flt train --arch ... --init-from instead)")
    tune = args.tune_steps if args.tune_steps is not None else max(1, preset.run.steps // 20)
    config = SearchConfig(tuple(candidates), tune_steps=tune, alpha_lr=args.alpha_lr, fixed_alpha=args.fixed_alpha,
                          holdout=args.holdout, posenc_candidates=tuple(posenc_candidates))
    check_search(preset, config)
    return preset, config


def run(args: argparse.Namespace) -> int:
    import torch

    from flt.commands.outputs import check_output_dir, plots_available
    from flt.options import check_threads
    from flt.search import SearchInterrupted, search

    if args.threads is not None:
        check_threads(args.threads)
        torch.set_num_threads(args.threads)
    preset, config = build(args)
    out_dir = args.out_dir or os.path.join("runs", f"search-{args.task}-{args.preset}-s{preset.run.seed}")
    check_output_dir(out_dir)
    args.out_dir = out_dir  # named in the error of a failed write
    plots = not args.no_plots and plots_available("search")
    try:
        search(preset, config, out_dir, resume=args.resume, device=args.device, plots=plots,
               say=lambda text: print(text, flush=True))
    except SearchInterrupted as stop:
        argv = getattr(args, "argv", None)
        if stop.checkpoint is None:
            print(f"flt search: interrupted after step {stop.step}, before the first checkpoint; start again", file=sys.stderr)
        else:
            again = shlex.join(["flt", *argv, *([] if "--resume" in argv else ["--resume"])]) if argv else "the same command and --resume"
            print(f"flt search: interrupted after step {stop.step}; last checkpoint {stop.checkpoint}; resume with: {again}",
                  file=sys.stderr)
        return 130
    return 0
