"""The training loop shared by every task of :data:`flt.tasks.TASKS`.

One function, :func:`train`, runs a :class:`flt.train.Preset` in a run directory:

* seeds Python, numpy and torch from ``run.seed``; batches are a function of
  ``(seed, step)`` (:mod:`flt.tasks.base`), so nothing depends on a sampler's state;
* one or several processes (``torchrun``; DistributedDataParallel, ``gloo`` on CPU,
  ``nccl`` on CUDA), each taking its slice of the same global batch;
* a tqdm progress bar with the live loss and throughput, ``metrics.jsonl``, periodic
  validation, atomic checkpoints (:mod:`flt.train.checkpoint`), PNG plots;
* ``resume=True`` restores weights, optimizer, every RNG (per process), the step and the
  partly filled logging window, and continues bit for bit where the last checkpoint of a
  stopped or killed run left off (in every file, timings aside: see :func:`train`); with a
  larger ``run.steps`` it extends the run (see :func:`train` for the learning rate);
* one trainer per run directory: ``RUN/.lock`` (:mod:`flt.train.lock`) is held from before
  anything in the directory is read until the end, and what a killed trainer left half
  written is cleared once it is held (:func:`flt.train.checkpoint.remove_leftovers`);
* a non-finite training loss raises :class:`TrainingDiverged`, naming the step and the
  last (intact) checkpoint;
* Ctrl-C raises :class:`TrainingInterrupted` (a ``KeyboardInterrupt``) carrying the step
  reached and the checkpoint a resume would start from.

Files in the run directory: ``run.json`` (configuration and environment),
``metrics.jsonl``, ``checkpoints/``, ``summary.json``, ``learning_curves.png``,
``rpe_functions.png`` (models with a spectrum), and ``.lock`` while a trainer runs.

:func:`_train` reads top to bottom: find where the run starts (:func:`_find_origin`),
load the task's data (:func:`load_data`), build the model (:func:`_build_model`), restore
a checkpoint (:func:`restore`), open the run directory, loop over the steps
(:func:`run_steps`: :func:`train_step`, :func:`_log_training`, :func:`_validate`,
:func:`checkpoint_step`) and finish (:func:`_finish`: draw gap, summary, plots).

The loop has two other clients, each with a :class:`Run` and a :class:`StepHooks` of its
own, through the same step, checkpoint and resume functions. :func:`flt.search.search`
adds an architecture step before each weights step, its evaluation on a held-out part and
its extra checkpoint state, then its selection step. :func:`flt.train.linearize.linearize`
runs a ``transformers`` model in two stages, one :class:`Run` each (its own parameters,
optimizer and learning-rate schedule), with records, validation and advice of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from flt import perf
from flt._io import atomic_write_json
from flt.models.config import TrunkConfig
from flt.models.memory import check_task_memory
from flt.tasks import Task, check_preset, config_to_dict, load_task, preset_from_dict
from flt.tasks.base import check_data_fields, has_test_split
from flt.tasks.preset import (
    Preset,
    RunConfig,
    default_precision,
    preset_to_dict,
    record_differences,
)
from flt.train import distributed as D, drawgap as DG
from flt.train.checkpoint import (
    CONFIG_FILE,
    STATE_FILE,
    CheckpointError,
    find_checkpoint,
    has_checkpoint,
    load_trainer_state,
    load_weights,
    locate_checkpoint,
    optimizer_state_before_cores,
    remove_leftovers,
    save_checkpoint,
)
from flt.train.lock import RunDirectoryInUse, RunLock, lock_run_dir
from flt.train.metrics import MetricsLogger
from flt.train.rng import rng_state, seed_everything, set_rng_state

if TYPE_CHECKING:
    from tqdm.auto import tqdm


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


class TrainingDiverged(FloatingPointError, ValueError):
    """The training loss became NaN or infinite; the message names the step and the last
    checkpoint, which is intact (the step that diverged changed nothing)."""


@dataclass
class Progress:
    """How far a run got, and the step budget in force, for :class:`TrainingInterrupted`
    (and :class:`flt.search.SearchInterrupted`)."""

    step: int = 0
    steps: int = 0


def parameter_groups(model: nn.Module, weight_decay: float, exclude: Iterable[nn.Parameter] = ()) -> list[dict[str, Any]]:
    """Decay the weights of linear, convolution and embedding layers; nothing else.

    Norms, biases, learned temperatures and spectral parameters (amplitudes, log lengths)
    are left alone: decaying a log length to 0 would pull every length scale towards 1.
    Parameters in ``exclude`` (a search's architecture weights, which have an optimizer of
    their own) are left out.
    """
    decay = set()
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            decay.add(id(module.weight))
    excluded = {id(p) for p in exclude}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in excluded]
    return [
        {"params": [p for p in params if id(p) in decay], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0},
    ]


def weights_optimizer(model: nn.Module, run: RunConfig, exclude: Iterable[nn.Parameter] = ()) -> torch.optim.Optimizer:
    """AdamW over :func:`parameter_groups` at the run's peak learning rate."""
    return torch.optim.AdamW(parameter_groups(model, run.weight_decay, exclude), lr=run.lr, betas=(0.9, 0.95))


def peak_memory_mib(device: torch.device) -> tuple[float, str]:
    """``(MiB, what)``: CUDA peak allocated memory, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), "cpu_max_rss"


class _Printer:
    """Prints on the main process only, through tqdm when a bar is showing."""

    def __init__(self, ctx: D.Context, bar: tqdm | None) -> None:
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
def evaluate(task: Task, model: nn.Module, ctx: D.Context, batch_size: int, max_batches: int | None,
             split: str = "valid") -> dict[str, float]:
    """Metrics of ``split`` (``"valid"``: :meth:`Task.eval_batches`; ``"test"``:
    :meth:`Task.test_batches`) over this process's shard, summed over processes."""
    if split not in ("valid", "test"):
        raise ValueError(f"split must be 'valid' or 'test', got {split!r}")
    batches = task.eval_batches if split == "valid" else task.test_batches
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    try:
        for batch in batches(batch_size, max_batches, ctx.rank, ctx.world):
            for k, v in task.eval_sums(model, to_device(batch, ctx.device)).items():
                sums[k] = sums.get(k, 0.0) + v
    finally:
        model.train(was_training)
    keys = sorted(sums) if sums else []
    # Every process must take part in the reduction, with the same keys in the same order.
    gathered = D.all_gather(ctx, keys)
    keys = sorted(set().union(*gathered))
    totals = D.all_reduce_sum(ctx, [sums.get(k, 0.0) for k in keys])
    return task.metrics(dict(zip(keys, totals, strict=True)))


def evaluate_on_draw(task: Task, model: nn.Module, ctx: D.Context, run: RunConfig, max_batches: int | None, *,
                     split: str = "valid", keep: bool = False) -> dict[str, float]:
    """:func:`evaluate` on the run's fixed evaluation draw (:func:`flt.train.drawgap.evaluation_draw`;
    ``keep`` leaves the model on it) in batches of ``run.eval_batch_size`` (default: the
    training batch size)."""
    with DG.evaluation_draw(model, run, keep=keep):
        return evaluate(task, model, ctx, run.eval_batch_size or run.batch_size, max_batches, split)


#: A batch of any task (:data:`flt.tasks.base.BatchT`).
_Batch = TypeVar("_Batch")


def to_device(batch: _Batch, device: torch.device | str) -> _Batch:
    """``batch`` on ``device``: a tensor, an object with ``.to(device)``, or a tuple or list of these."""
    # A batch's type is the task's own (Task[BatchT, ...]); what it is made of is checked here, at run time.
    moved: Any = batch
    if hasattr(moved, "to") and not isinstance(moved, torch.Tensor):
        return moved.to(device)
    if isinstance(moved, (tuple, list)):
        return type(moved)(to_device(b, device) for b in moved)  # type: ignore[return-value]
    return moved.to(device)


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
    keep_steps: bool = False,
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
            A resumed run writes what the uninterrupted run would have written, in
            ``metrics.jsonl`` too (the checkpoint keeps the partly filled logging window),
            except for timings: the throughput field ``{unit}_per_s`` of ``train`` records
            and, in ``summary.json``, ``time_per_step_s``, ``train_time_s`` (both over the
            steps that count, restored from the checkpoint), ``wall_time_s`` (this
            invocation) and ``peak_memory_mib``.
        keep_steps: with ``resume``, ignore ``preset.run.steps`` and continue to the step
            budget saved in the run (its own, extended or not): what ``flt train --resume``
            does without ``--steps``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``; under ``torchrun`` each process takes
            ``cuda:LOCAL_RANK``.
        progress, plots: show the tqdm bar; write the PNG plots.
        deterministic: ``torch.use_deterministic_algorithms(True)`` (needed for bitwise
            reproducibility on CUDA; CPU kernels used here are deterministic already).
        on_step: called with the step number after each step (and its checkpoint).

    Raises:
        TrainingInterrupted: on Ctrl-C (``KeyboardInterrupt``), in every process; the
            checkpoints written so far are intact and ``resume=True`` continues the run.
        RunDirectoryInUse: another process trains in ``out_dir`` (an ``OSError``; the
            message names its pid), before anything in ``out_dir`` is touched.
        TrainingDiverged: the training loss is not finite (a ``ValueError``).
    """
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    ctx = D.setup(device)
    reached = Progress(steps=preset.run.steps)
    lock = None
    try:
        lock = _lock(out_dir, ctx)
        return _train(preset, out_dir, ctx, resume=resume, keep_steps=keep_steps, progress=progress, plots=plots,
                      on_step=on_step, reached=reached, lock=lock)
    except KeyboardInterrupt as e:
        raise TrainingInterrupted(out_dir, reached.step, reached.steps, resumable_checkpoint(out_dir), ctx.is_main) from e
    finally:
        if lock is not None:
            lock.release()
        D.teardown(ctx)


def _lock(out_dir: str, ctx: D.Context) -> RunLock | None:
    """The run directory's lock (:mod:`flt.train.lock`), taken by the main process; every
    process raises the main one's refusal or error, so that none waits for the others."""
    lock, failure = None, None
    if ctx.is_main:
        try:
            lock = lock_run_dir(out_dir)
        except OSError as e:
            failure = (isinstance(e, RunDirectoryInUse), str(e))
            if ctx.world == 1:
                raise
    failure = D.all_gather(ctx, failure)[0]
    if failure is not None:
        in_use, message = failure
        raise (RunDirectoryInUse if in_use else OSError)(message)
    return lock


def resumable_checkpoint(out_dir: str) -> str | None:
    """The checkpoint ``resume=True`` would start from, or None."""
    try:
        return find_checkpoint(out_dir, report=lambda message: None)
    except (FileNotFoundError, CheckpointError):
        return None


@dataclass
class Origin:
    """Where a run starts: a fresh run (no checkpoint) or the checkpoint it resumes from."""

    checkpoint: str | None = None
    step: int = 0
    #: Step budget of the resumed run (its saved configuration), and what finding its
    #: checkpoint had to say.
    saved_steps: int = 0
    notes: list[str] = field(default_factory=list)
    #: ``init_from`` resolved: ``{"checkpoint": path, "step": n}``, the checkpoint whose
    #: weights the run started from (a resumed run carries its record on), or None.
    init: dict[str, Any] | None = None
    #: The preset in force: the one given, or with ``keep_steps`` the saved step budget.
    preset: Preset | None = None


class StepHooks:
    """What a client of the loop adds to its steps; these defaults add nothing, and
    :func:`train` is the loop with them. :mod:`flt.search` is a client: its architecture
    step runs in :meth:`before_update`, its progress lines in :meth:`validate`, and its
    architecture optimizer and decisions travel in every checkpoint (:meth:`state`,
    :meth:`record`), so that a resumed search continues bit for bit.
    :mod:`flt.train.linearize` is another: each of its stages names its records
    (:meth:`train_record`), validates by perplexity and says which learning rate to lower
    (:attr:`advice`)."""

    #: The end of :class:`TrainingDiverged`'s message: what to change.
    advice = "lower --lr or check the data"

    def before_update(self, r: Run, step: int) -> None:
        """Runs in step ``step`` after the draw of the step, before the weights' loss; it
        must leave no gradient on the weights."""

    def validate(self, r: Run, step: int, loss: float, logger: MetricsLogger | None, say: Callable[[str], None]) -> dict[str, float]:
        """The periodic evaluation after step ``step`` (whose training loss is ``loss``):
        by default the validation split (:func:`_validate`)."""
        return _validate(r, step, logger, say)

    def train_record(self, r: Run, step: int, values: dict[str, float]) -> tuple[str, dict[str, Any]]:
        """The split and fields of the record written after step ``step`` every
        ``log_every`` steps; ``values`` are the loop's: the mean training loss over those
        steps, the learning rate and the throughput ``{unit}_per_s``. By default
        ``("train", values)``."""
        return "train", values

    def state(self) -> dict[str, Any]:
        """Extra trainer state for every checkpoint (tensors and plain containers)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` saved, from a checkpoint's whole trainer state."""

    def record(self) -> dict[str, Any]:
        """Extra entries of every checkpoint's ``config.json`` (JSON)."""
        return {}


@dataclass
class Run:
    """What :func:`run_steps` and :func:`checkpoint_step` work on: a model trained on a
    task's batches with one optimizer under ``run`` (the step budget, batches, logging,
    evaluation and checkpoint intervals, clipping, precision, seed). :func:`_train` builds
    one for each run (a :class:`_TrainRun`), a client of the loop its own (:class:`StepHooks`)."""

    run: RunConfig
    out_dir: str
    ctx: D.Context
    task: Task
    model: nn.Module
    ddp: nn.Module
    optimizer: torch.optim.Optimizer
    #: Configuration saved in ``run.json`` and in every checkpoint (JSON), serialised once.
    record: dict[str, Any]
    #: The last step already trained; :func:`run_steps` trains ``start + 1 .. run.steps``.
    start: int
    #: What the checkpoint restored: the partly filled logging window of each process and
    #: the main process's step times (both empty for a fresh run).
    window: _Window
    step_times: list[float]
    #: The newest checkpoint written or resumed from, named by :class:`TrainingDiverged`.
    last_checkpoint: str | None = None
    #: What a client adds to the steps; the parameters whose gradient norm ``grad_clip``
    #: bounds (None: every parameter of the model).
    hooks: StepHooks = field(default_factory=StepHooks)
    clipped: list[nn.Parameter] | None = None
    #: The learning rate of each step (None: ``run.lr_at``, the schedule of ``run.steps``).
    schedule: Callable[[int], float] | None = None

    def lr_at(self, step: int) -> float:
        """The learning rate of (1-based) ``step``."""
        return self.run.lr_at(step) if self.schedule is None else self.schedule(step)


@dataclass(kw_only=True)
class _TrainRun(Run):
    """A run of :func:`train`: also its preset (whose ``run`` is :attr:`Run.run`), the
    model's config with its data-dependent fields, and the number of parameters."""

    preset: Preset
    model_cfg: TrunkConfig
    parameters: int


@dataclass
class _Window:
    """Training loss and throughput since the last ``train`` record."""

    loss: float = 0.0
    steps: int = 0
    items: int = 0
    seconds: float = 0.0

    def add(self, loss: float, items: int, seconds: float) -> None:
        self.loss, self.steps, self.items, self.seconds = self.loss + loss, self.steps + 1, self.items + items, self.seconds + seconds

    def clear(self) -> None:
        self.loss, self.steps, self.items, self.seconds = 0.0, 0, 0, 0.0


def _train(preset: Preset, out_dir: str, ctx: D.Context, *, resume: bool, keep_steps: bool, progress: bool, plots: bool,
           on_step: Callable[[int], None] | None, reached: Progress,
           lock: RunLock | None) -> dict[str, Any]:
    wall_start = time.perf_counter()
    check_preset(preset)
    # Under the lock: nothing else writes here, so half-written files are leftovers.
    notes = [lock.note] if lock is not None and lock.note else []
    if ctx.is_main:
        notes += [f"removed {path}, left half written by a trainer that was killed" for path in remove_leftovers(out_dir)]
    origin = _find_origin(preset, out_dir, ctx, resume, keep_steps)
    origin.notes[:0] = notes
    assert origin.preset is not None, "_find_origin sets the preset in force"
    preset = origin.preset
    preset_record = preset_to_dict(preset)
    reached.step, reached.steps = origin.step, preset.run.steps
    if not D.all_equal(ctx, json.dumps(preset_record, sort_keys=True)):
        raise ValueError("the processes were given different configurations")
    task, model_cfg = load_data(preset, ctx)
    model, optimizer = _build_model(task, model_cfg, preset.run, ctx)
    start, window, step_times = restore(origin, model, optimizer, preset.run, ctx, StepHooks())
    r = _TrainRun(
        run=preset.run, preset=preset, out_dir=out_dir, ctx=ctx, task=task, model_cfg=model_cfg, model=model,
        ddp=_training_module(model, preset.run, ctx), optimizer=optimizer,
        record={"preset": preset_record, "model": config_to_dict(model_cfg), "extra": task.extra(), "init": origin.init},
        start=start, parameters=sum(p.numel() for p in model.parameters()), window=window, step_times=step_times,
        last_checkpoint=origin.checkpoint,
    )
    # A Ctrl-C must not leave the bar's line unfinished under the message that follows,
    # nor the last metrics unflushed: both close on the way out.
    with contextlib.ExitStack() as stack:
        logger = stack.enter_context(contextlib.closing(_open_run_dir(r, origin))) if ctx.is_main else None
        bar = stack.enter_context(_progress_bar(r)) if ctx.is_main and progress else None
        say = _Printer(ctx, bar)
        _announce(r, origin, say)
        last_valid, step_times = run_steps(r, logger, bar, say, on_step, reached)
    return _finish(r, say, last_valid, step_times, plots, wall_start)


def _training_module(model: torch.nn.Module, run: RunConfig, ctx: D.Context) -> torch.nn.Module:
    """What the training loss calls: the model, wrapped by DDP with several processes and
    compiled with ``run.compile`` (:func:`flt.perf.compile`: freed memory kept for reuse,
    torch's automatic dynamic shapes, as batches may differ in length). Evaluation and
    checkpoints use ``model`` itself."""
    module = DistributedDataParallel(model) if ctx.world > 1 else model
    return perf.compile(module, dynamic=None) if run.compile else module


def _find_origin(preset: Preset, out_dir: str, ctx: D.Context, resume: bool, keep_steps: bool) -> Origin:
    """The checkpoint to resume from (checked against ``preset``; with ``keep_steps`` the
    preset takes the saved step budget), or a fresh start in an ``out_dir`` that holds no
    run yet."""
    if not resume:
        if has_checkpoint(out_dir):
            raise ValueError(f"{out_dir} already holds a run; pass --resume to continue it or choose another --out-dir")
        origin = _init_origin(preset, ctx)
        origin.preset = _with_precision(preset, preset.run.precision or default_precision(ctx.device.type))
        return origin
    notes: list[str] = []
    ckpt, meta = _shared_checkpoint(out_dir, ctx, notes, "to resume from in")
    saved = _saved_preset(ckpt, meta)
    # Runs saved before RunConfig.precision existed trained in float32.
    saved_precision = saved.run.precision or "fp32"
    saved = _with_precision(saved, saved_precision)
    preset = _with_precision(preset, preset.run.precision or saved_precision)
    step = int(meta["step"])
    if step > saved.run.steps:
        raise CheckpointError(f"{os.path.join(ckpt, CONFIG_FILE)} says step {step}, beyond its run's budget of {saved.run.steps} steps; "
                              "the checkpoint was altered")
    if keep_steps:
        preset = dataclasses.replace(preset, run=dataclasses.replace(preset.run, steps=saved.run.steps))
    _check_resume(saved, preset_to_dict(preset), preset, step, out_dir)
    return Origin(ckpt, step, saved.run.steps, notes, init=meta.get("init"), preset=preset)


def _saved_preset(ckpt: str, meta: dict[str, Any]) -> Preset:
    """The preset a checkpoint's ``config.json`` records, refused (:class:`CheckpointError`
    naming the file) when it holds none that reads."""
    try:
        return preset_from_dict(meta["preset"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{os.path.join(ckpt, CONFIG_FILE)} records no valid preset ({type(e).__name__}: {e})") from None


def _with_precision(preset: Preset, precision: str) -> Preset:
    return dataclasses.replace(preset, run=dataclasses.replace(preset.run, precision=precision))


def _init_origin(preset: Preset, ctx: D.Context) -> Origin:
    """A fresh run; with ``init_from``, the checkpoint it starts from, resolved before any
    data is loaded (the same in every process, of the same task)."""
    if preset.run.init_from is None:
        return Origin()
    notes: list[str] = []
    ckpt, meta = _shared_checkpoint(preset.run.init_from, ctx, notes, "in init_from")
    task = _saved_preset(ckpt, meta).task
    if task != preset.task:
        raise ValueError(f"init_from: {ckpt} holds a {task!r} model; this run trains {preset.task!r}")
    return Origin(notes=notes, init={"checkpoint": ckpt, "step": int(meta["step"])})


def _shared_checkpoint(path: str, ctx: D.Context, notes: list[str], where: str) -> tuple[str, dict[str, Any]]:
    """The checkpoint ``path`` resolves to (absolute) and its verified config, the same in
    every process; :func:`find_checkpoint`'s messages go to ``notes``."""
    ckpt, meta = locate_checkpoint(path, report=notes.append)
    ckpt = os.path.abspath(ckpt)
    if not D.all_equal(ctx, ckpt):
        raise ValueError(f"the processes found different checkpoints {where} {path}")
    return ckpt, meta


def _check_resume(saved: Preset, preset_record: dict[str, Any], preset: Preset, step: int, out_dir: str) -> None:
    """Refuse to resume the run ``saved`` (checkpoint at ``step``) with ``preset`` (whose
    record is ``preset_record``) unless they differ at most by a larger step budget."""
    diffs = [d for d in record_differences(preset_to_dict(saved), preset_record) if d != "run.steps"]
    if diffs:
        raise ValueError(f"--resume needs the configuration of the run in {out_dir}; these differ: {', '.join(diffs)}"
                         " (only --steps may change, to extend the run)")
    if preset.run.steps < saved.run.steps:
        raise ValueError(f"--steps {preset.run.steps} is below the budget of the run in {out_dir} "
                         f"({saved.run.steps} steps, checkpoint at step {step}); --resume can extend a run, not shorten it: "
                         f"pass --steps {saved.run.steps} to continue it, or more to extend it")


def load_data(preset: Preset, ctx: D.Context) -> tuple[Task, Any]:
    """The task with its data loaded, and the model config with its data-dependent fields."""
    seed_everything(preset.run.seed)
    # The main process loads first so that a generated dataset is cached once.
    if not ctx.is_main:
        D.barrier(ctx)
    task = load_task(preset.task, preset.data)
    if ctx.is_main:
        D.barrier(ctx)
    model_cfg = task.configure(preset.model)
    check_data_fields(preset.model, model_cfg)
    return task, model_cfg


def _build_model(task: Task, model_cfg: TrunkConfig, run: RunConfig, ctx: D.Context) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its AdamW optimizer; initialisation depends on the seed alone, not on
    what data loading consumed."""
    seed_everything(run.seed)
    # Sizes that cannot fit are refused with the estimate before anything is allocated.
    check_task_memory(task, model_cfg, batch_size=run.batch_size // ctx.world, training=True, device=ctx.device)
    if run.eval_batch_size:
        check_task_memory(task, model_cfg, batch_size=run.eval_batch_size, training=False, device=ctx.device)
    model = task.build_model(model_cfg, device=ctx.device)
    return model, weights_optimizer(model, run)


def restore(origin: Origin, model: nn.Module, optimizer: torch.optim.Optimizer, run: RunConfig,
            ctx: D.Context, hooks: StepHooks) -> tuple[int, _Window, list[float]]:
    """Load the checkpoint's weights, optimizer, random states and the state of ``hooks``
    (or, for a fresh run, the weights of its ``init_from`` checkpoint if any, and seed this
    process's training noise);
    returns the last step already trained, this process's partly filled logging window and
    the step times so far (checkpoints written before they were saved have neither: an
    empty window and no times)."""
    if origin.checkpoint is None:
        if origin.init is not None:
            load_weights(origin.init["checkpoint"], model)
        # Dropout and other training noise differ between processes, as they would
        # between the samples of one big batch.
        torch.manual_seed(run.seed + 7919 * ctx.rank)
        return 0, _Window(), []
    before_cores = load_weights(origin.checkpoint, model)
    state = load_trainer_state(origin.checkpoint, origin.step)
    path = os.path.join(origin.checkpoint, STATE_FILE)
    if isinstance(state.get("world_size"), bool) or not isinstance(state.get("world_size"), int):
        raise CheckpointError(f"checkpoint file {path} is not a trainer state this run can resume (no world_size)")
    if state["world_size"] != ctx.world:
        raise ValueError(f"the checkpoint was written by {state.get('world_size')!r} processes; resume with the same number (got {ctx.world})")
    try:
        rngs, windows = state["rng"], state.get("log_window")
        if not isinstance(rngs, list) or len(rngs) != ctx.world or (windows is not None and (not isinstance(windows, list) or len(windows) != ctx.world)):
            raise ValueError("one random state and logging window per process expected")
        saved = state["optimizer"]
        if before_cores:  # its optimizer listed the parameters in their order of then
            saved = optimizer_state_before_cores(optimizer, saved, model)
        optimizer.load_state_dict(saved)
        set_rng_state(rngs[ctx.rank], model)
        hooks.load_state(state)
        window = _Window(**windows[ctx.rank]) if windows is not None else _Window()
        step_times = state["step_times"].tolist() if "step_times" in state else []
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"checkpoint file {path} is not a trainer state this run can resume ({type(e).__name__}: {first})") from None
    if origin.step == origin.saved_steps < run.steps:
        _restore_training_draw(model, run, origin.step)
    return origin.step, window, step_times


def _restore_training_draw(model: nn.Module, run: RunConfig, start: int) -> None:
    """Before extending a run from its final checkpoint (step ``start``): put the model back
    on the training draw of step ``start``. The final checkpoint holds the evaluation draw
    (:func:`flt.train.drawgap.evaluation_draw` with ``keep=True``); an uninterrupted longer
    run would still be on the draw of the last redraw step, which :func:`DG.redraw_for_step`
    recomputes from ``(seed, step)``. Nothing to do when step ``start + 1`` redraws anyway."""
    interval = run.redraw_interval  # set whenever the run redraws
    if interval and DG.redraws_enabled(model, run) and start % interval:
        last_redraw = 1 + (start - 1) // interval * interval
        DG.redraw_for_step(model, run, last_redraw)


def _open_run_dir(r: _TrainRun, origin: Origin) -> MetricsLogger:
    """Write ``run.json`` (configuration and environment) and open ``metrics.jsonl``."""
    os.makedirs(r.out_dir, exist_ok=True)
    atomic_write_json(os.path.join(r.out_dir, "run.json"), {
        **r.record, "parameters": r.parameters, "world_size": r.ctx.world, "device": str(r.ctx.device),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
    }, indent=2, sort_keys=True)
    return MetricsLogger(os.path.join(r.out_dir, "metrics.jsonl"), resume_step=origin.step if origin.checkpoint else None)


def _progress_bar(r: _TrainRun) -> tqdm:
    return progress_bar(r.run.steps, r.start, f"{r.preset.task} {r.model_cfg.attention}")


def progress_bar(steps: int, start: int, desc: str) -> tqdm:
    """The progress bar of a run of ``steps`` steps, ``start`` of them done already (a
    resumed run's); :func:`flt.train.linearize.linearize` shows the same."""
    # tqdm is an optional dependency (flt-attention[train]); --no-progress runs without it.
    from tqdm.auto import tqdm

    return tqdm(total=steps, initial=start, desc=desc, dynamic_ncols=True, unit="step")


def uses_attention(cfg: Any) -> bool:
    """Whether the model ``cfg`` describes is built of ``cfg.attention`` layers: a config
    whose ``encoder`` is not a transformer (``schnet``, ``schnet+lr``, a GNN) uses neither
    its ``attention`` nor its ``posenc``, whatever their defaults say."""
    encoder = getattr(cfg, "encoder", None)
    return not isinstance(encoder, str) or encoder == "transformer" or encoder.startswith("transformer+")


def model_label(cfg: Any) -> str:
    """The model as a run's header and plots name it: ``flt + none`` (attention +
    positional encoding), or the encoder (``schnet+lr``) of a model without attention."""
    return f"{cfg.attention} + {cfg.posenc}" if uses_attention(cfg) else str(cfg.encoder)


def _announce(r: _TrainRun, origin: Origin, say: _Printer) -> None:
    """The first lines: notes about the checkpoint, an extension, what trains where."""
    run = r.run
    for note in origin.notes:
        say(note)
    if origin.checkpoint is not None and run.steps > origin.saved_steps:
        say(f"extending the run from {origin.saved_steps} to {run.steps} steps; the learning rate of steps "
            f"{r.start + 1}..{run.steps} follows the {run.steps}-step schedule")
    if origin.checkpoint is None and origin.init is not None:
        say(f"initialised from the weights of {origin.init['checkpoint']} (step {origin.init['step']} of that run)")
    say(f"{r.preset.task}: {model_label(r.model_cfg)}, {r.parameters:,} parameters, "
        f"{r.ctx.world} process(es) on {r.ctx.device}, steps {r.start + 1}..{run.steps}")


def run_steps(r: Run, logger: MetricsLogger | None, bar: tqdm | None, say: Callable[[str], None],
              on_step: Callable[[int], None] | None,
              reached: Progress) -> tuple[dict[str, float], list[float]]:
    """Steps ``start + 1 .. run.steps``; returns ``(last validation metrics, step times)``."""
    run, ctx = r.run, r.ctx
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    # Both continue from the checkpoint, so that a resumed run logs what an uninterrupted one does.
    step_times, window = r.step_times, r.window
    last_valid: dict[str, float] = {}
    r.model.train()
    for step in range(r.start + 1, run.steps + 1):
        t0 = time.perf_counter()
        loss, items = train_step(r, step, r.lr_at(step))
        dt = time.perf_counter() - t0
        step_times.append(dt)
        window.add(loss, items, dt)
        last = step == run.steps
        if step % run.log_every == 0 or last:
            _log_training(r, logger, window, step)
            window.clear()
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"loss {loss:.4f}  {items / dt:,.0f} {r.task.unit}/s")
        if step % run.eval_every == 0 or last:
            last_valid = r.hooks.validate(r, step, loss, logger, say)
        if step % run.checkpoint_every == 0 or last:
            checkpoint_step(r, step, window, step_times)
        reached.step = step
        if on_step is not None:
            on_step(step)
    return last_valid, step_times


def train_step(r: Run, step: int, lr: float) -> tuple[float, int]:
    """One optimizer step at learning rate ``lr`` (after the client's :meth:`StepHooks.before_update`);
    returns the loss and the number of ``task.unit`` in the global batch."""
    run, ctx = r.run, r.ctx
    DG.redraw_for_step(r.model, run, step)  # draw-robust training (flt.train.drawgap)
    r.hooks.before_update(r, step)
    for group in r.optimizer.param_groups:
        group["lr"] = lr
    batch = to_device(r.task.train_batch(step, run.batch_size, run.seed, ctx.rank, ctx.world), ctx.device)
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=run.precision == "bf16"):
        loss = r.task.loss(r.ddp, batch)
    value = _check_finite(r, loss, step)
    loss.backward()
    if run.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(r.model.parameters() if r.clipped is None else r.clipped, run.grad_clip)
    r.optimizer.step()
    r.optimizer.zero_grad(set_to_none=True)
    return value, r.task.batch_items(batch) * ctx.world


def _check_finite(r: Run, loss: torch.Tensor, step: int) -> float:
    """The loss as a float; raises :class:`TrainingDiverged` before a non-finite loss
    reaches the weights, in every process at once (one process's NaN would otherwise leave
    the others waiting in the gradient reduction)."""
    value = float(loss.detach())
    finite = math.isfinite(value)
    if r.ctx.world > 1:
        finite = D.all_reduce_sum(r.ctx, [0.0 if finite else 1.0])[0] == 0
    if finite:
        return value
    shown = value if not math.isfinite(value) else "not finite in another process"
    where = (f"the last checkpoint, {r.last_checkpoint}, is intact"
             if r.last_checkpoint else "no checkpoint was written yet")
    raise TrainingDiverged(f"the training loss is {shown} at step {step} of {r.run.steps} in {r.out_dir}; "
                           f"{where}; {r.hooks.advice}")


def _log_training(r: Run, logger: MetricsLogger | None, window: _Window, step: int) -> None:
    """A ``train`` record (or what :meth:`StepHooks.train_record` makes of it): the mean
    loss over the window and processes, the learning rate, the throughput."""
    mean_loss = D.all_reduce_sum(r.ctx, [window.loss / window.steps])[0] / r.ctx.world
    if logger is not None:
        rate = window.items / max(window.seconds, 1e-9)
        split, fields = r.hooks.train_record(r, step, {"loss": mean_loss, "lr": r.lr_at(step), f"{r.task.unit}_per_s": rate})
        logger.log(step, split, **fields)


def _validate(r: Run, step: int, logger: MetricsLogger | None, say: Callable[[str], None]) -> dict[str, float]:
    """Validation metrics of ``step``, logged and printed. All on one fixed draw, which the
    final checkpoint keeps (flt.train.drawgap); the final evaluation covers the whole
    validation split, periodic ones may be capped."""
    run = r.run
    last = step == run.steps
    metrics = evaluate_on_draw(r.task, r.model, r.ctx, run, None if last else run.eval_batches, keep=last)
    if logger is not None:
        logger.log(step, "valid", **metrics)
    say(f"step {step}: valid {_format(metrics)}")
    return metrics


def checkpoint_step(r: Run, step: int, window: _Window, step_times: list[float]) -> None:
    """Save step ``step``: weights, optimizer, every process's RNG and logging window
    (``window``, the records' sums since the last ``train`` record), the step times and
    what the client adds (:meth:`StepHooks.state`, :meth:`StepHooks.record`)."""
    rngs = D.all_gather(r.ctx, rng_state(r.model))
    windows = D.all_gather(r.ctx, dataclasses.asdict(window))
    if r.ctx.is_main:
        state = {"step": step, "optimizer": r.optimizer.state_dict(), "rng": rngs, "world_size": r.ctx.world,
                 "log_window": windows, "step_times": torch.tensor(step_times, dtype=torch.float64), **r.hooks.state()}
        r.last_checkpoint = save_checkpoint(r.out_dir, step, r.model, config={**r.record, **r.hooks.record()}, trainer_state=state,
                                            keep=r.run.keep_checkpoints)
    D.barrier(r.ctx)


def _finish(r: _TrainRun, say: _Printer, last_valid: dict[str, float], step_times: list[float], plots: bool, wall_start: float) -> dict[str, Any]:
    """Final evaluation if none ran, draw gap, ``summary.json``, plots and the last lines."""
    run, ctx = r.run, r.ctx
    eval_bs = run.eval_batch_size or run.batch_size
    if not last_valid:
        # Resumed at the final step: nothing left to train, report the final weights.
        last_valid = evaluate_on_draw(r.task, r.model, ctx, run, None)
    test = None
    if has_test_split(r.task):  # the held-out test split, read once, on the draw the final checkpoint keeps
        test = evaluate_on_draw(r.task, r.model, ctx, run, None, split="test")
        say(f"test {_format(test)}")
    # Own draw vs fresh draws vs exact attention (flt.train.drawgap).
    gap = DG.draw_gap(r.task, r.model, r.model_cfg, run, lambda m, bs: evaluate(r.task, m, ctx, bs, DG.gap_batches(run, bs)), eval_bs,
                      own=last_valid if run.draw_gap_batches is None else None)
    summary = _summary(r, last_valid, step_times, gap, wall_start)
    if test is not None:
        summary.update({"test": test, f"test_{r.task.metric}": test[r.task.metric]})
    _check_final_metrics(r, last_valid, test)
    if gap is not None:
        say(DG.format_draw_gap(gap, r.task.metric))
    if ctx.is_main:
        atomic_write_json(os.path.join(r.out_dir, "summary.json"), summary, indent=2, sort_keys=True)
        saved = _plots(r) if plots else []
        report = r.task.report(r.model, ctx.device)
        if report:
            say(report)
        say(f"done: {_format(last_valid)}; {summary['time_per_step_s'] or 0:.3f} s/step; run directory {r.out_dir}"
            + (f" (plots: {', '.join(saved)})" if saved else ""))
    # Leave together: a process that tears the group down while another still writes its
    # plots can abort inside gloo.
    D.barrier(ctx)
    return summary


def _check_final_metrics(r: _TrainRun, valid: dict[str, float], test: dict[str, float] | None) -> None:
    """Raise :class:`TrainingDiverged` if a final metric is NaN or infinite: the model's
    outputs overflowed though the training loss stayed finite, and a summary cannot hold
    such a number (JSON has none)."""
    for split, metrics in (("validation", valid), ("test", test or {})):
        bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
        if bad:
            where = f"the last checkpoint, {r.last_checkpoint}, holds these weights" if r.last_checkpoint else "no checkpoint was written"
            raise TrainingDiverged(f"the final {split} {', '.join(f'{k} is {v}' for k, v in bad.items())} at step {r.run.steps} "
                                   f"in {r.out_dir} (not a finite number; summary.json is not written); {where}; check the data's "
                                   "values and scale, or lower --lr")


def _summary(r: _TrainRun, last_valid: dict[str, float], step_times: list[float], gap: dict[str, Any] | None, wall_start: float) -> dict[str, Any]:
    """The contents of ``summary.json``; the peak memory is the largest over processes."""
    run, ctx = r.run, r.ctx
    memory, memory_kind = peak_memory_mib(ctx.device)
    summary = {
        "task": r.preset.task, **_mechanism(r.model_cfg), "seed": run.seed,
        "steps": run.steps, "metric": r.task.metric, "final": last_valid, "parameters": r.parameters,
        "time_per_step_s": statistics.median(step_times[1:] or step_times) if step_times else None,
        "train_time_s": sum(step_times), "wall_time_s": time.perf_counter() - wall_start,
        "peak_memory_mib": max(D.all_gather(ctx, memory)), "memory_kind": memory_kind, "world_size": ctx.world,
        "device": str(ctx.device),
    }
    if gap is not None:
        summary["draw_gap"] = gap
    return summary


def _mechanism(cfg: Any) -> dict[str, Any]:
    """The summary's record of the model: its ``attention`` and ``posenc`` (null for a
    model without attention layers), and its ``model`` (the encoder) where the config names one."""
    used = uses_attention(cfg)
    record: dict[str, Any] = {"attention": cfg.attention if used else None, "posenc": cfg.posenc if used else None}
    if isinstance(getattr(cfg, "encoder", None), str):
        record["model"] = cfg.encoder
    return record


def _plots(r: _TrainRun) -> list[str]:
    """Write the PNG plots; returns their file names."""
    # matplotlib is an optional dependency, imported only when plots are wanted.
    from flt.train.plots import plot_learning_curves, plot_rpe_functions

    task, cfg = r.task, r.model_cfg
    title = f"{task.name}: {model_label(cfg)}"
    plot_learning_curves(os.path.join(r.out_dir, "metrics.jsonl"), os.path.join(r.out_dir, "learning_curves.png"),
                         metric=task.metric, title=title, task=task.name)
    saved = ["learning_curves.png"]
    extent, causal = task.rpe_extent(cfg)
    if plot_rpe_functions(r.model, os.path.join(r.out_dir, "rpe_functions.png"), extent=extent, causal=causal, task=task.name) is not None:
        saved.append("rpe_functions.png")
    return saved + task.plots(r.model, r.out_dir)
