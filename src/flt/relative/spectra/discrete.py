"""A discrete spectrum: ``R`` point masses per head, each with a learned frequency and weight.

``g(xi) = sum_k w_k [delta(xi - xi_k) + delta(xi + xi_k)] / 2`` and
``f(Delta) = sum_k w_k cos(2 pi xi_k.Delta)``. The other families learn a few numbers that
shape a density and estimate its ``f`` with ``R`` sampled frequencies; here the ``R``
frequencies are the parameters, so the features compute ``f`` exactly (``a_i . c_j =
f(r_i - r_j)``, no sampling error and nothing to redraw) and the learned mask is any
``R``-term cosine sum. What is random is only the start: the frequencies are drawn as the
``gaussian_mixture`` family draws them with the same ``components``, ``length_scale``,
``length_spread``, ``sampler`` and ``seed``, so a fresh discrete spectrum equals that
mixture's estimate with fixed draws, and training then moves each frequency and weight
on its own (docs/math.md section 3.1, "A discrete spectrum").
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import torch
from torch import nn

from flt._dtype import compute_dtype
from flt.relative.base import tensor_sum
from flt.relative.spectra.base import Spectrum, as_dtype, cycles
from flt.relative.spectra.gaussian_mixture import component_lengths
from flt.relative.spectra.kernels import check_amplitude


class DiscreteSpectrum(Spectrum):
    """Learned frequencies ``xi [H, R, P]`` and weights ``w [H, R]``: ``f = sum_k w_k cos(2 pi xi_k.Delta)``.

    Parameterised so that Adam's steps (about the learning rate per step) are of the right
    size: ``xi_k = s_c theta_k`` with ``theta_k`` a learned number of order 1 (it starts at
    the base draw ``eps_k``) and ``s_c = 1 / (2 pi l_c)`` the fixed spread of frequency
    ``k``'s starting component; ``w_k = beta_k / (R / C)`` with ``beta_k`` starting at
    ``amplitude / C``, as the mixture's ``alpha_c`` does.

    Args:
        heads, pos_dim, num_frequencies: ``H``, ``P``, ``R``; ``R`` must be a multiple of
            ``components``.
        components: ``C`` starting components (lengths spread geometrically from
            ``length_scale`` to ``length_scale * length_spread``), ``R / C`` frequencies each.
        amplitude: the starting ``f(0) = sum_k w_k``; ``0`` gives ``f == 0``.
        length_scale, length_spread: the starting components' lengths in position units.
        **kwargs: ``sampler`` and ``seed`` (they set the starting frequencies only),
            ``device``, ``dtype``.
    """

    #: The features compute ``f`` itself: the estimate is exact, nothing is sampled.
    deterministic = True
    random_feature_buffers = ()

    spread: torch.Tensor  # buffer: ``s_c`` of every frequency, ``[1, R, 1]`` (from the options, not saved)

    def __init__(self, heads: int, pos_dim: int, num_frequencies: int, *, components: int = 4, amplitude: float = 1.0,
                 length_scale: float = 8.0, length_spread: float = 8.0, **kwargs: Any) -> None:
        amplitude = check_amplitude(amplitude)
        lengths = component_lengths(num_frequencies, components, length_scale, length_spread)
        if kwargs.get("shift"):
            raise ValueError("shift: the discrete family has no components to shift (its mask is even); use shift=False")
        super().__init__(heads, pos_dim, num_frequencies, **kwargs)  # has_random_features: False
        self.components = components
        per = num_frequencies // components
        fk = {"device": self._factory["device"], "dtype": self._factory["dtype"]}
        spread = (1.0 / (2 * math.pi * lengths)).repeat_interleave(per).view(1, num_frequencies, 1)
        self.register_buffer("spread", spread.to(**fk), persistent=False)
        self.theta = nn.Parameter(self.eps[..., :pos_dim].detach().clone().to(**fk))
        self.beta = nn.Parameter(torch.full((heads, num_frequencies), amplitude / components, **fk))

    def redraw_random_features(self, generator: torch.Generator | None = None) -> None:
        """Nothing to redraw: the frequencies are learned parameters (the base draws only
        set their starting values)."""

    redraw_frequencies = redraw_random_features

    def density(self, xi: torch.Tensor) -> NoReturn:
        raise ValueError("a discrete spectrum has no density (it is R point masses); its mask f is computed exactly "
                         "by mask() and by the features")

    def frequencies(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        theta, spread, beta = (as_dtype(t, dtype) for t in (self.theta, self.spread, self.beta))
        return spread * theta, beta * (self.components / self.num_frequencies)

    def mask(self, delta: torch.Tensor) -> torch.Tensor:
        """``f(Delta) = sum_k w_k cos(2 pi xi_k.Delta)``: ``[..., P] -> [..., H]``, with the
        phases reduced to whole cycles in float64 as the features reduce them."""
        self._check_points("delta", delta)
        cdt = compute_dtype(delta, self.theta)
        xi, w = self.precise_frequencies(delta)
        return (torch.cos(2 * math.pi * cycles(delta, xi).to(cdt)) * w.to(cdt)).sum(-1)

    def head_value(self, delta: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        # One scalar term per frequency (a score_mod indexes with a traced head, not slices).
        xi, w = self.frequencies()
        return tensor_sum(w[h, k] * torch.cos(2 * math.pi * tensor_sum(xi[h, k, p] * d for p, d in enumerate(delta)))
                          for k in range(self.num_frequencies))

    def pairwise(self, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
        """The exact ``f`` of every pair, ``[B|1, H, N, Nk]``, as products of the features
        (exact for this family): ``O(N Nk R)`` without the ``[B, N, Nk, H, R]`` phases."""
        a, c = self.features(pos_q)
        if pos_k is not pos_q:
            _, c = self.features(pos_k)
        return a @ c.transpose(-1, -2)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, components={self.components}"
