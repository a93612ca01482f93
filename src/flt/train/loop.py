"""The training loop shared by every task of :data:`flt.tasks.TASKS`.

One function, :func:`train`, runs a :class:`flt.train.Preset` in a run directory:

* seeds Python, numpy and torch from ``run.seed``; batches are a function of
  ``(seed, step)`` (:mod:`flt.tasks.base`), so nothing depends on a sampler's state;
* one or several processes (``torchrun``; DistributedDataParallel, ``gloo`` on CPU,
  ``nccl`` on CUDA), each taking its slice of the same global batch;
* a tqdm progress bar with the live loss and throughput, ``metrics.jsonl``, periodic
  validation, atomic checkpoints (:mod:`flt.train.checkpoint`), PNG plots;
* ``resume=True`` restores weights, optimizer, every RNG (per process) and the step, and
  continues bit for bit where the last checkpoint of a stopped or killed run left off;
  with a larger ``run.steps`` it extends the run (see :func:`train` for the learning rate);
* Ctrl-C raises :class:`TrainingInterrupted` (a ``KeyboardInterrupt``) carrying the step
  reached and the checkpoint a resume would start from.

Files in the run directory: ``run.json`` (configuration and environment),
``metrics.jsonl``, ``checkpoints/``, ``summary.json``, ``learning_curves.png``,
``rpe_functions.png`` (models with a spectrum).
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from flt._io import atomic_write_text
from flt.models.config import config_to_dict
from flt.train import distributed as D
from flt.train import drawgap as DG
from flt.train.checkpoint import (
    CheckpointError,
    find_checkpoint,
    has_checkpoint,
    load_trainer_state,
    load_weights,
    read_checkpoint_config,
    save_checkpoint,
)
from flt.train.config import Preset, preset_differences, preset_from_dict, preset_to_dict
from flt.train.metrics import MetricsLogger
from flt.tasks import Task, load_task


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (``KeyboardInterrupt``) during :func:`train`.

    Attributes:
        out_dir: the run directory.
        step: the last step completed (the checkpoint's step if none was trained yet).
        steps: the run's step budget.
        checkpoint: the checkpoint ``resume=True`` would start from, or None if there is none.
        is_main: whether this is the main process (the one that reports).
    """

    def __init__(self, out_dir: str, step: int, steps: int, checkpoint: str | None, is_main: bool):
        super().__init__(f"training in {out_dir} interrupted after step {step} of {steps}")
        self.out_dir, self.step, self.steps, self.checkpoint, self.is_main = out_dir, step, steps, checkpoint, is_main


@dataclass
class _Progress:
    """How far :func:`_train` got, for :class:`TrainingInterrupted`."""

    step: int = 0


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's global generator and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay the weights of linear, convolution and embedding layers; nothing else.

    Norms, biases, learned temperatures and spectral parameters (amplitudes, log lengths)
    are left alone: decaying a log length to 0 would pull every length scale towards 1.
    """
    decay = set()
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            decay.add(id(module.weight))
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if id(p) in decay], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0},
    ]


def _module_generators(model: nn.Module) -> dict[str, torch.Generator]:
    """Private ``torch.Generator`` attributes of submodules (e.g. feature redraws)."""
    found = {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Generator):
                found[f"{name}.{attr}" if name else attr] = value
    return found


def rng_state(model: nn.Module) -> dict[str, Any]:
    """Every random state the run depends on, as tensors and plain containers."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "torch": torch.get_rng_state(),
        "modules": {k: g.get_state() for k, g in _module_generators(model).items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], model: nn.Module) -> None:
    """Inverse of :func:`rng_state`."""
    random.setstate(_to_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    gens = _module_generators(model)
    if set(gens) != set(state["modules"]):
        raise ValueError(f"the checkpoint's module generators {sorted(state['modules'])} differ from the model's {sorted(gens)}")
    for k, g in gens.items():
        g.set_state(state["modules"][k])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def peak_memory_mib(device: torch.device) -> tuple[float, str]:
    """``(MiB, what)``: CUDA peak allocated memory, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), "cpu_max_rss"


class _Printer:
    """Prints on the main process only, through tqdm when a bar is showing."""

    def __init__(self, ctx: D.Context, bar):
        self.ctx, self.bar = ctx, bar

    def __call__(self, text: str) -> None:
        if not self.ctx.is_main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)


def _format(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, ctx: D.Context, batch_size: int, max_batches: int | None) -> dict[str, float]:
    """Validation metrics over this process's shard, summed over processes."""
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    try:
        for batch in task.eval_batches(batch_size, max_batches, ctx.rank, ctx.world):
            for k, v in task.eval_sums(model, _to_device(batch, ctx.device)).items():
                sums[k] = sums.get(k, 0.0) + v
    finally:
        model.train(was_training)
    keys = sorted(sums) if sums else []
    # Every process must take part in the reduction, with the same keys in the same order.
    gathered = D.all_gather(ctx, keys)
    keys = sorted(set().union(*gathered))
    totals = D.all_reduce_sum(ctx, [sums.get(k, 0.0) for k in keys])
    return task.metrics(dict(zip(keys, totals)))


def _to_device(batch, device):
    if hasattr(batch, "to") and not isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(b, device) for b in batch)
    return batch.to(device)


def train(
    preset: Preset,
    out_dir: str,
    *,
    resume: bool = False,
    device: str = "auto",
    progress: bool = True,
    plots: bool = True,
    deterministic: bool = False,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Train ``preset`` in ``out_dir`` and return the summary (also in ``summary.json``).

    Args:
        resume: continue from the latest checkpoint in ``out_dir`` (without
            ``checkpoints/latest``: the newest complete ``step-*`` checkpoint, with a
            message). The configuration must be the one saved there, except that
            ``run.steps`` may grow: that extends the run (a finished one too) to the new
            budget. The learning rate of every step is ``run.lr_at(step)`` for the
            configuration in force when the step runs, i.e. a function of the step and the
            *current* step budget: steps up to the checkpoint keep the rate they were
            trained with, and the remaining ones follow the schedule of the new budget
            (with the default cosine decay, a finished run restarts from its final rate at
            the new schedule's rate for the next step, then decays to the floor at the new
            last step). An extended run therefore equals, bit for bit, a run started with
            the larger budget exactly when both budgets give every step up to the
            checkpoint the same rate: always with ``min_lr_ratio=1`` (constant after
            warm-up), otherwise only while the checkpoint is inside the warm-up. A smaller
            ``run.steps`` is refused. Without ``resume``, ``out_dir`` must not hold a run yet.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``; under ``torchrun`` each process takes
            ``cuda:LOCAL_RANK``.
        progress, plots: show the tqdm bar; write the PNG plots.
        deterministic: ``torch.use_deterministic_algorithms(True)`` (needed for bitwise
            reproducibility on CUDA; CPU kernels used here are deterministic already).
        on_step: called with the step number after each step (and its checkpoint).

    Raises:
        TrainingInterrupted: on Ctrl-C (``KeyboardInterrupt``), in every process; the
            checkpoints written so far are intact and ``resume=True`` continues the run.
    """
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    ctx = D.setup(device)
    reached = _Progress()
    try:
        return _train(preset, out_dir, ctx, resume=resume, progress=progress, plots=plots, on_step=on_step, reached=reached)
    except KeyboardInterrupt as e:
        raise TrainingInterrupted(out_dir, reached.step, preset.run.steps, _resumable(out_dir), ctx.is_main) from e
    finally:
        D.teardown(ctx)


def _resumable(out_dir: str) -> str | None:
    """The checkpoint ``resume=True`` would start from, or None."""
    try:
        return find_checkpoint(out_dir, report=lambda message: None)
    except (FileNotFoundError, CheckpointError):
        return None


def _check_resume(saved: Preset, preset: Preset, step: int, out_dir: str) -> None:
    """Refuse to resume the run ``saved`` (checkpoint at ``step``) with ``preset`` unless
    they differ at most by a larger step budget."""
    diffs = [d for d in preset_differences(saved, preset) if d != "run.steps"]
    if diffs:
        raise ValueError(f"--resume needs the configuration of the run in {out_dir}; these differ: {', '.join(diffs)}"
                         " (only --steps may change, to extend the run)")
    if preset.run.steps < saved.run.steps:
        raise ValueError(f"--steps {preset.run.steps} is below the budget of the run in {out_dir} "
                         f"({saved.run.steps} steps, checkpoint at step {step}); --resume can extend a run, not shorten it: "
                         f"pass --steps {saved.run.steps} to continue it, or more to extend it")


def _train(preset: Preset, out_dir: str, ctx: D.Context, *, resume, progress, plots, on_step, reached: _Progress) -> dict[str, Any]:
    wall_start = time.perf_counter()
    run = preset.run
    ckpt = meta = saved = None
    notes: list[str] = []
    if resume:
        ckpt = find_checkpoint(out_dir, report=notes.append)
        meta = read_checkpoint_config(ckpt)
        saved = preset_from_dict(meta["preset"])
        reached.step = int(meta["step"])
        _check_resume(saved, preset, reached.step, out_dir)
        if not D.all_equal(ctx, os.path.abspath(ckpt)):
            raise ValueError(f"the processes found different checkpoints to resume from in {out_dir}")
    elif has_checkpoint(out_dir):
        raise ValueError(f"{out_dir} already holds a run; pass --resume to continue it or choose another --out-dir")
    if not D.all_equal(ctx, json.dumps(preset_to_dict(preset), sort_keys=True)):
        raise ValueError("the processes were given different configurations")

    seed_everything(run.seed)
    # The main process loads first so that a generated dataset is cached once.
    if not ctx.is_main:
        D.barrier(ctx)
    task = load_task(preset.task, preset.data)
    if ctx.is_main:
        D.barrier(ctx)
    model_cfg = task.configure(preset.model)
    # Model initialisation depends on the seed alone, not on what data loading consumed.
    seed_everything(run.seed)
    model = task.build_model(model_cfg, device=ctx.device)
    optimizer = torch.optim.AdamW(parameter_groups(model, run.weight_decay), lr=run.lr, betas=(0.9, 0.95))
    start = 0
    if ckpt is not None:
        load_weights(ckpt, model)
        state = load_trainer_state(ckpt)
        if state["world_size"] != ctx.world:
            raise ValueError(f"the checkpoint was written by {state['world_size']} processes; resume with the same number (got {ctx.world})")
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"][ctx.rank], model)
        start = int(meta["step"])
        if start == saved.run.steps < run.steps:
            _restore_training_draw(model, run, start)
    else:
        # Dropout and other training noise differ between processes, as they would
        # between the samples of one big batch.
        torch.manual_seed(run.seed + 7919 * ctx.rank)
    ddp = DistributedDataParallel(model) if ctx.world > 1 else model
    n_params = sum(p.numel() for p in model.parameters())

    logger = None
    if ctx.is_main:
        os.makedirs(out_dir, exist_ok=True)
        atomic_write_text(os.path.join(out_dir, "run.json"), json.dumps({
            "preset": preset_to_dict(preset), "model": config_to_dict(model_cfg), "extra": task.extra(),
            "parameters": n_params, "world_size": ctx.world, "device": str(ctx.device),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        }, indent=2, sort_keys=True))
        logger = MetricsLogger(os.path.join(out_dir, "metrics.jsonl"), resume_step=start if ckpt is not None else None)

    bar = None
    try:
        if ctx.is_main and progress:
            # tqdm is an optional dependency (flt[train]); --no-progress runs without it.
            from tqdm.auto import tqdm

            bar = tqdm(total=run.steps, initial=start, desc=f"{preset.task} {model_cfg.attention}", dynamic_ncols=True, unit="step")
        say = _Printer(ctx, bar)
        for note in notes:
            say(note)
        if saved is not None and run.steps > saved.run.steps:
            say(f"extending the run from {saved.run.steps} to {run.steps} steps; the learning rate of steps "
                f"{start + 1}..{run.steps} follows the {run.steps}-step schedule")
        say(f"{preset.task}: {model_cfg.attention} + {model_cfg.posenc}, {n_params:,} parameters, "
            f"{ctx.world} process(es) on {ctx.device}, steps {start + 1}..{run.steps}")
        last_valid, step_times = _loop(preset, out_dir, ctx, task, model, ddp, optimizer, model_cfg, logger, bar, say, start, on_step, reached)
    finally:
        # A Ctrl-C must not leave the bar's line unfinished under the message that follows,
        # nor the last metrics unflushed.
        if bar is not None:
            bar.close()
        if logger is not None:
            logger.close()
    return _finish(preset, out_dir, ctx, task, model, model_cfg, say, last_valid, step_times, n_params, plots, wall_start)


def _restore_training_draw(model: nn.Module, run, start: int) -> None:
    """Before extending a run from its final checkpoint (step ``start``): put the model back
    on the training draw of step ``start``. The final checkpoint holds the evaluation draw
    (:func:`flt.train.drawgap.evaluation_draw` with ``keep=True``); an uninterrupted longer
    run would still be on the draw of the last redraw step, which :func:`DG.redraw_for_step`
    recomputes from ``(seed, step)``. Nothing to do when step ``start + 1`` redraws anyway."""
    if DG.redraws_enabled(model, run) and start % run.redraw_interval:
        last_redraw = 1 + (start - 1) // run.redraw_interval * run.redraw_interval
        DG.redraw_for_step(model, run, last_redraw)


def _loop(preset, out_dir, ctx, task, model, ddp, optimizer, model_cfg, logger, bar, say, start, on_step, reached):
    """Steps ``start + 1 .. run.steps``; returns ``(last validation metrics, step times)``."""
    run = preset.run
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)

    eval_bs = run.eval_batch_size or run.batch_size
    step_times: list[float] = []
    window, window_steps, window_items, window_time = 0.0, 0, 0, 0.0
    last_valid: dict[str, float] = {}
    model.train()
    for step in range(start + 1, run.steps + 1):
        t0 = time.perf_counter()
        lr = run.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = _to_device(task.train_batch(step, run.batch_size, run.seed, ctx.rank, ctx.world), ctx.device)
        DG.redraw_for_step(model, run, step)  # draw-robust training (flt.train.drawgap)
        loss = task.loss(ddp, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the training loss is {float(loss)} at step {step}; lower --lr or check the data")
        loss.backward()
        if run.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
        dt = time.perf_counter() - t0
        step_times.append(dt)
        window += loss_value
        window_steps += 1
        window_items += task.batch_items(batch) * ctx.world
        window_time += dt

        if step % run.log_every == 0 or step == run.steps:
            mean_loss = D.all_reduce_sum(ctx, [window / window_steps])[0] / ctx.world
            rate = window_items / max(window_time, 1e-9)
            if logger is not None:
                logger.log(step, "train", loss=mean_loss, lr=lr, **{f"{task.unit}_per_s": rate})
            window, window_steps, window_items, window_time = 0.0, 0, 0, 0.0
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"loss {loss_value:.4f}  {task.batch_items(batch) * ctx.world / dt:,.0f} {task.unit}/s")

        if step % run.eval_every == 0 or step == run.steps:
            # The final evaluation covers the whole validation split; periodic ones may be capped.
            # All on one fixed draw; the final checkpoint keeps it (flt.train.drawgap).
            with DG.evaluation_draw(model, run, keep=step == run.steps):
                last_valid = evaluate(task, model, ctx, eval_bs, None if step == run.steps else run.eval_batches)
            if logger is not None:
                logger.log(step, "valid", **last_valid)
            say(f"step {step}: valid {_format(last_valid)}")
        if step % run.checkpoint_every == 0 or step == run.steps:
            _checkpoint(out_dir, step, model, optimizer, preset, model_cfg, task, ctx, run.keep_checkpoints)
        reached.step = step
        if on_step is not None:
            on_step(step)
    return last_valid, step_times


def _finish(preset, out_dir, ctx, task, model, model_cfg, say, last_valid, step_times, n_params, plots, wall_start) -> dict[str, Any]:
    """Final evaluation if none ran, draw gap, ``summary.json``, plots and the last lines."""
    run = preset.run
    eval_bs = run.eval_batch_size or run.batch_size
    if not last_valid:
        # Resumed at the final step: nothing left to train, report the final weights.
        with DG.evaluation_draw(model, run):
            last_valid = evaluate(task, model, ctx, eval_bs, None)
    # --- draw gap (flt.train.drawgap): own draw vs fresh draws vs exact attention --------
    gap = DG.draw_gap(task, model, model_cfg, run, lambda m, bs: evaluate(task, m, ctx, bs, run.draw_gap_batches), eval_bs,
                      own=last_valid if run.draw_gap_batches is None else None)
    # ------------------------------------------------------------------------------------
    memory, memory_kind = peak_memory_mib(ctx.device)
    summary = {
        "task": preset.task, "attention": model_cfg.attention, "posenc": model_cfg.posenc, "seed": run.seed,
        "steps": run.steps, "metric": task.metric, "final": last_valid, "parameters": n_params,
        "time_per_step_s": statistics.median(step_times[1:] or step_times) if step_times else None,
        "train_time_s": sum(step_times), "wall_time_s": time.perf_counter() - wall_start,
        "peak_memory_mib": memory, "memory_kind": memory_kind, "world_size": ctx.world, "device": str(ctx.device),
    }
    peaks = D.all_gather(ctx, memory)
    summary["peak_memory_mib"] = max(peaks)
    if gap is not None:
        summary["draw_gap"] = gap
        say(DG.format_draw_gap(gap, task.metric))
    if ctx.is_main:
        atomic_write_text(os.path.join(out_dir, "summary.json"), json.dumps(summary, indent=2, sort_keys=True))
        saved = _plots(out_dir, task, model, model_cfg) if plots else []
        report = task.report(model, ctx.device)
        if report:
            say(report)
        say(f"done: {_format(last_valid)}; {summary['time_per_step_s'] or 0:.3f} s/step; run directory {out_dir}"
            + (f" (plots: {', '.join(saved)})" if saved else ""))
    # Leave together: a process that tears the group down while another still writes its
    # plots can abort inside gloo.
    D.barrier(ctx)
    return summary


def _checkpoint(out_dir, step, model, optimizer, preset, model_cfg, task, ctx, keep) -> None:
    rngs = D.all_gather(ctx, rng_state(model))
    if ctx.is_main:
        state = {"step": step, "optimizer": optimizer.state_dict(), "rng": rngs, "world_size": ctx.world}
        config = {"preset": preset_to_dict(preset), "model": config_to_dict(model_cfg), "extra": task.extra()}
        save_checkpoint(out_dir, step, model, config=config, trainer_state=state, keep=keep)
    D.barrier(ctx)


def _plots(out_dir: str, task: Task, model: nn.Module, model_cfg) -> list[str]:
    """Write the PNG plots; returns their file names."""
    # matplotlib is an optional dependency, imported only when plots are wanted.
    from flt.train.plots import plot_learning_curves, plot_rpe_functions

    title = f"{task.name}: {model_cfg.attention} + {model_cfg.posenc}"
    plot_learning_curves(os.path.join(out_dir, "metrics.jsonl"), os.path.join(out_dir, "learning_curves.png"), metric=task.metric, title=title, task=task.name)
    saved = ["learning_curves.png"]
    extent, causal = task.rpe_extent(model_cfg)
    if plot_rpe_functions(model, os.path.join(out_dir, "rpe_functions.png"), extent=extent, causal=causal, task=task.name) is not None:
        saved.append("rpe_functions.png")
    return saved
