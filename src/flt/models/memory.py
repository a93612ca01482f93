"""Memory estimates of whole models, from their configs (:mod:`flt.models.config`): the
estimate of every attention layer (its mechanism's own, ``parameter_values`` and
``activation_values`` of the class its config names in :data:`flt.layers.ATTENTION`), the MLPs, embeddings and
heads, compared with the machine's limit (:func:`flt._limits.check_memory`) before a model
is built or trained.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flt._limits import FLOAT_BYTES, check_memory, format_bytes
from flt.layers.base import AttentionBase
from flt.layers.registry import ATTENTION

if TYPE_CHECKING:
    import torch

    from flt.models.config import TrunkConfig


def _layers(cfg: TrunkConfig) -> list[tuple[type[AttentionBase], dict, int]]:
    """``(attention class, options, how many layers)``: one entry for a uniform trunk, so a
    ``depth`` of 10^9 costs one estimate, not 10^9. The class is :class:`AttentionBase`
    (projections and softmax's weights) for a config without an attention or with an
    unknown one."""
    layered = getattr(cfg, "layer_attention", None)
    if layered:
        return [(_attention_class(entry["attention"]), entry["attention_options"], 1) for entry in layered]
    return [(_attention_class(getattr(cfg, "attention", None)), getattr(cfg, "attention_options", {}), cfg.depth)]


def _attention_class(name: str | None) -> type[AttentionBase]:
    return ATTENTION.get(name, AttentionBase) if name is not None else AttentionBase


def model_parameter_values(cfg: Any) -> int:
    """Values of a model config's parameters and buffers: the trunk (attention and MLP of
    every layer), embeddings and heads of its vocabulary, classes or elements, patches."""
    dim, heads, pos_dim = cfg.dim, cfg.heads, _pos_dim(cfg)
    mlp = int(2 * dim * dim * float(getattr(cfg, "mlp_ratio", 4.0)))
    total = sum((cls.parameter_values(options, dim=dim, heads=heads, pos_dim=pos_dim) + mlp + 4 * dim) * count
                for cls, options, count in _layers(cfg))
    for field in ("vocab_size", "num_classes", "num_elements", "in_dim"):
        value = getattr(cfg, field, None)
        if isinstance(value, int) and not isinstance(value, bool):
            total += value * dim
    patch, channels = getattr(cfg, "patch_size", None), getattr(cfg, "channels", None)
    if isinstance(patch, int) and isinstance(channels, int):
        total += patch * patch * channels * dim
    return total


def _pos_dim(cfg: TrunkConfig) -> int:
    return getattr(cfg, "position_dims", 1)


def model_bytes(cfg: Any, *, batch: int, length: int, training: bool) -> dict[str, int]:
    """Estimated bytes of a model config at work: ``parameters`` (with gradients and AdamW's
    two moments when ``training``), ``activations`` (the trunk's ``B N dim (8 + 2 mlp_ratio)``
    values per layer and the mechanism's ``activation_values``; every layer's kept for backward
    when training, one layer at a time otherwise) and ``total``."""
    params = model_parameter_values(cfg) * FLOAT_BYTES * (4 if training else 1)
    head_dim = max(cfg.dim // max(cfg.heads, 1), 1)
    trunk = batch * length * cfg.dim * (8 + 2 * float(getattr(cfg, "mlp_ratio", 4.0)))
    per_layer = [(trunk + cls.activation_values(options, batch=batch, heads=cfg.heads, length=length, head_dim=head_dim,
                                                 training=training), count)
                 for cls, options, count in _layers(cfg)]
    kept = sum(v * count for v, count in per_layer) if training else max((v for v, _ in per_layer), default=0)
    activations = int(kept * FLOAT_BYTES)
    return {"parameters": int(params), "activations": activations, "total": int(params) + activations}


def check_model_memory(cfg: Any, *, batch: int, length: int | None, training: bool, device: torch.device | str | None = None, purpose: str | None = None) -> None:
    """Refuse a model config whose estimated memory (:func:`model_bytes`) for ``batch``
    sequences of ``length`` tokens exceeds the limit, naming the sizes that set it."""
    if not all(isinstance(getattr(cfg, f, None), int) for f in ("dim", "depth", "heads")):
        return  # not a Transformer trunk config: nothing to estimate
    length = max(int(length or 1), 1)
    est = model_bytes(cfg, batch=batch, length=length, training=training)
    what = purpose or ("training" if training else "evaluating")
    size_options = _attention_class(getattr(cfg, "attention", None)).size_options
    options = {k: v for k, v in getattr(cfg, "attention_options", {}).items() if k in size_options}
    sizes = (f"dim={cfg.dim}, depth={cfg.depth}, heads={cfg.heads}, attention {getattr(cfg, 'attention', None)!r}"
             f"{' ' + str(options) if options else ''}, batch_size={batch}, {length} tokens")
    check_memory(
        f"{what} this model ({sizes}: {format_bytes(est['parameters'])} of parameters"
        f"{' with gradients and optimizer state' if training else ''}, {format_bytes(est['activations'])} of activations)",
        est["total"], device=device, hint="make these sizes smaller",
    )




def check_task_memory(task: Any, cfg: Any, *, batch_size: int, training: bool, device: torch.device | str | None = None) -> None:
    """:func:`check_model_memory` for ``batch_size`` samples of ``task`` (its
    ``step_shape``: how many sequences of how many tokens they give the attention layers)."""
    batch, length = task.step_shape(cfg, batch_size)
    check_model_memory(cfg, batch=batch, length=length, training=training, device=device)
