"""The run of :func:`linearize`: attention transfer, then fine-tuning, in a run directory.

What it shares with :func:`flt.train.train`: the run directory's lock
(:func:`flt.train.lock.lock_run_dir`) and the removal of what a killed run left half
written, the checkpoints (:mod:`flt.train.checkpoint`: written atomically and hashed,
found, verified and loaded for ``resume``), the random states (:mod:`flt.train.rng`),
``metrics.jsonl`` (:mod:`flt.train.metrics`), and from :mod:`flt.train.loop` the progress
bar, the step reached and the checkpoint named on Ctrl-C (:class:`~flt.train.loop.Progress`,
:func:`~flt.train.loop.resumable_checkpoint`), :class:`~flt.train.loop.TrainingDiverged` and
the peak memory. The learning-rate schedule is :meth:`flt.tasks.preset.RunConfig.lr_at`.

What it does not: its steps (:func:`_loop`) are not :func:`flt.train.loop.run_steps`, whose
run is a :class:`flt.train.loop.Run` of a task (:class:`flt.tasks.Task`: batches and loss)
with one optimizer, one schedule, windowed ``train`` records and a trainer state of the
loop's layout. Here, without a change to what a run computes or writes:

* the two stages train different parameters with a fresh AdamW each, under a schedule
  that restarts at the stage boundary (:meth:`LinearizeConfig.lr_at`), and the student
  runs in eval mode during transfer; the boundary is validated and checkpointed as well as
  every ``eval_every`` and ``checkpoint_every`` steps (``run_steps`` does so at multiples
  and at the last step only);
* the transfer loss is the layers' matching error against the teacher's (both models run
  each step), not a task's loss, and no random features are redrawn;
* every step writes its own record (``transfer`` with each layer's error, or ``train``
  with its ``stage``), where ``run_steps`` averages ``train`` records over ``log_every``;
* the trainer state is ``{step, stage, optimizer, rng, step_times}`` (one process, one
  random state), which the runs written so far resume from; the loop's state adds the
  world size and logging windows and refuses one without them.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flt._io import atomic_dir, atomic_write_json
from flt.train import metrics
from flt.train.checkpoint import (
    has_checkpoint,
    load_trainer_state,
    load_weights,
    locate_checkpoint,
    remove_leftovers,
    save_checkpoint,
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
    Progress,
    TrainingDiverged,
    peak_memory_mib,
    progress_bar,
    resumable_checkpoint,
)
from flt.train.rng import rng_state, seed_everything, set_rng_state

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class _Run:
    """What a linearisation holds while it trains."""

    config: LinearizeConfig
    out_dir: str
    device: torch.device
    teacher: PreTrainedModel
    student: PreTrainedModel
    matching: LayerMatching
    train_ids: torch.Tensor
    valid_ids: torch.Tensor
    record: dict[str, Any]
    logger: Any = None
    optimizer: torch.optim.Optimizer | None = None
    stage: str | None = None
    step_times: list[float] = field(default_factory=list)
    last_checkpoint: str | None = None


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
    origin: str | None = None
    meta: dict[str, Any] = {}
    if resume:
        origin, meta = _resume_point(out_dir, record, notes)
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
    r = _Run(config, out_dir, device, teacher, student, LayerMatching(teacher, student, weights=weights), train_ids, valid_ids, record)
    if config.transfer_steps and not trainable_parameters(student, "cores"):
        raise ValueError(f"{config.attention} with options {config.attention_options} has no learned parameters for "
                         "attention transfer; set transfer_steps to 0 or choose a mechanism with a learned part")
    start = 0 if origin is None else _restore(r, origin, meta)
    for note in notes:
        print(f"note: {note}", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    _write_run_json(r, teacher, student)
    with contextlib.closing(metrics.MetricsLogger(os.path.join(out_dir, "metrics.jsonl"), resume_step=start if origin else None)) as r.logger:
        if origin is None:
            _baselines(r)
        _loop(r, start, progress, on_step, reached)
    return _finish(r, plots, wall_start)


def _resume_point(out_dir: str, record: dict[str, Any], notes: list[str]) -> tuple[str, dict[str, Any]]:
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
    return ckpt, meta


def _write_run_json(r: _Run, teacher: PreTrainedModel, student: PreTrainedModel) -> None:
    info = {**r.record, "parameters": sum(p.numel() for p in student.parameters()),
            "softmax_parameters": sum(p.numel() for p in teacher.parameters()), "model_type": teacher.config.model_type,
            "device": str(r.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}
    atomic_write_json(os.path.join(r.out_dir, "run.json"), info, indent=2, sort_keys=True)


def _evaluate(r: _Run, model: PreTrainedModel) -> dict[str, float]:
    c = r.config
    return perplexity(model, r.valid_ids, seq_len=c.seq_len, batch_size=c.batch_size, max_batches=c.eval_batches, device=r.device)


def _matching(r: _Run) -> dict[str, list[float]]:
    """The ``matching`` record's values on the validation windows: each layer's output
    error (``error``) and, when weights are matched, its weights' KL (``kl``)."""
    c = r.config
    losses = r.matching.evaluate(r.valid_ids, c.seq_len, c.batch_size, c.eval_batches, device=r.device)
    return {"error": losses["outputs"], **({"kl": losses["weights"]} if "weights" in losses else {})}


def _baselines(r: _Run) -> None:
    """Step 0: the softmax model's and the converted model's validation perplexity and the
    converted layers' matching error, before any training."""
    softmax, converted = _evaluate(r, r.teacher), _evaluate(r, r.student)
    r.logger.log(0, "softmax", **softmax)
    r.logger.log(0, "valid", stage="converted", **converted)
    r.logger.log(0, "matching", **_matching(r))
    print(f"softmax model: valid ppl {softmax[METRIC]:.4g}; converted, before training: valid ppl {converted[METRIC]:.4g}", flush=True)


def _set_stage(r: _Run, stage: str) -> None:
    """Trainable parameters, optimizer and train/eval mode of ``stage``; a fresh AdamW."""
    c = r.config
    params = trainable_parameters(r.student, "cores" if stage == "transfer" else c.finetune)
    r.optimizer = torch.optim.AdamW(params, lr=c.transfer_lr if stage == "transfer" else c.finetune_lr, betas=(0.9, 0.95),
                                    weight_decay=0.0)
    # Transfer matches the teacher's deterministic outputs: no dropout in the student either.
    r.student.train(stage == "finetune")
    r.stage = stage


def _optimizer(r: _Run) -> torch.optim.Optimizer:
    """The optimizer of the stage in progress (:func:`_set_stage` creates it)."""
    if r.optimizer is None:
        raise RuntimeError("no stage has been set: the optimizer comes with the stage (_set_stage)")
    return r.optimizer


def _restore(r: _Run, ckpt: str, meta: dict[str, Any]) -> int:
    load_weights(ckpt, r.student)
    state = load_trainer_state(ckpt)
    step = int(meta["step"])
    if step < r.config.steps:
        _set_stage(r, r.config.stage(step + 1))
        if state["stage"] == r.stage:
            _optimizer(r).load_state_dict(state["optimizer"])
    set_rng_state(state["rng"], r.student)
    r.step_times = state["step_times"].tolist()
    r.last_checkpoint = ckpt
    return step


def _loop(r: _Run, start: int, progress: bool, on_step: Callable[[int], None] | None, reached: Progress) -> None:
    """Steps ``start + 1 .. steps`` of both stages (the module docstring says why not
    :func:`flt.train.loop.run_steps`)."""
    c = r.config
    bar = progress_bar(c.steps, start, f"linearize {c.attention}") if progress else None
    try:
        for step in range(start + 1, c.steps + 1):
            if r.stage != c.stage(step):
                _set_stage(r, c.stage(step))
            t0 = time.perf_counter()
            loss, layers = _train_step(r, step)
            r.step_times.append(time.perf_counter() - t0)
            values = {"loss": loss, "lr": c.lr_at(step), "stage": r.stage}
            r.logger.log(step, "transfer" if layers is not None else "train", **values, **(layers or {}))
            stage_end = step in (c.transfer_steps, c.steps)
            if step % c.eval_every == 0 or stage_end:
                valid = _evaluate(r, r.student)
                r.logger.log(step, "valid", stage=r.stage, **valid)
                if r.stage == "transfer" and step == c.transfer_steps:
                    r.logger.log(step, "matching", **_matching(r))
                message = f"step {step} ({r.stage}): valid ppl {valid[METRIC]:.4g}"
                bar.write(message) if bar is not None else print(message, flush=True)
            if step % c.checkpoint_every == 0 or stage_end:
                _checkpoint(r, step)
            reached.step = step
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{r.stage} loss {loss:.4g}")
            if on_step is not None:
                on_step(step)
    finally:
        if bar is not None:
            bar.close()


def _train_step(r: _Run, step: int) -> tuple[float, dict[str, list[float]] | None]:
    """One optimizer step: ``(loss, per-layer matching losses or None)``: in transfer each
    layer's output error (``layers``) and, when weights are matched, its weights' KL (``kl``)."""
    c, optimizer = r.config, _optimizer(r)
    for group in optimizer.param_groups:
        group["lr"] = c.lr_at(step)
    batch = window_batch(r.train_ids, step, c.batch_size, c.seq_len, c.seed).to(r.device)
    layers = None
    if r.stage == "transfer":
        losses = r.matching.losses(batch[:, :-1])
        loss = transfer_loss(losses, c.transfer)
        layers = {"layers": losses["outputs"].detach().tolist()}
        if "weights" in losses:
            layers["kl"] = losses["weights"].detach().tolist()
    else:
        loss = next_token_loss(r.student, batch)
    value = float(loss.detach())
    if not math.isfinite(value):
        where = f"the last checkpoint, {r.last_checkpoint}, is intact" if r.last_checkpoint else "no checkpoint was written yet"
        raise TrainingDiverged(f"the {r.stage} loss is {value} at step {step} of {c.steps} in {r.out_dir}; {where}; "
                               f"lower the {r.stage} learning rate")
    loss.backward()
    if c.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], c.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value, layers


def _checkpoint(r: _Run, step: int) -> None:
    state = {"step": step, "stage": r.stage, "optimizer": _optimizer(r).state_dict(), "rng": rng_state(r.student),
             "step_times": torch.tensor(r.step_times, dtype=torch.float64)}
    r.last_checkpoint = save_checkpoint(r.out_dir, step, r.student, config=r.record, trainer_state=state,
                                        keep=r.config.keep_checkpoints)


def _finish(r: _Run, plots: bool, wall_start: float) -> dict[str, Any]:
    """``summary.json`` from the records (a resumed run has the earlier ones too), the
    linearised model in ``model/`` and the plot."""
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
    times = {stage: [t for i, t in enumerate(r.step_times, 1) if c.stage(i) == stage] for stage in ("transfer", "finetune")}
    memory, memory_kind = peak_memory_mib(r.device)
    summary = {
        **r.record, "attention": c.attention, "attention_options": c.attention_options, "metric": METRIC,
        "steps": c.steps, "transfer_steps": c.transfer_steps, "finetune_steps": c.finetune_steps, "finetune": c.finetune,
        "transfer": c.transfer,
        "ppl": ppl, "ppl_ratio": final / ppl["softmax"], "eval_tokens": softmax["tokens"],
        "matching_error": {"before": matching.get(0), "after": matching.get(c.transfer_steps) if c.transfer_steps else None},
        "weights_kl": {"before": kl.get(0), "after": kl.get(c.transfer_steps) if c.transfer_steps else None},
        "time_per_step_s": {k: statistics.median(v) if v else None for k, v in times.items()},
        "train_time_s": sum(r.step_times), "wall_time_s": time.perf_counter() - wall_start,
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


def _save_model(r: _Run) -> None:
    """``save_pretrained`` into a temporary directory renamed into place, so ``model/`` is
    complete or absent."""
    atomic_dir(r.out_dir, "model", r.student.save_pretrained)
