"""The long-range block (:class:`flt.layers.LongRangeBlock`) on existing models, without
copying their code.

A model's own modules are wrapped in place: the wrapper runs the module unchanged and adds
the block's update to what it returns, so the model's forward (PyG's SchNet and
DimeNet++, flt's trunk) stays the library's own. Three wrappers cover the field's models:

* :class:`AfterResidual`: a module whose output is a residual increment, ``h + m(h, ...)``
  (SchNet's interaction blocks): the block acts on ``h + m(h, ...)``.
* :class:`AfterOutput`: a module whose output is the node features (the ``lin_up`` of
  DimeNet++'s output blocks, where edge messages become atom features).
* :class:`AfterBlock`: a block of flt's trunk, ``forward(x, pos, key_padding_mask, exact=)``.

PyG's models work on flat atoms ``[A, d]``; the block on padded sets ``[B, N, d]``. The
owning model binds the padded positions and padding mask for the length of its forward
(:meth:`LongRangeContext.bound`); the wrappers scatter the flat atoms into that layout and
back (:meth:`LongRangeContext.delta`).

Placement (:data:`PLACEMENTS`): ``"readout"`` wraps the last of the given modules only
(one block, just before the readout), ``"each"`` wraps every one; ``"input"`` puts one block
on the embedded inputs, before the first module (models that offer it: the ``nbody``
SchNet), so that its values are a function of each point's own input alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from flt._checks import check_choice
from flt.layers.longrange import LongRangeBlock, check_block_options

#: Where the blocks go: once before the readout, after each wrapped module, or on the inputs.
PLACEMENTS = ("readout", "each", "input")


class LongRangeContext:
    """The padded layout of one forward: ``pos [B, N, P]``, ``padding [B, N]`` (True =
    padding) and ``exact``; a plain object shared by a model's wrappers (not a module, so it
    holds no state of the model's)."""

    def __init__(self) -> None:
        self.pos: torch.Tensor | None = None
        self.padding: torch.Tensor | None = None
        self.exact = False

    @contextlib.contextmanager
    def bound(self, pos: torch.Tensor, padding: torch.Tensor, *, exact: bool = False) -> Iterator[None]:
        """Bind the layout for the forward that runs inside the ``with``."""
        self.pos, self.padding, self.exact = pos, padding, exact
        try:
            yield
        finally:
            self.pos, self.padding, self.exact = None, None, False

    def delta(self, block: LongRangeBlock, x: torch.Tensor) -> torch.Tensor:
        """The block's update of flat features ``x [A, d]`` (the real points of the bound
        layout in row-major order), ``[A, d]``."""
        if self.pos is None or self.padding is None:
            raise RuntimeError("a long-range wrapper ran outside its model's forward (no positions are bound)")
        real = ~self.padding
        if x.shape[0] != int(real.sum()):
            raise ValueError(f"the wrapped module returned {x.shape[0]} rows, but the bound layout has {int(real.sum())} real points")
        dense = x.new_zeros(*real.shape, x.shape[-1])
        dense[real] = x
        return (block(dense, self.pos, self.padding, exact=self.exact) - dense)[real]


class AfterResidual(nn.Module):
    """``m(h, ...) + block(h + m(h, ...)) - (h + m(h, ...))``: the block on the features after
    a residual module, returned as a larger increment (flat ``h [A, d]``)."""

    def __init__(self, inner: nn.Module, block: LongRangeBlock, context: LongRangeContext) -> None:
        super().__init__()
        self.inner, self.block, self.context = inner, block, context

    def forward(self, h: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.inner(h, *args, **kwargs)
        return out + self.context.delta(self.block, h + out)


class AfterOutput(nn.Module):
    """``block(m(x))`` for a module that returns flat node features ``[A, d]``."""

    def __init__(self, inner: nn.Module, block: LongRangeBlock, context: LongRangeContext) -> None:
        super().__init__()
        self.inner, self.block, self.context = inner, block, context

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.inner(*args, **kwargs)
        return out + self.context.delta(self.block, out)


class AfterBlock(nn.Module):
    """``block(m(x, pos, key_padding_mask))`` for a block of flt's trunk (padded layout)."""

    def __init__(self, inner: nn.Module, block: LongRangeBlock) -> None:
        super().__init__()
        self.inner, self.block = inner, block

    @property
    def attn(self) -> nn.Module:
        """The wrapped block's attention (:meth:`flt.models.Trunk.attention_layers` reads it)."""
        return cast(nn.Module, self.inner.attn)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *,
                exact: bool = False) -> torch.Tensor:
        out = self.inner(x, pos, key_padding_mask, exact=exact)
        return self.block(out, pos, key_padding_mask, exact=exact)


def wrap_modules(slots: list[tuple[nn.Module, str]], dim: int, options: dict[str, Any], placement: str,
                 wrapper: type[nn.Module], context: LongRangeContext | None = None, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> list[LongRangeBlock]:
    """Replace the module at the last slot (``placement="readout"``) or at every slot
    (``"each"``), a slot being ``(parent, attribute name)`` (an index of a ``ModuleList`` is
    the name ``"0"``, ...), by ``wrapper(module, LongRangeBlock(dim, **options)[, context])``.
    Returns the blocks; the parents are changed in place."""
    check_placement(placement, takes_input=False)
    blocks = []
    for parent, name in (slots if placement == "each" else slots[-1:]):
        block = LongRangeBlock(dim, device=device, dtype=dtype, **options)
        inner = getattr(parent, name)
        setattr(parent, name, wrapper(inner, block) if context is None else wrapper(inner, block, context))
        blocks.append(block)
    return blocks


def list_slots(modules: nn.ModuleList) -> list[tuple[nn.Module, str]]:
    """The slots of :func:`wrap_modules` for every entry of ``modules``."""
    return [(modules, str(i)) for i in range(len(modules))]


def blocks_of(model: nn.Module) -> list[LongRangeBlock]:
    """Every long-range block of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, LongRangeBlock)]


def check_placement(placement: object, *, takes_input: bool) -> None:
    """One of :data:`PLACEMENTS`; ``"input"`` only for a model that offers it."""
    check_choice("longrange_placement", placement, PLACEMENTS)
    if placement == "input" and not takes_input:
        raise ValueError("longrange_placement='input' (one block on the embedded inputs) is offered by the nbody "
                         "SchNet only; this model takes 'readout' or 'each'")


def check_longrange(encoder: str, options: object, placement: object, default_placement: str = "readout", *,
                    input_encoders: tuple[str, ...] = ()) -> None:
    """A config's ``longrange`` options and placement: a dict and one of :data:`PLACEMENTS`
    (``"input"`` only for ``input_encoders``), and left at their defaults unless ``encoder``
    ends with ``"lr"`` (a model with the block)."""
    if not isinstance(options, dict):
        raise TypeError(f"longrange must be a dict of LongRangeBlock options, got {type(options).__name__}")
    check_placement(placement, takes_input=encoder in input_encoders)
    if not encoder.endswith("lr") and (options or placement != default_placement):
        raise ValueError(f"longrange and longrange_placement configure the long-range block of the '+lr' models; "
                         f"encoder={encoder!r} has none")
    for reserved in ("dim", "device", "dtype"):
        if reserved in options:
            raise ValueError(f"longrange: {reserved} is set by the model, leave it out")
    check_block_options(options)


__all__ = [
    "PLACEMENTS",
    "AfterBlock",
    "AfterOutput",
    "AfterResidual",
    "LongRangeContext",
    "blocks_of",
    "check_longrange",
    "check_placement",
    "list_slots",
    "wrap_modules",
]
