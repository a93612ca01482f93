"""The held-out part of a task's training split, on which architecture weights learn and
perturbation selection measures (the task's own validation split stays unseen by the search).

:func:`split_task` takes a loaded, configured task and returns ``(weights_task,
alpha_task)``: the first trains on the training split minus the held-out part, the second
draws its batches from the held-out part and evaluates on it. The held-out part is fixed
(it does not depend on the run's seed), so searches with different seeds see the same data:

* ``image``: a fixed random fraction of the training images (generator seed 0);
* ``lm``: the last fraction of the training tokens;
* ``molecule``: a random fraction of the training structures, drawn from the data's
  ``split_seed`` (the seed that cut training from validation), whole structures only;
* ``graph``, ``task=link``: a random fraction of the training edges, drawn from the data's
  ``seed``, becomes held-out positives (with as many of the training negatives): they are
  taken out of the structure too, so the supernet (weights and held-out part alike) sees
  the graph without them, as the validation edges are kept out of the structure of every
  run; anchors and positions are recomputed from the remaining edges;
* ``graph``, ``task=pair``: a random fraction of the labelled training pairs (the
  structure is every edge and stays).

The validation split of every task is never touched.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["SUPPORTED", "heldout_batch_size", "split_task"]

#: Tasks whose training split this module knows how to cut.
SUPPORTED = ("image", "lm", "molecule", "graph")
#: Added to the data seed for the held-out draw, so that it is not the draw of the data's own split.
HOLDOUT_STREAM = 7_368_787


def split_task(task, fraction: float, seed: int = 0):
    """``(weights_task, alpha_task)``: ``task`` (configured) split by ``fraction`` held out.
    ``seed`` (the data's seed: ``split_seed`` of molecules, ``seed`` of graphs) draws the
    held-out molecules and graph pairs; images and text ignore it."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"holdout must be a fraction in (0, 1), got {fraction!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"the held-out seed must be a non-negative integer, got {seed!r}")
    if task.name == "image":
        return _split_images(task, fraction)
    if task.name == "lm":
        return _split_text(task, fraction)
    if task.name == "molecule":
        return _split_molecules(task, fraction, seed)
    if task.name == "graph":
        return _split_graph(task, fraction, seed)
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


def _held_count(n: int, fraction: float, what: str) -> int:
    held = int(round(fraction * n))
    if held < 1 or n - held < 1:
        raise ValueError(f"holdout {fraction} of {n} {what} leaves an empty part; the search needs both a training and a held-out part")
    return held


def _permutation(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + HOLDOUT_STREAM))


def _split_indices(n: int, fraction: float, seed: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rest, held)``: sorted indices of ``n`` items, a random ``fraction`` held out."""
    held = _held_count(n, fraction, what)
    perm = _permutation(n, seed)
    return perm[held:].sort().values, perm[:held].sort().values


def _split_molecules(task, fraction: float, seed: int):
    """Whole structures: a random ``fraction`` of the training structures, drawn from
    ``seed``. The target standardisation (``target_mean``, ``target_std``: the model's
    output scale) stays the whole training split's, as in the run the search stands for."""
    data = task.train
    rest, hold = _split_indices(len(data), fraction, seed, "training structures")
    weights, alpha = copy.copy(task), copy.copy(task)
    weights.train = data.subset(rest.numpy())
    alpha.train = alpha.valid = data.subset(hold.numpy())
    return weights, alpha


def _split_graph(task, fraction: float, seed: int):
    pairs, labels = task.train
    if task.kind == "pair":
        rest, hold = _split_indices(len(labels), fraction, seed, "labelled training pairs")
        weights, alpha = copy.copy(task), copy.copy(task)
        weights.train = (pairs[rest], labels[rest])
        alpha.train = alpha.valid = (pairs[hold], labels[hold])
        return weights, alpha
    # Links: the training pairs are the training edges (label 1) then as many negatives.
    pos, neg = pairs[labels == 1], pairs[labels == 0]
    rest_idx, hold_idx = _split_indices(len(pos), fraction, seed, "training edges")
    rest_pos, hold_pos = pos[rest_idx], pos[hold_idx]
    perm_neg = _permutation(len(neg), seed + 1)
    keep_neg = min(len(neg), len(hold_idx))
    rest_neg, hold_neg = neg[perm_neg[keep_neg:].sort().values], neg[perm_neg[:keep_neg].sort().values]
    # The held-out edges leave the structure: anchors and positions of the remaining edges.
    structure = task.with_structure(rest_pos)
    weights, alpha = copy.copy(structure), copy.copy(structure)
    weights.train = _labelled(rest_pos, rest_neg)
    alpha.train = alpha.valid = _labelled(hold_pos, hold_neg)
    return weights, alpha


def _labelled(pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([pos, neg]), torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))])


def heldout_batch_size(alpha_task, batch_size: int) -> int:
    """The batch size of the architecture updates: ``batch_size``, or the whole held-out
    part when it is smaller (a held-out fifth of a small training split can be; the graph
    task embeds every node at every step anyway). Text windows are sampled, never short."""
    if alpha_task.name in ("image", "molecule"):
        return min(batch_size, len(alpha_task.train))
    if alpha_task.name == "graph":
        return min(batch_size, len(alpha_task.train[1]))
    return batch_size
