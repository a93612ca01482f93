"""Property regressor over atoms (``P = 3``): atoms are tokens, coordinates are positions.

Symmetries. Coordinates are centred on each structure's mean atom position, the blocks
act per token apart from attention, and the readout is a masked sum or mean, so:

* permuting the atoms permutes nothing in the output (no token index is used);
* translating a structure changes nothing (centring; relative mechanisms also see only
  differences);
* rotating it changes nothing when every attention layer's mask depends on ``|Delta|``
  only, e.g. FLT with a radial spectrum (``gaussian`` or ``matern`` with tied per-axis
  lengths, see ``isotropic``, or the ``radial`` family, whose fast path is invariant to its
  direction rule's stated error whatever ``R``) and no absolute encoding. This holds exactly for
  ``exact=True`` (the O(N^2) mask ``f`` from ``spectrum.mask``); the fast path uses ``R``
  random frequencies whose estimate ``f^`` is radial only in expectation, so it is
  rotation invariant up to an error that shrinks like ``R^(-1/2)``.

``exact=True`` is an analysis tool: it computes the attention the fast path estimates.
Trained with redraws (``flt train``'s default), a model's exact attention is close to its
estimate (the small preset's FLT, seed 0: 0.127 eV on its own draw, 0.121 exact), which a
model trained on one fixed draw is not (an earlier preset: 0.23 eV on its draw, 3.4 eV exact).
``flt evaluate RUN`` measures both for a saved run, also with other estimator settings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from flt._checks import check_choice
from flt.models.block import trunk_modules
from flt.models.config import READOUTS
from flt.relative.spectra import (
    GaussianKernelSpectrum,
    GaussianMixtureSpectrum,
    MaternSpectrum,
    RadialSpectrum,
    Spectrum,
)

#: Spectra whose mask is a function of ``|Delta / l|``: radial once the lengths are tied.
#: A Gaussian mixture is radial once its per-axis scales are tied and its means held at the
#: origin: ``f(r) = sum_c alpha_c exp(-r^2 / (2 l_c^2))``, several length scales per head.
#: The radial family is radial as it is (learned shells; its features to their direction
#: rule's error) and needs no tying.
RADIAL_SPECTRA = (GaussianKernelSpectrum, MaternSpectrum, GaussianMixtureSpectrum, RadialSpectrum)


class _SameOnEveryAxis(nn.Module):
    """Parametrisation of log length scales ``[H, P]``: the mean over axes on every axis."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=-1, keepdim=True).expand_as(x)


class _AtOrigin(nn.Module):
    """Parametrisation of mixture means ``mu [H, C, P]``: zero, so no component oscillates
    along an axis (``cos(2 pi mu . Delta)`` is the only non-radial factor of a mixture)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def tie_isotropic(module: nn.Module) -> int:
    """Tie the per-axis length scales of every radial spectrum under ``module``.

    The tied value is the mean of the per-axis raw parameters, so gradients reach all of
    them equally and the lengths stay equal through training. A Gaussian mixture also has
    its component means held at the origin (its lengths, one per component, stay free), so
    its mask is a sum of radial Gaussians. Returns the number of radial spectra found (the
    ``radial`` family needs no tying); a spectrum that is not in :data:`RADIAL_SPECTRA`, or
    one with a learned shift, raises ``ValueError``.
    """
    tied = 0
    for name, sub in module.named_modules():
        if not isinstance(sub, Spectrum):
            continue
        if not isinstance(sub, RADIAL_SPECTRA):
            raise ValueError(
                f"isotropic=True needs radial spectra (gaussian, matern, gaussian_mixture or radial), but {name} is a "
                f"{type(sub).__name__}; choose a radial spectrum or set isotropic=False"
            )
        if getattr(sub, "shift", None) is not None:
            raise ValueError(f"isotropic=True needs radial spectra, but {name} has a learned shift (shift=True); drop it or set isotropic=False")
        if isinstance(sub, RadialSpectrum):
            tied += 1
            continue
        if isinstance(sub, GaussianMixtureSpectrum) and bool((sub.mu != 0).any()):
            raise ValueError(f"isotropic=True holds a Gaussian mixture's means at the origin, but {name} has nonzero means "
                             f"(mean_scale > 0); set mean_scale=0 or isotropic=False")
        length = "log_scale" if isinstance(sub, GaussianMixtureSpectrum) else "log_length"
        if not parametrize.is_parametrized(sub, length):
            raw = getattr(sub, length)
            with torch.no_grad():
                raw.copy_(raw.mean(dim=-1, keepdim=True).expand_as(raw))
            parametrize.register_parametrization(sub, length, _SameOnEveryAxis())
        if isinstance(sub, GaussianMixtureSpectrum) and not parametrize.is_parametrized(sub, "mu"):
            parametrize.register_parametrization(sub, "mu", _AtOrigin())
        tied += 1
    return tied


class MoleculeRegressor(nn.Module):
    """Element embeddings, pre-norm Transformer over atoms, per-atom head, pooled readout.

    Shapes: ``forward(z [B, N] int64, pos [B, N, 3], key_padding_mask [B, N] bool) -> [B]``
    where ``key_padding_mask`` is True for padding (any ``pos``; ``z = 0``, the padding
    element, is refused for a real atom), the polarity of every attention layer. The keyword
    arguments are the fields of :class:`flt.models.MoleculeConfig`, those of the trunk (all
    but ``dim``) as ``**trunk`` (:func:`flt.models.block.trunk_modules`).
    """

    def __init__(
        self,
        *,
        num_elements: int,
        dim: int,
        readout: str = "mean",
        isotropic: bool = True,
        target_mean: float = 0.0,
        target_std: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **trunk: Any,
    ) -> None:
        super().__init__()
        check_choice("readout", readout, READOUTS)
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.num_elements, self.readout = num_elements, readout
        self.target_mean, self.target_std = float(target_mean), float(target_std)
        self.embed = nn.Embedding(num_elements, dim, **fk)
        self.posenc, self.drop, self.trunk = trunk_modules(dim=dim, pos_dim=3, causal=False, **fk, **trunk)
        self.head = nn.Linear(dim, 1, **fk)
        if isotropic:
            tie_isotropic(self.trunk)

    def forward(
        self, z: torch.Tensor, pos: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *, exact: bool = False
    ) -> torch.Tensor:
        """Predicted property ``[B]`` in target units; ``exact`` uses each layer's ``exact``."""
        if key_padding_mask is None:
            key_padding_mask = torch.zeros(z.shape, dtype=torch.bool, device=z.device)
        pad = key_padding_mask
        if z.ndim != 2 or pos.shape != (*z.shape, 3) or pad.shape != z.shape or pad.dtype != torch.bool:
            raise ValueError(
                f"expected z [B, N], pos [B, N, 3] and a bool key_padding_mask [B, N] (True = padding), got {tuple(z.shape)}, "
                f"{tuple(pos.shape)} and {tuple(pad.shape)} {pad.dtype}"
            )
        mask = ~pad  # real atoms
        if bool((z[mask] < 0).any()) or bool((z[mask] >= self.num_elements).any()):
            raise ValueError(f"atomic numbers must lie in [0, {self.num_elements}) for real atoms")
        if bool((z[mask] == 0).any()) or not bool(mask.any(dim=1).all()):
            raise ValueError(
                "key_padding_mask marks an atom with z = 0 (the padding element) as real, or a structure with no real atom; "
                "key_padding_mask is True for padding, as in every attention layer (an inverted mask gives this error)"
            )
        keep = mask.unsqueeze(-1).to(pos.dtype)
        count = keep.sum(dim=1, keepdim=True).clamp_min(1)
        centre = (pos * keep).sum(dim=1, keepdim=True) / count
        # Padding sits at the centre; it is never attended to and never read out.
        pos = (pos - centre) * keep
        x = self.embed(z.masked_fill(~mask, 0)) + self.posenc(pos).to(self.embed.weight.dtype)
        x = self.trunk(self.drop(x), pos, key_padding_mask=~mask, exact=exact)
        per_atom = self.head(x).squeeze(-1) * mask.to(x.dtype)  # [B, N]
        out = per_atom.sum(dim=1)
        if self.readout == "mean":
            out = out / count.view(-1).to(out.dtype)
        return self.target_mean + self.target_std * out
