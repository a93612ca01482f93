"""``flt evaluate RUN``: a trained model's validation metric, on other random draws, with
other estimator settings, or on other data.

A model with random features computes with one draw of them; ``flt train`` ends with the
draw gap (its metric on its own draw, on fresh draws and with exact attention,
docs/math.md 5.2). This command measures the same on a saved run, and also with the
estimator changed by ``--attn-opt``: more random features or frequencies
(``num_features``, ``num_frequencies``), another frequency sampler (``sampler=qmc``),
another near set (``near_neighbors``), without retraining. It answers "how much of my
trained model's error is the estimator's, and what would a larger budget at inference
buy?". ``--data-opt`` changes the task's data options (``--data`` its files) for the
evaluation, e.g. a model trained on short sequences evaluated on long ones (length
generalisation of its relative term).

``--split test`` measures the held-out test split instead of validation (the default,
so that the numbers match ``summary.json``'s draw gap): validation picked the presets and
learning rates, so test is the split to report. ``--fidelity`` adds, for every attention
layer, the relative error ``||fast(x) - exact(x)|| / ||exact(x)||`` on the hidden states
that reach that layer on the split's batches (:mod:`flt.train.fidelity`), printed as a
table and written to ``--out``'s JSON as ``fidelity``. ``--breakdown`` (tasks that have
one: ``nbody``) splits the error on the model's own draw by what it misses, as
``breakdown`` in the JSON: for ``nbody``, by the distance of the pairs whose part of the
target the model gets wrong (:meth:`flt.tasks.nbody.NBodyTask.error_breakdown`).

Only the random draws may change shape: every learned tensor of the checkpoint must fit
the model built with the new options (an option that adds or reshapes parameters is an
error naming them), and data that changes the model's configuration (an LM's vocabulary, a
molecule model's target scaling) is refused. With no ``--attn-opt``, ``--data-opt`` or
``--data`` the fresh draws and the exact evaluation are
those of ``flt train``'s draw gap, so the numbers equal ``summary.json``'s ``draw_gap``.

Examples::

    flt evaluate runs/molecule-flt-small-s0
    flt evaluate runs/molecule-flt-small-s0 --split test --fidelity
    flt evaluate runs/molecule-flt-small-s0 --attn-opt num_frequencies=1024 --attn-opt sampler=qmc
    flt evaluate runs/listops-flt-small-s0 --data-opt min_length=500 --data-opt max_length=2000
    flt evaluate runs/nbody-s1 --split test --breakdown --data-opt eval_particles=4096 --batch-size 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import TYPE_CHECKING

from flt.commands import THREADS_HELP, default_threads

if TYPE_CHECKING:
    import torch
    from tqdm import tqdm

    from flt.models.config import TrunkConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "evaluate", help="re-evaluate a trained run on fresh draws, exactly, with other estimator settings or on other data",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="run directory (its latest checkpoint) or checkpoint directory")
    p.add_argument("--attn-opt", action="append", metavar="KEY=VALUE",
                   help="attention option changed before evaluating (repeatable), e.g. num_frequencies=1024")
    p.add_argument("--data", default=None, metavar="PATH", help="evaluate on this dataset (the task's data option path; the bundled data's options and those of the trained path, such as an LM's valid_path, are dropped)")
    p.add_argument("--data-opt", action="append", metavar="KEY=VALUE",
                   help="data loader option changed before evaluating (repeatable), e.g. ListOps' max_length=2000")
    p.add_argument("--split", default="valid", choices=("valid", "test"),
                   help="the split to measure: valid (default; as the draw gap of flt train) or test, held out "
                        "from training and from the validation that chose presets")
    p.add_argument("--fidelity", action="store_true",
                   help="also each attention layer's relative error ||fast - exact|| / ||exact|| on the hidden "
                        "states that reach it (the split's batches, --max-batches of them)")
    p.add_argument("--breakdown", action="store_true",
                   help="also split the error by what the model misses (nbody: by the pairs' distance)")
    p.add_argument("--draws", type=int, default=3, help="fresh draws to evaluate (default: %(default)s)")
    p.add_argument("--no-exact", action="store_true", help="skip the exact O(N^2) evaluation")
    p.add_argument("--exact-max-elements", type=int, default=None, metavar="E",
                   help="evaluate exactly only if one sample's attention weights (heads x N x N) fit E elements; "
                        "batches shrink to fit too (default: 2**24, 64 MiB in float32, as the draw gap of flt train)")
    p.add_argument("--batch-size", type=int, default=None, help="evaluation batch size (default: the run's)")
    p.add_argument("--max-batches", type=int, default=None,
                   help="batches to evaluate (default: as many as hold the samples of the run's draw gap, "
                        "draw_gap_batches of the run's batch size, rounded up to whole batches: --batch-size "
                        "changes memory, not the samples)")
    p.add_argument("--out", default=None, help="also write the results as JSON to this file")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--threads", type=int, default=default_threads(), help=THREADS_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (shown on a terminal's stderr: the step running and its batches)")
    p.set_defaults(func=run)


def _positive(name: str, value: int | None, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if value is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def load_with_draws(model: torch.nn.Module, state: dict, changed: dict[str, dict]) -> bool:
    """Load ``state`` into ``model``, where only the random draws may differ in shape.

    Returns True when the checkpoint's draws were all loaded, False when some draw buffer
    has a new shape (it keeps the model's fresh draw until a fixed draw replaces it). Raises
    ValueError naming the learned tensors that do not fit, and the ``changed`` options
    (``{flag: options}``, e.g. ``{"--attn-opt": {...}}``).
    """
    from flt.layers.upgrade import upgrade_state_dict

    state = upgrade_state_dict(model, state)  # a checkpoint saved before layers had cores
    # Every module's draw buffers, used or not (a near set's term keeps unused frequency draws);
    # a deterministic feature map's projection is None, in no state dict, and no draw.
    draws = {f"{name}.{b}" if name else b for name, mod in model.named_modules()
             for b in getattr(mod, "random_feature_buffers", ()) if getattr(mod, b, None) is not None}
    target = model.state_dict()
    # safetensors keeps one name of a tensor that several modules share (SchNet's filter
    # network is both ``mlp`` and ``conv.nn``): the other names load from that one.
    saved_as = {(t.data_ptr(), t.shape): k for k, t in target.items() if k in state}
    state = {**{k: state[saved_as[(t.data_ptr(), t.shape)]] for k, t in target.items()
                if k not in state and (t.data_ptr(), t.shape) in saved_as}, **state}
    missing = sorted(k for k in target if k not in state and k not in draws)
    unexpected = sorted(k for k in state if k not in target)
    misfit = sorted(k for k in state if k in target and k not in draws and state[k].shape != target[k].shape)
    if missing or unexpected or misfit:
        parts = [f"{label}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}"
                 for label, keys in (("new", missing), ("gone", unexpected), ("reshaped", misfit)) if keys]
        named = ", ".join(f"{flag} {opts}" for flag, opts in changed.items() if opts)
        if not named:
            raise ValueError(f"the checkpoint's learned tensors do not fit the model its own config builds "
                             f"({'; '.join(parts)}): a checkpoint of another version of flt?")
        raise ValueError(f"{named}: the learned tensors of the checkpoint do not fit ({'; '.join(parts)}); "
                         "only random draws (feature projections, frequency draws) may change")
    own = all(k in state and state[k].shape == target[k].shape for k in draws)
    model.load_state_dict({k: v for k, v in state.items() if k not in draws or v.shape == target[k].shape}, strict=False)
    return own


def same_value(a: object, b: object) -> bool:
    """Equal, with floats equal to 1e-9 relative: statistics a task computes from the same
    training data (a target's mean and spread) differ in their last bits with the number
    of threads that summed them."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def _check_same_model(name: str, data: dict, cfg: TrunkConfig, configured: TrunkConfig, saved_extra: dict,
                      extra: dict) -> None:
    """Refuse ``data`` on which the trained model would not compute what it was trained to:
    the task's configuration of the model (vocabulary, classes, target scaling) or its saved
    state (an LM's tokenizer) would change."""
    from flt.tasks import config_to_dict

    before, after = (json.loads(json.dumps(config_to_dict(c))) for c in (cfg, configured))
    fields = [f"{k}={before.get(k)!r} (trained) against {after.get(k)!r}" for k in sorted(set(before) | set(after))
              if not same_value(before.get(k), after.get(k))]
    fields += [f"the task's saved {k}" for k in sorted(set(saved_extra) | set(extra))
               if json.loads(json.dumps(extra.get(k))) != saved_extra.get(k)]
    if fields:
        raise ValueError(f"--data-opt/--data {data}: the {name!r} model would change on this data ({'; '.join(fields)}); "
                         "evaluate only on data the trained model fits")


#: Folders of the system's own special files, never a dataset.
_SYSTEM_DIRS = ("/dev", "/proc", "/sys")


def _check_recorded_paths(task: str, options: dict, given: dict, config: str) -> None:
    """Refuse the dataset paths that the checkpoint's ``config`` recorded (not those
    ``given`` on the command line) unless each is an existing regular file or directory
    outside the system's special folders: no hash covers ``config.json``, so a path read
    from it could name a device, a FIFO or a file of the system instead of a dataset."""
    from flt.tasks import get_task

    for key in ("path", *get_task(task).path_options):
        value = options.get(key)
        if key in given or value is None:
            continue
        if not isinstance(value, str) or not value:
            problem = "is not a path"
        elif not os.path.exists(value):
            problem = "does not exist"
        elif not (os.path.isfile(value) or os.path.isdir(value)):
            problem = "is not a regular file or directory"
        elif any(os.path.realpath(value) == d or os.path.realpath(value).startswith(d + os.sep) for d in _SYSTEM_DIRS):
            problem = "is a file of the system, not a dataset"
        else:
            continue
        raise ValueError(f"{config} records the dataset {key}={value!r}, which {problem}; "
                         f"pass --data PATH (or --data-opt {key}=PATH) to evaluate on a dataset")


def evaluate_run(path: str, attention_options: dict | None = None, *, draws: int = 3, exact: bool = True,
                 batch_size: int | None = None, max_batches: int | None = None, device: torch.device | str = "cpu",
                 exact_max_elements: int | None = None, data_options: dict | None = None, split: str = "valid",
                 fidelity: bool = False, breakdown: bool = False, bar: tqdm | None = None) -> dict:
    """The metrics of a saved run on ``split`` (``"valid"`` or ``"test"``): ``{"metric",
    "split", "options", "data", "dropped", "own", "fresh", "fresh_mean", "fresh_std",
    "exact"}`` (``own``, the checkpoint's own draw, only without changed attention options;
    ``exact`` None when skipped or too large, as for the draw gap), and with ``fidelity``
    ``"fidelity"``: :func:`flt.train.fidelity.layer_fidelity`'s rows on the model's own
    draw (or its first fresh draw when the options changed the draws' shapes); with
    ``breakdown`` ``"breakdown"``, the task's ``error_breakdown`` of the model's own draw.
    ``data_options`` change the run's data options (its validation set) for the evaluation;
    ``data`` in the result lists them, ``dropped`` the trained data options that a new path
    dropped (:func:`flt.tasks.change_data`). ``split="test"`` scores the task's test split
    (tasks with ``has_test_split``) instead of the validation split. ``bar``, a tqdm
    bar, shows the step running (loading, each draw, the exact evaluation) and counts its batches."""
    import statistics

    from safetensors.torch import load_file

    from flt.layers.draws import fixed_draw
    from flt.models import replace_fields
    from flt.options import ATTENTION_ARGUMENTS, check_attention_options
    from flt.tasks import change_data, config_from_dict, load_task
    from flt.tasks.base import has_test_split
    from flt.tasks.preset import run_config_from_dict
    from flt.train import checkpoint as ckpt_io, drawgap as DG
    from flt.train.distributed import Context, resolve_device
    from flt.train.loop import evaluate, to_device

    if split not in ("valid", "test"):
        raise ValueError(f"--split must be 'valid' or 'test', got {split!r}")
    _positive("--draws", draws, allow_zero=True)
    _positive("--batch-size", batch_size)
    _positive("--max-batches", max_batches)
    _positive("--exact-max-elements", exact_max_elements)
    dev = resolve_device(device) if isinstance(device, str) else device
    ckpt, meta = ckpt_io.locate_checkpoint(path)  # verified once; a corrupt newest one is skipped with a note
    preset, model_record = ckpt_io.saved_run(ckpt, meta)
    model_dict = json.loads(json.dumps(model_record))
    changed = dict(attention_options or {})
    if changed and model_dict.get("layer_attention"):
        raise ValueError("--attn-opt changes the model's one attention; this run chooses one per layer (layer_attention)")
    model_dict["attention_options"] = {**model_dict.get("attention_options", {}), **changed}
    cfg = config_from_dict(model_dict)
    run = run_config_from_dict(preset["run"])
    if changed:  # bad estimator options are refused before any data is loaded, and the model built from them as checked
        cfg = replace_fields(cfg, attention_options=check_attention_options(cfg.attention, cfg.attention_options,
                                                                            reserved=ATTENTION_ARGUMENTS))
    data = dict(data_options or {})
    name, trained = preset["task"], preset.get("data", {})
    options = change_data(name, trained, data, "--data-opt/--data")
    _check_recorded_paths(name, options, data, os.path.join(ckpt, ckpt_io.CONFIG_FILE))
    dropped = sorted(set(trained) - set(options))
    _stage(bar, f"loading the {name} data")
    task = load_task(name, options)
    if breakdown and not hasattr(task, "error_breakdown"):
        raise ValueError(f"--breakdown: task {name!r} has no error breakdown (nbody has one)")
    if split == "test" and not has_test_split(task):
        raise ValueError(f"--split test: task {name!r} has no test split (it defines no test_batches)")
    configured = task.configure(cfg)  # as training does: a task may size its data by the config (an LM's windows)
    if data:
        _check_same_model(name, data, cfg, configured, meta.get("extra", {}), task.extra())
    cfg = configured
    bs = batch_size or run.eval_batch_size or run.batch_size
    if changed or batch_size or data:  # new sizes are refused with their memory estimate before the model is built
        from flt.models.memory import check_task_memory

        check_task_memory(task, cfg, batch_size=bs, training=False, device=dev)
    _stage(bar, "building the model")
    model = type(task).build_model(cfg, device=dev)
    own_draw = load_with_draws(model, load_file(os.path.join(ckpt, ckpt_io.MODEL_FILE), device=str(dev)),
                               {"--attn-opt": changed})  # data that changes the config was refused above
    model.eval()
    if bar is not None:  # one model call per batch, through ExactForward too
        counter = bar

        def count(module: torch.nn.Module, args: tuple) -> None:
            counter.update()

        model.register_forward_pre_hook(count)
    ctx = Context(0, 1, dev)

    def batches_of(size: int) -> int | None:
        """``--max-batches``, or as many batches of ``size`` as hold the draw gap's samples."""
        return max_batches if max_batches is not None else DG.gap_batches(run, size)

    batches = batches_of(bs)
    split_batches = task.eval_batches if split == "valid" else task.test_batches
    metric = task.metric

    def measure(m: torch.nn.Module, size: int = bs, what: str = "") -> float:
        _stage(bar, what, batches_of(size))
        return float(evaluate(task, m, ctx, size, batches_of(size), split=split)[metric])

    rows = None
    if fidelity:  # before the fresh draws, which leave the model on the last of them
        from flt.train.fidelity import layer_fidelity

        _stage(bar, "each layer's fidelity")
        rows = layer_fidelity(model, split_batches(bs, batches, 0, 1), lambda m, b: task.eval_sums(m, to_device(b, dev)))

    parts = None
    if breakdown:  # on the own draw, before the fresh draws
        _stage(bar, "the error's breakdown", batches)
        parts = task.error_breakdown(model, (to_device(b, dev) for b in split_batches(bs, batches, 0, 1)))  # type: ignore[attr-defined]

    fresh = []
    for i in range(draws):
        with fixed_draw(model, DG.draw_seed(run.seed, f"fresh-{i}")):
            fresh.append(measure(model, what=f"fresh draw {i + 1} of {draws}"))
    exact_value = None
    if exact:
        exact_bs = DG.exact_batch_size(task, model, cfg, bs, exact_max_elements or DG.EXACT_MAX_ELEMENTS)
        if exact_bs is not None:
            exact_value = measure(DG.ExactForward(model), exact_bs, "exact attention")
    return {
        # The own draw is the trained configuration's: with changed options there is none.
        "metric": metric, "split": split, "options": changed, "data": data, "dropped": dropped, "own": measure(model, what="own draw") if own_draw and not changed else None, "fresh": fresh,
        "fresh_mean": statistics.fmean(fresh) if fresh else None,
        "fresh_std": statistics.stdev(fresh) if len(fresh) > 1 else (0.0 if fresh else None),
        "exact": exact_value, **({"fidelity": rows} if rows is not None else {}),
        **({"breakdown": parts} if parts is not None else {}),
    }


def format_breakdown(parts: dict) -> str:
    """``flt evaluate --breakdown``'s table: one row per distance band."""
    lines = [f"error by the pairs' distance (mean spacings): nmse {parts['nmse']:.4g}, "
             f"{parts['nmse_left']:.4g} left once each band's relative error is removed; a dipole field "
             f"(r_i - c).D fits {parts['dipole_share']:.1%} of the squared error",
             "  band          share of target variance   relative error (pred - y per unit of the band)"]
    for row in parts["bands"]:
        band = f"[{row['low']:g}, {'inf' if row['high'] is None else format(row['high'], 'g')})"
        lines.append(f"  {band:<13} {row['share']:>10.3f}                 {row['coef']:+.3f}")
    return "\n".join(lines)


def _stage(bar: tqdm | None, what: str, batches: int | None = None) -> None:
    """Show the step ``what`` on ``bar``, counting its ``batches`` from 0."""
    if bar is not None:
        bar.reset(total=batches)
        bar.set_description_str(f"evaluate: {what}", refresh=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from flt.commands.outputs import check_output_file, check_run_path
    from flt.options import check_threads, parse_assignments
    from flt.train.drawgap import mean_and_spread

    check_run_path(args.checkpoint)
    if args.out is not None:
        check_output_file(args.out, "--out")  # before the evaluation, not after it
    if args.threads is not None:
        check_threads(args.threads)
        torch.set_num_threads(args.threads)
    options = parse_assignments(args.attn_opt, "--attn-opt")
    data = parse_assignments(args.data_opt, "--data-opt")
    if args.data is not None:
        from flt.tasks import set_data_path

        set_data_path(data, args.data)
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        # On a terminal only (disable=None): a log keeps the result and one-line errors alone.
        bar = tqdm(desc="evaluate", unit=" batches", dynamic_ncols=True, leave=False, disable=None)
    try:
        res = evaluate_run(args.checkpoint, options, draws=args.draws, exact=not args.no_exact,
                           batch_size=args.batch_size, max_batches=args.max_batches, device=args.device,
                           exact_max_elements=args.exact_max_elements, data_options=data, split=args.split,
                           fidelity=args.fidelity, breakdown=args.breakdown, bar=bar)
    finally:
        if bar is not None:
            bar.close()
    num = lambda x: "n/a" if x is None else f"{x:.4g}"  # noqa: E731
    fresh = " ".join(num(v) for v in res["fresh"])
    on = f" on {data}" if data else ""
    if res["dropped"]:
        on += f" (the trained run's {', '.join(res['dropped'])} dropped with its dataset)"
    on += " (test split)" if args.split == "test" else ""
    print(f"{res['metric']} with {options or 'the trained options'}{on}: own draw {num(res['own'])}, "
          f"fresh draws {fresh or 'none'} (mean {mean_and_spread(res['fresh_mean'], res['fresh_std'])}), exact {num(res['exact'])}")
    if "fidelity" in res:
        from flt.train.fidelity import format_fidelity

        print(format_fidelity(res["fidelity"]))
    if "breakdown" in res:
        print(format_breakdown(res["breakdown"]))
    if args.out:
        from flt._io import atomic_write_json

        atomic_write_json(args.out, res, indent=2)
    return 0
