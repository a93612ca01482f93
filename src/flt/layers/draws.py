"""One mechanism for the random draws of every random-feature module (docs/math.md section 5.2).

Two kinds of modules hold random draws: :class:`flt.layers.features.FeatureMap` (the
FAVOR+ or ReLU projection ``W``, buffer ``projection``) and :class:`flt.relative.spectra.Spectrum`
(the base draws ``eps`` that its parameters turn into frequencies). Both implement a small
protocol, :class:`RandomFeatures`:

* ``has_random_features``: whether the module's draws are used (False for the
  deterministic ``elu`` map, or a spectrum whose owner evaluates only its exact mask);
* ``random_feature_buffers``: names of the buffers that hold the draws;
* ``redraw_random_features(generator)``: replace them in place, drawn on the CPU from
  ``generator`` (``None``: the module's own generator or torch's global one).

Layers need nothing of their own: FLT (both couplings), Performer and Toeplitz attention
are covered through their submodules. On top of the protocol:

* :func:`redraw` gives every such module of a model a new draw from one generator; the
  trainer calls it every ``RunConfig.redraw_interval`` steps (draw-robust training);
* :func:`fixed_draw` puts every module on the draw determined by ``(seed, module name)``,
  for evaluation; as a context manager it restores the previous draws on exit.

Only buffers change: parameters are untouched, so spectra stay differentiable in their
parameters after any redraw (``xi = T_theta(eps)`` with the new ``eps``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Protocol, TypeGuard, runtime_checkable

import torch
from torch import nn

__all__ = ["RandomFeatures", "draw_generator", "fixed_draw", "has_random_features", "random_feature_modules", "redraw",
           "stable_named_modules"]


@runtime_checkable
class RandomFeatures(Protocol):
    """What :func:`redraw` and :func:`fixed_draw` need of a module."""

    has_random_features: bool
    random_feature_buffers: tuple[str, ...]

    def redraw_random_features(self, generator: torch.Generator | None = None) -> None: ...


def _unwrap(model: nn.Module) -> nn.Module:
    """The module behind DDP / DataParallel / ``torch.compile`` wrappers, so that module
    names (and hence :func:`fixed_draw`'s draws) do not depend on the wrapping."""
    while True:
        inner = getattr(model, "module", None) if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else None
        inner = inner if inner is not None else getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _draws_used(module: nn.Module) -> TypeGuard[RandomFeatures]:
    """True for a module that redraws and whose draws its outputs depend on now."""
    return callable(getattr(module, "redraw_random_features", None)) and bool(getattr(module, "has_random_features", False))


def stable_named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``named_modules`` of ``model``, each module once, except that the
    submodules a module lists in ``unnamed_submodules`` add no part to the names below them:
    an attention layer's ``core`` (:class:`flt.layers.base.AttentionBase`), so that
    ``attn.core.feature_map`` is named ``attn.feature_map``, as before layers had cores.
    These names seed :func:`fixed_draw`'s draws and key the generators a run saves
    (:mod:`flt.train.rng`), so evaluations and resumed runs of older checkpoints see the
    same draws."""
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        name, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield name, module
        unnamed = getattr(type(module), "unnamed_submodules", ())
        children = [(name if key in unnamed else f"{name}.{key}" if name else key, child)
                    for key, child in module._modules.items() if child is not None]
        stack.extend(reversed(children))  # depth first, in registration order, as named_modules


def random_feature_modules(model: nn.Module) -> Iterator[tuple[str, RandomFeatures]]:
    """``(name, module)`` of every submodule (``model`` included) whose draws are used,
    named by :func:`stable_named_modules`."""
    for name, module in stable_named_modules(_unwrap(model)):
        if _draws_used(module):
            yield name, module


def has_random_features(model: nn.Module) -> bool:
    """True if some submodule of ``model`` holds random draws that its outputs depend on."""
    return next(random_feature_modules(model), None) is not None


def _sub_generator(generator: torch.Generator | None) -> torch.Generator:
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def redraw(model: nn.Module, generator: torch.Generator | None = None) -> int:
    """Give every random-feature module of ``model`` a new draw; returns how many.

    Modules are visited in ``named_modules`` order; each gets its own CPU generator seeded
    from ``generator`` (a CPU ``torch.Generator``; ``None``: torch's global generator), so
    the draws are a function of the generator's state alone, whatever the device.
    """
    count = 0
    for _, module in random_feature_modules(model):
        module.redraw_random_features(_sub_generator(generator))
        count += 1
    return count


def draw_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator determined by ``(seed, name)`` alone (the draws of :func:`fixed_draw`)."""
    digest = hashlib.sha256(f"flt-draw/{int(seed)}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


class fixed_draw:  # noqa: N801 (used like a function or a context manager, as torch.no_grad)
    """Put every random-feature module of ``model`` on the draw of ``(seed, its name)``.

    The draw is applied at once: ``fixed_draw(model, 0)`` alone leaves the model on it.
    Used as a context manager, the previous draws are put back on exit::

        with fixed_draw(model, seed=0):
            metric = evaluate(model)      # the same draws every time, for any training draw

    Names are relative to ``model`` (after unwrapping DDP and ``torch.compile``), so the
    same model class gets the same draws in any process and on any device; a different
    ``seed`` gives independent draws. Parameters are never touched.
    """

    def __init__(self, model: nn.Module, seed: int) -> None:
        self._saved: list[tuple[RandomFeatures, str, torch.Tensor]] = []
        with torch.no_grad():
            for name, module in random_feature_modules(model):
                for buf in module.random_feature_buffers:
                    self._saved.append((module, buf, getattr(module, buf).clone()))
                module.redraw_random_features(draw_generator(seed, name))

    def restore(self) -> None:
        """Put the draws that were there before back (once)."""
        with torch.no_grad():
            for module, buf, value in self._saved:
                getattr(module, buf).copy_(value)
        self._saved = []

    def __enter__(self) -> fixed_draw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
