"""A radial spectrum: thin shells ``|xi| = rho_k`` with learned radii and weights.

``g(xi) = sum_k w_k delta(|xi| - rho_k) / (area of the shell)`` puts weight ``w_k`` evenly
on the shell of radius ``rho_k``, so the mask depends on ``|Delta|`` only:
``f(Delta) = sum_k w_k A_P(rho_k |Delta|)`` with ``A_P(x)`` the average of ``cos(2 pi x
u.e)`` over unit directions ``u`` (``e`` any unit vector): ``cos(2 pi x)`` for ``P = 1``,
the Bessel function ``J_0(2 pi x)`` for ``P = 2`` and ``sinc(2 x) = sin(2 pi x) / (2 pi x)``
for ``P = 3`` (:func:`shell_average`). Neither ``J_0`` nor the sinc is a finite sum of
feature products, so the features replace the average over directions by a fixed rule of
``S`` directions (:func:`shell_rule`): ``R = K S`` frequencies ``rho_k u_s`` with weights
``w_k q_s``. They compute that rule's ``f^`` exactly and deterministically (nothing is
sampled or redrawn); :meth:`RadialSpectrum.mask` is the exact ``f``. The rule's error, and
so the features' rotation invariance error, is stated in :func:`shell_rule`.

This is the discrete family (learned frequencies one by one) with the rotation invariance
that molecules and particles need: the discrete family's cosines point along learned
directions, so its mask changes when a molecule turns. Docs: docs/math.md section 3.1, "A
radial spectrum".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from einops import rearrange
from torch import nn
from torch.autograd.function import once_differentiable

from flt._checks import check_positive_float, check_positive_int
from flt._dtype import compute_dtype
from flt.relative.spectra.base import Spectrum, as_dtype
from flt.relative.spectra.kernels import check_amplitude


def gauss_legendre(n: int, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss-Legendre nodes and weights on ``[low, high]`` (float64, Golub-Welsch), exact for
    polynomials of degree below ``2 n``."""
    check_positive_int("n", n)
    k = torch.arange(1, n, dtype=torch.float64)
    off = k / torch.sqrt(4 * k * k - 1)
    nodes, vectors = torch.linalg.eigh(torch.diag(off, 1) + torch.diag(off, -1))
    half = (high - low) / 2
    return low + half * (nodes + 1), half * 2 * vectors[0] ** 2


def sphere_quadrature(order: int, *, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Directions ``u [S, 3]`` and weights ``q [S]`` (summing to 1) for averages over the unit
    sphere of functions even in ``u`` (``g(u) = g(-u)``), ``S = order^2``.

    The product rule: Gauss-Legendre nodes ``mu_i`` in ``cos(theta)`` (``order`` of them,
    :func:`gauss_legendre`) times ``2 order`` equally spaced
    azimuths, exact for spherical harmonics of degree below ``2 order``. The rule is
    antipodally symmetric (``(mu, phi) -> (-mu, phi + pi)`` maps nodes to nodes), so for an
    even function the lower hemisphere repeats the upper one: only ``mu_i > 0`` is kept,
    with twice the weight. Deterministic, no random rotation. ``order`` must be even.
    """
    check_positive_int("order", order)
    if order % 2:
        raise ValueError(f"order must be even (the rule keeps the upper half of its symmetric nodes), got {order}")
    mu, weight = gauss_legendre(order, -1.0, 1.0)  # weights summing to 2
    upper = mu > 0
    mu, weight = mu[upper], weight[upper]
    azimuths = 2 * order
    phi = 2 * math.pi * (torch.arange(azimuths, dtype=torch.float64) + 0.5) / azimuths
    sin_theta = torch.sqrt(1 - mu * mu)
    u = torch.stack([sin_theta[:, None] * torch.cos(phi), sin_theta[:, None] * torch.sin(phi),
                     mu[:, None].expand(-1, azimuths)], dim=-1).reshape(-1, 3)
    # Upper half: weight w_i / 2 per node of the full rule, doubled, over `azimuths` nodes.
    q = (weight[:, None] / azimuths).expand(-1, azimuths).reshape(-1)
    return u.to(dtype), q.to(dtype)


def shell_rule(pos_dim: int, order: int, *, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Directions ``u [S, P]`` and weights ``q [S]`` (summing to 1) for averages over the unit
    directions of ``R^P`` of functions even in ``u``, exact for harmonics of degree below
    ``2 order``:

    * ``P = 1``: ``u = [[1]]`` (``S = 1``; ``+1`` and ``-1`` give the same value), exact;
    * ``P = 2``: ``order`` angles ``pi (j + 1/2) / order`` on the half circle (``S = order``);
    * ``P = 3``: :func:`sphere_quadrature` (``S = order^2``, ``order`` even).

    For ``cos(2 pi x u.e)`` the terms of degree ``2 order`` and above carry Bessel factors
    that vanish fast once ``2 order > 2 pi x``; the rule of order ``n`` is accurate while
    ``pi x + 4 <= n`` (:func:`rule_order`). Measured in float64 over
    directions of ``e`` (``tests/library/test_spectrum_radial.py``): order 8, ``P = 3``,
    below ``1e-5`` for ``x <= 1`` and ``3e-3`` for ``x <= 1.6``; order 8, ``P = 2``, below
    ``1e-5`` for ``x <= 1`` and ``4e-3`` for ``x <= 1.6``; order 12, ``P = 3``, below ``1e-7``
    for ``x <= 1.6`` and ``1e-5`` for ``x <= 2``.
    """
    check_positive_int("order", order)
    if pos_dim == 1:
        return torch.ones(1, 1, dtype=dtype), torch.ones(1, dtype=dtype)
    if pos_dim == 2:
        phi = math.pi * (torch.arange(order, dtype=torch.float64) + 0.5) / order
        u = torch.stack([torch.cos(phi), torch.sin(phi)], dim=-1)
        return u.to(dtype), torch.full((order,), 1.0 / order, dtype=dtype)
    if pos_dim == 3:
        return sphere_quadrature(order, dtype=dtype)
    raise ValueError(f"a radial spectrum averages over the directions of 1-, 2- or 3-D space; pos_dim must be 1, 2 or 3, "
                     f"got {pos_dim}")


def rule_order(radius: float, reach: float) -> int:
    """The order of :func:`sphere_quadrature` that averages ``cos(2 pi xi.r)`` over
    ``|xi| = radius`` well enough for ``|r| <= reach``: the smallest even order at least
    ``pi radius reach + 4`` (the rule of order ``n`` holds while ``pi x + 4 <= n``, :func:`shell_rule`).
    At that edge, ``x = radius reach``, the rule's error in ``P = 3`` is 1e-4 (order 8) to
    6e-3 (order 36); at three quarters of that ``x``, below 1e-5 (float64, over directions,
    ``tests/library/test_spectrum_radial.py``)."""
    return 2 * math.ceil((math.pi * radius * reach + 4) / 2)


def shell_frequencies(rho: torch.Tensor, w: torch.Tensor, u: torch.Tensor, q: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every shell times every direction of a rule: radii ``rho [G, K]`` and weights ``w [H,
    K]`` with directions ``u [S, P]`` and weights ``q [S]`` give ``(xi [G, K S, P], w [H, K
    S])``, frequencies ``rho_k u_s`` with weights ``w_k q_s``."""
    xi = rearrange(rho[..., None, None] * u, "g k s p -> g (k s) p")
    return xi, rearrange(w[..., None] * q, "h k s -> h (k s)")


def shell_frequencies_each(rho: torch.Tensor, w: torch.Tensor, rules: Sequence[tuple[torch.Tensor, torch.Tensor]]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each shell with its own rule: radii ``rho [G, K]`` and weights ``w [H, K]`` with one
    ``(u [S_k, P], q [S_k])`` per radius give ``(xi [G, sum S_k, P], w [H, sum S_k])``, radius
    ``k``'s frequencies ``rho_k u_s`` (weights ``w_k q_s``) in one contiguous run. The same
    few tensor operations whatever the rules (the directions are concatenated first)."""
    sizes = torch.tensor([u.shape[0] for u, _ in rules], device=rho.device)
    index = torch.repeat_interleave(torch.arange(len(rules), device=rho.device), sizes)
    u, q = torch.cat([u for u, _ in rules]), torch.cat([q for _, q in rules])
    return rho[:, index, None] * u, w[:, index] * q


class _BesselJ0(torch.autograd.Function):
    """``J_0(x)`` with its derivative ``-J_1(x)`` (torch's ``bessel_j0`` has no backward);
    once differentiable: a second derivative through it raises instead of being dropped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.special.bessel_j0(x)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return -torch.special.bessel_j1(x) * grad


def shell_average(x: torch.Tensor, pos_dim: int) -> torch.Tensor:
    """``A_P(x)``, the average of ``cos(2 pi x u.e)`` over unit directions ``u`` of ``R^P``
    (elementwise): ``cos(2 pi x)``, ``J_0(2 pi x)``, ``sinc(2 x)`` for ``P = 1, 2, 3``.
    torch's ``bessel_j0`` is off by up to ``4e-7`` in float64 (largest near ``2 pi x = 5``,
    against SciPy's ``j0``), so for ``P = 2`` that is the exact mask's accuracy."""
    if pos_dim == 1:
        return torch.cos(2 * math.pi * x)
    if pos_dim == 2:
        return _BesselJ0.apply(2 * math.pi * x)
    if pos_dim == 3:
        return torch.sinc(2 * x)
    raise ValueError(f"pos_dim must be 1, 2 or 3, got {pos_dim}")


def chi_quantiles(dof: int, count: int) -> torch.Tensor:
    """The quantiles ``(k + 1/2) / count`` of the chi distribution with ``dof`` degrees of
    freedom (the norm of a standard normal vector of ``R^dof``), float64 ``[count]``, by
    bisection on its CDF ``P(dof / 2, x^2 / 2)``."""
    target = (torch.arange(count, dtype=torch.float64) + 0.5) / count
    low, high = torch.zeros(count, dtype=torch.float64), torch.full((count,), 40.0, dtype=torch.float64)
    half = torch.tensor(dof / 2, dtype=torch.float64)
    for _ in range(80):
        mid = (low + high) / 2
        below = torch.special.gammainc(half, mid * mid / 2) < target
        low, high = torch.where(below, mid, low), torch.where(below, high, mid)
    return (low + high) / 2


class RadialSpectrum(Spectrum):
    """Learned radii ``rho [H, K]`` and weights ``w [H, K]``: ``f(Delta) = sum_k w_k
    A_P(rho_k |Delta|)``, a function of ``|Delta|`` only (``P`` = 1, 2 or 3).

    The features use :func:`shell_rule` of ``quadrature``: ``S`` directions, ``K = R / S``
    radii (``R = num_frequencies`` must be a multiple of ``S``: 1, ``quadrature`` and
    ``quadrature^2`` directions for ``P = 1, 2, 3``). They compute ``f^(Delta) = sum_k w_k
    sum_s q_s cos(2 pi rho_k u_s.Delta)`` exactly; :meth:`mask` is ``f``, and ``|f^ - f|``
    is at most ``sum_k |w_k|`` times the rule's error at ``x = rho_k |Delta|``
    (:func:`shell_rule`), which bounds the rotation invariance error of ``f^`` by twice that.

    Start and parametrisation: ``rho_k = s theta_k`` with ``s = 1 / (2 pi length_scale)``
    and ``theta_k`` starting at the quantiles ``(k + 1/2) / K`` of the chi distribution with
    ``P`` degrees of freedom, the radial law of the Gaussian kernel's frequencies; ``w_k =
    beta_k / K`` with ``beta_k`` starting at ``amplitude``. So a fresh spectrum is the
    Gaussian kernel ``amplitude exp(-|Delta|^2 / (2 length_scale^2))`` by a ``K``-point
    rule in the radius, and training moves each radius and weight on its own.

    Args:
        heads, pos_dim, num_frequencies: ``H``, ``P``, ``R``.
        quadrature: the rule's order (even for ``P = 3``; ignored for ``P = 1``).
        amplitude: the starting ``f(0) = sum_k w_k``; ``0`` gives ``f == 0``.
        length_scale: the starting Gaussian's length in position units.
        **kwargs: ``device``, ``dtype``, and the base class's ``sampler`` and ``seed``,
            which set nothing here (the start is deterministic).
    """

    deterministic = True
    random_feature_buffers = ()

    def __init__(self, heads: int, pos_dim: int, num_frequencies: int, *, quadrature: int = 8, amplitude: float = 1.0,
                 length_scale: float = 8.0, **kwargs: Any) -> None:
        amplitude = check_amplitude(amplitude)
        length_scale = check_positive_float("length_scale", length_scale)  # position units
        if kwargs.get("shift"):
            raise ValueError("shift: the radial family has no components to shift (its mask is even); use shift=False")
        check_positive_int("quadrature", quadrature)
        if pos_dim == 3 and quadrature % 2:
            raise ValueError(f"quadrature must be even for pos_dim=3 (the sphere rule keeps half of its symmetric nodes), "
                             f"got {quadrature}")
        u, q = shell_rule(pos_dim, quadrature)
        check_positive_int("num_frequencies", num_frequencies)
        if num_frequencies % u.shape[0]:
            raise ValueError(f"num_frequencies must be a multiple of the rule's {u.shape[0]} directions (pos_dim={pos_dim}, "
                             f"quadrature={quadrature}): radii times directions, got {num_frequencies}")
        super().__init__(heads, pos_dim, num_frequencies, **kwargs)  # has_random_features: False
        fk = {"device": self._factory["device"], "dtype": self._factory["dtype"]}
        self.quadrature, self.num_radii = quadrature, num_frequencies // u.shape[0]
        self.scale = 1.0 / (2 * math.pi * length_scale)
        # The rule stays float64 and is cast per device and dtype on use: a float32 copy would
        # put 1e-7 errors into the directions of a float64 spectrum.
        self._rule = (u, q)
        self._rules: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        start = chi_quantiles(pos_dim, self.num_radii)
        self.theta = nn.Parameter(start.expand(heads, -1).clone().to(**fk))
        self.beta = nn.Parameter(torch.full((heads, self.num_radii), amplitude, **fk))

    def redraw_random_features(self, generator: torch.Generator | None = None) -> None:
        """Nothing to redraw: the radii are learned parameters and the rule is fixed."""

    redraw_frequencies = redraw_random_features

    def density(self, xi: torch.Tensor) -> NoReturn:
        raise ValueError("a radial spectrum has no density function (its weight sits on thin shells); its mask f is "
                         "computed exactly by mask(), and by the features to the rule's stated error")

    def radii(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rho [H, K], w [H, K])`` in position units: the shells and their weights."""
        theta, beta = as_dtype(self.theta, dtype), as_dtype(self.beta, dtype)
        return self.scale * theta, beta / self.num_radii

    def frequencies(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(xi [H, K S, P], w [H, K S])``: every shell times every direction of the rule."""
        rho, w = self.radii(dtype)
        key = (rho.device, rho.dtype)
        if key not in self._rules:
            self._rules[key] = tuple(t.to(device=rho.device, dtype=rho.dtype) for t in self._rule)  # type: ignore[assignment]
        return shell_frequencies(rho, w, *self._rules[key])

    def mask(self, delta: torch.Tensor) -> torch.Tensor:
        """``f(Delta) = sum_k w_k A_P(rho_k |Delta|)``: ``[..., P] -> [..., H]``, in float32
        or better."""
        self._check_points("delta", delta)
        cdt = compute_dtype(delta, self.theta)
        rho, w = self.radii(cdt)
        r = delta.to(cdt).norm(dim=-1)[..., None, None]
        return (shell_average(rho * r, self.pos_dim) * w).sum(-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, K={self.num_radii}, quadrature={self.quadrature} ({self._rule[0].shape[0]} directions)"
