"""``flt compare TASK --attention a,b,c``: train mechanisms with the same budget and seeds.

Each entry of ``--attention`` is a mechanism's name, optionally followed by its
own options: ``flt:coupling=multiplicative:spectrum=gaussian``, the syntax of ``flt train
--attention`` (:mod:`flt.options`); ``--attn-opt`` applies to every entry, and a key that
both set to different values is an error. Every entry's options are checked before the
first run starts. Every (entry, seed) pair
is one ``flt train`` run in a fresh Python process, one after the other, with the same
preset, steps, batch and seed, in ``OUT/ENTRY/seed-S``. Then a table is printed (and
saved as ``OUT/compare.md`` and ``compare.json``) with the final validation metric
(mean and sample standard deviation over seeds), the median time per training step
and the peak memory, and ``OUT/compare.png`` plots the validation metric per step.

Peak memory: on CPU, the peak resident set size of the training process
(``getrusage(RUSAGE_SELF).ru_maxrss``; it includes the interpreter, torch and the
dataset, a baseline of a few hundred MiB common to all rows, so compare differences);
on CUDA, ``torch.cuda.max_memory_allocated``. One process per run makes both clean.

Ctrl-C stops the comparison with one line that names the run it stopped in and the
command that continues it: the same command with ``--resume``, which keeps every finished
run (one with a ``summary.json`` and the configuration asked for), continues an unfinished
one from its last checkpoint (``flt train --resume``) and runs the others; a larger
``--steps`` extends the finished runs too.

Example::

    flt compare lm --attention flt,flt:coupling=multiplicative --seeds 0,1 --preset smoke
    flt compare lm --attention flt,flt:coupling=multiplicative --seeds 0,1 --preset smoke --resume   # after Ctrl-C
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

from flt._io import atomic_write_json, atomic_write_text, open_own_file
from flt.commands.train import (
    add_config_arguments,
    add_runtime_arguments,
    preset_from_args,
    task_list,
)
from flt.layers import ATTENTION
from flt.options import parse_attention_list
from flt.tasks import TASKS, get_task


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare", help="train several attention mechanisms with the same budget and compare",
        description=__doc__, epilog=task_list(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", choices=list(TASKS))
    p.add_argument("--attention", required=True,
                   help=f"comma-separated entries NAME[:KEY=VALUE...], each NAME one of {', '.join(ATTENTION)}")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    p.add_argument("--out-dir", help="directory for the runs and the table (default: runs/compare-TASK-PRESET)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted comparison in --out-dir with the same options: a run with a summary.json "
                        "and the same configuration is kept, an unfinished one continues from its last checkpoint "
                        "(flt train --resume), the others run")
    add_config_arguments(p)
    add_runtime_arguments(p)
    p.set_defaults(func=run)


def parse_entries(text: str) -> list[tuple[str, str, dict]]:
    """``"a,b:k=v"`` -> ``[(label, name, options)]``; labels must be distinct
    (:func:`flt.options.parse_attention_list`, the parser of ``flt train --attention`` too)."""
    return parse_attention_list(text)


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must list distinct non-negative integers, got {text!r}")
    return seeds


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)


def _child_argv(args: argparse.Namespace, name: str, options: dict, seed: int, out_dir: str) -> list[str]:
    # The entry in the one --attention syntax (flt.options), so that the child checks it as flt train does.
    entry = name + "".join(f":{key}={json.dumps(value)}" for key, value in options.items())
    argv = [sys.executable, "-m", "flt.cli", "train", args.task, "--attention", entry, "--seed", str(seed),
            "--out-dir", out_dir, "--preset", args.preset, "--posenc", args.posenc, "--no-progress",
            "--device", args.device]
    for flag in ("steps", "batch_size", "lr", "eval_every", "checkpoint_every", "threads", "data", "init_from", "precision"):
        value = getattr(args, flag, None)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), os.path.abspath(value) if flag == "init_from" else str(value)]
    if getattr(args, "compile", None):
        argv.append("--compile")
    for flag in ("attn_opt", "posenc_opt", "model_opt", "run_opt", "data_opt"):
        for item in getattr(args, flag) or []:
            argv += ["--" + flag.replace("_", "-"), item]
    if args.no_plots:
        argv.append("--no-plots")
    return argv


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _table(rows: list[dict], metric: str, extra: list[str]) -> str:
    head = ["attention", "seeds", f"{metric} (mean ± std)", *extra, "ms/step", "peak MiB", "params"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if r["failed"]:
            cells = [r["label"], f"{len(r['seeds'])}", f"FAILED: {r['failed']}", *["" for _ in extra], "", "", ""]
        else:
            mean, std = r["metric"]
            cells = [r["label"], str(len(r["seeds"])), f"{mean:.4g}" + (f" ± {std:.2g}" if std is not None else ""),
                     *[f"{r['extra'][k]:.4g}" for k in extra], f"{1000 * r['time_per_step_s']:.1f}",
                     f"{r['peak_memory_mib']:.0f}", f"{r['parameters']:,}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_state(run_dir: str, expected: dict) -> str:
    """What ``--resume`` does with one (entry, seed) run directory: ``new`` (none yet: run
    it), ``finished`` (its ``summary.json`` is there and its ``run.json`` holds the
    configuration asked for: keep it), ``resume`` (a checkpoint: ``flt train --resume``,
    which also extends a finished run to more steps or refuses other changed options) or
    ``restart`` (no checkpoint yet: train it from the start)."""
    from flt.train.checkpoint import has_checkpoint

    if not os.path.exists(run_dir):
        return "new"
    if os.path.isfile(os.path.join(run_dir, "summary.json")):
        from flt._io import read_json_file

        try:
            record = read_json_file(os.path.join(run_dir, "run.json"))
        except (OSError, ValueError):
            record = None
        # A run.json of another shape says nothing about the run: train it again or resume it.
        saved = record.get("preset") if isinstance(record, dict) else None
        if not isinstance(saved, dict) or not isinstance(saved.get("run"), dict):
            saved = None
        own = (saved or {}).get("run", {}).get("precision")
        if own is not None and expected["run"].get("precision") is None:  # unset: the run's own (decided by its device)
            expected = {**expected, "run": {**expected["run"], "precision": own}}
        if json.dumps(saved, sort_keys=True) == json.dumps(expected, sort_keys=True):
            return "finished"
    return "resume" if has_checkpoint(run_dir) else "restart"


def _expected_preset(args: argparse.Namespace, name: str, options: dict, seed: int) -> dict:
    """The preset record (``run.json``'s ``preset``) that ``flt train`` would save for one run."""
    from flt.tasks.preset import preset_to_dict

    one = argparse.Namespace(**{**vars(args), "seed": seed})
    return json.loads(json.dumps(preset_to_dict(preset_from_args(one, name, options))))


def _check_arguments(args: argparse.Namespace, entries: list[tuple[str, str, dict]]) -> None:
    """Everything that can be refused before the first run: every entry's options, the
    seeds and the output directory."""
    from flt.commands.outputs import check_output_dir
    from flt.options import parse_assignments

    for label, name, options in entries:
        # Every entry's options (with --attn-opt, the preset's and the encoding's) before the first run.
        preset_from_args(args, name, options, options_source=f"--attention entry {label!r}")
    if "seed" in parse_assignments(args.run_opt, "--run-opt"):
        raise ValueError("--run-opt seed=...: flt compare gives every run its seed from --seeds")
    check_output_dir(_out_dir(args))


def _out_dir(args: argparse.Namespace) -> str:
    return args.out_dir or os.path.join("runs", f"compare-{args.task}-{args.preset}")


def _train_one(args: argparse.Namespace, label: str, name: str, options: dict, seed: int, run_dir: str, state: str,
               metric: str, extra: list[str]) -> tuple[dict, list] | str:
    """Train (or continue) one run in its own process; returns ``(summary, curve)``, or why it failed."""
    argv = _child_argv(args, name, options, seed, run_dir) + (["--resume"] if state == "resume" else [])
    os.makedirs(run_dir, exist_ok=True)
    # Appended: a resumed run keeps the log of its first part. Never through a link.
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if state == "resume" else os.O_TRUNC)
    with os.fdopen(open_own_file(os.path.join(run_dir, "train.log"), flags, "log file"), "w", encoding="utf-8") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        with open(os.path.join(run_dir, "train.log"), encoding="utf-8", errors="replace") as log:
            lines = [ln for ln in log.read().splitlines() if ln.strip()]
        if proc.returncode < 0:
            return f"seed {seed} killed by signal {-proc.returncode}"
        return f"seed {seed}: " + (lines[-1] if lines else f"exit code {proc.returncode}")
    return _read_run(run_dir, metric, extra)


def _read_run(run_dir: str, metric: str, extra: list[str]) -> tuple[dict, list]:
    """A finished run's ``summary.json`` and its validation curve ``[(step, metric)]``;
    a summary without what the table reads is refused, naming the file."""
    from flt._io import read_json_file
    from flt.train.metrics import read_metrics

    path = os.path.join(run_dir, "summary.json")
    summary = read_json_file(path)
    final = summary.get("final") if isinstance(summary, dict) else None
    if not isinstance(final, dict) or not all(_is_number(final.get(k)) for k in (metric, *extra)) \
            or not all(k in summary for k in _SUMMARY_KEYS):
        raise ValueError(f"{path} is not a summary of a finished flt train run (an object with {', '.join(_SUMMARY_KEYS)} "
                         f"and numbers {', '.join(f'final.{k}' for k in (metric, *extra))})")
    curve = [(r["step"], r[metric]) for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))
             if r["split"] == "valid" and _is_number(r.get(metric))]
    return summary, curve


#: What the comparison table reads from every run's ``summary.json``, besides ``final``.
_SUMMARY_KEYS = ("task", "final", "time_per_step_s", "peak_memory_mib", "memory_kind", "parameters")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _interrupted_message(args: argparse.Namespace, label: str, seed: int, out: str) -> str:
    """The one line on Ctrl-C: where it stopped and the command that continues."""
    import shlex

    from flt.commands.train import launcher

    head = f"flt compare: interrupted during {label} seed {seed}; the finished runs in {out} are kept"
    argv = getattr(args, "argv", None)
    prefix = launcher()
    if argv is None or prefix is None:
        return f"{head}; continue with the same command and --resume"
    return f"{head}; continue with: {shlex.join([*prefix, *argv, *([] if '--resume' in argv else ['--resume'])])}"


def run(args: argparse.Namespace) -> int:
    from flt.commands.outputs import plots_available
    from flt.train.plots import plot_comparison

    entries = parse_entries(args.attention)
    seeds = parse_seeds(args.seeds)
    _check_arguments(args, entries)
    out = _out_dir(args)
    task_cls = get_task(args.task)
    metric, extra = task_cls.metric, list(task_cls.compare_metrics)
    states = {}
    for label, name, options in entries:
        for seed in seeds:
            path = os.path.join(out, _slug(label), f"seed-{seed}")
            if not args.resume and os.path.exists(path):
                raise ValueError(f"{path} already exists; pass --resume to continue the comparison or choose another --out-dir")
            states[label, seed] = _run_state(path, _expected_preset(args, name, options, seed)) if args.resume else "new"
    if not args.no_plots and not plots_available("compare"):
        args.no_plots = True  # the runs make no plots either
    os.makedirs(out, exist_ok=True)

    rows: list[dict] = []
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    total = len(entries) * len(seeds)
    done = 0
    for label, name, options in entries:
        summaries, curves[label], failed = [], [], ""
        for seed in seeds:
            done += 1
            run_dir = os.path.join(out, _slug(label), f"seed-{seed}")
            t0 = time.perf_counter()
            state = states[label, seed]
            print(f"[{done}/{total}] {label} seed {seed} ...", end=" ", flush=True)
            if state == "finished":
                summary, curve = _read_run(run_dir, metric, extra)
                print(f"finished earlier: {metric} {summary['final'][metric]:.4g}")
            else:
                if state != "new":
                    print(f"({'continuing from its last checkpoint' if state == 'resume' else 'starting again'})", end=" ", flush=True)
                try:
                    outcome = _train_one(args, label, name, options, seed, run_dir, state, metric, extra)
                except KeyboardInterrupt:
                    print(flush=True)
                    print(_interrupted_message(args, label, seed, out), file=sys.stderr, flush=True)
                    return 130
                if isinstance(outcome, str):
                    failed = outcome
                    print(f"failed ({failed}); log in {run_dir}/train.log")
                    break
                summary, curve = outcome
                print(f"{metric} {summary['final'][metric]:.4g} in {time.perf_counter() - t0:.1f} s")
            summaries.append(summary)
            curves[label].append(curve)
        row = {"label": label, "attention": name, "options": options, "seeds": seeds[: len(summaries)], "failed": failed}
        if not failed:
            row.update(
                metric=_mean_std([s["final"][metric] for s in summaries]),
                extra={k: _mean_std([s["final"][k] for s in summaries])[0] for k in extra},
                time_per_step_s=sorted(s["time_per_step_s"] for s in summaries)[len(summaries) // 2],
                peak_memory_mib=max(s["peak_memory_mib"] for s in summaries),
                memory_kind=summaries[0]["memory_kind"], parameters=summaries[0]["parameters"],
                runs=summaries,
            )
        rows.append(row)

    table = _table(rows, metric, extra)
    better = "higher" if task_cls.higher_is_better else "lower"
    note = (f"{args.task}, preset {args.preset}, seeds {','.join(map(str, seeds))}; {metric}: {better} is better; "
            f"ms/step: median training step; peak MiB: {rows[0].get('memory_kind', 'peak memory')} of the training process")
    print()
    print(table)
    print(note)
    atomic_write_text(os.path.join(out, "compare.md"), table + "\n\n" + note + "\n")
    atomic_write_json(os.path.join(out, "compare.json"), {"task": args.task, "preset": args.preset, "metric": metric, "seeds": seeds, "rows": rows},
                      indent=2)
    # plot_comparison returns None (nothing written) when no run reached a validation: an
    # empty plot says nothing.
    if not args.no_plots and plot_comparison(curves, os.path.join(out, "compare.png"), metric=metric, title=f"{args.task} ({args.preset})", task=args.task) is None:
        why = "every run failed" if all(r["failed"] for r in rows) else "no run logged a validation"
        print(f"no compare.png: {why} (see the table and each run's train.log)")
    print(f"results in {out}")
    return 1 if any(r["failed"] for r in rows) else 0
