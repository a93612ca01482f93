"""``flt train {lm,image,molecule}``: train a model with any attention mechanism and encoding.

Examples::

    flt train lm --preset small                       # the Python docs corpus, a few minutes
    flt train image --attention flt --posenc none --preset smoke
    flt train molecule --preset small --attn-opt spectrum=matern --out-dir runs/mol
    flt train lm --out-dir runs/lm --resume           # continue a stopped run bit for bit
    torchrun --nproc_per_node 2 -m flt.cli train lm --preset small   # 2 processes (DDP)

``KEY=VALUE`` options take JSON values (numbers, true/false, null, lists); anything that
is not valid JSON is a string.
"""

from __future__ import annotations

import argparse
import json
import os

TASK_NAMES = ("lm", "image", "molecule")
PRESET_NAMES = ("smoke", "small", "base")
#: Shortcut flags for RunConfig fields.
RUN_FLAGS = {"steps": int, "batch_size": int, "lr": float, "eval_every": int, "checkpoint_every": int}


def parse_value(text: str):
    """A JSON value, or the text itself when it is not valid JSON (``local`` -> ``"local"``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_assignments(items: list[str] | None, flag: str) -> dict:
    """``["a=1", "b=x"] -> {"a": 1, "b": "x"}``."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        out[key.strip()] = parse_value(value)
    return out


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """Options that define the run's configuration (shared with ``flt compare``)."""
    p.add_argument("--posenc", default="none", help="absolute encoding, a name in flt.posenc.POSENC (default: none)")
    p.add_argument("--preset", default="small", help=f"one of {', '.join(PRESET_NAMES)} (default: small)")
    p.add_argument("--steps", type=int, help="training steps")
    p.add_argument("--batch-size", type=int, help="global batch size (split over processes)")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--eval-every", type=int, help="steps between validations")
    p.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    p.add_argument("--attn-opt", action="append", metavar="KEY=VALUE", help="attention option (repeatable)")
    p.add_argument("--posenc-opt", action="append", metavar="KEY=VALUE", help="encoding option (repeatable)")
    p.add_argument("--model-opt", action="append", metavar="KEY=VALUE", help="model config field, e.g. depth=6 (repeatable)")
    p.add_argument("--run-opt", action="append", metavar="KEY=VALUE", help="RunConfig field, e.g. warmup_steps=10 (repeatable)")
    p.add_argument("--data", metavar="PATH", help="a real dataset instead of the bundled one (see flt.train.tasks)")
    p.add_argument("--data-opt", action="append", metavar="KEY=VALUE", help="data loader option (repeatable)")


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    """Options that do not change what is computed."""
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="no PNG plots")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a language model, image classifier or molecule regressor",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", choices=TASK_NAMES)
    p.add_argument("--attention", default="flt", help="attention mechanism, a name in flt.ATTENTION (default: flt)")
    add_config_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation, data order and noise (default: 0)")
    p.add_argument("--out-dir", help="run directory (default: runs/TASK-ATTENTION-PRESET-sSEED)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out-dir from its latest checkpoint")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms (for CUDA)")
    add_runtime_arguments(p)
    p.set_defaults(func=run)


def preset_from_args(args, attention: str, attention_options: dict | None = None):
    """The :class:`flt.train.Preset` the options describe."""
    from flt._checks import check_choice
    from flt.layers import ATTENTION
    from flt.models import replace_fields
    from flt.posenc import POSENC
    from flt.train import Preset, get_preset

    check_choice("attention", attention, ATTENTION)
    check_choice("posenc", args.posenc, POSENC)
    preset = get_preset(args.task, args.preset, attention, args.posenc)
    model_changes = parse_assignments(args.model_opt, "--model-opt")
    for reserved in ("attention", "attention_options", "posenc", "posenc_options"):
        if reserved in model_changes:
            raise ValueError(f"set {reserved} with --attention/--attn-opt/--posenc/--posenc-opt, not --model-opt")
    model = replace_fields(
        preset.model,
        attention_options={**preset.model.attention_options, **(attention_options or {}), **parse_assignments(args.attn_opt, "--attn-opt")},
        posenc_options={**preset.model.posenc_options, **parse_assignments(args.posenc_opt, "--posenc-opt")},
        **model_changes,
    )
    run_changes = parse_assignments(args.run_opt, "--run-opt")
    for name in RUN_FLAGS:
        if getattr(args, name) is not None:
            run_changes[name] = getattr(args, name)
    if getattr(args, "seed", None) is not None:
        run_changes["seed"] = args.seed
    run_cfg = replace_fields(preset.run, **run_changes)
    data = {**preset.data, **parse_assignments(args.data_opt, "--data-opt")}
    if args.data is not None:
        # A real dataset replaces the bundled one and its size options.
        data = {k: v for k, v in data.items() if k not in ("max_bytes", "num_samples", "relax_steps")}
        data["path"] = args.data
    return Preset(preset.task, model, run_cfg, data)


def run(args) -> int:
    import torch

    from flt.train import train

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    preset = preset_from_args(args, args.attention)
    out_dir = args.out_dir or os.path.join("runs", f"{args.task}-{args.attention}-{args.preset}-s{args.seed}")
    train(
        preset, out_dir, resume=args.resume, device=args.device, progress=not args.no_progress,
        plots=not args.no_plots, deterministic=args.deterministic,
    )
    return 0
