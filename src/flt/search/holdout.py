"""The held-out part of a task's training split, on which architecture weights learn and
perturbation selection measures (the task's own validation split stays unseen by the search).

Each task declares its held-out part itself (:meth:`flt.tasks.Task.holdout_split`; the
rules: :mod:`flt.tasks.holdout`); :func:`split_task` checks the fraction and the seed and
asks the task.
"""

from __future__ import annotations

from typing import Any

from flt.tasks.base import Task
from flt.tasks.holdout import check_holdout

__all__ = ["holdout_seed", "split_task"]


def split_task(task: Task, fraction: float, seed: int = 0) -> tuple[Task, Task]:
    """``(weights_task, alpha_task)``: ``task`` (configured) split by ``fraction`` held out,
    drawn from ``seed`` (the data's seed, :func:`holdout_seed`) where the task draws it."""
    check_holdout(fraction, seed)
    return task.holdout_split(fraction, seed)


def holdout_seed(task_cls: type[Task], data: dict[str, Any]) -> int:
    """The seed of the held-out draw: the data option the task names
    (:attr:`flt.tasks.Task.holdout_seed_option`), 0 without one."""
    value = data.get(task_cls.holdout_seed_option) if task_cls.holdout_seed_option else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
