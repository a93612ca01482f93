"""The pre-norm Transformer block and trunk shared by the models of this package.

The attention layer comes from :data:`flt.ATTENTION` by name, so every registered
mechanism works in every model with no change here. Shapes: tokens ``x [B, N, dim]``,
positions ``pos [B, N, P]``, ``key_padding_mask [B, N]`` (bool, True = padded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, cast

import torch
from torch import nn

from flt._checks import check_choice
from flt.layers import ATTENTION
from flt.options import (
    POSENC_ARGUMENTS,
    CheckedOptions,
    check_posenc_options,
    checked_once,
)
from flt.posenc import POSENC


class Decoder(Protocol):
    """What a causal attention layer that decodes token by token offers (``supports_decoding``)."""

    def prefill(self, x: torch.Tensor, pos: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]: ...

    def step(self, x: torch.Tensor, state: Any = None, pos: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]: ...


def build_attention(name: str, dim: int, heads: int, *, pos_dim: int, causal: bool, options: dict[str, Any],
                    device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """``ATTENTION[name].from_options(dim, heads, pos_dim=, causal=, **options)`` with a clear
    error for a bad name: the flat options checked (:func:`flt.options.check_attention_options`,
    the arguments set here reserved) unless they are the :class:`flt.options.CheckedOptions`
    that check returned, then the layer's parts built."""
    check_choice("attention", name, ATTENTION)
    options = checked_once(name, options)
    return ATTENTION[name].from_checked_options(dim, heads, pos_dim=pos_dim, causal=causal, device=device, dtype=dtype,
                                                **options)


def feed_forward(dim: int, mlp_ratio: float, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> nn.Sequential:
    """A block's MLP, ``[..., dim] -> [..., dim]``: a linear map to ``round(dim * mlp_ratio)``
    (at least 1), GELU, a linear map back (keys ``0.*`` and ``2.*``)."""
    hidden = max(1, int(round(dim * mlp_ratio)))
    return nn.Sequential(nn.Linear(dim, hidden, device=device, dtype=dtype), nn.GELU(),
                         nn.Linear(hidden, dim, device=device, dtype=dtype))


class Block(nn.Module):
    """``x + attn(LN(x))`` then ``x + MLP(LN(x))`` (pre-norm, GELU MLP, :func:`feed_forward`).

    Args:
        dim, heads: model width and attention heads.
        attention: a name in :data:`flt.ATTENTION`; ``attention_options`` go to its constructor.
        pos_dim: ``P``; causal: causal attention (enables :meth:`step` when the layer can decode).
        mlp_ratio: hidden width of the MLP over ``dim``; dropout: after attention and MLP.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        attention: str,
        attention_options: dict[str, Any],
        pos_dim: int,
        causal: bool,
        mlp_ratio: float,
        dropout: float,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.attention_name = attention
        self.norm1 = nn.LayerNorm(dim, **fk)
        self.attn = build_attention(attention, dim, heads, pos_dim=pos_dim, causal=causal, options=attention_options, **fk)
        self.norm2 = nn.LayerNorm(dim, **fk)
        self.mlp = feed_forward(dim, mlp_ratio, **fk)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *, exact: bool = False) -> torch.Tensor:
        """``[B, N, dim] -> [B, N, dim]``.

        ``exact=True`` calls the layer's ``exact`` method: the O(N^2) attention its fast
        path estimates (exact kernel, exact mask ``f``), for tests and analysis.
        """
        h = self.norm1(x)
        if exact:
            exact_fn = getattr(self.attn, "exact", None)
            if exact_fn is None:
                raise ValueError(f"attention {self.attention_name!r} has no exact() reference; use exact=False")
            a = exact_fn(h, pos, key_padding_mask)
        else:
            a = self.attn(h, pos, key_padding_mask)
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.norm2(x)))

    def prefill(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The forward over a prompt ``x [B, N, dim]`` that also returns the attention layer's
        decoding state (its ``prefill``): ``-> (y [B, N, dim], state)``."""
        a, state = cast(Decoder, self.attn).prefill(self.norm1(x), pos)
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.norm2(x))), state

    def step(self, x: torch.Tensor, state: Any, pos: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """One token ``x [B, dim]`` with the layer's decoding state: ``-> (y [B, dim], state)``."""
        a, state = cast(Decoder, self.attn).step(self.norm1(x), state, pos)
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.norm2(x))), state


def layer_mechanisms(attention: str, attention_options: dict[str, Any] | None, layer_attention: list | None,
                     depth: int) -> list[tuple[str, CheckedOptions]]:
    """``(name, options)`` of each of ``depth`` layers: ``attention`` with its options for
    every layer, or ``layer_attention`` (one ``{"attention": NAME, "attention_options":
    {...}}`` per layer, ``LayeredConfig.layer_attention``) replacing them layer by layer.
    Each distinct set is checked once (:func:`flt.options.checked_once`), however many
    layers share it."""
    if layer_attention is None:
        entries = [(attention, attention_options or {})] * depth
    elif len(layer_attention) != depth:
        raise ValueError(f"layer_attention must list one mechanism per layer ({depth}), got {len(layer_attention)}")
    else:
        entries = [(e["attention"], e["attention_options"]) for e in layer_attention]
    checked: dict[tuple[str, int], CheckedOptions] = {}
    for name, options in entries:
        if (name, id(options)) not in checked:
            check_choice("attention", name, ATTENTION)
            checked[name, id(options)] = checked_once(name, options)
    return [(name, checked[name, id(options)]) for name, options in entries]


class Trunk(nn.Module):
    """``depth`` blocks and a final LayerNorm; ``layer_attention`` (one
    ``{"attention": NAME, "attention_options": {...}}`` per block) gives each block its own mechanism."""

    def __init__(self, dim: int, depth: int, heads: int, *, norm_out: bool = True, layer_attention: list | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, **block_options: Any) -> None:
        super().__init__()
        attention, options = block_options.pop("attention"), block_options.pop("attention_options")
        self.blocks = nn.ModuleList(
            Block(dim, heads, attention=name, attention_options=opts, device=device, dtype=dtype, **block_options)
            for name, opts in layer_mechanisms(attention, options, layer_attention, depth)
        )
        self.norm = nn.LayerNorm(dim, device=device, dtype=dtype) if norm_out else nn.Identity()

    @property
    def block_list(self) -> Sequence[Block]:
        """The blocks, in order (``self.blocks`` typed as what it holds)."""
        return cast(Sequence[Block], self.blocks)

    @property
    def supports_decoding(self) -> bool:
        """True when every layer decodes token by token (``prefill`` and ``step``): with a
        constant-size state (linear mechanisms) or a KV cache (causal softmax)."""
        return all(getattr(b.attn, "supports_decoding", False) for b in self.blocks)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *, exact: bool = False) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, pos, key_padding_mask, exact=exact)
        return self.norm(x)

    def prefill(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """``x [B, N, dim]`` at ``pos [B, N, P]`` in one pass -> ``(y [B, N, dim], states)``:
        ``y`` is :meth:`forward`'s, ``states`` what :meth:`step` continues from."""
        states = []
        for block in self.block_list:
            x, state = block.prefill(x, pos)
            states.append(state)
        return self.norm(x), states

    def step(self, x: torch.Tensor, states: list | None, pos: torch.Tensor | None = None) -> tuple[torch.Tensor, list[Any]]:
        """``x [B, dim]``, per-layer states (``None`` to start) -> ``(y [B, dim], states)``."""
        states = states if states is not None else [None] * len(self.blocks)
        new = []
        for block, state in zip(self.block_list, states, strict=True):
            x, state = block.step(x, state, pos)
            new.append(state)
        return self.norm(x), new

    def attention_layers(self) -> list[nn.Module]:
        """The attention module of every block, in order."""
        return [b.attn for b in self.block_list]


def build_posenc(name: str, dim: int, pos_dim: int, options: dict[str, Any], device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """``POSENC[name](dim, pos_dim, **options)``: absolute encoding ``[B, N, P] -> [B, N, dim]``,
    its options checked unless they passed that check before (as :func:`build_attention`)."""
    check_choice("posenc", name, POSENC)
    if not (isinstance(options, CheckedOptions) and options.checked_for(POSENC[name], POSENC_ARGUMENTS)):
        options = check_posenc_options(name, options, reserved=POSENC_ARGUMENTS)
    return POSENC[name](dim, pos_dim, device=device, dtype=dtype, **options)


class TrunkModules(NamedTuple):
    """The modules every model of this package builds from its trunk fields (:func:`trunk_modules`)."""

    posenc: nn.Module
    drop: nn.Dropout
    trunk: Trunk


def trunk_modules(*, dim: int, depth: int, heads: int, mlp_ratio: float, dropout: float, attention: str,
                  attention_options: dict[str, Any], posenc: str, posenc_options: dict[str, Any],
                  layer_attention: list | None = None, pos_dim: int, causal: bool,
                  device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> TrunkModules:
    """The absolute encoding ``posenc`` (``[B, N, P] -> [B, N, dim]``), the dropout on the
    embedded inputs and the attention :class:`Trunk`, from the fields of a
    :class:`~flt.models.config.LayeredConfig` (the trunk's, the one signature that lists
    them: a model takes its own fields and passes the rest here as ``**trunk``) at ``P =
    pos_dim`` positions, ``causal`` or not. A model assigns them in this order, ``self.posenc,
    self.drop, self.trunk = trunk_modules(...)``: its state-dict keys and the order of its
    parameters (which a saved optimizer state follows) are those three names."""
    fk: dict[str, Any] = {"device": device, "dtype": dtype}
    return TrunkModules(
        build_posenc(posenc, dim, pos_dim, posenc_options, **fk),
        nn.Dropout(dropout),
        Trunk(dim, depth, heads, attention=attention, attention_options=attention_options, pos_dim=pos_dim,
              causal=causal, mlp_ratio=mlp_ratio, dropout=dropout, layer_attention=layer_attention, **fk),
    )
