"""CAPE: continuous augmented positional embeddings (Likhomanenko et al. 2021).

CAPE is a training-time augmentation of the positions themselves, so it composes with
any encoding that takes real-valued positions (sinusoidal, learnable Fourier features,
FLT's spectral RPE, RoPE). Per sample ``b``, after optional mean-centring,

    x'_(b,i) = lambda_b (x_(b,i) + Delta_b + eps_(b,i))

    Delta_b      ~ U[-Dmax, Dmax]               per sample, independently per axis
    eps_(b,i)    ~ U[-emax, emax]               per token, independently per axis
    log lambda_b ~ U[-log Lmax, log Lmax]       per sample, one scale for all axes

In eval mode the random part is off. Mean-centring (``x - mean_i x``, per sample and
axis) is deterministic and is applied in both modes, as in the reference implementations:
centring only during training would shift every position at test time relative to what
the model saw. The default ``mean_center=False`` makes ``eval()`` exactly the identity;
with ``mean_center=True`` (the paper's option) eval is a pure translation of each sample,
which relative mechanisms ignore.

Centring averages over all ``N`` tokens; for padded batches centre the valid tokens
yourself and pass ``mean_center=False``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from flt._checks import check_bool, check_nonnegative_float, check_positive_int
from flt.posenc._common import check_abs_positions, compute_dtype


@dataclass(frozen=True)
class CAPEDraws:
    """One draw of the CAPE transform for a batch.

    Attributes:
        shift: global shifts ``Delta``, ``[B, 1, P]``.
        local: local shifts ``eps``, ``[B, N, P]``.
        log_scale: ``log lambda``, ``[B, 1, 1]``.
    """

    shift: torch.Tensor
    local: torch.Tensor
    log_scale: torch.Tensor

    def apply(self, pos: torch.Tensor) -> torch.Tensor:
        """``lambda (pos + Delta + eps)`` for (already centred) ``pos [B, N, P]``."""
        return self.log_scale.exp() * (pos + self.shift + self.local)


def patch_grid(num_patches_per_side: int, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Centres of an ``n x n`` grid of patches on ``[-1, 1]^2``: ``[n * n, 2]``, row-major.

    Centres are ``-1 + (2k + 1)/n``, spacing ``2/n``, so ``CAPE.for_2d_patches``'s local
    shift of ``1/n`` is half a step and never swaps neighbouring patches.
    """
    check_positive_int("num_patches_per_side", num_patches_per_side)
    n = num_patches_per_side
    centres = -1.0 + (2.0 * torch.arange(n, device=device, dtype=torch.float64) + 1.0) / n
    rows, cols = torch.meshgrid(centres, centres, indexing="ij")
    grid = torch.stack((rows, cols), dim=-1).reshape(n * n, 2)
    return grid.to(dtype or torch.get_default_dtype())


class CAPE(nn.Module):
    """CAPE position augmentation; see the module docstring for the transform.

    Args:
        pos_dim: ``P``.
        max_global_shift: ``Dmax >= 0``, in position units.
        max_local_shift: ``emax >= 0``, in position units. On a grid of step ``s``,
            ``emax <= s/2`` keeps the token order.
        max_global_scaling: ``Lmax >= 1``; ``lambda`` lies in ``[1/Lmax, Lmax]``.
        mean_center: subtract each sample's mean position (train and eval).

    Shapes: ``forward(pos [B, N, P], *, generator=None) -> [B, N, P]`` in ``pos``'s dtype.
    """

    def __init__(
        self,
        pos_dim: int,
        *,
        max_global_shift: float = 0.0,
        max_local_shift: float = 0.0,
        max_global_scaling: float = 1.0,
        mean_center: bool = False,
    ):
        super().__init__()
        check_positive_int("pos_dim", pos_dim)
        self.pos_dim = pos_dim
        self.max_global_shift = check_nonnegative_float("max_global_shift", max_global_shift)
        self.max_local_shift = check_nonnegative_float("max_local_shift", max_local_shift)
        scaling = check_nonnegative_float("max_global_scaling", max_global_scaling)
        if scaling < 1.0:
            raise ValueError(f"max_global_scaling must be >= 1 (lambda lies in [1/L, L]), got {max_global_scaling!r}")
        self.max_global_scaling = scaling
        check_bool("mean_center", mean_center)
        self.mean_center = mean_center

    @classmethod
    def for_1d(
        cls,
        *,
        max_global_shift: float = 5.0,
        max_local_shift: float = 0.5,
        max_global_scaling: float = 1.0,
        mean_center: bool = False,
    ) -> CAPE:
        """Preset for token indices ``0 .. N-1`` (unit step).

        The local shift of half a step keeps the token order. The defaults are
        conservative choices for a unit grid, not the paper's per-task tuned values.
        """
        return cls(
            1,
            max_global_shift=max_global_shift,
            max_local_shift=max_local_shift,
            max_global_scaling=max_global_scaling,
            mean_center=mean_center,
        )

    @classmethod
    def for_2d_patches(cls, num_patches_per_side: int) -> CAPE:
        """Preset for image patches on ``[-1, 1]^2`` (see :func:`patch_grid`).

        Global shift 0.5, local shift ``1/n`` (half the patch spacing), scaling in
        ``[1/1.4, 1.4]`` (about [0.7, 1.4]) as in the paper's ViT setting. The grid is
        already centred, so no mean-centring.
        """
        check_positive_int("num_patches_per_side", num_patches_per_side)
        return cls(
            2,
            max_global_shift=0.5,
            max_local_shift=1.0 / num_patches_per_side,
            max_global_scaling=1.4,
            mean_center=False,
        )

    def sample(
        self,
        batch: int,
        length: int,
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> CAPEDraws:
        """Draw ``(Delta, eps, log lambda)`` for ``batch`` samples of ``length`` tokens.

        Draws are made on the generator's device (the default CPU generator when
        ``generator`` is None, so a seed gives the same draws on every device), then
        moved to ``device``. ``forward`` uses exactly one call to this method.
        """
        check_positive_int("batch", batch)
        check_positive_int("length", length)
        gen_device = generator.device if generator is not None else torch.device("cpu")

        def uniform(shape: tuple[int, ...], half_width: float) -> torch.Tensor:
            u = torch.rand(shape, generator=generator, device=gen_device, dtype=torch.float64)
            return ((2.0 * u - 1.0) * half_width).to(device=device, dtype=dtype)

        P = self.pos_dim
        return CAPEDraws(
            shift=uniform((batch, 1, P), self.max_global_shift),
            local=uniform((batch, length, P), self.max_local_shift),
            log_scale=uniform((batch, 1, 1), math.log(self.max_global_scaling)),
        )

    def forward(self, pos: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        check_abs_positions("pos", pos, self.pos_dim)
        cdt = compute_dtype(pos)
        x = pos.to(cdt)
        if self.mean_center:
            x = x - x.mean(dim=1, keepdim=True)
        if self.training:
            draws = self.sample(pos.shape[0], pos.shape[1], generator=generator, device=pos.device, dtype=cdt)
            x = draws.apply(x)
        return x.to(pos.dtype)

    def extra_repr(self) -> str:
        return (
            f"pos_dim={self.pos_dim}, max_global_shift={self.max_global_shift}, "
            f"max_local_shift={self.max_local_shift}, max_global_scaling={self.max_global_scaling}, "
            f"mean_center={self.mean_center}"
        )
