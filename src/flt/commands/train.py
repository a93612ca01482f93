"""``flt train TASK``: train a model of one of the tasks listed below
(:data:`flt.tasks.TASKS`) with any attention mechanism and encoding.

Examples::

    flt train lm --preset small                       # the Python docs corpus, a few minutes
    flt train image --attention flt --posenc none --preset smoke
    flt train molecule --preset small --attn-opt spectrum=matern --out-dir runs/mol
    flt train lm --out-dir runs/lm --resume           # continue a stopped run bit for bit
    flt train lm --out-dir runs/lm --resume --steps 2000   # extend it to 2000 steps
    flt train listops --preset long --init-from runs/listops-flt-small-s0   # start from another run's weights
    torchrun --nproc_per_node 2 -m flt.cli train lm --preset small   # 2 processes (DDP)

``KEY=VALUE`` options take JSON values (numbers, true/false, null, lists); anything that
is not valid JSON is a string. Attention options go with the mechanism, as in ``flt
compare``: ``--attention flt:num_frequencies=16:spectrum=local``, or by ``--attn-opt
KEY=VALUE``; a key set by both must have the same value (otherwise it is an error, not a
silent override). Options are checked against the mechanism's (and its spectrum's, and
the encoding's) constructor before anything is loaded: a misspelt name or a value of the
wrong type is named in the error (:mod:`flt.options`).

``--resume`` needs the options the run was started with, except ``--steps``: without it the
run continues to its own step budget (an extended one too); a larger one extends the run, a
finished one too. The learning rate of a step always follows the schedule of the step
budget in force when it runs (:meth:`flt.tasks.RunConfig.lr_at`): the steps left
follow the new budget's warm-up and cosine, so a finished run's rate rises from its final
value to the new schedule's and decays again to the floor at the new last step. The result
equals a run started with the larger budget, bit for bit, when the schedule does not depend
on the budget (``--run-opt min_lr_ratio=1``: constant after warm-up), and otherwise only if
the run stopped within its warm-up.

Ctrl-C stops training with one line: the step reached, the last checkpoint and the command
that resumes the run; the exit status is 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import sys
from typing import TYPE_CHECKING

from flt.commands import THREADS_HELP, default_threads
from flt.commands.helptext import plain
from flt.layers import ATTENTION

# The one option syntax of every command (re-exported: flt compare and tests import them here).
from flt.options import parse_assignments, parse_value
from flt.posenc import POSENC
from flt.tasks import TASKS, RunConfig, change_data, get_task, set_data_path

if TYPE_CHECKING:
    from flt.train import Preset
    from flt.train.loop import TrainingInterrupted

#: Shortcut flags for RunConfig fields.
RUN_FLAGS = {"steps": int, "batch_size": int, "lr": float, "eval_every": int, "checkpoint_every": int, "compile": bool,
             "init_from": str, "precision": str}


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """Options that define the run's configuration (shared with ``flt compare``)."""
    p.add_argument("--posenc", default="none", help=f"absolute encoding, one of {', '.join(POSENC)} (default: none)")
    p.add_argument("--preset", default="small", help=preset_help())
    p.add_argument("--steps", type=int, help="training steps")
    p.add_argument("--batch-size", type=int, help="global batch size (split over processes)")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--eval-every", type=int, help="steps between validations")
    p.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    p.add_argument("--compile", action="store_const", const=True, default=None,
                   help="train through torch.compile(model) (the first steps compile; the same as --run-opt compile=true)")
    p.add_argument("--precision", choices=("bf16", "fp32"), help="arithmetic of the training step: bfloat16 autocast "
                   "or float32 (default: bf16 on CUDA, fp32 on a CPU; --resume keeps the run's; the same as --run-opt precision=...)")
    p.add_argument("--init-from", metavar="RUN", help="start from the weights of this run or checkpoint directory "
                   "(fine-tuning, curricula; the same as --run-opt init_from=RUN)")
    p.add_argument("--attn-opt", action="append", metavar="KEY=VALUE", help="attention option (repeatable)")
    p.add_argument("--posenc-opt", action="append", metavar="KEY=VALUE", help="encoding option (repeatable)")
    p.add_argument("--model-opt", action="append", metavar="KEY=VALUE", help="model config field, e.g. depth=6 (repeatable)")
    p.add_argument("--run-opt", action="append", metavar="KEY=VALUE", help=run_option_help())
    p.add_argument("--data", metavar="PATH", help="a dataset of your own instead of the bundled one (its format: the task's "
                   "page of the manual)")
    p.add_argument("--data-opt", action="append", metavar="KEY=VALUE", help="data loader option (repeatable)")
    for flag, (tasks, help_text) in _shortcut_flags().items():
        p.add_argument(f"--{flag}", dest=f"shortcut_{flag.replace('-', '_')}", metavar="VALUE", help=f"{help_text} [{', '.join(tasks)} only]")


def preset_help() -> str:
    """The help of ``--preset``: the presets of every task, read from the registry (tasks
    with the same presets share a group)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, task in TASKS.items():
        groups.setdefault(tuple(task.presets), []).append(name)
    listed = "; ".join(f"{', '.join(tasks)}: {', '.join(presets)}" for presets, tasks in groups.items())
    return f"the task's preset, default small (flt train TASK --list-presets describes them): {listed}"


def run_option_help() -> str:
    """The help of ``--run-opt``, with every field of :class:`flt.tasks.RunConfig`."""
    return f"run option (repeatable), e.g. warmup_steps=10; KEY one of {', '.join(f.name for f in dataclasses.fields(RunConfig))}"


def _shortcut_flags() -> dict[str, tuple[list[str], str]]:
    """Every task's command-line shortcuts (:attr:`flt.tasks.base.Task.shortcuts`):
    ``{flag: (tasks that define it, help)}``; a flag of several tasks joins their helps,
    each after the tasks it is of (tasks that share a help share one entry)."""
    flags: dict[str, dict[str, list[str]]] = {}
    for name, task in TASKS.items():
        for flag, (_, _, help_text) in task.shortcuts.items():
            flags.setdefault(flag, {}).setdefault(help_text, []).append(name)
    return {flag: ([name for name, task in TASKS.items() if flag in task.shortcuts],
                   "; ".join(f"{', '.join(names)}: {text}" for text, names in helps.items()))
            for flag, helps in flags.items()}


def _apply_shortcuts(args: argparse.Namespace, model_changes: dict, data_changes: dict) -> list[str]:
    """Turn the shortcut flags given into model / data options of ``args.task``; a flag the
    task does not define, or one that contradicts its ``--model-opt`` / ``--data-opt``, is an error.
    Returns the flags that set data options (named in data errors)."""
    shortcuts = get_task(args.task).shortcuts
    data_flags = []
    for flag, (tasks, _) in _shortcut_flags().items():
        value = getattr(args, f"shortcut_{flag.replace('-', '_')}", None)
        if value is None:
            continue
        if flag not in shortcuts:
            raise ValueError(f"--{flag} is a shortcut of the {', '.join(tasks)} task(s), not of {args.task!r}")
        where, field, _ = shortcuts[flag]
        target, long_form = (model_changes, "--model-opt") if where == "model" else (data_changes, "--data-opt")
        value = parse_value(value)
        if field in target and target[field] != value:
            raise ValueError(f"--{flag} {value!r} contradicts {long_form} {field}={target[field]!r}")
        target[field] = value
        if where == "data":
            data_flags.append(f"--{flag}")
    return data_flags


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    """Options that do not change what is computed."""
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--threads", type=int, default=default_threads(), help=THREADS_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="no PNG plots")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help=f"train a model of one of the tasks ({', '.join(TASKS)})",
        description=__doc__, epilog=task_list(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", choices=list(TASKS))
    p.add_argument("--attention", metavar="NAME[:KEY=VALUE...]",
                   help=f"attention mechanism, one of {', '.join(ATTENTION)}, optionally with options as in flt compare "
                   "(flt:num_frequencies=16; default: flt)")
    p.add_argument("--arch", metavar="SEARCH.JSON", help="per-layer mechanisms chosen by flt search (its search.json), "
                   "trained from scratch; instead of --attention")
    p.add_argument("--arch-select", default="perturbation", choices=("perturbation", "magnitude"),
                   help="which choice of --arch to train (default: perturbation)")
    add_config_arguments(p)
    p.add_argument("--seed", type=int, help="seed of initialisation, data order and noise, a non-negative integer "
                   "(default: the preset's, 0; the same as --run-opt seed=N)")
    p.add_argument("--out-dir", help="run directory (default: runs/TASK-ATTENTION-PRESET-sSEED)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out-dir from its latest checkpoint, "
                   "with the same options; a larger --steps extends it (the remaining steps follow the learning-rate "
                   "schedule of the new budget)")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms (for CUDA)")
    p.add_argument("--list-presets", action="store_true",
                   help="print the task's presets (model, budget, measured run time and metric) and exit")
    add_runtime_arguments(p)
    p.set_defaults(func=run)


def preset_listing(task: str) -> str:
    """Every preset of ``task``: its docstring (command, model, run time, metric as measured)
    and the budget read from the preset itself."""
    import inspect
    import textwrap

    blocks = []
    for name, make in get_task(task).presets.items():
        run = make().run
        text = plain(inspect.cleandoc(make.__doc__ or ""))
        blocks.append(f"{name}\n{textwrap.indent(text, '  ')}\n  budget: {run.steps} steps of {run.batch_size}, "
                      f"peak lr {run.lr:g}")
    return "\n\n".join(blocks)


def task_list() -> str:
    """The registered tasks, one line each, for the end of ``--help``."""
    return "tasks:\n" + "\n".join(f"  {name:<10} {task.description}" for name, task in TASKS.items())


def preset_from_args(args: argparse.Namespace, attention: str, attention_options: dict | None = None, *, options_source: str = "--attention") -> Preset:
    """The :class:`flt.train.Preset` the options describe.

    ``attention_options`` (those of an ``--attention NAME:KEY=VALUE`` entry, named
    ``options_source`` in errors) and ``--attn-opt`` override the preset's; a key both set
    to different values is an error. The options are validated here, before any data loads.
    """
    from flt._checks import check_choice
    from flt.layers import ATTENTION
    from flt.models import replace_fields
    from flt.options import (
        ATTENTION_ARGUMENTS,
        POSENC_ARGUMENTS,
        check_attention_options,
        check_posenc_options,
        merge_options,
    )
    from flt.posenc import POSENC
    from flt.train import Preset, get_preset

    check_choice("attention", attention, ATTENTION)
    check_choice("posenc", args.posenc, POSENC)
    preset = get_preset(args.task, args.preset, attention, args.posenc)
    model_changes = parse_assignments(args.model_opt, "--model-opt")
    data_changes = parse_assignments(args.data_opt, "--data-opt")
    data_flags = _apply_shortcuts(args, model_changes, data_changes)
    for reserved in ("attention", "attention_options", "posenc", "posenc_options", "layer_attention"):
        if reserved in model_changes:
            raise ValueError(f"set {reserved} with --attention/--attn-opt/--posenc/--posenc-opt/--arch, not --model-opt")
    chosen = merge_options(attention_options or {}, parse_assignments(args.attn_opt, "--attn-opt"), entry_source=options_source)
    attn_options = get_task(args.task).attention_options(attention, preset.model.attention_options, chosen)
    posenc_options = {**preset.model.posenc_options, **parse_assignments(args.posenc_opt, "--posenc-opt")}
    # Checked here, before any data loads, and handed to the model as checked (CheckedOptions).
    attn_options = check_attention_options(attention, attn_options, reserved=ATTENTION_ARGUMENTS)
    posenc_options = check_posenc_options(args.posenc, posenc_options, reserved=POSENC_ARGUMENTS)
    model = replace_fields(preset.model, attention_options=attn_options, posenc_options=posenc_options, **model_changes)
    run_changes = parse_assignments(args.run_opt, "--run-opt")
    for name in RUN_FLAGS:  # commands that share this function may lack some flags (flt search)
        value = getattr(args, name, None)
        if value is None:
            continue
        # No silent precedence: a flag and --run-opt that disagree are refused, as for --seed.
        if name in run_changes and run_changes[name] != value:
            raise ValueError(f"--{name.replace('_', '-')} {value!r} contradicts --run-opt {name}={run_changes[name]!r}; give it once")
        run_changes[name] = value
    if run_changes.get("init_from") is not None:  # recorded absolute, so --resume works from anywhere
        run_changes["init_from"] = os.path.abspath(run_changes["init_from"])
    _merge_seed(args, run_changes)
    run_cfg = replace_fields(preset.run, **run_changes)
    flags = ["--data-opt", *data_flags]
    if args.data is not None:
        set_data_path(data_changes, args.data)
        flags.insert(1, "--data")
    data = change_data(args.task, preset.data, data_changes, "/".join(flags))
    return Preset(preset.task, model, run_cfg, data)


def _merge_seed(args: argparse.Namespace, run_changes: dict) -> None:
    """Put ``--seed`` into the ``--run-opt`` changes: given both, they must agree (a
    default never overrides an explicit ``--run-opt seed=N``), and a seed is never negative."""
    from flt.options import check_seed

    seed = getattr(args, "seed", None)
    if seed is None:
        return
    check_seed(seed, "--seed")
    if "seed" in run_changes and run_changes["seed"] != seed:
        raise ValueError(f"--seed {seed} contradicts --run-opt seed={run_changes['seed']!r}; give the seed once")
    run_changes["seed"] = seed


def launcher() -> list[str] | None:
    """The words that started this process, before flt's own arguments: ``flt``,
    ``python -m flt``, ``python -m flt.cli`` or, under ``torchrun`` on one node,
    ``torchrun --nproc_per_node=W -m flt.cli``. None under a multi-node ``torchrun``, whose
    rendezvous options a worker cannot know."""
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.dirname(script) == package and os.path.basename(script) in ("__main__.py", "cli.py"):
        # python -m flt / python -m flt.cli: the interpreter as it was typed.
        interpreter = sys.orig_argv[0]
        target = ["-m", "flt" if script.endswith("__main__.py") else "flt.cli"]
    elif os.path.basename(script) == "flt":
        # The console script; its short name when that is the one on PATH.
        found = shutil.which("flt")
        interpreter, target = None, ["flt" if found and os.path.samefile(found, script) else script]
    else:
        # main() called from Python (a notebook, a test): the module runs the same code.
        interpreter, target = sys.executable, ["-m", "flt"]
    if "LOCAL_WORLD_SIZE" in os.environ and "GROUP_WORLD_SIZE" in os.environ:
        # Set by torchrun in every worker: relaunch through torchrun, which runs Python itself.
        if os.environ["GROUP_WORLD_SIZE"] != "1":
            return None
        return ["torchrun", f"--nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}", *(target if interpreter else [script])]
    return [interpreter, *target] if interpreter else target


def interrupted_message(stop: TrainingInterrupted, argv: list[str] | None) -> str:
    """The one line ``flt train`` prints on Ctrl-C for ``stop``, a
    :class:`flt.train.loop.TrainingInterrupted`: the step reached, the last checkpoint and
    the command to resume (``argv`` with ``--resume`` added, shell-quoted)."""
    where = "interrupted " + (f"after step {stop.step}" if stop.step else "before step 1") + f" of {stop.steps}"
    if stop.checkpoint is None:
        # Without a checkpoint --resume would fail; the same command starts the run again.
        head, verb, command = f"{where}, before the first checkpoint; nothing to resume", "start again", argv
    else:
        head, verb = f"{where}; last checkpoint {stop.checkpoint}", "resume"
        command = None if argv is None else [*argv, *([] if "--resume" in argv else ["--resume"])]
    if command is None:
        return f"flt train: {head}; {verb} with the same command" + (" and --resume" if stop.checkpoint else "")
    prefix = launcher()
    if prefix is None:
        return f"flt train: {head}; {verb} with the same torchrun launch and the arguments {shlex.join(command)}"
    return f"flt train: {head}; {verb} with: {shlex.join([*prefix, *command])}"


def arch_preset(args: argparse.Namespace) -> Preset:
    """The preset of ``--arch SEARCH.JSON``: the task's preset with every layer's mechanism
    (``layer_attention``) and, when the search mixed it, the absolute encoding as the search
    chose them (:func:`flt.search.arch_fields`)."""
    from flt.models import replace_fields
    from flt.search.arch import arch_fields, read_search

    if args.attention is not None or args.attn_opt:
        raise ValueError("--arch gives every layer its mechanism; leave out --attention and --attn-opt")
    data = read_search(args.arch)
    if data["task"] != args.task:
        raise ValueError(f"--arch: the search was for task {data['task']!r}, not {args.task!r}")
    fields = arch_fields(data, args.arch_select)
    if "posenc" in fields and ((args.posenc != "none" and args.posenc != fields["posenc"]) or args.posenc_opt):
        raise ValueError(f"--arch gives the model the absolute encoding the search chose ({fields['posenc']!r}); "
                         "leave out --posenc and --posenc-opt")
    layers = fields["layer_attention"]
    preset = preset_from_args(args, layers[0]["attention"], {}, options_source="--arch")
    if len(layers) != preset.model.depth:
        raise ValueError(f"--arch: the search chose {len(layers)} layers, the model has depth {preset.model.depth}; "
                         f"pass the preset the search used, or --model-opt depth={len(layers)}")
    model = replace_fields(preset.model, **fields)
    return type(preset)(preset.task, model, preset.run, preset.data)


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        print(preset_listing(args.task))
        return 0
    import torch

    from flt.commands.outputs import check_output_dir, plots_available
    from flt.options import check_threads
    from flt.train import train
    from flt.train.loop import TrainingInterrupted

    if args.threads is not None:
        check_threads(args.threads)
        torch.set_num_threads(args.threads)
    from flt.options import parse_attention, run_label

    if args.arch is not None:
        preset, label = arch_preset(args), f"arch-{args.arch_select}"
    else:
        attention = args.attention or "flt"
        name, options = parse_attention(attention)
        preset = preset_from_args(args, name, options, options_source=f"--attention {attention.strip()}")
        label = run_label(attention)
    out_dir = args.out_dir or os.path.join("runs", f"{args.task}-{label}-{args.preset}-s{preset.run.seed}")
    check_output_dir(out_dir)
    args.out_dir = out_dir  # named in the error of a failed write
    # Checked now, not when the finished run writes its plots.
    plots = not args.no_plots and plots_available("train")
    # --resume without --steps continues to the run's own budget, an extended one too.
    steps_given = args.steps is not None or "steps" in parse_assignments(args.run_opt, "--run-opt")
    try:
        train(
            preset, out_dir, resume=args.resume, device=args.device, progress=not args.no_progress,
            plots=plots, deterministic=args.deterministic, keep_steps=args.resume and not steps_given,
        )
    except TrainingInterrupted as stop:
        # Ctrl-C: one line instead of a traceback; only the main process speaks.
        if stop.is_main:
            print(interrupted_message(stop, getattr(args, "argv", None)), file=sys.stderr, flush=True)
        return 130
    return 0
