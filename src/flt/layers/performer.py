"""PerformerAttention: FAVOR+ linear attention with no relative positional encoding."""

from __future__ import annotations

from flt.layers.kernel import KernelAttention
from flt.ops.linear import DEFAULT_CHUNK_SIZE
from flt.ops.reference import rpe_attention_reference


class PerformerAttention(KernelAttention):
    """Performer attention (Choromanski et al. 2021), O(N).

    Args:
        dim, heads, pos_dim, causal: as every attention layer.
        num_features: ``m`` random features per head.
        feature_map: ``"favor+"`` (default; estimates the softmax kernel), ``"relu"`` or ``"elu"``.
        qk_norm: L2-normalise queries and keys with a learned temperature (default on for
            FAVOR+: its variance grows exponentially with ``|q|^2``).
        temperature: initial temperature for ``qk_norm``.
        orthogonal: orthogonal random blocks.
        redraw_interval: redraw the projection every this many training forward calls
            (``None``: fixed; :class:`flt.layers.kernel.KernelAttention`). ``flt train``
            redraws by ``RunConfig.redraw_interval`` instead (:mod:`flt.layers.draws`).
        seed: seeds the projection.
        rope, rope_base: rotate queries and keys by RoPE (1-D or axial) at ``pos``.
        chunk_size: chunk length of the causal computation.

    ``forward(x [B, N, dim], pos, key_padding_mask) -> [B, N, dim]``; positions only matter
    with ``rope=True``.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        pos_dim: int = 1,
        causal: bool = False,
        num_features: int = 256,
        feature_map: str = "favor+",
        qk_norm: bool | None = None,
        temperature: float = 1.0,
        orthogonal: bool = True,
        redraw_interval: int | None = None,
        seed: int | None = None,
        rope: bool = False,
        rope_base: float = 10000.0,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            dim, heads, pos_dim=pos_dim, causal=causal, num_features=num_features, feature_map=feature_map,
            qk_norm=qk_norm, temperature=temperature, orthogonal=orthogonal, redraw_interval=redraw_interval,
            seed=seed, rope=rope, rope_base=rope_base, chunk_size=chunk_size, device=device, dtype=dtype,
        )

    def exact(self, x, pos=None, key_padding_mask=None):
        """Exact softmax attention ``softmax(x_q.x_k)`` with the same parameters (FAVOR+'s target)."""
        p = self.prepare(x, pos, key_padding_mask)
        xq, xk = self.scaled_qk(p.q, p.k, p.pos)
        pad = self.padding_mask_matrix(p.pad, xq.dtype)
        return self.finish(rpe_attention_reference(xq, xk, p.v.to(xq.dtype), mask=pad, causal=self.causal, scale=1.0), x)
