"""PerformerAttention: FAVOR+ linear attention with no relative positional encoding."""

from __future__ import annotations

import torch

from flt._signatures import flat_options
from flt.layers.kernel import KernelAttention
from flt.layers.parts import FavorPlus, Features, Settings, check_kernel_parts, kernel_parts


class PerformerAttention(KernelAttention):
    """Performer attention (Choromanski et al. 2021), O(N).

    Args:
        dim, heads, pos_dim, causal: as every attention layer.
        features: the kernel features (:mod:`flt.layers.parts`): :class:`~flt.layers.parts.FavorPlus`
            (default: ``m = 256`` random features estimating the softmax kernel, queries and
            keys L2-normalised with a learned temperature), ``ReLUFeatures``,
            ``EluFeatures``, ``TaylorFeatures`` or ``Hedgehog``, each with its own options.
        settings: :class:`~flt.layers.parts.Settings`: ``rope``/``rope_base`` (rotate queries
            and keys by RoPE at ``pos``, 1-D or axial), ``chunk_size``, ``backend``
            (``"triton"``: the kernels of :mod:`flt.ops.triton`), ``redraw_interval``.

    ``PerformerAttention.from_options(dim, heads, num_features=64, rope=True)`` builds it from
    the flat options of presets and the command line (``--attention performer:num_features=64``).
    ``forward(x [B, N, dim], pos, key_padding_mask) -> [B, N, dim]``; positions only matter
    with RoPE.
    """

    registry_name = "performer"

    def __init__(self, dim: int, heads: int, *, pos_dim: int = 1, causal: bool = False, features: Features | None = None,
                 settings: Settings | None = None, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        features = FavorPlus() if features is None else features
        settings = Settings() if settings is None else settings
        check_kernel_parts(features, settings)
        super().__init__(dim, heads, pos_dim=pos_dim, causal=causal, **features.map_options(), **settings.kernel_options(),
                         device=device, dtype=dtype)
        self.kernel, self.settings = features, settings

    @classmethod
    @flat_options
    # Narrower than the base's **options: the names listed here are the layer's flat options,
    # and from_options has checked them against this very signature.
    def _from_options(cls, dim: int, heads: int, *, pos_dim: int = 1, causal: bool = False, num_features: int = 256,  # type: ignore[override]
                      feature_map: str = "favor+", qk_norm: bool | None = None, temperature: float = 1.0, orthogonal: bool = True,
                      redraw_interval: int | None = None, seed: int | None = None, rope: bool = False, rope_base: float = 10000.0,
                      chunk_size: int | None = None, backend: str = "torch", device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> PerformerAttention:
        """The layer from flat options (checked by :meth:`from_options`): ``num_features``,
        ``feature_map``, ``qk_norm``, ``temperature``, ``orthogonal``, ``seed`` make the
        features part; ``rope``, ``rope_base``, ``chunk_size``, ``backend``,
        ``redraw_interval`` the settings."""
        features, settings = kernel_parts(feature_map=feature_map, num_features=num_features, orthogonal=orthogonal, seed=seed,
                                          qk_norm=qk_norm, temperature=temperature, rope=rope, rope_base=rope_base,
                                          chunk_size=chunk_size, backend=backend, redraw_interval=redraw_interval)
        return cls(dim, heads, pos_dim=pos_dim, causal=causal, features=features, settings=settings, device=device, dtype=dtype)

    def exact(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The attention the features estimate, with the same parameters: softmax
        ``softmax(x_q.x_k)`` for FAVOR+, the arc-cosine kernel for ``"relu"``, and for the
        deterministic ``"elu"``, ``"taylor"`` and ``"hedgehog"`` maps their own kernel (so ``exact`` equals
        ``forward``)."""
        p = self.prepare(x, pos, key_padding_mask)
        xq, xk = self.scaled_qk(p.q, p.k, p.pos)
        pad = self.padding_mask_matrix(p.pad, xq.dtype)
        return self.finish(self.exact_attention(xq, xk, p.v.to(xq.dtype), mask=pad), x)
