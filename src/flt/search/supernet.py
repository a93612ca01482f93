"""The search's side of the training loop: the architecture step, the held-out progress
lines and the selection step, plugged into :mod:`flt.train.loop` as a
:class:`~flt.train.loop.StepHooks` client.

The loop runs the supernet's steps as it runs a training run's (data, redraws, weights
step, gradient clipping, checkpoints, resume); :class:`Supernet` adds what the search needs:

* before every weights step, the architecture step: ``alpha`` learns (first order, Adam)
  from a batch of the held-out part of the training split (:mod:`flt.search.holdout`);
* the periodic evaluation is on the held-out part, never the validation split, and records
  ``softmax(alpha)`` in the history;
* every checkpoint holds ``alpha``'s optimizer and the search's progress (history,
  decisions, magnitude choices), so that a resumed search ends as an uninterrupted one;
* :meth:`Supernet.select`, the selection step: the slots are decided by perturbation in a
  seeded order, each decision followed by fine-tuning steps of the same loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from flt.search.mixed import MixedOp, encoding_slot, mixed_slots
from flt.search.select import magnitude_choice, select_slot
from flt.tasks import Task, step_generator
from flt.tasks.preset import RunConfig
from flt.train import distributed as D
from flt.train.loop import (
    Progress,
    Run,
    StepHooks,
    checkpoint_step,
    evaluate_on_draw,
    to_device,
    train_step,
)
from flt.train.metrics import MetricsLogger

if TYPE_CHECKING:
    from flt.search.config import SearchConfig

__all__ = ["ALPHA_SEED_OFFSET", "ORDER_STREAM", "Supernet", "empty_progress"]

#: ``step_generator`` stream of the order in which slots are decided.
ORDER_STREAM = 11
#: Seed offset of the held-out batches (they must not repeat the training batches' order).
ALPHA_SEED_OFFSET = 104729


def empty_progress() -> dict[str, Any]:
    """The progress of a search that has not started: what every checkpoint saves."""
    return {"slots": [], "magnitude": None, "alpha_end": None, "history": [], "seconds": {"supernet": 0.0, "selection": 0.0}}


class Supernet(StepHooks):
    """The slots of ``model`` (every layer's mixed attention, then the mixed absolute
    encoding if any), ``alpha``'s optimizer and the search's ``progress`` record.

    Args:
        config: the :class:`flt.search.SearchConfig`.
        alpha_task: the held-out part (:meth:`flt.tasks.Task.holdout_split`).
        metric, higher_is_better: the task's headline metric.
        say: receives the progress lines.
    """

    def __init__(self, model: torch.nn.Module, config: SearchConfig, alpha_task: Task, run: RunConfig, ctx: D.Context,
                 progress: dict[str, Any], say: Callable[[str], None]) -> None:
        self.model, self.config, self.alpha_task, self.run, self.ctx = model, config, alpha_task, run, ctx
        self.metric, self.higher_is_better = alpha_task.metric, alpha_task.higher_is_better
        self.slots: list[MixedOp] = list(mixed_slots(model))
        self.depth = len(self.slots)
        self.encoding = encoding_slot(model)
        if self.encoding is not None:
            self.slots.append(self.encoding)
        self.names = [*range(self.depth), *(["posenc"] if self.encoding is not None else [])]
        self.alphas = [s.alpha for s in self.slots]
        self.alpha_optimizer = torch.optim.Adam(self.alphas, lr=config.alpha_lr, betas=(0.5, 0.999),
                                                weight_decay=config.alpha_weight_decay)
        self.alpha_batch = alpha_task.fit_batch_size(run.batch_size)
        self.progress, self.say = progress, say
        self.phase, self.mark = "supernet", time.perf_counter()

    def before_update(self, r: Run, step: int) -> None:
        """The architecture step: ``alpha`` (of the slots still undecided) on a held-out batch."""
        if not self.config.fixed_alpha and any(a.requires_grad for a in self.alphas):
            self.alpha_optimizer.zero_grad(set_to_none=True)
            batch = self.alpha_task.train_batch(step, self.alpha_batch, self.run.seed + ALPHA_SEED_OFFSET, 0, 1)
            self.alpha_task.loss(self.model, to_device(batch, self.ctx.device)).backward()
            self.alpha_optimizer.step()
        # The held-out loss left gradients on the weights too: the weights learn from the
        # training batch alone.
        self.alpha_optimizer.zero_grad(set_to_none=True)
        r.optimizer.zero_grad(set_to_none=True)

    def holdout_metric(self) -> float:
        """The headline metric on the held-out part, on the run's fixed evaluation draw."""
        return evaluate_on_draw(self.alpha_task, self.model, self.ctx, self.run, self.run.eval_batches)[self.metric]

    def validate(self, r: Run, step: int, loss: float, logger: MetricsLogger | None, say: Callable[[str], None]) -> dict[str, float]:
        """The held-out metric and ``softmax(alpha)`` into the history and a progress line;
        after the supernet's last step, the magnitude choice of every slot."""
        metric = self.holdout_metric()
        probs = [s.probabilities().tolist() for s in self.slots]
        self.progress["history"].append({"step": step, "loss": loss, self.metric: metric, "alpha": probs})
        labels = [c.label for c in self.config.candidates]
        mean = torch.stack([s.probabilities() for s in self.slots[:self.depth]]).mean(0).tolist()
        say(f"supernet step {step}/{self.run.steps}: loss {loss:.4g}, held-out {self.metric} {metric:.4g}; mean softmax(alpha) "
            + "  ".join(f"{k} {v:.3f}" for k, v in zip(labels, mean, strict=True))
            + ("; encoding " + "  ".join(f"{c.label} {v:.3f}" for c, v in zip(self.config.posenc_candidates, probs[-1], strict=True))
               if self.encoding is not None else ""))
        if step == self.run.steps:
            # With alpha frozen uniform the argmax says nothing: no magnitude choice.
            self.progress["magnitude"] = None if self.config.fixed_alpha else [s.labels[magnitude_choice(s)] for s in self.slots]
            self.progress["alpha_end"] = probs
        return {self.metric: metric}

    def state(self) -> dict[str, Any]:
        return {"alpha_optimizer": self.alpha_optimizer.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        for s in self.slots:
            if s.is_decided:
                s.alpha.requires_grad_(False)

    def record(self) -> dict[str, Any]:
        self._tick()
        return {"progress": self.progress}

    def _tick(self) -> None:
        """Add the time since the last tick to the current phase's seconds."""
        now = time.perf_counter()
        self.progress["seconds"][self.phase] += now - self.mark
        self.mark = now

    def select(self, r: Run, step: int, reached: Progress, on_step: Callable[[int], None] | None,
               decided: Callable[[int], object]) -> int:
        """The selection step: decide the open slots in the seeded order, each followed by
        ``tune_steps`` steps of the loop at the schedule's final learning rate, a checkpoint
        and ``decided(step)``; returns the last step."""
        self._tick()
        self.phase = "selection"
        order = torch.randperm(len(self.slots), generator=step_generator(self.run.seed, 0, ORDER_STREAM)).tolist()
        for index in order:
            if self.slots[index].is_decided:
                continue
            entry = self._decide(index)
            for _ in range(self.config.tune_steps):
                step += 1
                train_step(r, step, self.run.lr_at(self.run.steps))
                reached.step = step
                if on_step is not None:
                    on_step(step)
            entry["tuned_metric"] = self.holdout_metric() if self.config.tune_steps else entry["metric"]
            self.progress["slots"].append(entry)
            checkpoint_step(r, step, r.window, r.step_times)
            decided(step)
        return step

    def _decide(self, index: int) -> dict[str, Any]:
        """Measure slot ``index`` by perturbation and decide it (:func:`flt.search.select.select_slot`)."""
        self.model.eval()
        entry = select_slot(self.slots[index], self.holdout_metric, self.higher_is_better)
        self.model.train()
        magnitude = self.progress["magnitude"][index] if not self.config.fixed_alpha else None
        entry = {"layer": self.names[index], **entry, "magnitude": magnitude}
        removed = "  ".join(f"{k} {v:.4g}" for k, v in entry["removed"].items())
        where = "absolute encoding" if self.names[index] == "posenc" else f"layer {index}"
        self.say(f"slot {len(self.progress['slots']) + 1}/{len(self.slots)} ({where}): held-out {self.metric} {entry['metric']:.4g}; "
                 f"without each candidate: {removed}; chosen {entry['chosen']}"
                 + (f" (magnitude: {entry['magnitude']})" if magnitude is not None else ""))
        return entry
