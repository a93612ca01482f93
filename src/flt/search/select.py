"""Architecture selection on a trained supernet: by perturbation (DARTS-PT) and by magnitude.

*Magnitude* reads the architecture weights: the chosen candidate of a slot is
``argmax softmax(alpha)``. *Perturbation* asks the supernet instead: remove one candidate
of the slot (its mixing weight set to 0, the others unchanged), measure the validation
metric, put it back; the candidate whose removal hurts the metric most is the one the
supernet relies on, and it is chosen. The two differ whenever a large weight does not mean
a large contribution (an op whose output is small or cancelled elsewhere gets a large
``alpha`` cheaply); :func:`select_slot` records both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flt.search.mixed import MixedOp

__all__ = ["magnitude_choice", "perturbation_choice", "removal_metrics", "select_slot"]


@torch.no_grad()
def removal_metrics(slot: MixedOp, evaluate: Callable[[], float]) -> list[float | None]:
    """The metric ``evaluate()`` returns with each candidate of ``slot`` removed in turn
    (None for a candidate already out). The slot is left as it was found."""
    if slot.is_decided:
        raise ValueError(f"the slot is decided already (on {slot.choice!r}); there is nothing to remove")
    saved = slot.keep.clone()
    out: list[float | None] = []
    try:
        for k in range(len(slot.labels)):
            if not saved[k]:
                out.append(None)
                continue
            slot.keep.copy_(saved)
            slot.keep[k] = 0.0
            out.append(float(evaluate()))
    finally:
        slot.keep.copy_(saved)
    return out


def perturbation_choice(removed: list[float | None], higher_is_better: bool) -> int:
    """Index of the candidate whose removal gives the worst metric (the first on a tie)."""
    scored = [(k, m) for k, m in enumerate(removed) if m is not None]
    if not scored:
        raise ValueError("no candidate was measured")
    worst = min(m for _, m in scored) if higher_is_better else max(m for _, m in scored)
    return next(k for k, m in scored if m == worst)


def magnitude_choice(slot: MixedOp) -> int:
    """``argmax softmax(alpha)`` of ``slot`` (the first on a tie)."""
    return int(torch.argmax(slot.probabilities()))


def select_slot(slot: MixedOp, evaluate: Callable[[], float], higher_is_better: bool) -> dict:
    """Measure ``slot`` by perturbation, decide it on the candidate whose removal hurts most
    and return the record: ``alpha`` (softmax, before deciding), ``metric`` (nothing
    removed), ``removed`` (label -> metric without it), ``chosen`` and ``magnitude`` (labels)."""
    alpha = slot.probabilities().tolist()
    magnitude = magnitude_choice(slot)
    base = float(evaluate())
    removed = removal_metrics(slot, evaluate)
    chosen = perturbation_choice(removed, higher_is_better)
    slot.decide(chosen)
    return {
        "alpha": dict(zip(slot.labels, alpha, strict=True)),
        "metric": base,
        "removed": {label: m for label, m in zip(slot.labels, removed, strict=True) if m is not None},
        "chosen": slot.labels[chosen],
        "magnitude": slot.labels[magnitude],
    }
