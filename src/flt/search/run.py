"""The search: train a supernet, then decide its slots one by one by perturbation.

:func:`search` runs a :class:`flt.train.Preset` (the model and budget of one training run)
with every block's attention replaced by a mixed op over the candidates
(:mod:`flt.search.mixed`), in a run directory:

1. **Supernet**, ``run.steps`` steps (``preset.run``'s learning-rate schedule, batches,
   redraws, gradient clipping): each step first updates the architecture weights
   ``alpha`` on a batch of the held-out part of the training split
   (:mod:`flt.search.holdout`; first order: the gradient at the current weights), then the
   network weights on a training batch. ``SearchConfig.fixed_alpha`` keeps ``alpha`` at
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
from dataclasses import asdict, dataclass
from typing import Any

import torch

from flt._io import atomic_write_text
from flt.models.config import config_to_dict, replace_fields
from flt.search.holdout import SUPPORTED, heldout_batch_size, split_task
from flt.search.mixed import (
    Candidate,
    EncodingCandidate,
    attention_blocks,
    build_supernet,
    check_candidates,
    check_posenc_candidates,
    encoding_owner,
    encoding_slot,
    mixed_slots,
)
from flt.search.select import magnitude_choice, select_slot
from flt.tasks import check_preset, load_task, step_generator
from flt.tasks.preset import Preset, preset_to_dict, record_differences
from flt.train import distributed as D
from flt.train import drawgap as DG
from flt.train.checkpoint import (
    find_checkpoint,
    has_checkpoint,
    load_trainer_state,
    load_weights,
    read_checkpoint_config,
    save_checkpoint,
)
from flt.train.lock import lock_run_dir
from flt.train.loop import _to_device, evaluate, parameter_groups
from flt.train.rng import rng_state, seed_everything, set_rng_state

__all__ = ["SearchConfig", "SearchInterrupted", "check_search", "search", "supernet_model"]

#: ``step_generator`` stream of the order in which slots are decided.
ORDER_STREAM = 11
#: Seed offset of the held-out batches (they must not repeat the training batches' order).
ALPHA_SEED_OFFSET = 104729
RESULT = "search.json"


@dataclass(frozen=True)
class SearchConfig:
    """What the search does besides the preset's training run.

    Args:
        candidates: the mechanisms every slot chooses from (:func:`flt.search.mixed.parse_candidates`).
        tune_steps: fine-tuning steps after each decision.
        alpha_lr, alpha_weight_decay: Adam on ``alpha`` (betas 0.5, 0.999).
        fixed_alpha: keep ``alpha`` uniform (no architecture updates).
        holdout: fraction of the training split held out for ``alpha`` and selection.
        posenc_candidates: the absolute encodings the model's encoding slot chooses from
            (:func:`flt.search.mixed.parse_posenc_candidates`); empty (the default): the
            preset's encoding, not searched.
    """

    candidates: tuple[Candidate, ...]
    tune_steps: int = 20
    alpha_lr: float = 3e-3
    alpha_weight_decay: float = 1e-3
    fixed_alpha: bool = False
    holdout: float = 0.2
    posenc_candidates: tuple[EncodingCandidate, ...] = ()

    def __post_init__(self):
        if len(self.candidates) < 2:
            raise ValueError(f"a search needs at least two candidates, got {len(self.candidates)}")
        if len(self.posenc_candidates) == 1:
            raise ValueError("posenc_candidates needs at least two encodings to choose from (or none: the encoding is not searched)")
        if isinstance(self.tune_steps, bool) or not isinstance(self.tune_steps, int) or self.tune_steps < 0:
            raise ValueError(f"tune_steps must be a non-negative integer, got {self.tune_steps!r}")
        if not self.alpha_lr > 0:
            raise ValueError(f"alpha_lr must be positive, got {self.alpha_lr!r}")
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, (int, float)) or not 0 < self.holdout < 1:
            raise ValueError(f"holdout must be a fraction in (0, 1), got {self.holdout!r}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["candidates"] = [c.to_dict() for c in self.candidates]
        if self.posenc_candidates:
            out["posenc_candidates"] = [c.to_dict() for c in self.posenc_candidates]
        else:
            del out["posenc_candidates"]  # the record of a search that does not mix the encoding is as before
        return out


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`search`; ``checkpoint`` is where ``resume=True`` starts (or None)."""

    def __init__(self, out_dir: str, step: int, checkpoint: str | None):
        super().__init__(f"search in {out_dir} interrupted after step {step}")
        self.out_dir, self.step, self.checkpoint = out_dir, step, checkpoint


def check_search(preset: Preset, config: SearchConfig) -> None:
    """Everything that can be checked before data loads: the preset, the task, and that
    every candidate constructs at the model's width and position geometry."""
    task_cls = check_preset(preset)
    if task_cls.name not in SUPPORTED:
        raise ValueError(f"flt search supports the tasks {', '.join(SUPPORTED)}; got {task_cls.name!r}")
    if task_cls.name == "graph" and getattr(preset.model, "encoder", "transformer") != "transformer":
        raise ValueError(f"flt search graph chooses the attention of the transformer encoder; encoder={preset.model.encoder!r} "
                         "has no attention layers (leave out --model-opt encoder=)")
    if getattr(preset.model, "layer_attention", None) is not None:
        raise ValueError("flt search mixes every layer itself; leave out layer_attention")
    # The preset's model with its default data-dependent fields: cheap, and it tells the
    # position dimension and causality of its attention layers.
    probe_cfg = preset.model
    if task_cls.name == "graph":
        # The width of the positions the graph's data gives (the anchors by default).
        positions = preset.data.get("positions", "anchor")
        width = {"rwse": preset.data.get("walk_steps", 16), "laplacian": preset.data.get("eigenvectors", 16)}.get(positions)
        if isinstance(width, int) and not isinstance(width, bool) and width > 0:
            probe_cfg = replace_fields(probe_cfg, in_dim=width)
    probe = task_cls.build_model(probe_cfg)
    block, attr = attention_blocks(probe)[0]
    attn = getattr(block, attr)
    check_candidates(list(config.candidates), dim=attn.dim, heads=attn.heads, pos_dim=attn.pos_dim, causal=attn.causal)
    if config.posenc_candidates:
        encoding_owner(probe)
        check_posenc_candidates(list(config.posenc_candidates), dim=attn.dim, pos_dim=attn.pos_dim)
    # The supernet itself, for the model's own constraints on its mechanisms (the molecule
    # model's isotropic spectra).
    supernet_model(task_cls, probe_cfg, config)


def supernet_model(task, model_cfg, config: SearchConfig, *, device=None):
    """The supernet of the search: ``task``'s model of ``model_cfg`` with every layer's
    attention (and, with ``config.posenc_candidates``, the absolute encoding) mixed over the
    candidates (:func:`flt.search.mixed.build_supernet`). A molecule model with
    ``isotropic`` ties the per-axis length scales of its candidates' radial spectra as it
    ties its own (a candidate with another spectrum is refused, as ``flt train`` refuses it)."""
    model = task.build_model(model_cfg, device=device)
    build_supernet(model, list(config.candidates), frozen=config.fixed_alpha,
                   posenc_candidates=list(config.posenc_candidates) or None)
    if getattr(model_cfg, "isotropic", False) and task.name == "molecule":
        from flt.models.molecule import tie_isotropic

        try:
            tie_isotropic(model.trunk)
        except ValueError as err:
            raise ValueError(f"--candidates: a candidate of the molecule model does not fit isotropic=true: {err}") from None
    return model


def _record(preset: Preset, config: SearchConfig) -> dict[str, Any]:
    return {"preset": preset_to_dict(preset), "search": config.to_dict()}


def search(
    preset: Preset,
    config: SearchConfig,
    out_dir: str,
    *,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
    plots: bool = True,
    say: Callable[[str], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
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
    state = {"step": 0}
    lock = None
    try:
        # One writer per directory, as for flt train (flt.train.lock).
        lock = lock_run_dir(out_dir, "flt search")
        if lock.note:
            say(lock.note)
        return _search(preset, config, out_dir, ctx, resume=resume, plots=plots, say=say, on_step=on_step, state=state)
    except KeyboardInterrupt as e:
        try:
            ckpt = find_checkpoint(out_dir, report=lambda m: None)
        except (FileNotFoundError, ValueError):
            ckpt = None
        raise SearchInterrupted(out_dir, state["step"], ckpt) from e
    finally:
        if lock is not None:
            lock.release()
        D.teardown(ctx)


def _search(preset, config, out_dir, ctx, *, resume, plots, say, on_step, state) -> dict[str, Any]:
    wall = time.perf_counter()
    run = preset.run
    record = _record(preset, config)
    progress_record: dict[str, Any] = {"slots": [], "magnitude": None, "alpha_end": None, "history": [],
                                       "seconds": {"supernet": 0.0, "selection": 0.0}}
    ckpt = None
    if resume:
        ckpt = find_checkpoint(out_dir, report=say)
        meta = read_checkpoint_config(ckpt)
        diffs = _differences(meta, record)
        if diffs:
            raise ValueError(f"--resume needs the configuration of the search in {out_dir}; these differ: {', '.join(diffs)}")
        progress_record = meta["progress"]
    elif has_checkpoint(out_dir):
        raise ValueError(f"{out_dir} already holds a search; pass --resume to continue it or choose another --out-dir")

    # Data, then the model from the seed alone (as flt train does).
    seed_everything(run.seed)
    task = load_task(preset.task, preset.data)
    model_cfg = task.configure(preset.model)
    weights_task, alpha_task = split_task(task, config.holdout, holdout_seed(preset))
    seed_everything(run.seed)
    model = supernet_model(task, model_cfg, config, device=ctx.device)
    # The slots: every layer's attention, then the absolute encoding when it is searched.
    slots = mixed_slots(model)
    depth = len(slots)
    encoding = encoding_slot(model)
    if encoding is not None:
        slots.append(encoding)
    names = [*range(depth), *(["posenc"] if encoding is not None else [])]
    alpha_batch = heldout_batch_size(alpha_task, run.batch_size)
    alphas = [s.alpha for s in slots]
    alpha_ids = {id(a) for a in alphas}
    groups = [{**g, "params": [p for p in g["params"] if id(p) not in alpha_ids]} for g in parameter_groups(model, run.weight_decay)]
    w_opt = torch.optim.AdamW(groups, lr=run.lr, betas=(0.9, 0.95))
    a_opt = torch.optim.Adam(alphas, lr=config.alpha_lr, betas=(0.5, 0.999), weight_decay=config.alpha_weight_decay)
    full = {"preset": record["preset"], "search": record["search"], "model": config_to_dict(model_cfg)}

    step = 0
    if ckpt is not None:
        load_weights(ckpt, model)
        trainer = load_trainer_state(ckpt)
        w_opt.load_state_dict(trainer["weights_optimizer"])
        a_opt.load_state_dict(trainer["alpha_optimizer"])
        set_rng_state(trainer["rng"], model)
        step = int(trainer["step"])
        for s in slots:
            if s.is_decided:
                s.alpha.requires_grad_(False)
        say(f"resuming the search in {out_dir} from step {step} ({len(progress_record['slots'])} of {len(slots)} slots decided)")
    else:
        torch.manual_seed(run.seed + 7919)
    state["step"] = step
    labels = [c.label for c in config.candidates]
    posenc_labels = [c.label for c in config.posenc_candidates]
    n_params = sum(p.numel() for p in model.parameters())
    say(f"{preset.task} search over {', '.join(labels)}"
        + (f" and the absolute encodings {', '.join(posenc_labels)}" if posenc_labels else "")
        + f": {len(slots)} slots, {n_params:,} parameters in the supernet, "
        f"{run.steps} supernet steps, {config.tune_steps} fine-tuning steps per decision"
        + (", alpha frozen uniform" if config.fixed_alpha else ""))

    def checkpoint(at: int) -> None:
        trainer = {"step": at, "weights_optimizer": w_opt.state_dict(), "alpha_optimizer": a_opt.state_dict(),
                   "rng": rng_state(model)}
        save_checkpoint(out_dir, at, model, config={**full, "progress": progress_record}, trainer_state=trainer,
                        keep=run.keep_checkpoints)

    def holdout_metric() -> float:
        with DG.evaluation_draw(model, run):
            return evaluate(alpha_task, model, ctx, run.eval_batch_size or run.batch_size, run.eval_batches)[task.metric]

    def train_step(at: int, lr: float) -> float:
        DG.redraw_for_step(model, run, at)
        if not config.fixed_alpha and any(a.requires_grad for a in alphas):
            a_opt.zero_grad(set_to_none=True)
            batch = _to_device(alpha_task.train_batch(at, alpha_batch, run.seed + ALPHA_SEED_OFFSET, 0, 1), ctx.device)
            alpha_task.loss(model, batch).backward()
            a_opt.step()
        # The held-out loss left gradients on the weights too: the weights learn from the
        # training batch alone.
        a_opt.zero_grad(set_to_none=True)
        w_opt.zero_grad(set_to_none=True)
        for g in w_opt.param_groups:
            g["lr"] = lr
        batch = _to_device(weights_task.train_batch(at, run.batch_size, run.seed, 0, 1), ctx.device)
        loss = weights_task.loss(model, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the supernet's training loss is {float(loss)} at step {at}; lower --lr")
        loss.backward()
        if run.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_([p for g in w_opt.param_groups for p in g["params"]], run.grad_clip)
        w_opt.step()
        w_opt.zero_grad(set_to_none=True)
        a_opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    model.train()
    # 1. Supernet.
    t0 = time.perf_counter()
    while step < run.steps:
        step += 1
        loss = train_step(step, run.lr_at(step))
        state["step"] = step
        if step % run.eval_every == 0 or step == run.steps:
            metric = holdout_metric()
            mix = {label: p for label, p in zip(labels, _mean_probabilities(slots[:depth]))}
            progress_record["history"].append({"step": step, "loss": loss, task.metric: metric,
                                               "alpha": [s.probabilities().tolist() for s in slots]})
            say(f"supernet step {step}/{run.steps}: loss {loss:.4g}, held-out {task.metric} {metric:.4g}; mean softmax(alpha) "
                + "  ".join(f"{k} {v:.3f}" for k, v in mix.items())
                + ("; encoding " + "  ".join(f"{k} {v:.3f}" for k, v in zip(posenc_labels, encoding.probabilities().tolist()))
                   if encoding is not None else ""))
        if step % run.checkpoint_every == 0 or step == run.steps:
            if step == run.steps:
                # With alpha frozen uniform the argmax says nothing: no magnitude choice.
                progress_record["magnitude"] = None if config.fixed_alpha else [s.labels[magnitude_choice(s)] for s in slots]
                progress_record["alpha_end"] = [s.probabilities().tolist() for s in slots]
            progress_record["seconds"]["supernet"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            checkpoint(step)
        if on_step is not None:
            on_step(step)
    progress_record["seconds"]["supernet"] += time.perf_counter() - t0

    # 2. Selection, one slot at a time in a seeded order.
    order = torch.randperm(len(slots), generator=step_generator(run.seed, 0, ORDER_STREAM)).tolist()
    tune_lr = run.lr_at(run.steps)
    for index in order:
        if slots[index].is_decided:
            continue
        t0 = time.perf_counter()
        model.eval()
        entry = select_slot(slots[index], holdout_metric, task.higher_is_better)
        model.train()
        entry = {"layer": names[index], **entry, "magnitude": progress_record["magnitude"][index] if not config.fixed_alpha else None}
        removed = "  ".join(f"{k} {v:.4g}" for k, v in entry["removed"].items())
        where = "absolute encoding" if names[index] == "posenc" else f"layer {index}"
        say(f"slot {len(progress_record['slots']) + 1}/{len(slots)} ({where}): held-out {task.metric} {entry['metric']:.4g}; "
            f"without each candidate: {removed}; chosen {entry['chosen']}"
            + (f" (magnitude: {entry['magnitude']})" if entry["magnitude"] is not None else ""))
        for _ in range(config.tune_steps):
            step += 1
            train_step(step, tune_lr)
            state["step"] = step
            if on_step is not None:
                on_step(step)
        entry["tuned_metric"] = holdout_metric() if config.tune_steps else entry["metric"]
        progress_record["slots"].append(entry)
        progress_record["seconds"]["selection"] += time.perf_counter() - t0
        checkpoint(step)
        result = _result(preset, config, model_cfg, progress_record, slots, task, step, done=False)
        atomic_write_text(os.path.join(out_dir, RESULT), json.dumps(result, indent=2))

    if not progress_record["slots"]:
        raise ValueError("the model has no slots to decide")
    result = _result(preset, config, model_cfg, progress_record, slots, task, step, done=True)
    result["final_metric"] = holdout_metric()
    result["wall_time_s"] = time.perf_counter() - wall
    atomic_write_text(os.path.join(out_dir, RESULT), json.dumps(result, indent=2))
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


def _mean_probabilities(slots) -> list[float]:
    probs = torch.stack([s.probabilities() for s in slots])
    return probs.mean(0).tolist()


def _result(preset, config, model_cfg, progress, slots, task, step, *, done: bool) -> dict[str, Any]:
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


def holdout_seed(preset: Preset) -> int:
    """The seed of the held-out draw: the data's own seed (``split_seed`` of molecules,
    ``seed`` of graphs; 0 without one)."""
    for key in ("split_seed", "seed"):
        value = preset.data.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0
