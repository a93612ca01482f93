"""PerformerAttention: FAVOR+ linear attention with no relative positional encoding."""

from __future__ import annotations

import torch

from flt.layers.kernel import KernelAttention


class PerformerAttention(KernelAttention):
    """Performer attention (Choromanski et al. 2021), O(N).

    Args:
        dim, heads, pos_dim, causal: as every attention layer.
        num_features: ``m`` random features per head.
        feature_map: ``"favor+"`` (default; estimates the softmax kernel), ``"relu"``, ``"elu"``,
            ``"taylor"`` or ``"hedgehog"`` (:class:`flt.layers.features.FeatureMap`).
        qk_norm: L2-normalise queries and keys with a learned temperature (default on for
            FAVOR+: its variance grows exponentially with ``|q|^2``).
        temperature: initial temperature for ``qk_norm``.
        orthogonal: orthogonal random blocks.
        redraw_interval: redraw the projection every this many training forward calls
            (``None``: fixed; :class:`flt.layers.kernel.KernelAttention`). ``flt train``
            redraws by ``RunConfig.redraw_interval`` instead (:mod:`flt.layers.draws`).
        seed: seeds the projection.
        rope, rope_base: rotate queries and keys by RoPE (1-D or axial) at ``pos``.
        chunk_size: chunk length of the causal computation (None: chosen from the shapes,
            :func:`flt.ops.linear.causal_chunk_size`).

    ``forward(x [B, N, dim], pos, key_padding_mask) -> [B, N, dim]``; positions only matter
    with ``rope=True``. The constructor is :class:`flt.layers.kernel.KernelAttention`'s, where
    these options are declared once for every kernel layer.
    """

    registry_name = "performer"

    def exact(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The attention the features estimate, with the same parameters: softmax
        ``softmax(x_q.x_k)`` for FAVOR+, the arc-cosine kernel for ``"relu"``, and for the
        deterministic ``"elu"``, ``"taylor"`` and ``"hedgehog"`` maps their own kernel (so ``exact`` equals
        ``forward``)."""
        p = self.prepare(x, pos, key_padding_mask)
        xq, xk = self.scaled_qk(p.q, p.k, p.pos)
        pad = self.padding_mask_matrix(p.pad, xq.dtype)
        return self.finish(self.exact_attention(xq, xk, p.v.to(xq.dtype), mask=pad), x)
