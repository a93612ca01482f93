"""Causal language model: token embeddings, pre-norm Transformer, tied output head.

Positions are the token indices ``0 .. T-1`` as ``[B, T, 1]`` floats, fed both to the
absolute encoding and to the attention layers (relative mechanisms such as FLT use only
their differences). Generation takes the prompt in one forward pass that also returns
every layer's decoding state (:meth:`CausalLM.prefill`), then one token at a time from it
(:meth:`CausalLM.step`): a constant-size state for the linear mechanisms, whose memory does
not grow with the text, a KV cache for exact softmax. Mechanisms that cannot decode
(Toeplitz) recompute the last ``max_len`` tokens at every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flt._dtype import compute_dtype
from flt.models.block import trunk_modules
from flt.posenc import CAPE


@dataclass
class LMState:
    """Recurrent decoding state: one state per layer and the next token's position."""

    layers: list | None
    position: int = 0


class CausalLM(nn.Module):
    """Decoder-only Transformer with tied embeddings (see :class:`flt.models.LMConfig`): the
    keyword arguments are its fields, those of the trunk (all but ``dim``) as ``**trunk``
    (:func:`flt.models.block.trunk_modules`).

    Shapes: ``forward(tokens [B, T] int64) -> logits [B, T, vocab_size]``.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        max_len: int,
        dim: int,
        cape: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **trunk: Any,
    ) -> None:
        super().__init__()
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.vocab_size, self.max_len = vocab_size, max_len
        self.embed = nn.Embedding(vocab_size, dim, **fk)
        # Small init: the same matrix is the output head, and N(0, 1) rows would start
        # the logits with a spread of sqrt(dim).
        nn.init.normal_(self.embed.weight, std=0.02)
        # No mean-centring: decoding token by token cannot know the mean of future positions.
        self.cape = CAPE.for_1d(mean_center=False) if cape else None
        self.posenc, self.drop, self.trunk = trunk_modules(dim=dim, pos_dim=1, causal=True, **fk, **trunk)

    @property
    def supports_decoding(self) -> bool:
        """True when every attention layer decodes token by token: with a constant-size
        state (FLT, Performer) or a KV cache (causal softmax)."""
        return self.trunk.supports_decoding

    def _pos_dtype(self) -> torch.dtype:
        return compute_dtype(self.embed.weight)

    def positions(self, batch: int, length: int, offset: int = 0) -> torch.Tensor:
        """Token indices ``offset .. offset + length - 1`` as ``[batch, length, 1]``."""
        idx = torch.arange(offset, offset + length, device=self.embed.weight.device, dtype=self._pos_dtype())
        return idx.view(1, length, 1).expand(batch, length, 1)

    def _inputs(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedded ``tokens [B, T]`` and their positions: ``([B, T, dim], [B, T, 1])``."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        pos = self.positions(B, T)
        if self.cape is not None:
            pos = self.cape(pos)
        x = self.embed(tokens) + self.posenc(pos).to(self.embed.weight.dtype)
        return self.drop(x), pos

    def forward(self, tokens: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        """``tokens [B, T]`` -> next-token logits ``[B, T, V]``; ``exact`` uses each layer's ``exact``."""
        x, pos = self._inputs(tokens)
        return F.linear(self.trunk(x, pos, exact=exact), self.embed.weight)

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, LMState]:
        """Take a prompt ``tokens [B, T]`` in one forward pass: ``-> (logits [B, T, V], state)``.

        The logits are :meth:`forward`'s; :meth:`step` from ``state`` continues the text as
        if the prompt had been fed token by token (in eval mode), at the cost of one
        forward instead of ``T`` steps.
        """
        self._check_decoding("prefill")
        x, pos = self._inputs(tokens)
        x, layers = self.trunk.prefill(x, pos)
        return F.linear(x, self.embed.weight), LMState(layers, tokens.shape[1])

    def _check_decoding(self, what: str) -> None:
        if not self.supports_decoding:
            names = sorted({b.attention_name for b in self.trunk.block_list if not getattr(b.attn, "supports_decoding", False)})
            raise ValueError(f"{what}() needs attention layers that decode token by token (supports_decoding); {names} do not")

    def step(self, tokens: torch.Tensor, state: LMState | None = None) -> tuple[torch.Tensor, LMState]:
        """Feed one token per sequence, ``tokens [B]``: ``-> (logits [B, V], state)``.

        Feeding a sequence token by token gives the logits of :meth:`forward` (in eval mode).
        """
        self._check_decoding("step")
        state = state or LMState(layers=None, position=0)
        B = tokens.shape[0]
        pos = self.positions(B, 1, offset=state.position)  # [B, 1, 1]
        x = self.embed(tokens) + self.posenc(pos)[:, 0].to(self.embed.weight.dtype)
        x, layers = self.trunk.step(self.drop(x), state.layers, pos[:, 0])
        return F.linear(x, self.embed.weight), LMState(layers, state.position + 1)

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        recurrent: bool | None = None,
    ) -> torch.Tensor:
        """Continue ``prompt [B, T0]`` by ``max_new_tokens`` tokens: ``-> [B, T0 + new]``.

        ``temperature = 0`` is greedy decoding; ``top_k`` keeps the k most likely tokens.
        ``recurrent`` (default: whenever the layers support it, ``supports_decoding``) takes
        the prompt in one pass (:meth:`prefill`) and then decodes token by token from each
        layer's state (:meth:`step`: constant-size for FLT and Performer, a KV cache for
        softmax); positions keep counting past ``max_len``. ``recurrent=False`` recomputes
        the forward over the last ``max_len`` tokens at every step (positions restart at 0
        in that window), so the two agree while ``T0 + max_new_tokens <= max_len``.
        Call in eval mode for deterministic layers (no dropout, no CAPE).
        """
        if prompt.ndim != 2 or prompt.shape[1] < 1:
            raise ValueError(f"prompt must be [B, T0] with T0 >= 1, got shape {tuple(prompt.shape)}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
        recurrent = self.supports_decoding if recurrent is None else recurrent
        if recurrent and not self.supports_decoding:
            raise ValueError("recurrent generation needs attention layers that support decoding")
        out = prompt
        if recurrent:
            logits, state = self.prefill(prompt)
            logits = logits[:, -1]
            for i in range(max_new_tokens):
                nxt = sample_next(logits, temperature, top_k, generator)
                out = torch.cat([out, nxt[:, None]], dim=1)
                if i + 1 < max_new_tokens:  # the last token's logits are never used
                    logits, state = self.step(nxt, state)
            return out
        for _ in range(max_new_tokens):
            logits = self(out[:, -self.max_len :])[:, -1]
            out = torch.cat([out, sample_next(logits, temperature, top_k, generator)[:, None]], dim=1)
        return out


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> torch.Tensor:
    """Next token ``[B]`` from logits ``[B, V]`` (greedy when ``temperature == 0``)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        k = min(int(top_k), logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
