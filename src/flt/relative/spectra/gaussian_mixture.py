"""Gaussian-mixture spectra (docs/math.md section 3.1).

``g(xi) = sum_c alpha_c N(xi; mu_c, diag(s_c^2))`` per head, with the closed form
``f(Delta) = sum_c alpha_c cos(2 pi mu_c.Delta) exp(-2 pi^2 sum_p s_cp^2 Delta_p^2)``.
``alpha_c`` is signed, so ``f`` need not be positive definite. Sampling is stratified by
component: ``R / C`` frequencies each, ``xi = mu_c + s_c * eps``, ``w = alpha_c / R_c``
(unbiased for signed ``alpha`` too).

``min_length`` bounds every component's length from below (``l = min_length + l'`` with
``l' > 0`` learned), i.e. the spectrum's width from above: a far field restricted to long,
smooth components, the only ones a few random frequencies estimate well when the short
range is computed exactly elsewhere (FLT's near set; docs/nbody.md).

``basis`` turns a shifted 1-D mixture into a fixed basis, as a bias table is: centres frozen
on an even grid from 0 to ``basis`` position units, lengths and ``mu`` frozen at their
initial values, only the weights learnt. ``f`` is then linear in its parameters, so Adam
fits it as fast as a table, where a free mixture must first move its centres and lengths
(docs/offsets.md); its Fourier transform is still a shifted Gaussian mixture, so the
random-feature estimate applies unchanged. ``alpha_scale`` multiplies the weights (as a
table's ``table_scale``) so that they move by about ``alpha_scale * lr`` per Adam step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from flt._checks import check_positive_int
from flt._dtype import compute_dtype
from flt.relative.base import tensor_sum
from flt.relative.spectra.base import Spectrum, as_dtype, inverse_positive, positive
from flt.relative.spectra.kernels import check_amplitude


def component_lengths(num_frequencies: int, components: int, length_scale: float, length_spread: float) -> torch.Tensor:
    """The starting lengths of ``components`` components, geometric from ``length_scale`` to
    ``length_scale * length_spread`` (float64 ``[C]``), after checking that each component
    gets ``num_frequencies / components`` frequencies (the mixture and the discrete family)."""
    check_positive_int("num_frequencies", num_frequencies)
    check_positive_int("components", components)
    # An initial length of 0, inf or NaN would give log scales of +-inf.
    for name, value in (("length_scale", length_scale), ("length_spread", length_spread)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number (position units), got {value!r}")
    if num_frequencies % components:
        raise ValueError(
            f"num_frequencies ({num_frequencies}) must be a multiple of components ({components}) "
            "so every component gets the same number of frequencies"
        )
    if components == 1:
        return torch.tensor([float(length_scale)], dtype=torch.float64)
    return length_scale * torch.logspace(0, math.log10(length_spread), components, dtype=torch.float64)


class GaussianMixtureSpectrum(Spectrum):
    """Learned Gaussian mixture per head: ``alpha [H, C]``, ``mu [H, C, P]``, ``log s [H, C, P]``.

    Args:
        components: ``C``; ``num_frequencies`` must be a multiple of it.
        amplitude: initial total ``sum_c alpha_c = f(0)``, split evenly over components.
            ``0`` makes ``f = 0`` (a fresh logit-coupled layer is a Performer); ``1``
            makes ``f`` start near 1 (the multiplicative coupling starts as plain attention).
        length_scale: initial decay length of ``f`` in position units, per component
            spread geometrically from ``length_scale`` to ``length_scale * length_spread``
            so heads see several ranges. ``s = 1 / (2 pi l)``.
        mean_scale: std of the initial component means ``mu`` (0: all at the origin,
            giving nonnegative ``f``).
        min_length: a floor on every component's length in position units (default 0:
            none): ``l = min_length + l'`` with the learned ``l' > 0``, so ``s <= 1 / (2 pi
            min_length)`` however the parameters move. The initial lengths (from
            ``length_scale``) must exceed it. For a far field that may only hold smooth,
            long-range components, the ones whose random-feature estimate has a small
            variance: a Gaussian of length ``l`` in a box of side ``L`` has about
            ``(L / l)^3`` independent modes to sample.
        basis: ``0`` (default): a free mixture. ``> 0``: a fixed basis (needs ``shift=True``,
            ``pos_dim = 1`` and ``mean_scale = 0``): component ``c`` of every head centred at
            ``c * basis / (C - 1)``, shifts, lengths and ``mu`` frozen (``requires_grad``
            off), only ``alpha`` learnt. ``length_spread=1`` gives every component the length
            ``length_scale``; about the grid spacing covers the offsets evenly.
        alpha_scale: the mixture weights are ``alpha_scale * alpha`` (default 1): Adam moves
            ``alpha`` by about the learning rate per step, the weights by ``alpha_scale``
            times that.
        **kwargs: ``sampler``, ``seed``, ``shift``, ``shift_scale`` (a learned shift per
            component, :class:`flt.relative.spectra.base.Spectrum`), ``device``, ``dtype``.
    """

    supports_shift = True

    def __init__(self, heads: int, pos_dim: int, num_frequencies: int, *, components: int = 4, amplitude: float = 1.0,
                 length_scale: float = 8.0, length_spread: float = 8.0, mean_scale: float = 0.0, min_length: float = 0.0,
                 basis: float = 0.0, alpha_scale: float = 1.0, **kwargs: Any) -> None:
        amplitude = check_amplitude(amplitude)
        lengths = component_lengths(num_frequencies, components, length_scale, length_spread)
        if isinstance(mean_scale, bool) or not isinstance(mean_scale, (int, float)) or not (math.isfinite(mean_scale) and mean_scale >= 0):
            raise ValueError(f"mean_scale must be a finite number >= 0 (std of the initial component means), got {mean_scale!r}")
        if isinstance(min_length, bool) or not isinstance(min_length, (int, float)) or not (math.isfinite(min_length) and min_length >= 0):
            raise ValueError(f"min_length must be a finite number >= 0 (a floor on the component lengths, position units), got {min_length!r}")
        if min_length and min(length_scale, length_scale * length_spread) <= min_length:
            raise ValueError(
                f"the initial lengths (length_scale {length_scale}, length_spread {length_spread}) must exceed "
                f"min_length ({min_length}): set length_scale above it"
            )
        if isinstance(basis, bool) or not isinstance(basis, (int, float)) or not math.isfinite(basis) or basis < 0:
            raise ValueError(f"basis must be a finite number >= 0 (0: off), got {basis!r}")
        if isinstance(alpha_scale, bool) or not isinstance(alpha_scale, (int, float)) or not math.isfinite(alpha_scale) or alpha_scale <= 0:
            raise ValueError(f"alpha_scale must be a finite number > 0 (the weights are alpha_scale * alpha), got {alpha_scale!r}")
        if basis and (not kwargs.get("shift") or pos_dim != 1 or mean_scale):
            raise ValueError(
                f"basis={basis} fixes the component centres on a grid of offsets: it needs shift=True, pos_dim=1 and "
                f"mean_scale=0, got shift={kwargs.get('shift', False)!r}, pos_dim={pos_dim}, mean_scale={mean_scale}"
            )
        super().__init__(heads, pos_dim, num_frequencies, **kwargs)
        self.components = components
        fk = {"device": self._factory["device"], "dtype": self._factory["dtype"]}
        self.alpha_scale = float(alpha_scale)
        self.alpha = nn.Parameter(torch.full((heads, components), amplitude / components / self.alpha_scale, **fk))
        mu = torch.randn(heads, components, pos_dim, dtype=torch.float64) * mean_scale
        self.mu = nn.Parameter(mu.to(**fk))
        self.min_length = float(min_length)
        # log_scale holds the learned part l' = l - min_length (all of l without a floor).
        scales = (1.0 / (2 * math.pi * (lengths - self.min_length))).view(1, components, 1)
        self.log_scale = nn.Parameter(inverse_positive(scales, shape=(heads, components, pos_dim), **fk))
        self._init_shift(components)
        self.basis = float(basis)
        if self.basis:
            self._fix_basis()

    def _fix_basis(self) -> None:
        """Centres on the grid ``0 .. basis``; shifts, lengths and ``mu`` frozen."""
        assert self.shift is not None, "the constructor checks shift=True"
        grid = torch.linspace(0.0, self.basis, self.components, dtype=torch.float64) if self.components > 1 else torch.zeros(1, dtype=torch.float64)
        with torch.no_grad():
            self.shift.copy_((grid / self.shift_scale).view(1, -1, 1).expand_as(self.shift))
        for p in (self.shift, self.mu, self.log_scale):
            p.requires_grad_(False)

    def weights(self) -> torch.Tensor:
        """The mixture weights ``alpha_scale * alpha``, ``[H, C]``."""
        return self.alpha * self.alpha_scale if self.alpha_scale != 1.0 else self.alpha

    def scales(self) -> torch.Tensor:
        """Component standard deviations ``s [H, C, P]``."""
        return self._scales_of(self.log_scale)

    def lengths(self) -> torch.Tensor:
        """Component lengths ``l = 1 / (2 pi s)`` in position units, ``[H, C, P]`` (at least
        ``min_length``)."""
        return 1.0 / (2 * math.pi * self.scales())

    def _scales_of(self, log_scale: torch.Tensor) -> torch.Tensor:
        """``s`` from the raw parameter: ``1 / s = 1 / s' + 2 pi min_length`` (lengths add)."""
        s = positive(log_scale)
        return s / (1 + 2 * math.pi * self.min_length * s) if self.min_length else s

    def density(self, xi: torch.Tensor) -> torch.Tensor:
        self._check_points("xi", xi)
        self._check_unshifted("density")
        s = self.scales()
        z = (xi.unsqueeze(-2).unsqueeze(-2) - self.mu) / s  # [..., H, C, P]
        log_norm = -0.5 * (z * z).sum(-1) - torch.log(s).sum(-1) - 0.5 * self.pos_dim * math.log(2 * math.pi)
        return (self.weights() * torch.exp(log_norm)).sum(-1)

    def mask(self, delta: torch.Tensor) -> torch.Tensor:
        self._check_points("delta", delta)
        # In float32 or better (as the local family): a half-precision offset minus a shift
        # would round the shift.
        x = delta.to(compute_dtype(delta, self.mu))
        s = self.scales()
        if self.shift is None:
            # Unshifted: the phase and the decay contract P by one product each, with no
            # [..., H, C, P] tensor (the near set's k pairs per query, every step). Outside
            # autocast, which would lower these products to 16 bits.
            mu, s2 = self.mu.to(x.dtype), (s * s).to(x.dtype)
            with torch.autocast(x.device.type, enabled=False):
                phase, decay = torch.einsum("...p,hcp->...hc", x, mu), torch.einsum("...p,hcp->...hc", x * x, s2)
        else:
            d = self.component_offsets(x)  # [..., H, C, P]
            phase, decay = (self.mu * d).sum(-1), (s * s * d * d).sum(-1)
        return (self.weights() * torch.cos(2 * math.pi * phase) * torch.exp(-2 * math.pi**2 * decay)).sum(-1)

    def head_value(self, delta: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        terms, weights, scales = [], self.weights(), self.scales()  # scales() holds min_length, as mask() has it
        for c in range(self.components):
            d = self.head_offsets(delta, h, c)
            phase = tensor_sum(self.mu[h, c, p] * x for p, x in enumerate(d))
            decay = tensor_sum((scales[h, c, p] * x) ** 2 for p, x in enumerate(d))
            terms.append(weights[h, c] * torch.cos(2 * math.pi * phase) * torch.exp(-2 * math.pi**2 * decay))
        return tensor_sum(terms)

    def pairwise(self, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
        """The exact ``f`` of every pair, ``[B|1, H, N, Nk]``. Unshifted mixtures contract the
        offsets ``[B, N, Nk, P]`` with ``s^2`` and ``mu`` per component (einsum) instead of
        broadcasting ``[B, N, Nk, H, C, P]`` through :meth:`mask`, one component at a time: faster for 1024
        points in 3-D with 4 heads of 4 components (what the exact softmax reference with this
        mask computes every step)."""
        if self.shift is not None:
            return super().pairwise(pos_q, pos_k)
        cdt = compute_dtype(pos_q, self.mu)
        delta = pos_q.to(cdt).unsqueeze(2) - pos_k.to(cdt).unsqueeze(1)  # [B, N, Nk, P]
        s, mu = self.scales().to(cdt), self.mu.to(cdt)
        alpha, sq = self.weights().to(cdt), delta * delta
        f = None
        for c in range(self.components):  # one [B, H, N, Nk] block at a time
            env = torch.exp(-2 * math.pi**2 * torch.einsum("bijp,hp->bhij", sq, s[:, c] * s[:, c]))
            osc = torch.cos(2 * math.pi * torch.einsum("bijp,hp->bhij", delta, mu[:, c]))
            term = alpha[:, c].view(1, -1, 1, 1) * osc * env
            f = term if f is None else f + term
        assert f is not None, "the constructor checks components >= 1"
        return f

    def frequencies(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        H, C, P = self.mu.shape
        per = self.num_frequencies // C
        mu, log_scale, alpha, eps = (as_dtype(t, dtype) for t in (self.mu, self.log_scale, self.weights(), self.eps[..., :P]))
        eps = eps.reshape(H, C, per, P)
        xi = mu.unsqueeze(-2) + self._scales_of(log_scale).unsqueeze(-2) * eps  # [H, C, per, P]
        w = (alpha / per).unsqueeze(-1).expand(H, C, per)
        return xi.reshape(H, C * per, P), w.reshape(H, C * per)

    def extra_repr(self) -> str:
        floor = f", min_length={self.min_length}" if self.min_length else ""
        basis = f", basis={self.basis}" if self.basis else ""
        scale = f", alpha_scale={self.alpha_scale}" if self.alpha_scale != 1.0 else ""
        return f"{super().extra_repr()}, components={self.components}{floor}{basis}{scale}"
