"""PerformerAttention: FAVOR+ linear attention with no relative positional encoding."""

from __future__ import annotations

from flt.layers import flat
from flt.layers.kernel import KernelAttention, KernelCore


class PerformerCore(KernelCore):
    """The Performer's core: the kernel features and settings of :class:`PerformerAttention`
    on queries and keys ``[B, H, N, D]`` (``features``, ``settings`` as there; the arguments
    of :class:`flt.layers.kernel.KernelCore`)."""


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
            (``"triton"``: the kernels of :mod:`flt.ops.triton`; ``"triton-split"``: the
            feature-split ones, :mod:`flt.ops.triton.split`), ``redraw_interval``.

    ``PerformerAttention.from_options(dim, heads, num_features=64, rope=True)`` builds it from
    the flat options of presets and the command line (``--attention performer:num_features=64``).
    ``forward(x [B, N, dim], pos, key_padding_mask) -> [B, N, dim]``; positions only matter
    with RoPE. ``exact`` is the attention the features estimate
    (:meth:`flt.layers.kernel.KernelCore.exact`). The mechanism is ``layer.core``, a
    :class:`PerformerCore`.
    """

    registry_name = "performer"
    #: Its flat options and how they become its parts (:mod:`flt.layers.flat`).
    flat_builder = staticmethod(flat.performer)
    core_class = PerformerCore
    core: PerformerCore
