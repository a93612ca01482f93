"""State dicts saved before attention layers had a core, upgraded once where they are loaded.

Before 0.2.0 an attention layer held its mechanism's parts itself: a state dict had
``attn.spectrum.mu`` beside ``attn.to_qkv.weight``. A layer is now its projections plus
``layer.core`` (:class:`flt.layers.base.AttentionBase`), and the same tensor is
``attn.core.spectrum.mu``. :func:`upgrade_state_dict` renames the keys of such a file to the
current layout; flt's loaders call it (:func:`flt.train.checkpoint.load_weights` through
:func:`upgrading`, and ``flt evaluate``), and a state dict of one's own loads by::

    layer.load_state_dict(upgrade_state_dict(layer, state))

The cores' own renames of still older layouts (a table without its ``scale``) then run in
``load_state_dict``. Converted Hugging Face models need nothing: their cores
(:class:`flt.functional.AttentionCore`) have kept their keys.

Parameters were listed in another order too: a core's own parameter (FLT's
``far_constant``) belonged to its layer and came before the projections.
:func:`parameters_before_cores` gives that order, so that an optimizer state saved then can be
renumbered for the current one (:func:`flt.train.checkpoint.optimizer_state_before_cores`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from torch import nn

from flt.layers.base import AttentionBase

__all__ = ["parameters_before_cores", "upgrade_state_dict", "upgrading"]

_Value = TypeVar("_Value")


def _layers_with_cores(model: nn.Module) -> Iterator[tuple[str, AttentionBase]]:
    """``(key prefix, layer)`` of every attention layer of ``model`` that holds a core."""
    for name, module in model.named_modules():
        if isinstance(module, AttentionBase) and "core" in module._modules:
            yield (f"{name}." if name else ""), module


def upgrade_state_dict(model: nn.Module, state: Mapping[str, _Value]) -> dict[str, _Value]:
    """A copy of ``state``, a state dict of ``model`` (or any mapping from its keys), with
    the keys an attention layer wrote before it had a core moved under ``core.``: for a
    layer at ``prefix``, ``prefix + X`` becomes ``prefix + "core." + X`` unless ``X`` starts
    with a name of the layer's own (``to_qkv``, ``to_out``, ``core``). A key whose new name
    is already there stays, so that strict loading reports it as unexpected rather than one
    of the two tensors being dropped unseen. A state dict of the current layout comes back
    equal."""
    upgraded = dict(state)
    for prefix, layer in _layers_with_cores(model):
        own = set(layer._modules) | set(layer._parameters) | set(layer._buffers)
        for key in [k for k in upgraded if k.startswith(prefix)]:
            rest = key[len(prefix):]
            moved = f"{prefix}core.{rest}"
            if rest.split(".", 1)[0] not in own and moved not in upgraded:
                upgraded[moved] = upgraded.pop(key)
    return upgraded


@contextmanager
def upgrading(model: nn.Module) -> Iterator[list[str]]:
    """While open, ``model.load_state_dict(state)`` loads ``upgrade_state_dict(model,
    state)``: for loaders that read a file themselves (safetensors' ``load_model``). Yields
    a list that the load fills with the old keys it moved (empty: the file was current)."""
    moved: list[str] = []

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Called once, on the model itself, before any of its modules reads the dict.
        upgraded = upgrade_state_dict(module, state_dict)
        if upgraded.keys() != state_dict.keys():
            moved.extend(k for k in state_dict if k not in upgraded)
            state_dict.clear()
            state_dict.update(upgraded)

    handle = model.register_load_state_dict_pre_hook(hook)
    try:
        yield moved
    finally:
        handle.remove()


def parameters_before_cores(model: nn.Module) -> list[nn.Parameter]:
    """``model.parameters()`` in the order they were listed before layers had cores: a
    core's own parameters (FLT's ``far_constant``) were its layer's, listed before
    ``to_qkv``; every other parameter keeps its place. An optimizer state saved then follows
    this order."""
    layers = {id(layer): layer.core for _, layer in _layers_with_cores(model)}
    cores = {id(core) for core in layers.values()}
    order: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        own = [] if id(module) in cores else list(module._parameters.values())
        if id(module) in layers:
            own = list(layers[id(module)]._parameters.values()) + own
        for p in own:
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                order.append(p)
    return order
