"""Per-layer fidelity of a trained model's attention on the hidden states it really sees.

The draw gap (:mod:`flt.train.drawgap`) measures what the estimator costs in the task's
metric, with every layer switched to exact attention at once, so later layers see other
inputs. This module asks each layer on its own: with forward hooks it captures the input
``(x, pos, key_padding_mask)`` that reaches every attention layer while the model runs on
evaluation batches, calls the layer's ``exact`` (the O(N^2) attention its fast path
estimates) on the same input, and pools the relative error

    ||fast(x) - exact(x)|| / ||exact(x)||

over the batches (Frobenius norms of the outputs, padded query rows left out): the
square root of the summed squared differences over the summed squared exact outputs.
Synthetic inputs (random ``x``) flatter an estimator whose error depends on how peaked the
learned queries and keys are; these are the trained model's own.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from flt.layers.base import AttentionBase


def attention_layers(model: nn.Module) -> list[tuple[str, AttentionBase]]:
    """``(qualified name, layer)`` of every attention layer of ``model``, outermost only (a
    layer nested in another attention layer is part of that layer's computation)."""
    found: list[tuple[str, AttentionBase]] = []
    for name, module in model.named_modules():
        if isinstance(module, AttentionBase) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return found


def _call_arguments(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any, Any]:
    """``(x, pos, key_padding_mask)`` of one call of ``layer.forward``, however it was passed."""
    # Every attention layer's forward is ``forward(x, pos=None, key_padding_mask=None)``.
    bound = inspect.signature(layer.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments["x"], bound.arguments.get("pos"), bound.arguments.get("key_padding_mask")


class _Accumulator:
    """Summed squared differences and squared exact outputs of one layer over the batches."""

    def __init__(self) -> None:
        self.diff_sq = 0.0
        self.exact_sq = 0.0
        self.tokens = 0

    def add(self, fast: torch.Tensor, exact: torch.Tensor, key_padding_mask: torch.Tensor | None) -> None:
        fast, exact = fast.detach().double(), exact.detach().double()
        if key_padding_mask is not None:  # padded queries' outputs are discarded by the model
            keep = ~key_padding_mask.bool()
            fast, exact = fast[keep], exact[keep]
        else:
            fast, exact = fast.reshape(-1, fast.shape[-1]), exact.reshape(-1, exact.shape[-1])
        self.diff_sq += float(((fast - exact) ** 2).sum())
        self.exact_sq += float((exact**2).sum())
        self.tokens += int(fast.shape[0])

    def relative_error(self) -> float:
        return math.sqrt(self.diff_sq / self.exact_sq) if self.exact_sq > 0 else math.nan


@torch.no_grad()
def layer_fidelity(model: nn.Module, batches: Iterable, run_batch: Callable[[nn.Module, Any], Any]) -> list[dict[str, Any]]:
    """Relative error of every attention layer's fast output against its ``exact`` on the
    inputs that reach it while ``run_batch(model, batch)`` runs the model on each batch
    (e.g. a task's ``eval_sums``). Returns one dict per layer, in model order: ``layer``
    (qualified name), ``attention`` (class name), ``relative_error`` (NaN when the exact
    output is all zero), ``tokens`` (query rows compared). Raises ValueError naming a
    layer without ``exact``. The model is put in eval mode and restored."""
    layers = attention_layers(model)
    if not layers:
        raise ValueError("the model has no attention layers (flt.layers.base.AttentionBase) to compare")
    missing = [name for name, layer in layers if not callable(getattr(layer, "exact", None))]
    if missing:
        raise ValueError(f"attention layers without an exact() reference: {', '.join(missing)}")
    sums = {name: _Accumulator() for name, _ in layers}

    def hook_for(name: str) -> Callable[[Any, tuple[Any, ...], dict[str, Any], torch.Tensor], None]:
        # ``layer`` is an attention layer whose ``exact`` was checked above (duck-typed: no base class declares it).
        def hook(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor) -> None:
            x, pos, pad = _call_arguments(layer, args, kwargs)
            sums[name].add(output, layer.exact(x, pos, pad), pad)
        return hook

    handles = [layer.register_forward_hook(hook_for(name), with_kwargs=True) for name, layer in layers]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            run_batch(model, batch)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return [{"layer": name, "attention": type(layer).__name__, "relative_error": sums[name].relative_error(),
             "tokens": sums[name].tokens} for name, layer in layers]


def format_fidelity(rows: list[dict[str, Any]]) -> str:
    """A table of :func:`layer_fidelity`'s rows, one line per layer."""
    width = max(len("layer"), *(len(r["layer"]) for r in rows))
    lines = [f"{'layer':<{width}}  {'attention':<20} {'||fast - exact|| / ||exact||':>28}  tokens"]
    lines += [f"{r['layer']:<{width}}  {r['attention']:<20} {r['relative_error']:>28.4f}  {r['tokens']}" for r in rows]
    return "\n".join(lines)
