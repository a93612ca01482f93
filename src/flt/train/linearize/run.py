"""The run of :func:`linearize`: attention transfer, then fine-tuning, in a run directory,
on the training loop of :mod:`flt.train.loop`.

Each stage is one :class:`flt.train.loop.Run` (transfer: steps ``1..transfer_steps``,
fine-tuning: the rest) that :func:`flt.train.loop.run_steps` trains as it trains
``flt train``'s and ``flt search``'s: the same step (batch, loss, finite-loss check,
clipping, update), step times, progress bar, ``metrics.jsonl``, checkpoints
(:func:`~flt.train.loop.checkpoint_step`) and resume (:func:`~flt.train.loop.restore`),
under the same lock. What a stage brings (:class:`_Stage`):

* its task (:class:`_Text`): the training windows of each step (:func:`window_batch`) and
  the stage's loss, in transfer the layers' matching error against the teacher (both
  models run, the student in eval mode: no dropout), in fine-tuning next-token
  cross-entropy;
* its parameters, a fresh AdamW over them and the schedule :meth:`LinearizeConfig.lr_at`,
  which restarts at the boundary; the boundary is the transfer :class:`Run`'s last step,
  so it is validated and checkpointed as every ``eval_every`` and ``checkpoint_every`` steps;
* its hooks: a record every step (``transfer`` with each layer's error, or ``train``, with
  the stage), validation by perplexity (and, at the end of transfer, each layer's
  matching error), the learning rate to lower should the loss diverge.

A resumed run restores its checkpoint into the stage that wrote it (at the boundary, the
transfer stage, whose optimizer fine-tuning then replaces with a fresh one).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flt._io import atomic_dir, atomic_write_json
from flt.tasks import Task
from flt.tasks.preset import RunConfig
from flt.train import distributed as D, metrics
from flt.train.checkpoint import (
    has_checkpoint,
    load_trainer_state,
    locate_checkpoint,
    remove_leftovers,
)
from flt.train.linearize.config import LinearizeConfig, check_attention
from flt.train.linearize.data import (
    METRIC,
    Tokens,
    check_tokens,
    load_text,
    next_token_loss,
    perplexity,
    window_batch,
)
from flt.train.linearize.matching import LayerMatching, trainable_parameters, transfer_loss
from flt.train.linearize.model import check_model_dir, load_softmax_model
from flt.train.linearize.plots import plot_linearization
from flt.train.lock import lock_run_dir
from flt.train.loop import (
    Origin,
    Progress,
    Run,
    StepHooks,
    TrainingDiverged,
    peak_memory_mib,
    progress_bar,
    restore,
    resumable_checkpoint,
    run_steps,
)
from flt.train.metrics import MetricsLogger
from flt.train.rng import seed_everything

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class _Linearization:
    """What both stages of a linearisation share."""

    config: LinearizeConfig
    out_dir: str
    device: torch.device
    teacher: PreTrainedModel
    student: PreTrainedModel
    matching: LayerMatching
    train_ids: torch.Tensor
    valid_ids: torch.Tensor
    record: dict[str, Any]


#: The default of :func:`linearize`'s ``config`` (frozen: one instance serves every call).
_DEFAULT_CONFIG = LinearizeConfig()


class LinearizeInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`linearize`: ``step`` reached, ``checkpoint`` a resume starts from."""

    def __init__(self, out_dir: str, step: int, steps: int, checkpoint: str | None):
        super().__init__(f"linearising in {out_dir} interrupted after step {step} of {steps}")
        self.out_dir, self.step, self.steps, self.checkpoint = out_dir, step, steps, checkpoint


def linearize(model_dir: str | os.PathLike, out_dir: str, config: LinearizeConfig = _DEFAULT_CONFIG, *,
              resume: bool = False, device: str = "cpu", progress: bool = True, plots: bool = True,
              on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Linearise the softmax decoder in ``model_dir`` into ``out_dir`` (:mod:`flt.train.linearize`)
    and return the summary (also ``summary.json``).

    Args:
        resume: continue the run in ``out_dir`` from its latest checkpoint (same
            ``model_dir`` and ``config``); it ends as the uninterrupted run would, bit for bit
            (timings aside). Without it ``out_dir`` must not hold a run yet.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        on_step: called with the step number after each step (and its checkpoint).

    Raises:
        LinearizeInterrupted: on Ctrl-C; the checkpoints written so far are intact.
        ValueError, FileNotFoundError: bad ``model_dir``, data or options, before training.
        flt.train.lock.RunDirectoryInUse: another process works in ``out_dir``.
    """
    config = check_attention(config)  # options the command line checked are not checked again
    check_model_dir(model_dir)
    check_tokens(model_dir, config.byte_tokens)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device)
    lock = lock_run_dir(out_dir, command="flt linearize")
    reached = Progress(steps=config.steps)
    try:
        return _linearize(Path(model_dir), out_dir, config, dev, resume, progress, plots, on_step, reached, lock.note)
    except KeyboardInterrupt as err:
        raise LinearizeInterrupted(out_dir, reached.step, reached.steps, resumable_checkpoint(out_dir)) from err
    finally:
        lock.release()


def _linearize(model_dir: Path, out_dir: str, config: LinearizeConfig, device: torch.device, resume: bool, progress: bool,
               plots: bool, on_step: Callable[[int], None] | None, reached: Progress, lock_note: str | None) -> dict[str, Any]:
    # The transformers integration (the hf extra) is imported only when a run starts.
    from flt.integrations.transformers import convert

    wall_start = time.perf_counter()
    notes = [lock_note] if lock_note else []
    notes += [f"removed {p}, left half written by a run that was killed" for p in remove_leftovers(out_dir)]
    record = {"linearize": dataclasses.asdict(config), "model_dir": str(model_dir.resolve())}
    origin = Origin()
    if resume:
        origin = _resume_point(out_dir, record, notes)
    elif has_checkpoint(out_dir):
        raise ValueError(f"{out_dir} already holds a run; pass --resume to continue it or choose another --out-dir")
    seed_everything(config.seed)
    teacher = load_softmax_model(model_dir, device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = convert(copy.deepcopy(teacher), config.attention, attention_options=config.attention_options)
    weights = config.transfer != "outputs"
    if weights:
        teacher.set_attn_implementation("eager")  # the implementation that returns the softmax weights
    tokens = Tokens(model_dir, teacher.config.vocab_size, config.byte_tokens)
    train_text, valid_text, corpus = load_text(config.data, config.valid_fraction)
    train_ids, valid_ids = tokens.encode(train_text), tokens.encode(valid_text)
    top = int(max(train_ids.max(), valid_ids.max()))
    if top >= teacher.config.vocab_size:
        raise ValueError(f"the text has token id {top}, beyond the vocabulary of {model_dir} ({teacher.config.vocab_size}); "
                         "a byte-level text needs vocab_size >= 256 or the model's tokenizer files in MODEL_DIR")
    record.update(tokens=tokens.kind, corpus=corpus)
    lin = _Linearization(config, out_dir, device, teacher, student, LayerMatching(teacher, student, weights=weights), train_ids,
                         valid_ids, record)
    if config.transfer_steps and not trainable_parameters(student, "cores"):
        raise ValueError(f"{config.attention} with options {config.attention_options} has no learned parameters for "
                         "attention transfer; set transfer_steps to 0 or choose a mechanism with a learned part")
    stages = [name for name, steps in (("transfer", config.transfer_steps), ("finetune", config.finetune_steps)) if steps]
    # The stage that wrote the checkpoint restores it (at the boundary, transfer); a fresh run starts with the first.
    stages = stages[stages.index(config.stage(max(origin.step, 1))):]
    first = _Stage(lin, stages[0])
    start, window, step_times = restore(origin, student, first.optimizer, first.run, first.ctx, first)
    r = first.on_loop(start, window, step_times, origin.checkpoint)
    reached.step = start
    for note in notes:
        print(f"note: {note}", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    _write_run_json(lin)
    with contextlib.ExitStack() as stack:
        logger = stack.enter_context(contextlib.closing(MetricsLogger(os.path.join(out_dir, "metrics.jsonl"),
                                                                      resume_step=start if origin.checkpoint else None)))
        if origin.checkpoint is None:
            _baselines(lin, logger)
        bar = stack.enter_context(progress_bar(config.steps, start, f"linearize {config.attention}")) if progress else None
        say: Callable[[str], None] = bar.write if bar is not None else lambda text: print(text, flush=True)
        peaks: list[float] = []
        for i, name in enumerate(stages):
            if i:  # the next stage starts where the last one ended
                r = _Stage(lin, name).on_loop(r.run.steps, r.window, r.step_times, r.last_checkpoint)
            if r.start < r.run.steps:
                run_steps(r, logger, bar, say, on_step, reached)
                peaks.append(peak_memory_mib(device)[0])
    return _finish(lin, r.step_times, peaks, plots, wall_start)


def _resume_point(out_dir: str, record: dict[str, Any], notes: list[str]) -> Origin:
    """The latest checkpoint of the run in ``out_dir``, refused unless it is a run of the
    same model and options whose trainer state the loop resumes."""
    ckpt, meta = locate_checkpoint(out_dir, report=notes.append)
    saved = {k: meta.get(k) for k in ("linearize", "model_dir")}
    if isinstance(saved["linearize"], dict):
        # Runs from before `transfer` existed matched outputs; those from before
        # `byte_tokens` read bytes wherever MODEL_DIR had no tokenizer (their record says which).
        saved["linearize"] = {"transfer": "outputs", "byte_tokens": meta.get("tokens") == "bytes", **saved["linearize"]}
    if saved["linearize"] != json.loads(json.dumps(record["linearize"])):
        diffs = sorted(k for k in record["linearize"] if (saved["linearize"] or {}).get(k) != json.loads(json.dumps(record["linearize"][k])))
        raise ValueError(f"--resume needs the options of the run in {out_dir}; these differ: {', '.join(diffs)}")
    if saved["model_dir"] != record["model_dir"]:
        raise ValueError(f"--resume: the run in {out_dir} linearises {saved['model_dir']}, not {record['model_dir']}")
    step = int(meta["step"])
    if "world_size" not in load_trainer_state(ckpt, step):
        # Before linearize ran on the training loop its trainer state had its own layout.
        raise ValueError(f"{ckpt} was written by an earlier version of flt linearize, whose checkpoints this one does not "
                         "resume; start the run again in another --out-dir")
    return Origin(ckpt, step, record["linearize"]["transfer_steps"] + record["linearize"]["finetune_steps"])


class _Text(Task[torch.Tensor, Any]):
    """The training text as the loop's task in one stage (one process): the windows of each
    step (:func:`window_batch`, ``[B, seq_len + 1]``) and the stage's loss on them."""

    unit = "tokens"

    def __init__(self, lin: _Linearization, stage: str) -> None:
        self.lin, self.stage = lin, stage
        #: Each layer's matching losses in the last transfer step (its ``transfer`` record's).
        self.layers: dict[str, list[float]] = {}

    def train_batch(self, step: int, batch_size: int, seed: int, rank: int, world: int) -> torch.Tensor:
        return window_batch(self.lin.train_ids, step, batch_size, self.lin.config.seq_len, seed)

    def batch_items(self, batch: torch.Tensor) -> int:
        return batch[:, 1:].numel()

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        """Fine-tuning: next-token cross-entropy. Transfer: the layers' matching loss
        (:func:`transfer_loss`); each layer's output error (``layers``) and, when weights
        are matched, its weights' KL (``kl``) are kept for the step's record. ``model`` is
        the student (one process: no DDP wrapper)."""
        student = self.lin.student
        if self.stage == "finetune":
            return next_token_loss(student, batch)
        # Transfer matches the teacher's deterministic outputs: no dropout in the student either.
        student.eval()
        losses = self.lin.matching.losses(batch[:, :-1])
        self.layers = {"layers": losses["outputs"].detach().tolist()}
        if "weights" in losses:
            self.layers["kl"] = losses["weights"].detach().tolist()
        return transfer_loss(losses, self.lin.config.transfer)


class _Stage(StepHooks):
    """One stage (``"transfer"`` or ``"finetune"``) as a client of the loop: its parameters,
    a fresh AdamW over them, the loop's settings of its steps (:attr:`run`) in one process
    (:attr:`ctx`), its task (:class:`_Text`) and its hooks."""

    def __init__(self, lin: _Linearization, name: str) -> None:
        c = lin.config
        self.lin, self.name, self.text, self.ctx = lin, name, _Text(lin, name), D.Context(0, 1, lin.device)
        self.advice = f"lower --{name}-lr"
        self.params = trainable_parameters(lin.student, "cores" if name == "transfer" else c.finetune)
        lr = c.transfer_lr if name == "transfer" else c.finetune_lr
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        # One record a step; the random features are drawn once, not redrawn; float32. The
        # learning rate is the schedule of the stage (on_loop), not this config's.
        self.run = RunConfig(steps=c.transfer_steps if name == "transfer" else c.steps, batch_size=c.batch_size, lr=lr,
                             grad_clip=c.grad_clip, eval_every=c.eval_every, checkpoint_every=c.checkpoint_every,
                             keep_checkpoints=c.keep_checkpoints, log_every=1, seed=c.seed, redraw_interval=0, precision="fp32")

    def on_loop(self, start: int, window: Any, step_times: list[float], last_checkpoint: str | None) -> Run:
        """The loop's :class:`Run` of this stage from step ``start``, with what the last
        stage or the checkpoint left: the loop's logging window, the step times and the
        newest checkpoint."""
        lin = self.lin
        return Run(run=self.run, out_dir=lin.out_dir, ctx=self.ctx, task=self.text, model=lin.student,
                   ddp=lin.student, optimizer=self.optimizer, record=lin.record, start=start, window=window,
                   step_times=step_times, last_checkpoint=last_checkpoint, hooks=self, clipped=self.params,
                   schedule=lin.config.lr_at)

    def train_record(self, r: Run, step: int, values: dict[str, float]) -> tuple[str, dict[str, Any]]:
        """The step's record (``log_every`` is 1), without the throughput: ``transfer`` with each
        layer's matching losses (:attr:`_Text.layers`), or ``train``; both name the stage."""
        record = {"loss": values["loss"], "lr": values["lr"], "stage": self.name}
        return ("transfer", {**record, **self.text.layers}) if self.name == "transfer" else ("train", record)

    def validate(self, r: Run, step: int, loss: float, logger: MetricsLogger | None, say: Callable[[str], None]) -> dict[str, float]:
        """The validation perplexity, and at the end of transfer each layer's matching error."""
        valid = _evaluate(self.lin, self.lin.student)
        if logger is not None:
            logger.log(step, "valid", stage=self.name, **valid)
            if self.name == "transfer" and step == r.run.steps:
                logger.log(step, "matching", **_matching(self.lin))
        say(f"step {step} ({self.name}): valid ppl {valid[METRIC]:.4g}")
        return valid


def _write_run_json(lin: _Linearization) -> None:
    info = {**lin.record, "parameters": sum(p.numel() for p in lin.student.parameters()),
            "softmax_parameters": sum(p.numel() for p in lin.teacher.parameters()), "model_type": lin.teacher.config.model_type,
            "device": str(lin.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}
    atomic_write_json(os.path.join(lin.out_dir, "run.json"), info, indent=2, sort_keys=True)


def _evaluate(lin: _Linearization, model: PreTrainedModel) -> dict[str, float]:
    c = lin.config
    return perplexity(model, lin.valid_ids, seq_len=c.seq_len, batch_size=c.batch_size, max_batches=c.eval_batches, device=lin.device)


def _matching(lin: _Linearization) -> dict[str, list[float]]:
    """The ``matching`` record's values on the validation windows: each layer's output
    error (``error``) and, when weights are matched, its weights' KL (``kl``)."""
    c = lin.config
    losses = lin.matching.evaluate(lin.valid_ids, c.seq_len, c.batch_size, c.eval_batches, device=lin.device)
    return {"error": losses["outputs"], **({"kl": losses["weights"]} if "weights" in losses else {})}


def _baselines(lin: _Linearization, logger: MetricsLogger) -> None:
    """Step 0: the softmax model's and the converted model's validation perplexity and the
    converted layers' matching error, before any training."""
    softmax, converted = _evaluate(lin, lin.teacher), _evaluate(lin, lin.student)
    logger.log(0, "softmax", **softmax)
    logger.log(0, "valid", stage="converted", **converted)
    logger.log(0, "matching", **_matching(lin))
    print(f"softmax model: valid ppl {softmax[METRIC]:.4g}; converted, before training: valid ppl {converted[METRIC]:.4g}", flush=True)


def _finish(r: _Linearization, step_times: list[float], peaks: list[float], plots: bool, wall_start: float) -> dict[str, Any]:
    """``summary.json`` from the records (a resumed run has the earlier ones too), the
    linearised model in ``model/`` and the plot; ``peaks``: each stage's peak memory (MiB)."""
    c = r.config
    records = metrics.read_metrics(os.path.join(r.out_dir, "metrics.jsonl"))
    valid = {rec["step"]: rec for rec in records if rec["split"] == "valid"}
    matching = {rec["step"]: rec["error"] for rec in records if rec["split"] == "matching"}
    kl = {rec["step"]: rec.get("kl") for rec in records if rec["split"] == "matching"}
    softmax = next(rec for rec in records if rec["split"] == "softmax")
    ppl = {"softmax": softmax[METRIC], "converted": valid[0][METRIC],
           "transferred": valid[c.transfer_steps][METRIC] if c.transfer_steps else None,
           "finetuned": valid[c.steps][METRIC] if c.finetune_steps else None}
    bad = {k: v for k, v in ppl.items() if v is not None and not math.isfinite(v)}
    if bad:
        raise TrainingDiverged(f"the validation perplexity {', '.join(f'{k} is {v}' for k, v in bad.items())} in {r.out_dir} "
                               "(not a finite number; summary.json is not written); lower the learning rates, or check "
                               "the model's and the text's scale")
    final = ppl["finetuned"] if ppl["finetuned"] is not None else ppl["transferred"]
    times = {stage: [t for i, t in enumerate(step_times, 1) if c.stage(i) == stage] for stage in ("transfer", "finetune")}
    memory, memory_kind = peak_memory_mib(r.device)
    memory = max([memory, *peaks])  # on CUDA each stage counts from its own start
    summary = {
        **r.record, "attention": c.attention, "attention_options": c.attention_options, "metric": METRIC,
        "steps": c.steps, "transfer_steps": c.transfer_steps, "finetune_steps": c.finetune_steps, "finetune": c.finetune,
        "transfer": c.transfer,
        "ppl": ppl, "ppl_ratio": final / ppl["softmax"], "eval_tokens": softmax["tokens"],
        "matching_error": {"before": matching.get(0), "after": matching.get(c.transfer_steps) if c.transfer_steps else None},
        "weights_kl": {"before": kl.get(0), "after": kl.get(c.transfer_steps) if c.transfer_steps else None},
        "time_per_step_s": {k: statistics.median(v) if v else None for k, v in times.items()},
        "train_time_s": sum(step_times), "wall_time_s": time.perf_counter() - wall_start,
        "peak_memory_mib": memory, "memory_kind": memory_kind, "device": str(r.device),
    }
    atomic_write_json(os.path.join(r.out_dir, "summary.json"), summary, indent=2, sort_keys=True)
    _save_model(r)
    if plots:
        plot_linearization(records, os.path.join(r.out_dir, "learning_curves.png"), transfer_steps=c.transfer_steps,
                           title=f"linearize {r.record['model_dir']}: {c.attention}")
    print(f"done: valid ppl softmax {ppl['softmax']:.4g}, converted {ppl['converted']:.4g}, "
          f"after transfer {_show(ppl['transferred'])}, after fine-tuning {_show(ppl['finetuned'])} "
          f"({summary['ppl_ratio']:.3f}x softmax); model in {os.path.join(r.out_dir, 'model')}", flush=True)
    return summary


def _show(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _save_model(r: _Linearization) -> None:
    """``save_pretrained`` into a temporary directory renamed into place, so ``model/`` is
    complete or absent."""
    atomic_dir(r.out_dir, "model", r.student.save_pretrained)
