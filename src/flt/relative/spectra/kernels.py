"""Shift-invariant kernel spectra: Gaussian and Matern (docs/math.md section 3.1).

Both ``g`` are nonnegative, so frequencies are sampled from ``g`` itself (Bochner) with
equal weights ``w_k = a / R``, reparameterised from the fixed base draws so gradients
reach the length scales. Per-axis length scales ``l [H, P]`` act by scaling each offset
coordinate, ``Delta_p / l_p``; the learned amplitude ``a [H]`` is ``f(0)`` and may be
negative (the estimator stays unbiased: ``f`` is then ``a`` times a kernel).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from flt._dtype import compute_dtype
from flt.relative.base import tensor_sum
from flt.relative.spectra.base import Spectrum, as_dtype, inverse_positive, positive

#: Smoothness parameters with closed-form Matern kernels; ``2 nu`` must be an integer
#: because the chi-square variable is a sum of ``2 nu`` squared base normals.
MATERN_NU = (0.5, 1.5, 2.5)


def check_amplitude(value: object) -> float:
    """Require a finite real initial amplitude (``f(0)``); 0 gives ``f == 0``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"amplitude must be a finite number (the initial f(0)), got {value!r}")
    return float(value)


def per_axis(name: str, value: object, size: int, what: str = "P") -> torch.Tensor:
    """A positive float or a sequence of ``size`` positive floats, as float64 ``[size]``."""
    t = torch.as_tensor(value, dtype=torch.float64)
    if t.ndim == 0:
        t = t.expand(size)
    if t.ndim != 1 or t.shape[0] != size:
        raise ValueError(f"{name} must be a number or a sequence of length {what} = {size}, got {value!r}")
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return t.clone()


class _KernelSpectrum(Spectrum):
    """Shared parameters of the kernel families: amplitude ``a [H]``, log lengths ``[H, P]``."""

    def _init_kernel(self, amplitude: float, lengths: torch.Tensor) -> None:
        fk = {"device": self._factory["device"], "dtype": self._factory["dtype"]}
        largest = torch.finfo(fk["dtype"] or torch.get_default_dtype()).max
        if not abs(float(amplitude)) <= largest:  # NaN too: a parameter that no step could change
            raise ValueError(f"amplitude must be finite and at most {largest:.3g} in magnitude (the parameters' dtype), got {amplitude!r}")
        self.amplitude = nn.Parameter(torch.full((self.heads,), amplitude, **fk))
        self.log_length = nn.Parameter(inverse_positive(lengths, shape=(self.heads, self.pos_dim), **fk))

    def lengths(self) -> torch.Tensor:
        """Length scales ``l [H, P]`` in position units."""
        return positive(self.log_length)

    def _cdt(self, x: torch.Tensor) -> torch.dtype:
        # Exponentials and frequencies in float32 or better, whatever the parameter dtype.
        return compute_dtype(x, self.log_length)


class GaussianKernelSpectrum(_KernelSpectrum):
    """Gaussian RPE ``f(Delta) = a exp(-sum_p (Delta_p / l_p)^2 / 2)``.

    Spectrum ``g(xi) = a prod_p N(xi_p; 0, 1 / (2 pi l_p)^2)``; frequencies
    ``xi = eps / (2 pi l)`` with ``eps ~ N(0, I)`` and weights ``w = a / R``.

    Args:
        heads, pos_dim, num_frequencies: ``H``, ``P``, ``R``.
        amplitude: initial ``a = f(0)`` for every head; ``0`` gives ``f == 0``.
        length_scale: initial ``l``, a number or a sequence of ``P`` numbers (per axis).
        **kwargs: ``sampler``, ``seed``, ``redraw``, ``device``, ``dtype`` (see :class:`Spectrum`).
    """

    def __init__(self, heads: int, pos_dim: int, num_frequencies: int, *, amplitude: float = 1.0,
                 length_scale: float | Sequence[float] = 8.0, **kwargs: Any) -> None:
        amplitude = check_amplitude(amplitude)
        lengths = per_axis("length_scale", length_scale, pos_dim)
        super().__init__(heads, pos_dim, num_frequencies, **kwargs)
        self._init_kernel(amplitude, lengths)

    def density(self, xi: torch.Tensor) -> torch.Tensor:
        """``g(xi)``: ``[..., P] -> [..., H]``."""
        self._check_points("xi", xi)
        cdt = self._cdt(xi)
        ell = self.lengths().to(cdt)
        z = 2 * math.pi * xi.to(cdt).unsqueeze(-2) * ell  # xi / s with s = 1 / (2 pi l): [..., H, P]
        log_g = -0.5 * (z * z).sum(-1) + torch.log(2 * math.pi * ell).sum(-1) - 0.5 * self.pos_dim * math.log(2 * math.pi)
        return self.amplitude.to(cdt) * torch.exp(log_g)

    def mask(self, delta: torch.Tensor) -> torch.Tensor:
        """``f(Delta) = a exp(-|Delta / l|^2 / 2)``: ``[..., P] -> [..., H]``."""
        self._check_points("delta", delta)
        cdt = self._cdt(delta)
        d = delta.to(cdt).unsqueeze(-2) / self.lengths().to(cdt)  # [..., H, P]
        return self.amplitude.to(cdt) * torch.exp(-0.5 * (d * d).sum(-1))

    def head_value(self, delta: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return self.amplitude[h] * torch.exp(-0.5 * self._head_square(delta, h))

    def _head_square(self, delta: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """``|Delta / l_h|^2`` for one offset (:meth:`flt.relative.RelativeTerm.head_value`)."""
        # A tensor: delta has P >= 1 coordinates.
        return cast(torch.Tensor, sum((d / positive(self.log_length[h, p])) ** 2 for p, d in enumerate(delta)))

    def pairwise(self, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
        """The exact ``f`` of every pair; for ``P > 3`` (graph anchor coordinates) without
        the ``[B, N, Nk, P]`` offsets: with ``s = r / l_h``,
        ``|s_q - s_k|^2 = |s_q|^2 + |s_k|^2 - 2 s_q . s_k`` (a matmul), memory
        ``O(N Nk H + (N + Nk) P H)`` instead of ``O(N Nk P H)``. The expansion loses digits
        to cancellation when ``|s|`` is large, so short positions keep the direct form."""
        if pos_q.shape[-1] <= 3:
            return super().pairwise(pos_q, pos_k)
        cdt = compute_dtype(self._cdt(pos_q), pos_k)
        lengths = self.lengths().to(cdt)[None, :, None, :]  # [1, H, 1, P]
        sq, sk = pos_q.to(cdt).unsqueeze(1) / lengths, pos_k.to(cdt).unsqueeze(1) / lengths  # [B, H, N, P]
        d2 = (sq * sq).sum(-1).unsqueeze(-1) + (sk * sk).sum(-1).unsqueeze(-2) - 2 * sq @ sk.transpose(-1, -2)
        return self.amplitude.to(cdt).view(1, -1, 1, 1) * torch.exp(-0.5 * d2.clamp(min=0))

    def frequencies(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``xi = eps / (2 pi l)`` ``[H, R, P]``, ``w = a / R`` ``[H, R]``."""
        P, R = self.pos_dim, self.num_frequencies
        eps, log_length, amplitude = (as_dtype(t, dtype) for t in (self.eps[..., :P], self.log_length, self.amplitude))
        xi = eps / (2 * math.pi * positive(log_length).unsqueeze(-2))
        w = (amplitude / R).unsqueeze(-1).expand(self.heads, R)
        return xi, w


class MaternSpectrum(_KernelSpectrum):
    """Matern RPE ``f(Delta) = a k_nu(|Delta / l|)``, ``nu`` in ``{1/2, 3/2, 5/2}``.

    ``k_nu`` is the Matern kernel with the standard normalisation ``k_nu(0) = 1``:
    ``k_1/2(r) = exp(-r)``, ``k_3/2(r) = (1 + sqrt3 r) exp(-sqrt3 r)``,
    ``k_5/2(r) = (1 + sqrt5 r + 5 r^2 / 3) exp(-sqrt5 r)``, and in general
    ``2^(1-nu) / Gamma(nu) (sqrt(2 nu) r)^nu K_nu(sqrt(2 nu) r)``. ``f`` is isotropic in
    the scaled offset: ``r = sqrt(sum_p (Delta_p / l_p)^2)``, so per-axis length scales
    stretch the level sets into ellipses.

    Its spectrum is a multivariate Student-t with ``2 nu`` degrees of freedom: with
    ``z ~ N(0, I_P)`` and ``u ~ chi^2(2 nu)``, ``2 pi xi_p = z_p / (l_p sqrt(u / (2 nu)))``
    and ``w = a / R``. ``u`` is the sum of ``2 nu`` squared extra base normals, so QMC and
    orthogonal draws apply to it too. In ``xi`` space (Jacobian ``(2 pi)^P prod_p l_p``)

        g(xi) = a Gamma(nu + P/2) / (Gamma(nu) (2 nu pi)^(P/2)) (2 pi)^P prod_p l_p
                * (1 + |2 pi xi * l|^2 / (2 nu))^-(nu + P/2).

    ``nu = 1/2`` has Cauchy-like tails: single frequencies can be very large, which is
    harmless (``cos`` stays bounded) but makes the estimate rough at small offsets.

    Args:
        heads, pos_dim, num_frequencies: ``H``, ``P``, ``R``.
        nu: smoothness, one of ``0.5, 1.5, 2.5``.
        amplitude: initial ``a = f(0)``; ``0`` gives ``f == 0``.
        length_scale: initial ``l``, a number or a sequence of ``P`` numbers.
        **kwargs: ``sampler``, ``seed``, ``redraw``, ``device``, ``dtype``.
    """

    def __init__(self, heads: int, pos_dim: int, num_frequencies: int, *, nu: float = 1.5, amplitude: float = 1.0,
                 length_scale: float | Sequence[float] = 8.0, **kwargs: Any) -> None:
        if isinstance(nu, bool) or not isinstance(nu, (int, float)) or float(nu) not in MATERN_NU:
            raise ValueError(
                f"nu must be one of {MATERN_NU} (closed-form Matern kernels whose chi-square "
                f"variable has an integer number 2 nu of degrees of freedom), got {nu!r}"
            )
        amplitude = check_amplitude(amplitude)
        lengths = per_axis("length_scale", length_scale, pos_dim)
        self.nu = float(nu)
        # The base class draws P + extra_normals normals per frequency in its __init__.
        self.extra_normals = int(round(2 * self.nu))
        super().__init__(heads, pos_dim, num_frequencies, **kwargs)
        self._init_kernel(amplitude, lengths)

    def density(self, xi: torch.Tensor) -> torch.Tensor:
        """``g(xi)`` (Student-t, see the class docstring): ``[..., P] -> [..., H]``."""
        self._check_points("xi", xi)
        cdt = self._cdt(xi)
        nu, P = self.nu, self.pos_dim
        ell = self.lengths().to(cdt)
        z = 2 * math.pi * xi.to(cdt).unsqueeze(-2) * ell  # [..., H, P]
        log_norm = (
            math.lgamma(nu + P / 2) - math.lgamma(nu) - 0.5 * P * math.log(2 * nu * math.pi) + P * math.log(2 * math.pi)
        )
        log_g = log_norm + torch.log(ell).sum(-1) - (nu + P / 2) * torch.log1p((z * z).sum(-1) / (2 * nu))
        return self.amplitude.to(cdt) * torch.exp(log_g)

    def mask(self, delta: torch.Tensor) -> torch.Tensor:
        """``f(Delta) = a k_nu(|Delta / l|)``: ``[..., P] -> [..., H]``."""
        self._check_points("delta", delta)
        cdt = self._cdt(delta)
        d = delta.to(cdt).unsqueeze(-2) / self.lengths().to(cdt)  # [..., H, P]
        return self.amplitude.to(cdt) * self._profile((d * d).sum(-1))

    def head_value(self, delta: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        sq = tensor_sum((d / positive(self.log_length[h, p])) ** 2 for p, d in enumerate(delta))
        return self.amplitude[h] * self._profile(sq)

    def _profile(self, sq: torch.Tensor) -> torch.Tensor:
        """``k_nu(r)`` of the squared scaled distance ``sq = r^2``. sqrt has an infinite
        derivative at 0; the double ``where`` keeps gradients finite there."""
        nonzero = sq > 0
        r = torch.where(nonzero, torch.sqrt(torch.where(nonzero, sq, torch.ones_like(sq))), torch.zeros_like(sq))
        if self.nu == 0.5:
            return torch.exp(-r)
        if self.nu == 1.5:
            return (1 + math.sqrt(3) * r) * torch.exp(-math.sqrt(3) * r)
        return (1 + math.sqrt(5) * r + (5.0 / 3.0) * sq) * torch.exp(-math.sqrt(5) * r)

    def frequencies(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``xi = z / (2 pi l sqrt(u / (2 nu)))`` ``[H, R, P]``, ``w = a / R`` ``[H, R]``."""
        P, R = self.pos_dim, self.num_frequencies
        eps, log_length, amplitude = (as_dtype(t, dtype) for t in (self.eps, self.log_length, self.amplitude))
        z, extra = eps[..., :P], eps[..., P : P + self.extra_normals]
        # u = 0 has probability zero but would give an infinite frequency; keep it finite.
        u = (extra * extra).sum(-1, keepdim=True).clamp_min(torch.finfo(extra.dtype).tiny)
        xi = z / (2 * math.pi * positive(log_length).unsqueeze(-2) * torch.sqrt(u / (2 * self.nu)))
        w = (amplitude / R).unsqueeze(-1).expand(self.heads, R)
        return xi, w

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, nu={self.nu}"
