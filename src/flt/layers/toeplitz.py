"""ToeplitzAttention: kernelized attention with a learned relative bias by FFT (Luo et al. 2021).

Weights ``exp(b_h(i - j)) * phi(q_i).phi(k_j)`` on a regular 1-D grid, computed with FFT
Toeplitz products in ``O(N log N m Dv)`` (:func:`flt.ops.toeplitz_attention`; causal:
key blocks, a fixed number of operations whatever ``N``, so that no output sees a later token).
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

import torch

from flt._checks import check_nonnegative_int, check_positive_int, check_values
from flt._dtype import compute_dtype
from flt.layers import flat
from flt.layers.base import OfCore, size
from flt.layers.kernel import KernelAttention, KernelCore, mask_padded_keys
from flt.layers.parts import Features, Settings
from flt.ops.reference import rpe_attention_reference
from flt.ops.toeplitz import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DENSE_BELOW,
    toeplitz_attention,
    toeplitz_attention_reference,
)
from flt.relative.tables import DEFAULT_TABLE_SCALE, ClippedBias

#: Why a Toeplitz layer or core refuses ``step`` and ``prefill``.
NO_DECODING = "toeplitz attention has no constant-size recurrent state (its bias depends on every offset)"


class ToeplitzCore(KernelCore):
    """The mechanism of :class:`ToeplitzAttention` without its projections: the kernel
    features and the bias table (``table``), computing on queries, keys and values ``[B, H,
    N, D]`` at positions on a unit grid. The arguments are the layer's, with ``head_dim``
    for ``dim``."""

    supports_decoding = False

    def __init__(self, heads: int, head_dim: int, *, pos_dim: int = 1, causal: bool = False, max_distance: int = 512,
                 table_scale: float = DEFAULT_TABLE_SCALE, learn_table_scale: bool = True, fft_dtype: torch.dtype | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, dense_below: int = DEFAULT_DENSE_BELOW, features: Features | None = None,
                 settings: Settings | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if pos_dim != 1:
            raise ValueError(f"toeplitz attention needs a 1-D regular grid (pos_dim = 1), got pos_dim = {pos_dim}")
        check_positive_int("max_distance", max_distance)
        check_positive_int("block_size", block_size)
        check_nonnegative_int("dense_below", dense_below, "0: always the FFTs")
        if isinstance(settings, Settings) and settings.backend != "torch":
            raise ValueError(f"toeplitz attention has no Triton kernel: backend must be 'torch', got {settings.backend!r}")
        super().__init__(heads, head_dim, pos_dim=1, causal=causal, features=features, settings=settings, device=device, dtype=dtype)
        self.max_distance, self.fft_dtype, self.block_size, self.dense_below = max_distance, fft_dtype, block_size, dense_below
        self.table = ClippedBias(  # RELATIVE["clipped"], by its class so that its table is typed
            heads, causal=causal, max_distance=max_distance, table_scale=table_scale,
            learn_scale=learn_table_scale, device=device, dtype=dtype,
        )

    def bias(self, n: int) -> torch.Tensor:
        """``[H, 2n - 1]``: entry ``t + n - 1`` is the bias of offset ``t = i - j``."""
        t = torch.arange(-(n - 1), n, device=self.table.table.device)
        return self.table.of_offsets(t.view(-1, 1)).T

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # Before it used RelativeBiasTable the layer stored bias_table [H, 2M + 1], entry
        # t + M for t = i - j, and no scale: the table's rows are that, reversed (the
        # table indexes key - query), and only the past half when causal; scale 1.
        old = state_dict.pop(prefix + "bias_table", None)
        if old is not None and prefix + "table.table" not in state_dict:
            state_dict[prefix + "table.table"] = old.flip(-1).T[: self.table.table.shape[0]].contiguous()
            state_dict[prefix + "table.scale"] = torch.ones_like(self.table.scale)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @staticmethod
    def check_grid(pos: torch.Tensor) -> None:
        check_values(
            "pos", pos, lambda p: p[:, 1:, 0] - p[:, :-1, 0] == 1,
            "toeplitz attention needs positions on a regular 1-D grid with unit step (pos[:, i] = pos[:, 0] + i)", tag="unit-grid",
        )

    def _inputs(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        self.check_grid(pos)
        f = mask_padded_keys(self.features(q, k, pos), pad)
        # The op stabilises the key scales itself (causally when causal).
        return f.q, f.k, f.key_log_scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        self.step_schedule()
        qf, kf, kls = self._inputs(q, k, pos, pad)
        bias = self.bias(q.shape[2]).to(qf.dtype)
        return toeplitz_attention(
            qf, kf, v.to(qf.dtype), bias, causal=self.causal, key_log_scale=kls, fft_dtype=self.fft_dtype,
            block_size=self.block_size, dense_below=self.dense_below,
        )

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                  pad: torch.Tensor | None = None) -> torch.Tensor:
        """The same features and bias through the dense O(N^2) formula
        (:func:`flt.ops.toeplitz_attention_reference`: per-row stabiliser over the keys the
        row sees, empty rows give zeros)."""
        qf, kf, kls = self._inputs(q, k, pos, pad)
        bias = self.bias(q.shape[2]).to(qf.dtype)
        return toeplitz_attention_reference(qf, kf, v.to(qf.dtype), bias, causal=self.causal, key_log_scale=kls)

    def exact(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              pad: torch.Tensor | None = None) -> torch.Tensor:
        """The O(N^2) attention this core estimates: ``exp(b(i - j)) exp(x_q.x_k)``
        normalised, i.e. softmax of ``x_q.x_k + b(i - j)`` with the exact kernel in place of
        the random features (float32 or better)."""
        self.check_grid(pos)
        xq, xk = self.scaled_qk(q, k, pos)
        cdt = compute_dtype(xq)
        bias = self.table.bias(pos[:1] - pos[:1, :1]).to(cdt)  # offsets only: one row of positions serves the batch
        mask = self.padding_mask_matrix(pad, cdt)
        return rpe_attention_reference(xq.to(cdt), xk.to(cdt), v.to(cdt), bias=bias, mask=mask, causal=self.causal, scale=1.0)

    def check_prefill(self, pad: torch.Tensor | None) -> NoReturn:
        raise NotImplementedError(NO_DECODING)

    def step_offset(self, state: Any) -> NoReturn:
        raise NotImplementedError(NO_DECODING)

    def prefill(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(NO_DECODING)

    def step(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(NO_DECODING)


class ToeplitzAttention(KernelAttention):
    """Kernelized attention with an FFT-Toeplitz relative positional bias.

    Args:
        dim, heads, causal: as every attention layer; ``pos_dim`` must be 1.
        max_distance: offsets beyond ``+-max_distance`` share the table's last entry.
        table_scale, learn_table_scale: the bias table is a
            :class:`flt.posenc.RelativeBiasTable` (``mode="clipped"``, unidirectional
            when causal), ``b_h = scale_h * table``, ``scale`` starting at ``table_scale``
            (default 16, which multiplies the table's effective learning rate; see there)
            and learned unless ``learn_table_scale=False``.
        features, settings: the kernel features and how the layer runs
            (:mod:`flt.layers.parts`), as in :class:`flt.layers.performer.PerformerAttention`;
            no Triton backend. Luo et al.'s stabiliser is ``qk_norm=True`` (L2-normalised
            queries and keys, learned temperature), :class:`~flt.layers.parts.FavorPlus`'s
            default. ``ToeplitzAttention.from_options(dim, heads, num_features=64, ...)`` takes
            the flat options of presets and the command line.
        fft_dtype: dtype of the FFT (float32 or better by default; float64 removes the FFT
            rounding error of rows whose sums are small next to the largest ones, see
            :mod:`flt.ops.toeplitz`).
        block_size: causal only: diagonal blocks of this many tokens are computed densely,
            longer offsets by FFTs (:func:`flt.ops.toeplitz_attention`).
        dense_below: sequences of at most this many tokens take the exact quadratic
            formula, on a CPU the faster route there (:data:`flt.ops.toeplitz.DEFAULT_DENSE_BELOW`;
            0: always the FFTs).

    Key stabiliser: FAVOR+'s per-key log scales go to the op as ``key_log_scale``.
    Bidirectional, the op shifts them by one maximum over all keys; causal, by maxima over
    key blocks that precede each row, so a later key, however large, changes no earlier
    output (``tests/library/test_layers_attention.py::test_toeplitz_causal_outputs_ignore_huge_future_keys``).

    Positions must be a regular grid with unit step, ``pos[:, i] = pos[:, 0] + i`` (any
    start: the bias depends only on offsets); anything else is rejected. The mechanism is
    ``layer.core``, a :class:`ToeplitzCore`.
    """

    registry_name = "toeplitz"
    #: Its flat options and how they become its parts (:mod:`flt.layers.flat`).
    flat_builder = staticmethod(flat.toeplitz)
    core_class = ToeplitzCore
    core: ToeplitzCore
    supports_decoding = False
    size_options: ClassVar[tuple[str, ...]] = ("num_features", "max_distance", "dense_below", "chunk_size")

    @classmethod
    def forward_values(cls, options: dict, *, batch: int, heads: int, length: int, head_dim: int) -> int:
        """The kernel's (:class:`flt.layers.kernel.KernelAttention`) and the Toeplitz product's:
        ``B H N N`` up to ``dense_below`` tokens, else FFTs of ``B H 2N m (Dv + 1)`` complex
        values."""
        values = super().forward_values(options, batch=batch, heads=heads, length=length, head_dim=head_dim)
        b, h, n, m = batch, heads, length, size(cls.option(options, "num_features"), 1)
        dense = cls.option(options, "dense_below")
        if isinstance(dense, int) and not isinstance(dense, bool):
            values += b * h * n * n if n <= dense else 4 * b * h * 2 * n * m * (head_dim + 1)
        return values

    table = OfCore[ClippedBias]("The relative bias table (``layer.core.table``).")

    def step(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(NO_DECODING)
