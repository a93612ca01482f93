"""Held-out parts of a training split: the data ``flt search`` learns its architecture
weights on and measures its perturbations on, while the task's validation split stays unseen.

A task declares its held-out part in :meth:`flt.tasks.Task.holdout_split`, which returns
``(weights_task, alpha_task)``: copies of the (configured) task, the first training on the
training split minus the held-out part, the second drawing its batches from the held-out
part and evaluating on it. Tasks that do not override it cannot be searched
(:func:`flt.tasks.holdout_tasks`). The held-out part is fixed: it depends on the data's own
seed (:attr:`flt.tasks.Task.holdout_seed_option`), never on the run's, so searches with
different seeds see the same data. The built-in rules (each in its task's file):

* images: a fixed random fraction of the training images (generator seed 0);
* text: the last fraction of the training tokens;
* molecules: a random fraction of the training structures, drawn from the data's
  ``split_seed`` (the seed that cut training from validation), whole structures only;
* graphs, ``task=link``: a random fraction of the training edges, drawn from the data's
  ``seed``, becomes held-out positives (with as many of the training negatives): they are
  taken out of the structure too, so the supernet (weights and held-out part alike) sees
  the graph without them, as the validation edges are kept out of the structure of every
  run; anchors and positions are recomputed from the remaining edges;
* graphs, ``task=pair``: a random fraction of the labelled training pairs (the structure is
  every edge and stays).

This module holds the helpers those rules share.
"""

from __future__ import annotations

import torch

__all__ = ["HOLDOUT_STREAM", "check_holdout", "held_count", "labelled", "permutation", "split_indices"]

#: Added to the data seed for the held-out draw, so that it is not the draw of the data's own split.
HOLDOUT_STREAM = 7_368_787


def check_holdout(fraction: object, seed: object) -> None:
    """``fraction`` in (0, 1) and ``seed`` a non-negative integer, or a ``ValueError`` naming them."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"holdout must be a fraction in (0, 1), got {fraction!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"the held-out seed must be a non-negative integer, got {seed!r}")


def held_count(n: int, fraction: float, what: str) -> int:
    """How many of ``n`` items ``fraction`` holds out; both parts must be non-empty."""
    held = round(fraction * n)
    if held < 1 or n - held < 1:
        raise ValueError(f"holdout {fraction} of {n} {what} leaves an empty part; the search needs both a training and a held-out part")
    return held


def permutation(n: int, seed: int) -> torch.Tensor:
    """The held-out draw's permutation of ``n`` items for the data seed ``seed``."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + HOLDOUT_STREAM))


def split_indices(n: int, fraction: float, seed: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rest, held)``: sorted indices of ``n`` items, a random ``fraction`` held out."""
    held = held_count(n, fraction, what)
    perm = permutation(n, seed)
    return perm[held:].sort().values, perm[:held].sort().values


def labelled(pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs ``pos`` then ``neg`` with their labels (1, then 0)."""
    return torch.cat([pos, neg]), torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))])
