"""Local RPE: learned smoothed windows (docs/math.md section 3.1).

The FLT paper's local RPE is a box ``f = a 1[|Delta| <= w]`` with spectrum
``g = a sin(2 pi w xi) / (pi xi)``. That ``g`` is signed with ``1/xi`` tails, so the
importance-sampling variance ``int g^2 / p`` is infinite for any Gaussian proposal (it
diverges like ``w / tau`` as the smoothing ``tau -> 0``; ``tests/library/test_spectra.py`` checks
the growth). Following docs/math.md we use the box convolved with a Gaussian of std ``tau``
instead, whose spectrum carries the Gaussian factor ``exp(-2 pi^2 tau^2 xi^2)``; sampling
from that factor makes ``g / p`` bounded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from flt._checks import check_positive_int
from flt._dtype import compute_dtype
from flt.relative.base import tensor_sum
from flt.relative.spectra.base import Spectrum, as_dtype, inverse_positive, positive
from flt.relative.spectra.kernels import check_amplitude, per_axis

_SQRT2 = math.sqrt(2.0)


class LocalSpectrum(Spectrum):
    """Sum of ``W`` smoothed windows per head, a product over axes in ``P`` dims.

    Window ``c`` of head ``h`` has a signed amplitude ``a_c``, half-widths ``w_cp`` and
    smoothings ``tau_cp`` (both log-parameterised, per axis):

        f_c(Delta) = a_c prod_p (1/2) [erf((w_cp - Delta_p) / (sqrt2 tau_cp))
                                       + erf((w_cp + Delta_p) / (sqrt2 tau_cp))]
        g_c(xi)    = a_c prod_p sin(2 pi w_cp xi_p) / (pi xi_p) exp(-2 pi^2 tau_cp^2 xi_p^2)

    (``sin(2 pi w xi) / (pi xi) -> 2 w`` at ``xi = 0``). ``f_c`` is about ``a_c`` for
    ``|Delta_p| < w_cp`` and falls to 0 over a few ``tau_cp``. ``f`` is even unless the
    windows are shifted (``shift=True``); in a causal language model only ``Delta >= 0`` is
    ever evaluated, so each window acts as "attend to the last ``w`` tokens" with a soft edge.

    Frequencies are stratified: ``R / W`` per window, sampled from the Gaussian factor,
    ``xi = eps / (2 pi tau)``, with importance weights ``w_k = g_c(xi_k) / (R_c p_c(xi_k))``.

    Args:
        heads, pos_dim, num_frequencies: ``H``, ``P``, ``R``; ``R`` must be a multiple of ``W``.
        windows: ``W`` per head.
        window_sizes: initial half-widths ``w`` in position units, a sequence of ``W``
            numbers shared by heads and axes; default geometric from 1 to 16 (4 if ``W = 1``).
        smoothing: initial ``tau`` in position units, one number or a sequence of ``W``
            (wide windows sample well only with a smoothing in proportion: the weights'
            second moment grows like ``w / tau``).
        amplitude: initial total ``f(0)``, split evenly over windows: each ``a_c`` is set
            so that window ``c`` contributes ``amplitude / W`` at ``Delta = 0`` (its own
            ``f_c(0) = a_c prod_p erf(w_cp / (sqrt2 tau_cp))``). ``0`` gives ``f == 0``.
        **kwargs: ``sampler``, ``seed``, ``redraw``, ``shift``, ``shift_scale`` (a learned
            shift per window, :class:`flt.relative.spectra.base.Spectrum`: window ``c`` then covers
            ``|Delta - delta_c| < w_c``, e.g. "the keys 100 to 500 tokens to my left"),
            ``device``, ``dtype``.
    """

    supports_shift = True

    def __init__(self, heads: int, pos_dim: int, num_frequencies: int, *, windows: int = 4,
                 window_sizes: Sequence[float] | None = None, smoothing: float | Sequence[float] = 1.0,
                 amplitude: float = 1.0, **kwargs: Any) -> None:
        check_positive_int("num_frequencies", num_frequencies)
        check_positive_int("windows", windows)
        if num_frequencies % windows:
            raise ValueError(
                f"num_frequencies ({num_frequencies}) must be a multiple of windows ({windows}) "
                "so every window gets the same number of frequencies"
            )
        amplitude = check_amplitude(amplitude)
        if window_sizes is None:
            if windows == 1:
                sizes = torch.tensor([4.0], dtype=torch.float64)
            else:
                sizes = torch.logspace(0, math.log10(16.0), windows, dtype=torch.float64)
        else:
            sizes = per_axis("window_sizes", window_sizes, windows, what="windows")
        if isinstance(smoothing, (bool, str)) or not isinstance(smoothing, (int, float, Sequence, torch.Tensor)):
            raise ValueError(f"smoothing must be a positive finite number or {windows} of them (tau in position units), got {smoothing!r}")
        taus = per_axis("smoothing", smoothing, windows, what="windows")
        super().__init__(heads, pos_dim, num_frequencies, **kwargs)
        self.windows = windows
        fk = {"device": self._factory["device"], "dtype": self._factory["dtype"]}
        shape = (heads, windows, pos_dim)
        self.log_half_width = nn.Parameter(inverse_positive(sizes.view(1, windows, 1), shape=shape, **fk))
        self.log_smoothing = nn.Parameter(inverse_positive(taus.view(1, windows, 1), shape=shape, **fk))
        peak = torch.erf(sizes / (_SQRT2 * taus)) ** pos_dim  # f_c(0) / a_c, [W]
        self.amplitude = nn.Parameter((amplitude / (windows * peak)).expand(heads, windows).clone().to(**fk))
        self._init_shift(windows)

    def half_widths(self) -> torch.Tensor:
        """``w [H, W, P]`` in position units."""
        return positive(self.log_half_width)

    def smoothings(self) -> torch.Tensor:
        """``tau [H, W, P]`` in position units."""
        return positive(self.log_smoothing)

    def _cdt(self, x: torch.Tensor) -> torch.dtype:
        return compute_dtype(x, self.log_smoothing)

    def density(self, xi: torch.Tensor) -> torch.Tensor:
        """``g(xi) = sum_c g_c(xi)``: ``[..., P] -> [..., H]``."""
        self._check_points("xi", xi)
        self._check_unshifted("density")
        cdt = self._cdt(xi)
        w, tau = self.half_widths().to(cdt), self.smoothings().to(cdt)
        x = xi.to(cdt).unsqueeze(-2).unsqueeze(-2)  # [..., 1, 1, P]
        # sin(2 pi w x) / (pi x) = 2 w sinc(2 w x) with torch's normalised sinc (finite at 0).
        box = 2 * w * torch.sinc(2 * w * x)
        gauss = torch.exp(-2 * math.pi**2 * (tau * x) ** 2)
        return (self.amplitude.to(cdt) * (box * gauss).prod(-1)).sum(-1)

    def mask(self, delta: torch.Tensor) -> torch.Tensor:
        """``f(Delta) = sum_c f_c(Delta)``: ``[..., P] -> [..., H]``."""
        self._check_points("delta", delta)
        cdt = self._cdt(delta)
        w, tau = self.half_widths().to(cdt), self.smoothings().to(cdt)
        # Each window is even about its centre: [..., 1, 1, P], or [..., H, W, P] with shifts.
        d = self.component_offsets(delta.to(cdt)).abs()
        # (1/2)[erf((w - d)/s) + erf((w + d)/s)] == (1/2)[erfc((d - w)/s) - erfc((d + w)/s)]:
        # the erfc form has no cancellation far outside the window (d >> w).
        s = _SQRT2 * tau
        axis = 0.5 * (torch.erfc((d - w) / s) - torch.erfc((d + w) / s))
        return (self.amplitude.to(cdt) * axis.prod(-1)).sum(-1)

    def head_value(self, delta: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        windows = []
        for c in range(self.windows):
            window = self.amplitude[h, c]
            for p, x in enumerate(self.head_offsets(delta, h, c)):
                d, w = x.abs(), positive(self.log_half_width[h, c, p])
                s = _SQRT2 * positive(self.log_smoothing[h, c, p])
                window = window * 0.5 * (torch.erfc((d - w) / s) - torch.erfc((d + w) / s))
            windows.append(window)
        return tensor_sum(windows)

    def frequencies(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``xi [H, R, P]`` (window-major), ``w [H, R]``.

        Per axis, with ``p = N(0, (2 pi tau)^-2)``, ``p(xi) = sqrt(2 pi) tau exp(-2 pi^2 tau^2 xi^2)``
        cancels the Gaussian factor of ``g`` exactly, and with ``xi = eps / (2 pi tau)``

            g_p(xi) / p(xi) = sin(2 pi w xi) / (pi xi sqrt(2 pi) tau)
                            = sqrt(2/pi) (w / tau) sinc(w eps / tau),   sinc(x) = sin(x) / x,

        bounded by ``sqrt(2/pi) w / tau``. So ``w_k = (a_c / R_c) prod_p sqrt(2/pi) (w_p/tau_p)
        sinc(w_p eps_p / tau_p)``. Its second moment per axis is about ``0.8 w / tau`` for
        ``w >> tau``: wide, sharp windows need more frequencies.
        """
        H, W, P = self.log_half_width.shape
        per = self.num_frequencies // W
        eps, log_w, log_tau, amplitude = (
            as_dtype(t, dtype) for t in (self.eps[..., :P], self.log_half_width, self.log_smoothing, self.amplitude)
        )
        eps = eps.reshape(H, W, per, P)
        w, tau = positive(log_w).unsqueeze(-2), positive(log_tau).unsqueeze(-2)  # [H, W, 1, P]
        xi = eps / (2 * math.pi * tau)
        ratio = w / tau
        # torch.sinc(x) = sin(pi x) / (pi x).
        factor = math.sqrt(2 / math.pi) * ratio * torch.sinc(ratio * eps / math.pi)
        weight = (amplitude / per).unsqueeze(-1) * factor.prod(-1)  # [H, W, per]
        return xi.reshape(H, W * per, P), weight.reshape(H, W * per)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, windows={self.windows}"
