"""The search: train a supernet, then decide its slots one by one by perturbation.

:func:`search` runs a :class:`flt.train.Preset` (the model and budget of one training run)
with every block's attention replaced by a mixed op over the candidates
(:mod:`flt.search.mixed`), in a run directory:

1. **Supernet**, ``run.steps`` steps of the training loop (:mod:`flt.train.loop`: the
   learning-rate schedule, batches, redraws, gradient clipping, checkpoints and resume of
   ``preset.run``) with the search as its client (:class:`flt.search.supernet.Supernet`):
   each step first updates the architecture weights ``alpha`` on a batch of the held-out
   part of the training split (:mod:`flt.search.holdout`; first order: the gradient at the
   current weights), then the network weights on a training batch. ``SearchConfig.fixed_alpha`` keeps ``alpha`` at
   zero (uniform mixing) and skips its update.
2. **Selection**: the slots are visited in a random order drawn from the seed; each is
   measured by perturbation and decided (:func:`flt.search.select.select_slot`, on the
   held-out part, the model on its fixed evaluation draw), then the supernet is fine-tuned
   for ``tune_steps`` steps (weights, and ``alpha`` of the slots still undecided) at the
   schedule's final learning rate. The magnitude choice (``argmax alpha`` at the end of the
   supernet phase) is recorded for every slot alongside.

Files: ``search.json`` (the result, rewritten after every decision), ``search.png``,
``checkpoints/`` (:mod:`flt.train.checkpoint`: atomic, hashed, trainer state loaded with
``weights_only=True``). ``resume=True`` continues from the latest checkpoint (during the
supernet phase, or after the last decided slot) and ends with the result of an
uninterrupted search, bit for bit on the CPU.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from flt._io import atomic_write_json
from flt.models.config import TrunkConfig
from flt.search.config import SearchConfig
from flt.search.holdout import holdout_seed, split_task
from flt.search.mixed import (
    MixedOp,
    attention_blocks,
    build_supernet,
    check_candidates,
    check_posenc_candidates,
    encoding_owner,
)
from flt.search.supernet import Supernet, empty_progress
from flt.tasks import Task, check_preset, config_to_dict, holdout_tasks
from flt.tasks.preset import Preset, preset_to_dict, record_differences
from flt.train import distributed as D
from flt.train.checkpoint import CONFIG_FILE, has_checkpoint, load_trainer_state, locate_checkpoint
from flt.train.lock import lock_run_dir
from flt.train.loop import (
    Origin,
    Progress,
    Run,
    load_data,
    restore,
    resumable_checkpoint,
    run_steps,
    weights_optimizer,
)
from flt.train.rng import seed_everything

__all__ = ["SearchConfig", "SearchInterrupted", "check_search", "search", "supernet_model"]

RESULT = "search.json"


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`search`; ``checkpoint`` is where ``resume=True`` starts (or None)."""

    def __init__(self, out_dir: str, step: int, checkpoint: str | None):
        super().__init__(f"search in {out_dir} interrupted after step {step}")
        self.out_dir, self.step, self.checkpoint = out_dir, step, checkpoint


def check_search(preset: Preset, config: SearchConfig) -> None:
    """Everything that can be checked before data loads: the preset, the task, and that
    every candidate constructs at the model's width and position geometry."""
    task_cls = check_preset(preset)
    if task_cls.name not in holdout_tasks():
        raise ValueError(f"flt search supports the tasks {', '.join(holdout_tasks())}; got {task_cls.name!r}")
    # The preset's model with what the data sets of its geometry: cheap, and it tells the
    # position dimension and causality of its attention layers.
    probe_cfg = task_cls.probe_config(preset.model, preset.data)
    if getattr(preset.model, "layer_attention", None) is not None:
        raise ValueError("flt search mixes every layer itself; leave out layer_attention")
    probe = task_cls.build_model(probe_cfg)
    block, attr = attention_blocks(probe)[0]
    attn = getattr(block, attr)
    check_candidates(list(config.candidates), dim=attn.dim, heads=attn.heads, pos_dim=attn.pos_dim, causal=attn.causal)
    if config.posenc_candidates:
        encoding_owner(probe)
        check_posenc_candidates(list(config.posenc_candidates), dim=attn.dim, pos_dim=attn.pos_dim)
    # The supernet itself, for the model's own constraints on its mechanisms
    # (:meth:`flt.tasks.Task.constrain_supernet`).
    supernet_model(task_cls, probe_cfg, config)


def supernet_model(task: type[Task], model_cfg: TrunkConfig, config: SearchConfig, *,
                   device: torch.device | str | None = None) -> torch.nn.Module:
    """The supernet of the search: ``task``'s model of ``model_cfg`` with every layer's
    attention (and, with ``config.posenc_candidates``, the absolute encoding) mixed over the
    candidates (:func:`flt.search.mixed.build_supernet`), under the task's constraints on
    its mechanisms (:meth:`flt.tasks.Task.constrain_supernet`)."""
    model = task.build_model(model_cfg, device=device)
    build_supernet(model, list(config.candidates), frozen=config.fixed_alpha,
                   posenc_candidates=list(config.posenc_candidates) or None)
    task.constrain_supernet(model, model_cfg)
    return model


def _record(preset: Preset, config: SearchConfig) -> dict[str, Any]:
    return {"preset": preset_to_dict(preset), "search": config.to_dict()}


def search(preset: Preset, config: SearchConfig, out_dir: str, *, resume: bool = False, device: str = "cpu",
           progress: bool = True, plots: bool = True, say: Callable[[str], None] | None = None,
           on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run the search of ``preset`` with ``config`` in ``out_dir``; returns the result (also
    in ``search.json``). ``say`` receives the progress lines (default: print when
    ``progress``); ``on_step`` is called with the step number after every step.

    Raises:
        SearchInterrupted: on Ctrl-C; ``resume=True`` continues from the last checkpoint.
    """
    say = say or ((lambda text: print(text, flush=True)) if progress else (lambda text: None))
    check_search(preset, config)
    ctx = D.setup(device)
    if ctx.world > 1:
        D.teardown(ctx)
        raise ValueError("flt search runs in one process")
    reached = Progress(steps=preset.run.steps)
    lock = None
    try:
        # One writer per directory, as for flt train (flt.train.lock).
        lock = lock_run_dir(out_dir, "flt search")
        if lock.note:
            say(lock.note)
        return _search(preset, config, out_dir, ctx, resume=resume, plots=plots, say=say, on_step=on_step, reached=reached)
    except KeyboardInterrupt as e:
        raise SearchInterrupted(out_dir, reached.step, resumable_checkpoint(out_dir)) from e
    finally:
        if lock is not None:
            lock.release()
        D.teardown(ctx)


def _search(preset: Preset, config: SearchConfig, out_dir: str, ctx: D.Context, *, resume: bool, plots: bool,
            say: Callable[[str], None], on_step: Callable[[int], None] | None, reached: Progress) -> dict[str, Any]:
    """The training loop's steps with the search as their client (:class:`Supernet`): the
    data and its held-out part, the supernet, the restored checkpoint, the supernet's
    steps, then the selection step and the result."""
    wall, run = time.perf_counter(), preset.run
    record = _record(preset, config)
    origin, progress = _origin(out_dir, record, resume, say)
    task, model_cfg = load_data(preset, ctx)
    weights_task, alpha_task = split_task(task, config.holdout, holdout_seed(type(task), preset.data))
    seed_everything(run.seed)
    model = supernet_model(type(task), model_cfg, config, device=ctx.device)
    supernet = Supernet(model, config, alpha_task, run, ctx, progress, say)
    optimizer = weights_optimizer(model, run, exclude=supernet.alphas)
    start, window, step_times = restore(origin, model, optimizer, run, ctx, supernet)
    reached.step = start
    r = Run(run=run, out_dir=out_dir, ctx=ctx, task=weights_task, model=model, ddp=model, optimizer=optimizer,
            record={**record, "model": config_to_dict(model_cfg)}, start=start, window=window, step_times=step_times,
            last_checkpoint=origin.checkpoint, hooks=supernet,
            clipped=[p for group in optimizer.param_groups for p in group["params"]])
    _announce(r, preset.task, supernet, say)

    def write(step: int, done: bool = False) -> dict[str, Any]:
        result = _result(preset, config, model_cfg, progress, supernet.slots, task, step, done=done)
        if done:
            result.update(final_metric=supernet.holdout_metric(), wall_time_s=time.perf_counter() - wall)
        atomic_write_json(os.path.join(out_dir, RESULT), result, indent=2)
        return result

    run_steps(r, None, None, say, on_step, reached)
    step = supernet.select(r, max(start, run.steps), reached, on_step, write)
    if not progress["slots"]:
        raise ValueError("the model has no slots to decide")
    return _finish(write(step, done=True), out_dir, plots, say)


def _origin(out_dir: str, record: dict[str, Any], resume: bool, say: Callable[[str], None]) -> tuple[Origin, dict[str, Any]]:
    """``(where the search starts, its progress so far)``: a fresh start in a directory
    that holds no search yet, or the latest checkpoint of the same configuration."""
    if not resume:
        if has_checkpoint(out_dir):
            raise ValueError(f"{out_dir} already holds a search; pass --resume to continue it or choose another --out-dir")
        return Origin(), empty_progress()
    ckpt, meta = locate_checkpoint(out_dir, report=say)
    diffs = _differences(meta, record)
    if diffs:
        raise ValueError(f"--resume needs the configuration of the search in {out_dir}; these differ: {', '.join(diffs)}")
    if "optimizer" not in load_trainer_state(ckpt, int(meta["step"])):
        raise ValueError(f"{ckpt} was written by an earlier version of flt search, whose checkpoints this one does not "
                         "resume; start the search again in another --out-dir")
    steps = record["preset"]["run"]["steps"]
    progress = meta.get("progress")
    if not (isinstance(progress, dict) and all(isinstance(progress.get(k), list) for k in ("slots", "history"))
            and isinstance(progress.get("seconds"), dict)) or int(meta["step"]) > steps:
        raise ValueError(f"{os.path.join(ckpt, CONFIG_FILE)} is not the checkpoint of a search of this configuration "
                         "(its progress record or step does not read); start the search again in another --out-dir")
    return Origin(ckpt, int(meta["step"]), steps), progress


def _announce(r: Run, task: str, supernet: Supernet, say: Callable[[str], None]) -> None:
    """The first lines: where a resumed search continues, what the supernet mixes."""
    run, config = r.run, supernet.config
    parameters = sum(p.numel() for p in r.model.parameters())
    if r.last_checkpoint is not None:
        say(f"resuming the search in {r.out_dir} from step {r.start} "
            f"({len(supernet.progress['slots'])} of {len(supernet.slots)} slots decided)")
    posenc_labels = [c.label for c in config.posenc_candidates]
    say(f"{task} search over {', '.join(c.label for c in config.candidates)}"
        + (f" and the absolute encodings {', '.join(posenc_labels)}" if posenc_labels else "")
        + f": {len(supernet.slots)} slots, {parameters:,} parameters in the supernet, "
        f"{run.steps} supernet steps, {config.tune_steps} fine-tuning steps per decision"
        + (", alpha frozen uniform" if config.fixed_alpha else ""))


def _finish(result: dict[str, Any], out_dir: str, plots: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """The last lines and ``search.png``."""
    say(f"perturbation: {', '.join(result['perturbation'])}")
    if result["magnitude"] is not None:
        say(f"magnitude:    {', '.join(result['magnitude'])}")
    if result.get("posenc") is not None:
        say("absolute encoding: perturbation " + result["posenc"]["perturbation"]
            + (f", magnitude {result['posenc']['magnitude']}" if result["posenc"]["magnitude"] is not None else ""))
    if plots:
        from flt.search.plots import plot_search

        plot_search(result, os.path.join(out_dir, "search.png"))
        say(f"done: {os.path.join(out_dir, RESULT)}, {os.path.join(out_dir, 'search.png')}")
    else:
        say(f"done: {os.path.join(out_dir, RESULT)}")
    return result


def _differences(meta: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """Dotted names of what differs between a checkpoint's configuration and ``record``."""
    if not isinstance(meta.get("preset"), dict) or not isinstance(meta.get("search"), dict):
        return ["the checkpoint is not a search's"]
    diffs = [f"preset.{d}" for d in record_differences(meta["preset"], record["preset"])]
    saved, now = json.loads(json.dumps(meta["search"])), json.loads(json.dumps(record["search"]))
    diffs += [f"search.{k}" for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    return diffs


def _result(preset: Preset, config: SearchConfig, model_cfg: TrunkConfig, progress: dict[str, Any], slots: list[MixedOp],
            task: Task, step: int, *, done: bool) -> dict[str, Any]:
    """The contents of ``search.json``. The attention slots are ``slots`` (by layer) and
    ``perturbation`` / ``magnitude`` (a label per layer); a searched absolute encoding is
    ``posenc_slot`` (its record, as a layer's) and ``posenc`` (``perturbation`` and
    ``magnitude`` labels), absent from a search that does not mix it."""
    layers = [e for e in progress["slots"] if e["layer"] != "posenc"]
    by_layer = sorted(layers, key=lambda e: e["layer"])
    depth = len(slots) - (1 if config.posenc_candidates else 0)
    magnitude, alpha_end = progress["magnitude"], progress["alpha_end"]
    out = {
        "format": "flt-search-1",
        "task": preset.task,
        "metric": task.metric,
        "higher_is_better": task.higher_is_better,
        "complete": done,
        "preset": preset_to_dict(preset),
        "model": config_to_dict(model_cfg),
        "search": config.to_dict(),
        "candidates": [c.to_dict() for c in config.candidates],
        "order": [e["layer"] for e in progress["slots"]],
        "slots": by_layer,
        "perturbation": [e["chosen"] for e in by_layer] if done else None,
        "magnitude": magnitude[:depth] if magnitude is not None else None,
        "alpha_end": alpha_end[:depth] if alpha_end is not None else None,
        "history": progress["history"],
        "steps": step,
        "seconds": progress["seconds"],
    }
    if config.posenc_candidates:
        entry = next((e for e in progress["slots"] if e["layer"] == "posenc"), None)
        out["posenc_candidates"] = [c.to_dict() for c in config.posenc_candidates]
        out["posenc_slot"] = entry
        out["posenc_alpha_end"] = alpha_end[depth] if alpha_end is not None else None
        out["posenc"] = {
            "perturbation": entry["chosen"] if done and entry is not None else None,
            "magnitude": magnitude[depth] if magnitude is not None else None,
        } if done else None
    return out
