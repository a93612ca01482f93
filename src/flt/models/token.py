"""A model over token sequences (``P = 1``: positions are the token indices ``0 .. N-1``):
token embedding, the attention trunk, a linear head; causal or bidirectional.

``head`` (:data:`TOKEN_HEADS`) says what the head reads: ``"mean"``, the mean of the
trunk's outputs over the valid tokens of each sequence (one output per sequence, a
classifier such as ``flt train listops``'s); ``"token"``, every token's output (one per
token, a per-token regressor such as ``flt train offsets``'s). The causal language model
with its tied head and decoding state is :class:`flt.models.CausalLM`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flt._checks import check_choice
from flt._dtype import compute_dtype
from flt.models.block import trunk_modules

#: ``TokenModel(head=...)``: one output per sequence from the mean over its valid tokens, or one per token.
TOKEN_HEADS = ("mean", "token")


class TokenModel(nn.Module):
    """Token embedding (std 0.02) plus the absolute encoding of the token indices, the
    trunk (``causal`` or bidirectional attention), and a linear head to ``out_dim``.

    Shapes: ``forward(tokens [B, N] int64, key_padding_mask [B, N] | None) -> [B, out_dim]``
    (``head="mean"``) or ``[B, N, out_dim]`` (``head="token"``); ``key_padding_mask`` is
    True for padding, which attention and the mean leave out. ``exact=True`` runs every
    layer's ``exact``.

    Args:
        vocab_size, out_dim: the vocabulary and the head's width.
        head: ``"mean"`` or ``"token"`` (:data:`TOKEN_HEADS`); causal: causal attention.
        dim: model width; ``**trunk``: the other trunk fields of
            :class:`~flt.models.config.LayeredConfig` (:func:`flt.models.block.trunk_modules`).
    """

    def __init__(self, *, vocab_size: int, out_dim: int, head: str, causal: bool, dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, **trunk: Any) -> None:
        super().__init__()
        check_choice("head", head, TOKEN_HEADS)
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.head_kind = head
        self.embed = nn.Embedding(vocab_size, dim, **fk)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.posenc, self.drop, self.trunk = trunk_modules(dim=dim, pos_dim=1, causal=causal, **fk, **trunk)
        self.head = nn.Linear(dim, out_dim, **fk)

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *, exact: bool = False) -> torch.Tensor:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, N], got shape {tuple(tokens.shape)}")
        B, N = tokens.shape
        pos = torch.arange(N, device=tokens.device, dtype=compute_dtype(self.embed.weight)).view(1, N, 1).expand(B, N, 1)
        x = self.embed(tokens) + self.posenc(pos).to(self.embed.weight.dtype)
        x = self.trunk(self.drop(x), pos, key_padding_mask, exact=exact)
        if self.head_kind == "token":
            return self.head(x)
        if key_padding_mask is None:
            return self.head(x.mean(dim=1))
        keep = (~key_padding_mask).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(dim=1) / keep.sum(dim=1).clamp_min(1.0))
