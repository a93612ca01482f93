"""The held-out part of a task's training split, on which architecture weights learn and
perturbation selection measures (the task's own validation split stays unseen by the search).

:func:`split_task` takes a loaded, configured task and returns ``(weights_task,
alpha_task)``: the first trains on the training split minus the held-out part, the second
draws its batches from the held-out part and evaluates on it. The held-out part is fixed
(it does not depend on the run's seed), so searches with different seeds see the same data.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["SUPPORTED", "split_task"]

#: Tasks whose training split this module knows how to cut.
SUPPORTED = ("image", "lm")


def split_task(task, fraction: float):
    """``(weights_task, alpha_task)``: ``task`` (configured) split by ``fraction`` held out."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"holdout must be a fraction in (0, 1), got {fraction!r}")
    if task.name == "image":
        return _split_images(task, fraction)
    if task.name == "lm":
        return _split_text(task, fraction)
    raise ValueError(f"flt search supports the tasks {', '.join(SUPPORTED)}; got {task.name!r}")


def _split_images(task, fraction: float):
    from flt.data.images import ImageData

    data = task.train
    n = len(data)
    held = max(1, int(round(fraction * n)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    rest, hold = perm[held:].sort().values, perm[:held].sort().values
    weights, alpha = copy.copy(task), copy.copy(task)
    weights.train = ImageData(data.images[rest], data.labels[rest], data.class_names)
    alpha.train = alpha.valid = ImageData(data.images[hold], data.labels[hold], data.class_names)
    return weights, alpha


def _split_text(task, fraction: float):
    from flt.data import LMDataset

    tokens = task.train_tokens
    cut = int(round((1 - fraction) * tokens.numel()))
    weights, alpha = copy.copy(task), copy.copy(task)
    weights.train_set = LMDataset(tokens[:cut], task.seq_len)
    alpha.train_set = alpha.valid_set = LMDataset(tokens[cut:], task.seq_len)
    for part, what in ((weights.train_set, "training"), (alpha.train_set, "held-out")):
        if len(part) < 1:
            raise ValueError(f"the {what} part of the text is shorter than one window of {task.seq_len} tokens")
    return weights, alpha
