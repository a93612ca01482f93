"""ToeplitzAttention: kernelized attention with a learned relative bias by FFT (Luo et al. 2021).

Weights ``exp(b_h(i - j)) * phi(q_i).phi(k_j)`` on a regular 1-D grid, computed with FFT
Toeplitz products in ``O(N log N m Dv)`` (:func:`flt.ops.toeplitz_attention`).
"""

from __future__ import annotations

import torch
from torch import nn

from flt._checks import check_positive_int
from flt.layers.kernel import KernelAttention, mask_padded_keys
from flt.ops.toeplitz import toeplitz_attention


class ToeplitzAttention(KernelAttention):
    """Kernelized attention with an FFT-Toeplitz relative positional bias.

    Args:
        dim, heads, causal: as every attention layer; ``pos_dim`` must be 1.
        max_distance: offsets beyond ``+-max_distance`` share the table's last entry.
        num_features, feature_map, qk_norm, temperature, orthogonal, redraw_interval, seed:
            the feature map, as in :class:`flt.layers.performer.PerformerAttention`. Luo et
            al.'s stabiliser is ``qk_norm=True`` (L2-normalised queries and keys, learned
            temperature), the default here.
        fft_dtype: dtype of the FFT (float32 or better by default; float64 makes the first
            rows of a long causal product exact to float32 rounding, see :mod:`flt.ops.toeplitz`).

    Positions must be a regular grid with unit step, ``pos[:, i] = pos[:, 0] + i`` (any
    start: the bias depends only on offsets); anything else is rejected.
    """

    supports_decoding = False

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        pos_dim: int = 1,
        causal: bool = False,
        max_distance: int = 512,
        num_features: int = 256,
        feature_map: str = "favor+",
        qk_norm: bool | None = None,
        temperature: float = 1.0,
        orthogonal: bool = True,
        redraw_interval: int | None = None,
        seed: int | None = None,
        fft_dtype: torch.dtype | None = None,
        device=None,
        dtype=None,
    ) -> None:
        if pos_dim != 1:
            raise ValueError(f"toeplitz attention needs a 1-D regular grid (pos_dim = 1), got pos_dim = {pos_dim}")
        check_positive_int("max_distance", max_distance)
        super().__init__(
            dim, heads, pos_dim=1, causal=causal, num_features=num_features, feature_map=feature_map, qk_norm=qk_norm,
            temperature=temperature, orthogonal=orthogonal, redraw_interval=redraw_interval, seed=seed, device=device, dtype=dtype,
        )
        self.max_distance, self.fft_dtype = max_distance, fft_dtype
        self.bias_table = nn.Parameter(torch.zeros(heads, 2 * max_distance + 1, device=device, dtype=dtype))

    def bias(self, n: int) -> torch.Tensor:
        """``[H, 2n - 1]``: entry ``t + n - 1`` is the bias of offset ``t = i - j``."""
        offsets = torch.arange(-(n - 1), n, device=self.bias_table.device).clamp(-self.max_distance, self.max_distance)
        return self.bias_table[:, offsets + self.max_distance]

    @staticmethod
    def check_grid(pos: torch.Tensor) -> None:
        steps = pos[:, 1:, 0] - pos[:, :-1, 0]
        if steps.numel() and not bool(torch.all(steps == 1)):
            raise ValueError("toeplitz attention needs positions on a regular 1-D grid with unit step (pos[:, i] = pos[:, 0] + i)")

    def _inputs(self, x, pos, key_padding_mask):
        p = self.prepare(x, pos, key_padding_mask)
        self.check_grid(p.pos)
        f = mask_padded_keys(self.features(p.q, p.k, p.pos), p.pad)
        kf = f.k
        if f.key_log_scale is not None:
            # The FFT product has no running state, so keys share one global shift; the
            # shift cancels exactly, and with qk_norm the features are bounded anyway.
            kls = f.key_log_scale
            kf = kf * torch.exp(kls - kls.amax(dim=-1, keepdim=True)).unsqueeze(-1)
        return p, f.q, kf

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.training:
            self.feature_map.step_schedule()
        p, qf, kf = self._inputs(x, pos, key_padding_mask)
        bias = self.bias(x.shape[1]).to(qf.dtype)
        out = toeplitz_attention(qf, kf, p.v.to(qf.dtype), bias, causal=self.causal, fft_dtype=self.fft_dtype)
        return self.finish(out, x)

    def reference(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The same features and bias through the dense O(N^2) formula."""
        p, qf, kf = self._inputs(x, pos, key_padding_mask)
        n = x.shape[1]
        idx = torch.arange(n, device=x.device)
        bias = self.bias(n).to(qf.dtype)[:, idx.view(-1, 1) - idx.view(1, -1) + n - 1]  # [H, N, N]
        w = torch.exp(bias - bias.amax()) * (qf @ kf.transpose(-1, -2))
        if self.causal:
            w = w.tril()
        out = (w @ p.v.to(qf.dtype)) / w.sum(-1, keepdim=True)
        return self.finish(out, x)

    def step(self, *args, **kwargs):
        raise NotImplementedError("toeplitz attention has no constant-size recurrent state (its bias depends on every offset)")
