"""A long-range block for point sets: ``h_i + W_o sum_j f(r_i - r_j) K_ij W_v h_j`` in O(N R d).

For features ``h [B, N, d]`` at positions ``pos [B, N, P]`` the block adds to every point a
sum over all the others of their projected features, weighed by a translation-invariant
kernel ``f`` of the offset (and optionally a content kernel ``K_ij``). ``f`` is a cosine sum,
``f(r) = sum_k w_k cos(2 pi xi_k.r)``, so it factorises: with ``cos_ik = cos(2 pi xi_k.r_i)``
and ``sin_ik`` likewise,

    sum_j f(r_i - r_j) v_j = sum_k w_k [cos_ik (sum_j cos_jk v_j) + sin_ik (sum_j sin_jk v_j)],

two sums over the points per frequency, then one read per point: ``O(N R Dv)`` per head
instead of ``O(N^2)``. It is Ewald's reciprocal-space sum without periodic boundaries, and
the numerator of FLT's linear attention without its denominator (docs/longrange.md).

Frequency sets (``frequencies=``, :data:`FREQUENCIES`), one ``f`` per head:

* ``"discrete"``: learned frequencies and weights, :class:`flt.relative.spectra.DiscreteSpectrum`'s
  parametrisation (``num_frequencies``, ``components``, ``length_scale``, ``length_spread``,
  ``sampler``, ``seed``, ``amplitude``).
* ``"radial"``: learned radii ``rho_k`` and weights, ``f(r) = sum_k w_k sinc(2 rho_k |r|)``
  (``P = 3``), the average of ``cos(2 pi xi.r)`` over the directions of ``|xi| = rho_k``,
  computed by the product quadrature of :func:`sphere_quadrature`; ``exact`` uses the sinc.
  ``width``: each shell with a Gaussian radial profile, whose sinc falls off past about
  ``1 / (2 pi width)`` instead of oscillating on like ``1 / r``.
* ``"grid"``: the Ewald message-passing control: fixed frequencies on a regular grid
  (``grid_spacing``) up to ``frequency_cutoff``, learned weights (filters); ``f`` is then
  periodic with period ``1 / grid_spacing`` along each axis.
* ``"random"``: the discrete set's starting frequencies, drawn once and frozen; learned weights.
* ``"coulomb"``: ``a_h erf(alpha |r|) / |r|``, a ``1 / r`` tail of fixed shape and learned
  scale (fixed frequencies that hold to ``reach``), plus ``"radial"``'s learned sincs
  (``P = 3``); ``exact`` uses the formula.

Shapes: frequencies ``xi [H, R, P]`` and weights ``w [H, R]`` (:meth:`Frequencies.frequencies`),
one kernel per head; values ``[B, H, N, Dv]`` with ``Dv = dim / heads``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from einops import rearrange
from torch import nn

from flt._checks import (
    check_bool,
    check_choice,
    check_finite,
    check_nonnegative_float,
    check_nonnegative_int,
    check_positive_float,
    check_positive_int,
    check_tensor,
    compiling,
)
from flt._dtype import compute_dtype
from flt._limits import check_memory, memory_limit
from flt.layers.features import FeatureMap
from flt.ops._common import safe_divide
from flt.ops.mesh import mesh_bytes, mesh_shape, mesh_sum, mesh_sum_reference
from flt.relative.spectra.base import cycles, phase_dtype
from flt.relative.spectra.discrete import DiscreteSpectrum
from flt.relative.spectra.radial import (
    gauss_legendre,
    rule_order,
    shell_average,
    shell_frequencies,
    shell_frequencies_each,
    sphere_quadrature,
)

#: How the block sums: through the set's frequencies (``O(N R Dv)``, the cosine sum), or
#: through a mesh (:func:`flt.ops.mesh.mesh_sum`, ``O(N p^3 Dv + M log M Dv)``, the exact
#: kernel smoothed by the mesh's splines).
ENGINES = ("features", "mesh")

#: Content kernels ``K_ij``: none (``K = 1``), ``elu + 1`` features of projected queries and
#: keys (deterministic), or FAVOR+ random features estimating ``exp(q.k / sqrt(Dk))``.
CONTENT = ("none", "elu", "favor+")

# Query rows per chunk of the O(N^2) reference: its [B, rows, N, H, R] phases stay below this.
_REFERENCE_ELEMENTS = 1 << 23
#: Bytes per phase value of the fast path's float64 arithmetic at its peak (the product
#: ``xi.r``, its rounding and the reduced turns), before the compute-dtype phases, cosines
#: and sines (:meth:`LongRangeBlock._sets_per_part`).
_PHASE_BYTES = 24


class Frequencies(nn.Module):
    """A kernel per head, ``f(r) = sum_k w_k cos(2 pi xi_k.r)``.

    Subclasses implement :meth:`frequencies`; :meth:`exact_mask` is the kernel the set
    stands for (the cosine sum itself unless a subclass says otherwise).
    """

    #: Whether ``f`` depends on ``|r|`` alone (sets that are say so).
    isotropic = False

    def __init__(self, heads: int, pos_dim: int) -> None:
        super().__init__()
        check_positive_int("heads", heads)
        check_positive_int("pos_dim", pos_dim)
        self.heads, self.pos_dim = heads, pos_dim

    def frequencies(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(xi [H, R, P], w [H, R])``, differentiable in the parameters, cast to ``dtype``."""
        raise NotImplementedError

    def _precise(self, like: torch.Tensor, *, offsets: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The frequencies for ``like`` (positions, or offsets when ``offsets``), in float64
        (float32 on MPS) outside autocast, as the spectra form phases."""
        with torch.autocast(like.device.type, enabled=False):
            return self.frequencies(phase_dtype(like))

    def mask(self, delta: torch.Tensor) -> torch.Tensor:
        """The cosine sum evaluated directly at offsets: ``[..., P] -> [..., H]``."""
        xi, w = self._precise(delta, offsets=True)
        cdt = compute_dtype(delta)
        return (torch.cos(2 * math.pi * cycles(delta, xi).to(cdt)) * w.to(cdt)).sum(-1)

    def exact_mask(self, delta: torch.Tensor) -> torch.Tensor:
        """The kernel this set stands for, ``[..., P] -> [..., H]``: here the cosine sum."""
        return self.mask(delta)

    def call_frequencies(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The frequencies one call on positions ``pos [B, N, P]`` uses, ``(xi [G, R, P], w
        [H, R])`` in float64: sets whose rule follows the points' extent choose it from all
        of ``pos``, so every part of a batch gets the same kernel."""
        return self._precise(pos, offsets=False)

    def phase_features(self, pos: torch.Tensor, frequencies: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(phase [B, G, N, R], w [H, R])`` in float32 or better, with ``f_h(r_i - r_j) =
        sum_r w_hr cos(phase_ir - phase_jr)`` (of group ``g = h`` when ``G = H``; ``G = 1``
        when the heads share their frequencies). The weights are kept apart, so that a sum
        folds them into its small ``[R, Dv]`` states (:func:`feature_sum`). ``frequencies``:
        those of :meth:`call_frequencies` for a larger batch that ``pos`` is part of."""
        xi, w = self.call_frequencies(pos) if frequencies is None else frequencies
        cdt = compute_dtype(pos)
        return 2 * math.pi * rearrange(cycles(pos, xi), "b n h r -> b h n r").to(cdt), w.to(cdt)

    def features(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, c)``, each ``[B, H, N, 2R]`` in float32 or better, with ``a_i . c_j =
        f(r_i - r_j)``: ``c = [cos, sin]`` of the phases, ``a`` the same times ``w``."""
        phase, w = self.phase_features(pos)
        c = torch.cat([torch.cos(phase), torch.sin(phase)], dim=-1)
        a = c * torch.cat([w, w], dim=-1).unsqueeze(-2)
        return a, c.expand_as(a)


class DiscreteFrequencies(Frequencies):
    """Learned frequencies and weights: :class:`flt.relative.spectra.DiscreteSpectrum`
    (``xi_k = s_c theta_k``, ``w_k = beta_k C / R``, starting as a Gaussian mixture's draws
    with lengths from ``length_scale`` to ``length_scale * length_spread``)."""

    def __init__(self, heads: int, pos_dim: int, *, num_frequencies: int = 64, components: int = 4,
                 amplitude: float = 1.0, length_scale: float = 1.0, length_spread: float = 16.0,
                 sampler: str = "qmc", seed: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(heads, pos_dim)
        self.spectrum = DiscreteSpectrum(heads, pos_dim, num_frequencies, components=components, amplitude=amplitude,
                                         length_scale=length_scale, length_spread=length_spread, sampler=sampler,
                                         seed=seed, device=device, dtype=dtype)

    def frequencies(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.spectrum.frequencies(dtype)


class RandomFrequencies(Frequencies):
    """The discrete set's starting frequencies (same options, same draw for the same
    ``seed``), frozen in a buffer ``xi [H, R, P]``; only the weights ``w_k = beta_k C / R``
    are learned. The control for "do the frequencies need to move?"."""

    xi: torch.Tensor

    def __init__(self, heads: int, pos_dim: int, *, num_frequencies: int = 64, components: int = 4,
                 amplitude: float = 1.0, length_scale: float = 1.0, length_spread: float = 16.0,
                 sampler: str = "qmc", seed: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(heads, pos_dim)
        start = DiscreteSpectrum(heads, pos_dim, num_frequencies, components=components, amplitude=amplitude,
                                 length_scale=length_scale, length_spread=length_spread, sampler=sampler, seed=seed,
                                 device=device, dtype=torch.float64)
        xi, _ = start.frequencies()
        self.scale = components / num_frequencies
        self.register_buffer("xi", xi.detach().to(device=device, dtype=dtype or torch.get_default_dtype()))
        self.beta = nn.Parameter(start.beta.detach().to(device=device, dtype=dtype or torch.get_default_dtype()))

    def frequencies(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        xi, beta = (t if dtype is None else t.to(dtype) for t in (self.xi, self.beta))
        return xi, beta * self.scale


class GridFrequencies(Frequencies):
    """The Ewald message-passing design without periodic boundaries: frequencies fixed at
    ``grid_spacing * m`` for every integer vector ``m`` with ``|grid_spacing m| <=
    frequency_cutoff``, one of each pair ``+-m`` (the cosine is even) and ``m = 0``; learned
    weights ``w [H, R] = beta / R`` (``f(0) = amplitude`` at the start).

    ``f`` is periodic with period ``1 / grid_spacing`` along each axis, so ``1 /
    grid_spacing`` should exceed the largest offset of the point sets (twice it for no
    image within the set); ``frequency_cutoff`` sets the finest length, about ``1 / (2
    frequency_cutoff)``. Defaults: period 16, cutoff 0.25 (``R = 129`` in 3-D).
    """

    xi: torch.Tensor

    def __init__(self, heads: int, pos_dim: int, *, frequency_cutoff: float = 0.25, grid_spacing: float = 0.0625,
                 amplitude: float = 1.0, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(heads, pos_dim)
        for name, value in (("frequency_cutoff", frequency_cutoff), ("grid_spacing", grid_spacing)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number (cycles per position unit), got {value!r}")
        reach = int(math.floor(frequency_cutoff / grid_spacing + 1e-9))
        if (2 * reach + 1) ** pos_dim > 1 << 22:
            raise ValueError(f"frequency_cutoff / grid_spacing = {frequency_cutoff / grid_spacing:g} gives too many grid "
                             f"frequencies in {pos_dim}-D; raise grid_spacing or lower frequency_cutoff")
        axis = torch.arange(-reach, reach + 1, dtype=torch.float64)
        m = torch.cartesian_prod(*[axis] * pos_dim).reshape(-1, pos_dim)
        inside = (m * grid_spacing).norm(dim=-1) <= frequency_cutoff * (1 + 1e-12)
        # One of each pair +-m: the first nonzero coordinate positive (and m = 0).
        nonzero = m != 0
        first = torch.where(nonzero.any(-1), nonzero.float().argmax(-1), torch.zeros(len(m), dtype=torch.long))
        lead = m.gather(-1, first[:, None]).squeeze(-1)
        m = m[inside & (lead >= 0)]
        self.frequency_cutoff, self.grid_spacing = float(frequency_cutoff), float(grid_spacing)
        fk: dict[str, Any] = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        self.register_buffer("xi", (m * grid_spacing).unsqueeze(0).to(**fk), persistent=False)
        self.beta = nn.Parameter(torch.full((heads, len(m)), float(amplitude), **fk))

    def frequencies(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        xi, beta = (t if dtype is None else t.to(dtype) for t in (self.xi, self.beta))
        return xi.expand(self.heads, -1, -1), beta / beta.shape[-1]

    def extra_repr(self) -> str:
        return f"R={self.xi.shape[1]}, frequency_cutoff={self.frequency_cutoff}, grid_spacing={self.grid_spacing}"


class RadialFrequencies(Frequencies):
    """Learned radii ``rho [H, K]`` and weights ``w [H, K]``: ``f(r) = sum_k w_k sinc(2 rho_k |r|)``
    (``sinc(x) = sin(pi x) / (pi x)``), rotation invariant; ``P = 3``.

    The sinc is the average of ``cos(2 pi xi.r)`` over ``|xi| = rho_k``; the fast path
    replaces that average by :func:`sphere_quadrature` of ``quadrature`` (even) Legendre
    nodes, ``R = K quadrature^2`` frequencies ``rho_k u_s`` with weights ``w_k q_s``.
    :meth:`exact_mask` is the sinc itself. The quadrature is exact for harmonics of degree
    below ``2 quadrature``; its error in ``f`` per unit of ``sum |w_k|``, the largest over
    directions of ``r`` (float64, ``tests/library/test_longrange.py``): order 8 (64 directions)
    below ``1e-5`` for ``rho |r| <= 1`` and ``3e-3`` for ``rho |r| <= 1.6``; order 12 (144)
    below ``1e-7`` for ``rho |r| <= 1.6`` and ``1e-5`` for ``rho |r| <= 2``. Past that range
    it does not decay like the sinc (errors up to 0.7 at ``rho |r| = 3`` for order 8): keep
    ``rho_k |r|`` within it for the offsets that matter (at the default ``length_scale = 1``
    the starting radii are below ``0.16``, so order 8 holds to ``|r| = 10``). The rotation
    invariance error, ``|f(Q r) - f(r)|`` for a rotation ``Q``, is at most twice these.
    ``quadrature=None`` picks the rule per call and per radius (:meth:`orders_for`) from the
    radius and the points' extent (the rung of :func:`tail_reach` covering twice their
    largest distance from their centre), as the coulomb tail does: the fast path then follows
    the sinc on sets larger than the training ones, at a cost that grows with their extent.
    A radius ``rho`` gets the order ``pi rho reach + 4`` (at least 8), so the small radii
    that carry the far field take fewer directions than the largest one: for 16 evenly spaced
    radii at the default start, 0.65 of the frequencies one rule for all would take at reach
    16 and 0.48 at reach 32.

    ``width > 0`` gives each shell a Gaussian radial profile of that standard deviation
    (cycles per position unit): radius ``rho_k`` becomes ``width_nodes`` (odd) radii
    ``rho_k + width z_m``, ``z_m`` equally spaced on ``[-3, 3]``, with weights ``w_k h_m``,
    ``h_m`` proportional to ``exp(-z_m^2 / 2)`` and summing to 1 (:func:`radial_profile`).
    The kernel is then ``sum_k w_k sum_m h_m sinc(2 (rho_k + width z_m) |r|)``, which for
    ``rho_k`` well above ``width`` is the thin shells' sincs times ``D(r) = sum_m h_m cos(2
    pi width z_m |r|)``: ``exp(-2 pi^2 width^2 r^2)`` out to about half the profile's period
    ``1 / (width dz)`` (``dz = 6 / (width_nodes - 1)``), where its nodes alias. A thin
    shell's sinc decays like ``1 / r`` and oscillates without end, so learned sincs fitted
    to the offsets of small sets go on oscillating beyond them; profiled shells fall off
    past ``1 / (2 pi width)``, and what the set has not learned stays near zero on larger
    sets (the ``coulomb`` set's corrections, whose tail carries the ``1 / r``). ``R = K
    width_nodes quadrature^2``: the cost is ``width_nodes`` times the thin shells'.

    Parametrisation: ``rho_k = rho_max theta_k`` with ``theta_k`` starting at ``(k + 1/2) /
    K`` and ``rho_max = 1 / (2 pi length_scale)``; ``w_k = beta_k / K`` with ``beta_k``
    starting at ``amplitude``. ``shared=True``: one set of radii for all heads (``theta [1,
    K]``), each head with its own weights (``beta [H, K]``): the heads' features are then
    one ``[N, 2 K S]`` tensor instead of ``H`` of them, so the block's cost in cosines and
    sines is ``1 / H`` of the unshared set's at the same ``K`` (:func:`feature_sum`).
    """

    directions: torch.Tensor
    weights: torch.Tensor
    #: ``f`` depends on ``|r|`` alone (the mesh engine evaluates it once per distance).
    isotropic = True

    profile: torch.Tensor
    profile_weights: torch.Tensor

    def __init__(self, heads: int, pos_dim: int, *, num_radii: int = 8, quadrature: int | None = 8, amplitude: float = 1.0,
                 length_scale: float = 1.0, shared: bool = False, width: float = 0.0, width_nodes: int = 9,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(heads, pos_dim)
        if pos_dim != 3:
            raise ValueError(f"frequencies='radial' averages over the directions of 3-D space; pos_dim must be 3, got {pos_dim}")
        check_positive_int("num_radii", num_radii)
        check_bool("shared", shared)
        z, h = radial_profile(width, width_nodes)
        length_scale = check_positive_float("length_scale", length_scale)  # position units
        u, q = sphere_quadrature(8 if quadrature is None else quadrature)
        fk: dict[str, Any] = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        self.quadrature, self.rho_max = quadrature, 1.0 / (2 * math.pi * length_scale)
        self.register_buffer("directions", u.to(**fk), persistent=False)
        self.register_buffer("weights", q.to(**fk), persistent=False)
        self.width = float(width)
        self.register_buffer("profile", (self.width * z).to(**fk), persistent=False)
        self.register_buffer("profile_weights", h.to(**fk), persistent=False)
        self._rules: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        start = (torch.arange(num_radii, dtype=torch.float64) + 0.5) / num_radii
        self.shared = shared
        self.theta = nn.Parameter(start.expand(1 if shared else heads, -1).clone().to(**fk))
        self.beta = nn.Parameter(torch.full((heads, num_radii), float(amplitude), **fk))

    def radii(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rho [G, K], w [H, K])`` in position units (``G = 1`` when ``shared``, else ``H``)."""
        theta, beta = (t if dtype is None else t.to(dtype) for t in (self.theta, self.beta))
        return self.rho_max * theta, beta / beta.shape[-1]

    def shells(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rho [G, K M], w [H, K M])``: every radius of every profile and its weight
        (``M = 1``, the radii themselves, when ``width = 0``)."""
        rho, w = self.radii(dtype)
        if self.width == 0.0:
            return rho, w
        z, h = (t.to(device=rho.device, dtype=rho.dtype) for t in (self.profile, self.profile_weights))
        return rearrange(rho[..., None] + z, "g k m -> g (k m)"), rearrange(w[..., None] * h, "h k m -> h (k m)")

    def orders_for(self, reach: float) -> list[int]:
        """The sphere rule's order that ``quadrature=None`` gives each radius (every radius of
        the profiles, in :meth:`shells`' order) for offsets up to ``reach``: the smallest even
        order at least ``pi rho reach + 4`` for that radius's largest value over the heads
        (the coulomb tail's rule), and at least 8. One host synchronisation."""
        return _orders(self.shells()[0], check_positive_float("reach", reach))

    def _precise(self, like: torch.Tensor, *, offsets: bool) -> tuple[torch.Tensor, torch.Tensor]:
        reach = None if self.quadrature is not None else call_reach(like, offsets=offsets)
        with torch.autocast(like.device.type, enabled=False):
            return self.frequencies(phase_dtype(like), reach=reach)

    def _rule(self, order: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`sphere_quadrature` of ``order``, built and moved once per order, device and dtype."""
        key = (order, like.device, like.dtype)
        if key not in self._rules:
            self._rules[key] = tuple(t.to(device=like.device, dtype=like.dtype) for t in sphere_quadrature(order))  # type: ignore[assignment]
        return self._rules[key]

    def frequencies(self, dtype: torch.dtype | None = None, *, reach: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(xi [G, R, 3], w [H, R])`` with the constructor's rule (``R = K S``, ``S =
        quadrature^2`` directions), or with each radius's rule for offsets up to ``reach``
        (:meth:`orders_for`; ``R`` the sum of the rules' sizes, each radius's run contiguous).
        ``G = 1`` when ``shared``, else ``H``; ``K`` counts every radius of the profiles."""
        rho, w = self.shells(dtype)
        if reach is None:
            u, q = (t.to(device=rho.device, dtype=rho.dtype) for t in (self.directions, self.weights))
            return shell_frequencies(rho, w, u, q)
        orders = _orders(rho, check_positive_float("reach", reach))
        return shell_frequencies_each(rho, w, [self._rule(order, rho) for order in orders])

    def exact_mask(self, delta: torch.Tensor) -> torch.Tensor:
        """``sum_k w_k sinc(2 rho_k |delta|)`` over every radius of the profiles: ``[..., 3] ->
        [..., H]``, in float32 or better."""
        cdt = compute_dtype(delta)
        rho, w = self.shells(cdt)
        r = delta.to(cdt).norm(dim=-1)[..., None, None]
        return (shell_average(rho * r, 3) * w).sum(-1)

    def extra_repr(self) -> str:
        shared = ", shared" if self.shared else ""
        if self.width:
            shared += f", width={self.width} ({self.profile.shape[0]} nodes)"
        if self.quadrature is None:
            return f"K={self.theta.shape[-1]}{shared}, quadrature per call (at least 8)"
        return f"K={self.theta.shape[-1]}{shared}, quadrature={self.quadrature} ({self.directions.shape[0]} directions)"


def _orders(rho: torch.Tensor, reach: float) -> list[int]:
    """:meth:`RadialFrequencies.orders_for` of radii ``rho [G, K]``: one host synchronisation."""
    return [max(8, rule_order(radius, reach)) for radius in rho.detach().abs().amax(0).tolist()]


def radial_profile(width: float, nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z [M], h [M])`` (float64) of :class:`RadialFrequencies`' radial profile: ``M =
    nodes`` points equally spaced on ``[-3, 3]`` and weights proportional to ``exp(-z^2 /
    2)`` summing to 1; ``width = 0`` (thin shells) gives ``z = [0], h = [1]``. ``nodes`` must
    be odd (the profile keeps its centre) and at least 3, whatever the width."""
    width = check_nonnegative_float("width", width)
    check_positive_int("width_nodes", nodes)
    if nodes % 2 == 0 or nodes < 3:
        raise ValueError(f"width_nodes must be an odd number >= 3 (the profile's nodes around each radius, its centre "
                         f"among them), got {nodes}")
    if width == 0:
        return torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    z = torch.linspace(-3.0, 3.0, nodes, dtype=torch.float64)
    h = torch.exp(-z * z / 2)
    return z, h / h.sum()


def call_reach(like: torch.Tensor, *, offsets: bool) -> float:
    """The :func:`tail_reach` rung that covers one call's offsets: ``like`` holds the offsets
    themselves, or positions (centred by the block), whose offsets are at most twice their
    largest norm. One host synchronisation."""
    largest = float(like.detach().norm(dim=-1).max()) if like.numel() else 0.0
    return tail_reach(largest if offsets else 2 * largest)


#: The Gaussian window ``exp(-(pi rho / alpha)^2)`` of the Coulomb tail is cut where it falls below this.
_TAIL_WINDOW = 1e-8


def coulomb_tail_quadrature(alpha: float, reach: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Frequencies ``xi [R, 3]`` and weights ``w [R]`` (float64) whose cosine sum is
    ``erf(alpha |r|) / |r|`` for ``|r| <= reach``: the smooth long-range part of ``1 / |r|``
    that Ewald's method sums in reciprocal space, here without periodic boundaries.

    ``erf(alpha r) / r = 4 int_0^inf exp(-(pi rho / alpha)^2) sinc(2 rho r) d rho``: the
    radii are Gauss-Legendre nodes on ``[0, rho_t]`` with ``rho_t = alpha sqrt(ln 1e8) / pi``
    (the window is below ``1e-8`` past it), ``K = ceil(pi rho_t reach / 2) + 6`` of them;
    each radius's sinc is the average over the directions of :func:`sphere_quadrature` of
    the smallest even order at least ``pi rho_k reach + 4``. The error, the largest over
    ``|r| <= reach`` and over directions, stays below ``5e-5 f(0)`` with ``f(0) = 2 alpha /
    sqrt(pi)`` (float64, ``tests/library/test_longrange.py``); past ``reach`` it is not bounded.
    ``R`` grows like ``(alpha reach)^3``: about 870 at ``alpha = 0.15, reach = 12``, 4,300 at
    ``reach = 30``.
    """
    alpha, reach = check_positive_float("alpha", alpha), check_positive_float("reach", reach)
    top = alpha * math.sqrt(math.log(1 / _TAIL_WINDOW)) / math.pi
    count = math.ceil(math.pi * top * reach / 2) + 6
    if count * rule_order(top, reach) ** 2 > 1 << 22:  # the largest radius's rule bounds R
        raise ValueError(f"alpha * reach = {alpha * reach:g} needs more than {1 << 22} tail frequencies; lower alpha "
                         f"(a longer smooth part) or reach")
    rho, weight = gauss_legendre(count, 0.0, top)
    weight = 4 * weight * torch.exp(-(math.pi * rho / alpha) ** 2)
    rules = [sphere_quadrature(rule_order(radius, reach)) for radius in rho.tolist()]
    xi, w = shell_frequencies_each(rho[None], weight[None], rules)
    return xi[0], w[0]


def coulomb_tail(r: torch.Tensor, alpha: float) -> torch.Tensor:
    """``erf(alpha r) / r``, with its limit ``2 alpha / sqrt(pi)`` at ``r = 0`` (and a
    finite gradient there)."""
    small = r < 1e-3 / alpha
    x = alpha * torch.where(small, torch.ones_like(r), r)
    series = (2 * alpha / math.sqrt(math.pi)) * (1 - (alpha * r) ** 2 / 3)  # error below 1e-7 relative
    return torch.where(small, series, torch.erf(x) / torch.where(small, torch.ones_like(r), r))


def tail_reach(needed: float) -> float:
    """The reach ``reach=None`` uses for offsets up to ``needed``: the smallest ``4 *
    sqrt(2)^k`` (``k >= 0``) at least ``needed``."""
    k = max(0, math.ceil(2 * math.log2(max(needed, 1e-12) / 4) - 1e-9))
    return 4 * 2 ** (k / 2)


class CoulombFrequencies(Frequencies):
    """A ``1 / r`` tail by construction plus learned radial corrections (``P = 3``):

        f(r) = a_h erf(alpha |r|) / |r| + sum_k w_k sinc(2 rho_k |r|).

    The first term is the smooth long-range part of the Coulomb kernel (Ewald's split: the
    rest, ``erfc(alpha r) / r``, is short ranged, within about ``2.5 / alpha``, where a
    cutoff model and the corrections work); its shape is fixed and only its scale ``a_h``
    per head is learned (starting at ``tail_amplitude``), so what the block learns on small
    systems holds on larger ones. Its frequencies come from :func:`coulomb_tail_quadrature`
    (fixed, not parameters) and hold to ``reach`` position units. ``reach=None`` (the
    default) takes, per call, the smallest :func:`tail_reach` covering the largest offset of
    the points (twice their largest distance from their centre): the function is the same
    at every size, and the cost adapts, ``O(N R)`` with ``R`` growing like ``(alpha
    reach)^3``, so at a fixed density the cost grows like ``N^2`` over sizes; a number fixes
    ``R`` (linear in ``N``) and the tail is right only for offsets within it. The corrections
    are :class:`RadialFrequencies` (``num_radii``, ``quadrature``, ``length_scale``,
    ``amplitude``, ``width``, ``width_nodes``; ``num_radii=0`` for none): with ``width > 0``
    they fall off past about ``1 / (2 pi width)``, so beyond the offsets they were fitted on
    the tail alone carries the kernel. :meth:`exact_mask` is the formula itself.
    """

    #: ``f`` depends on ``|r|`` alone (the mesh engine evaluates it once per distance).
    isotropic = True

    def __init__(self, heads: int, pos_dim: int, *, alpha: float = 0.15, reach: float | None = None,
                 tail_amplitude: float = 1.0, num_radii: int = 8, quadrature: int | None = 8, amplitude: float = 1.0,
                 length_scale: float = 1.0, width: float = 0.0, width_nodes: int = 9,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(heads, pos_dim)
        if pos_dim != 3:
            raise ValueError(f"frequencies='coulomb' is the 3-D Coulomb kernel; pos_dim must be 3, got {pos_dim}")
        check_nonnegative_int("num_radii", num_radii, "0: no learned corrections")
        if isinstance(tail_amplitude, bool) or not isinstance(tail_amplitude, (int, float)) or not math.isfinite(tail_amplitude):
            raise ValueError(f"tail_amplitude must be a finite number, got {tail_amplitude!r}")
        fk: dict[str, Any] = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        self.alpha, self.reach = check_positive_float("alpha", alpha), None if reach is None else check_positive_float("reach", reach)
        self._tails: dict[tuple[float, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.tail = nn.Parameter(torch.full((heads,), float(tail_amplitude), **fk))
        self.tail_frequencies(self.reach or tail_reach(0.0))  # refuses an alpha * reach too large, now
        self.corrections = None if num_radii == 0 else RadialFrequencies(
            heads, pos_dim, num_radii=num_radii, quadrature=quadrature, amplitude=amplitude,
            length_scale=length_scale, width=width, width_nodes=width_nodes, device=device, dtype=dtype)

    def tail_frequencies(self, reach: float, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The tail's ``(xi [R, 3], w [R])`` on the scale's device in ``dtype`` (default the
        scale's), built and moved once per reach, device and dtype."""
        dtype = dtype or self.tail.dtype
        key = (reach, self.tail.device, dtype)
        if key not in self._tails:
            xi, w = coulomb_tail_quadrature(self.alpha, reach)
            self._tails[key] = (xi.to(device=self.tail.device, dtype=dtype), w.to(device=self.tail.device, dtype=dtype))
        return self._tails[key]

    def _precise(self, like: torch.Tensor, *, offsets: bool) -> tuple[torch.Tensor, torch.Tensor]:
        extent = call_reach(like, offsets=offsets)
        with torch.autocast(like.device.type, enabled=False):
            return self.frequencies(phase_dtype(like), reach=self.reach or extent, extent=extent)

    def frequencies(self, dtype: torch.dtype | None = None, *, reach: float | None = None,
                    extent: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(xi [H, R, P], w [H, R])``: the corrections' then the tail's, whose quadrature
        holds to ``reach`` (default: the constructor's, or the smallest :func:`tail_reach`);
        ``extent`` (the largest offset of the call) sets the corrections' rule when their
        ``quadrature`` is None."""
        reach = reach or self.reach or tail_reach(0.0)
        tail = self.tail if dtype is None else self.tail.to(dtype)
        xi_t, w_t = self.tail_frequencies(reach, tail.dtype)
        xi, w = xi_t.expand(self.heads, -1, -1), tail[:, None] * w_t
        if self.corrections is None:
            return xi, w
        own = (extent or reach) if self.corrections.quadrature is None else None
        xi_c, w_c = self.corrections.frequencies(dtype, reach=own)
        return torch.cat([xi_c, xi], dim=1), torch.cat([w_c, w], dim=1)

    def exact_mask(self, delta: torch.Tensor) -> torch.Tensor:
        """``a_h erf(alpha |delta|) / |delta|`` plus the corrections' sincs: ``[..., 3] -> [..., H]``."""
        cdt = compute_dtype(delta)
        r = delta.to(cdt).norm(dim=-1)[..., None]
        out = self.tail.to(cdt) * coulomb_tail(r, self.alpha)
        return out if self.corrections is None else out + self.corrections.exact_mask(delta)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, reach={'per call' if self.reach is None else self.reach}"


#: Frequency sets by name; every class takes ``(heads, pos_dim, *, device, dtype, **options)``.
FREQUENCIES: dict[str, type[Frequencies]] = {
    "discrete": DiscreteFrequencies,
    "radial": RadialFrequencies,
    "grid": GridFrequencies,
    "random": RandomFrequencies,
    "coulomb": CoulombFrequencies,
}


def build_frequencies(name: str, heads: int, pos_dim: int, *, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None, **options: Any) -> Frequencies:
    """``FREQUENCIES[name](heads, pos_dim, **options)``; an option the set does not take is
    refused with the ones it does."""
    check_choice("frequencies", name, FREQUENCIES)
    cls: Any = FREQUENCIES[name]  # every set's constructor takes device and dtype (the base class does not)
    known = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "heads", "pos_dim", "device", "dtype")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"frequencies={name!r} takes the options {', '.join(known)}; got unknown {', '.join(unknown)}")
    return cls(heads, pos_dim, device=device, dtype=dtype, **options)


def check_block_options(options: dict[str, Any]) -> None:
    """Refuse options :class:`LongRangeBlock` would refuse by name, before anything is built:
    an unknown ``frequencies`` or ``content``, or a keyword neither the block nor its
    frequency set takes (values are checked when the block is built)."""
    frequencies = options.get("frequencies", "discrete")
    check_choice("frequencies", frequencies, FREQUENCIES)
    check_choice("content", options.get("content", "none"), CONTENT)
    own = [p for p in inspect.signature(LongRangeBlock.__init__).parameters
           if p not in ("self", "dim", "device", "dtype", "options")]
    theirs = [p for p in inspect.signature(FREQUENCIES[frequencies].__init__).parameters
              if p not in ("self", "heads", "pos_dim", "device", "dtype")]
    unknown = sorted(set(options) - set(own) - set(theirs))
    if unknown:
        raise TypeError(f"LongRangeBlock with frequencies={frequencies!r} takes {', '.join(own + theirs)}; "
                        f"got unknown {', '.join(unknown)}")


def _grouped(v: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, H, N, D] -> [B, G, N, (H / G) D]``: the heads of a group side by side."""
    return rearrange(v, "b (g k) n d -> b g n (k d)", g=groups)


def _per_head(state: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, G, R, K D] -> [B, G, R, K, D]``: a grouped state split into its ``K`` heads."""
    return rearrange(state, "b g r (k d) -> b g r k d", k=k)


def _weighted(state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``state [B, G, R, K D]`` times ``w [G, R, K]`` along its heads ``K``."""
    return rearrange(_per_head(state, w.shape[-1]) * w[None, ..., None], "b g r k d -> b g r (k d)")


class _CosineSum(torch.autograd.Function):
    """``out_i = sum_r w_r [cos_ir sum_j cos_jr v_j + sin_ir sum_j sin_jr v_j]`` on grouped
    layouts (:func:`_grouped`), with a backward written out: two ``[N, R]`` tensors kept,
    and no ``[N, 2R]`` feature or gradient tensor made (autograd's own backward of the same
    expression adds the two uses of each feature in an ``[N, 2R]`` buffer)."""

    @staticmethod
    def forward(ctx: Any, phase: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cos, sin = torch.cos(phase), torch.sin(phase)
        sum_cos, sum_sin = cos.transpose(-1, -2) @ v, sin.transpose(-1, -2) @ v
        ctx.save_for_backward(cos, sin, w, v, sum_cos, sum_sin)
        return cos @ _weighted(sum_cos, w) + sin @ _weighted(sum_sin, w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cos, sin, w, v, sum_cos, sum_sin = ctx.saved_tensors
        back_cos, back_sin = cos.transpose(-1, -2) @ grad, sin.transpose(-1, -2) @ grad
        grad_w = _per_head(back_cos * sum_cos + back_sin * sum_sin, w.shape[-1]).sum((0, -1))
        wb_cos, wb_sin, ws_cos, ws_sin = (_weighted(t, w) for t in (back_cos, back_sin, sum_cos, sum_sin))
        grad_v = cos @ wb_cos + sin @ wb_sin
        grad_cos = grad @ ws_cos.transpose(-1, -2) + v @ wb_cos.transpose(-1, -2)
        grad_sin = grad @ ws_sin.transpose(-1, -2) + v @ wb_sin.transpose(-1, -2)
        return cos * grad_sin - sin * grad_cos, grad_w, grad_v


def feature_sum(phase: torch.Tensor, w: torch.Tensor, v: torch.Tensor, qf: torch.Tensor | None = None,
                kf: torch.Tensor | None = None, *, keep: torch.Tensor | None = None,
                normalised: bool = False) -> torch.Tensor:
    """``out_i = sum_j f(r_i - r_j) (qf_i.kf_j) keep_j v_j`` with ``f_h(r_i - r_j) = sum_r
    w_hr cos(phase_ir - phase_jr)``, in ``O(N R m Dv)``; divided by the same sum with ``v =
    1`` when ``normalised`` (rows whose sum is 0 give 0, :func:`flt.ops._common.safe_divide`).

    ``phase [B, G, N, R]`` (``G = H``, or 1 for phases the heads share), weights ``w [H, R]``,
    ``v [B, H, N, Dv]``, content features ``qf, kf [B, H, N, m]`` or None (``qf_i.kf_j = 1``),
    ``keep [B, N]`` (False for keys that send nothing) or None -> ``[B, H, N, Dv]``. The
    weights and ``keep`` multiply the small states and the values, never an ``[N, R]`` tensor.
    """
    check_tensor("phase", phase, ndim=4, layout="[B, G, N, R]")
    check_tensor("v", v, ndim=4, layout="[B, H, N, Dv]")
    check_tensor("w", w, ndim=2, layout="[H, R]")
    heads, groups = v.shape[1], phase.shape[1]
    if heads % groups or phase.shape[0] != v.shape[0] or phase.shape[2] != v.shape[2]:
        raise ValueError(f"phase [B, G, N, R] and v [B, H, N, Dv] must share B and N, with G dividing H (G = H, or 1 for shared phases); "
                         f"got phase {tuple(phase.shape)}, v {tuple(v.shape)}")
    if w.shape != (heads, phase.shape[-1]):
        raise ValueError(f"w must be [H, R] = [{heads}, {phase.shape[-1]}], got shape {tuple(w.shape)}")
    if normalised:
        v = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
    if keep is not None:
        v = v * keep[:, None, :, None].to(v.dtype)
    if qf is not None and kf is not None:
        c = torch.cat([torch.cos(phase), torch.sin(phase)], dim=-1).expand(-1, heads, -1, -1)
        state = torch.einsum("bhnr,bhnm,bhnd->bhrmd", c, kf, v) * torch.cat([w, w], dim=-1)[None, :, :, None, None]
        out = torch.einsum("bhnr,bhnm,bhrmd->bhnd", c, qf, state)
    else:
        grouped = _CosineSum.apply(phase, rearrange(w, "(g k) r -> g r k", g=groups), _grouped(v, groups))
        out = rearrange(grouped, "b g n (k d) -> b (g k) n d", k=heads // groups)
    return safe_divide(out[..., :-1], out[..., -1:]) if normalised else out


def dense_sum(f: torch.Tensor, v: torch.Tensor, kernel: torch.Tensor | None = None, *,
              normalised: bool = False) -> torch.Tensor:
    """The O(N^2) form of :func:`feature_sum`: ``f [B, H, N, N]`` (padded keys already zero),
    ``v [B, H, N, Dv]``, ``kernel [B, H, N, N]`` or None -> ``[B, H, N, Dv]``."""
    weights = f if kernel is None else f * kernel
    out = weights @ v
    return safe_divide(out, weights.sum(-1, keepdim=True)) if normalised else out


class LongRangeBlock(nn.Module):
    """``h_i + W_o sum_j f(r_i - r_j) K_ij W_v LN(h)_j`` over all points of a set, per head.

    Args:
        dim: ``d``, the width of ``h``.
        heads: ``H``; ``f`` and the content kernel are per head, values ``Dv = d / H`` wide.
        pos_dim: ``P`` (``"radial"`` needs 3).
        frequencies: a key of :data:`FREQUENCIES`; ``**options`` go to its constructor.
        normalised: divide by ``sum_j f K`` (attention's weighted average; a signed ``f``
            can make that sum vanish or change sign, rows whose sum is 0 give 0) instead of
            the plain sum (the default: physical targets are sums, and a sum keeps its
            meaning on larger sets).
        content: a key of :data:`CONTENT`; ``"elu"`` and ``"favor+"`` project queries and keys
            (``Dk = d / H``) and multiply ``f`` by ``phi(q_i).phi(k_j)`` (a Kronecker product
            of the position and content features, ``O(N 2R m Dv)``).
        num_features: ``m`` of ``"favor+"`` (``"elu"`` has ``m = Dk``).
        feature_seed: seeds the FAVOR+ draw (None: torch's generator); the trainer redraws
            it like any FAVOR+ map (:mod:`flt.layers.draws`).
        neutral: subtract from the values their mean over the set's real points, so the
            sum sees only how values differ from point to point ("charges" of a neutral
            system). A kernel with a ``1 / r`` tail sums a constant value into a term that
            grows like the set's extent squared; a neutral block has none.
        prenorm: a LayerNorm on ``h`` before the projections.
        exact: always compute the O(N^2) sum with the exact kernels (:meth:`reference`): the
            control "the same relative term, exactly", at O(N^2 R) cost.
        engine: a key of :data:`ENGINES`. ``"features"`` (the default) sums the set's
            cosine sum through its frequencies. ``"mesh"`` sums the set's exact kernel
            (:meth:`Frequencies.exact_mask`: the sinc, the ``1 / r`` tail's formula)
            through a mesh of ``mesh_spacing`` position units and B-splines of
            ``mesh_order`` (:func:`flt.ops.mesh.mesh_sum`): its cost does not depend on the
            kernel's reach, and its error is the mesh's (docs/longrange.md), small for
            kernels smooth on the mesh's scale. The mesh engine takes no content kernel.
        value_dim: ``Dv``, each head's value width (default ``d / H``): the sums carry ``H
            Dv`` channels, so a narrower value cuts either engine's cost (the mesh's FFTs
            are one per channel) without narrowing ``h``.

    ``W_o`` starts at zero, so a fresh block is the identity and adding it to a trained
    model changes nothing until it learns.

    Shapes: ``forward(h [B, N, d], pos [B, N, P], key_padding_mask [B, N] bool (True =
    padding) or None) -> [B, N, d]``. Padded points neither send nor receive (their rows
    come back unchanged); their positions may hold anything, NaN included.
    """

    def __init__(self, dim: int, *, heads: int = 4, pos_dim: int = 3, frequencies: str = "discrete",
                 normalised: bool = False, content: str = "none", num_features: int = 16,
                 feature_seed: int | None = None, prenorm: bool = True, exact: bool = False, neutral: bool = False,
                 engine: str = "features", mesh_spacing: float = 1.0, mesh_order: int = 4,
                 value_dim: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, **options: Any) -> None:
        super().__init__()
        check_block_options({"frequencies": frequencies, "content": content, **options})
        check_positive_int("dim", dim)
        check_positive_int("heads", heads)
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        check_choice("content", content, CONTENT)
        check_bool("normalised", normalised)
        check_bool("prenorm", prenorm)
        check_bool("exact", exact)
        check_bool("neutral", neutral)
        check_choice("engine", engine, ENGINES)
        if engine == "mesh" and content != "none":
            raise ValueError(f"engine='mesh' sums the kernel alone; content must be 'none' with it, got {content!r}")
        self.engine = engine
        self.mesh_spacing = check_positive_float("mesh_spacing", mesh_spacing)
        check_positive_int("mesh_order", mesh_order)
        if mesh_order < 2:
            raise ValueError(f"mesh_order must be at least 2 (linear splines; 4 is cubic), got {mesh_order}")
        self.mesh_order = mesh_order
        if value_dim is not None:
            check_positive_int("value_dim", value_dim)
        self.value_dim = dim // heads if value_dim is None else value_dim
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.dim, self.heads, self.pos_dim = dim, heads, pos_dim
        self.frequency_set, self.normalised, self.content, self.exact = frequencies, normalised, content, exact
        self.neutral = neutral
        self.kernel = build_frequencies(frequencies, heads, pos_dim, **fk, **options)
        self.norm = nn.LayerNorm(dim, **fk) if prenorm else nn.Identity()
        self.value = nn.Linear(dim, heads * self.value_dim, **fk)
        self.out = nn.Linear(heads * self.value_dim, dim, **fk)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)
        self.query: nn.Linear | None = None
        self.key: nn.Linear | None = None
        self.feature_map: FeatureMap | None = None
        if content != "none":
            self.query, self.key = nn.Linear(dim, dim, **fk), nn.Linear(dim, dim, **fk)
            self.feature_map = FeatureMap(dim // heads, num_features, kind=content, seed=feature_seed, **fk)

    def _check(self, h: torch.Tensor, pos: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        """The validated padding mask ``[B, N]`` (all False when None)."""
        check_tensor("h", h, ndim=3, layout="[B, N, d]")
        check_tensor("pos", pos, ndim=3, layout="[B, N, P]")
        if h.shape[-1] != self.dim:
            raise ValueError(f"h must be [B, N, d] with d = {self.dim}, got shape {tuple(h.shape)}")
        if pos.shape != (*h.shape[:2], self.pos_dim):
            raise ValueError(f"pos must be [B, N, P] = [{h.shape[0]}, {h.shape[1]}, {self.pos_dim}] like h, got shape {tuple(pos.shape)}")
        if key_padding_mask is None:
            key_padding_mask = torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool or key_padding_mask.shape != h.shape[:2]:
            got = f"{tuple(key_padding_mask.shape)} {key_padding_mask.dtype}" if isinstance(key_padding_mask, torch.Tensor) else type(key_padding_mask).__name__
            raise ValueError(f"key_padding_mask must be a bool tensor [B, N] = {tuple(h.shape[:2])} (True = padding), got {got}")
        check_finite("pos", pos[~key_padding_mask])
        return key_padding_mask

    def _inputs(self, h: torch.Tensor, pos: torch.Tensor,
                pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Positions less their set's centre (f is translation invariant; centred positions
        keep phases small and bound every offset by twice the largest ``|pos|``), padding at
        0; values ``[B, H, N, Dv]``; queries and keys (or None)."""
        real = (~pad).unsqueeze(-1)
        pos = pos.masked_fill(~real, 0.0)
        centre = pos.sum(1, keepdim=True) / real.sum(1, keepdim=True).clamp_min(1).to(pos.dtype)
        pos = (pos - centre).masked_fill(~real, 0.0)
        x = self.norm(h)
        v = rearrange(self.value(x), "b n (h d) -> b h n d", h=self.heads)
        if self.neutral:
            weight = real.squeeze(-1)[:, None, :, None].to(v.dtype)
            v = v - (v * weight).sum(2, keepdim=True) / weight.sum(2, keepdim=True).clamp_min(1)
        if self.query is None or self.key is None:
            return pos, v, None, None
        q, k = (rearrange(lin(x), "b n (h d) -> b h n d", h=self.heads) for lin in (self.query, self.key))
        return pos, v, q, k

    def _content_features(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``phi(q), phi(k) [B, H, N, m]`` whose products are the content kernel (FAVOR+ of
        ``q / Dk^(1/4)``, with its per-row scale folded in: a sum has no ratio to cancel it)."""
        assert self.feature_map is not None
        if self.content == "favor+":
            scale = q.shape[-1] ** -0.25
            (fq, sq), (fk_, sk) = self.feature_map(q * scale), self.feature_map(k * scale)
            assert sq is not None and sk is not None
            return fq * sq.exp().unsqueeze(-1), fk_ * sk.exp().unsqueeze(-1)
        return self.feature_map(q)[0], self.feature_map(k)[0]

    def _finish(self, h: torch.Tensor, msg: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        update = self.out(rearrange(msg, "b h n d -> b n (h d)").to(h.dtype))
        return h + update.masked_fill(pad.unsqueeze(-1), 0.0)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *,
                exact: bool = False) -> torch.Tensor:
        """``[B, N, d] -> [B, N, d]`` in ``O(N R d)``; ``exact=True`` (or the constructor's) is
        :meth:`reference` with the exact kernels (the sinc for ``"radial"``, ``exp(q.k /
        sqrt(Dk))`` for FAVOR+)."""
        if exact or self.exact:
            return self.reference(h, pos, key_padding_mask, kernel="exact")
        pad = self._check(h, pos, key_padding_mask)
        if h.numel() == 0:
            return h.clone()  # no sets, or sets of no points: nothing to sum
        pos, v, q, k = self._inputs(h, pos, pad)
        if self.engine == "mesh":
            return self._finish(h, self._mesh(pos, v, pad), pad)
        frequencies = self.kernel.call_frequencies(pos)
        cdt = compute_dtype(pos, v)
        qf = kf = None
        if q is not None and k is not None:
            qf, kf = (t.to(cdt) for t in self._content_features(q, k))
        backward = torch.is_grad_enabled() and (h.requires_grad or pos.requires_grad
                                                or any(p.requires_grad for p in self.parameters()))
        rows = h.shape[0] if compiling() else self._sets_per_part(pos, frequencies, cdt, v.shape[-1], backward=backward)
        parts = []
        for b in range(0, h.shape[0], rows):
            part = slice(b, b + rows)
            phase, w = self.kernel.phase_features(pos[part], frequencies)
            parts.append(feature_sum(phase.to(cdt), w.to(cdt), v[part].to(cdt), None if qf is None else qf[part],
                                     None if kf is None else kf[part], keep=~pad[part], normalised=self.normalised))
        msg = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._finish(h, msg, pad)

    def _mesh(self, pos: torch.Tensor, v: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """The messages ``[B, H, N, Dv]`` through :func:`flt.ops.mesh.mesh_sum`, after a check
        that :func:`flt.ops.mesh.mesh_bytes` fits in memory, counting for a set that is not
        isotropic the float64 phases ``[..., H, R]`` that :meth:`Frequencies.mask` forms at
        every offset."""
        cdt = compute_dtype(pos, v)
        v, pos = v.to(cdt), pos.to(cdt)
        if self.normalised:
            v = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
        B, H, N, width = v.shape
        _, size = mesh_shape(pos, self.mesh_spacing, self.mesh_order)
        kernel_bytes = 0 if self.kernel.isotropic else H * self.kernel.frequencies()[1].shape[-1] * _PHASE_BYTES
        check_memory(f"the long-range block's mesh ({'x'.join(map(str, size))} nodes, {B} set(s) of {H * width} "
                     f"value channels, {N} points)",
                     mesh_bytes(size, sets=B, channels=H * width, points=N, order=self.mesh_order,
                                item=torch.finfo(cdt).bits // 8, kernel_bytes=kernel_bytes),
                     device=pos.device, hint="raise mesh_spacing, or use fewer sets per batch")
        out = mesh_sum(pos, v, self.kernel.exact_mask, spacing=self.mesh_spacing, order=self.mesh_order,
                       isotropic=self.kernel.isotropic, keep=~pad)
        return safe_divide(out[..., :-1], out[..., -1:]) if self.normalised else out

    def set_bytes(self, points: int, groups: int, count: int, cdt: torch.dtype, head_dim: int) -> int:
        """The fast path's estimated peak bytes for one set of ``points`` points with ``count``
        frequencies in ``groups`` phase groups (:meth:`_sets_per_part`)."""
        item = torch.finfo(cdt).bits // 8
        total = points * groups * count * (_PHASE_BYTES + 3 * item) + 4 * count * self.heads * (head_dim + 1) * item
        if self.feature_map is not None:
            total += 2 * self.heads * 2 * count * (self.feature_map.num_features * (head_dim + 1) + points) * item
        return total

    def _sets_per_part(self, pos: torch.Tensor, frequencies: tuple[torch.Tensor, torch.Tensor], cdt: torch.dtype,
                       head_dim: int, *, backward: bool) -> int:
        """How many sets of the batch one pass of the fast path takes. Its phases hold ``N G R``
        values per set, about :data:`_PHASE_BYTES` plus three compute-dtype values each at
        their peak (float64 phase arithmetic, then cosines and sines; measured 24-30 bytes
        per value in float32 on CPU); its states ``[R, H (Dv + 1)]`` (and with a content
        kernel ``[H, 2R, m, Dv + 1]``, with the features expanded to every head) add to that.
        With a backward pass ahead every set's are kept for it, so the whole batch must fit;
        without (evaluation), the batch is taken in parts that fit in half the limit, with
        the same frequencies (:meth:`Frequencies.call_frequencies`), so the result is the
        one-pass result to rounding. What cannot fit is refused with a
        :class:`flt._limits.MemoryLimitError` naming the sizes, before it is allocated."""
        B, N, _ = pos.shape
        groups, count = frequencies[0].shape[0], frequencies[0].shape[1]
        per_set = self.set_bytes(N, groups, count, cdt, head_dim)
        limit = memory_limit(pos.device)
        sets = B if backward else 1
        check_memory(f"the long-range block's phases and states ({self.frequency_set}: {count} frequencies for this "
                     f"call's extent, {groups} phase group(s), {N} points per set, {sets} set(s)"
                     f"{', kept for the backward pass' if backward else ''})", per_set * sets, device=pos.device,
                     hint="use fewer points or sets per batch, or fewer frequencies (num_radii, quadrature, alpha, "
                     "shared=True)", limit=limit)
        return B if backward else max(1, min(B, limit[0] // (2 * per_set)))

    def pair_kernel(self, pos: torch.Tensor, *, kernel: str = "features") -> torch.Tensor:
        """``f(r_i - r_j)`` of every pair, ``[B, H, N, N]``, evaluated directly from the offsets:
        ``kernel="features"`` the cosine sum the fast path computes, ``"exact"`` the kernel the
        set stands for (:meth:`Frequencies.exact_mask`). In query chunks that bound the
        ``[B, rows, N, H, R]`` phases."""
        check_choice("kernel", kernel, ("features", "exact"))
        fn = self.kernel.mask if kernel == "features" else self.kernel.exact_mask
        B, N, _ = pos.shape
        width = max(1, B * N * self.heads * self.kernel.frequencies()[1].shape[-1])
        rows = max(1, _REFERENCE_ELEMENTS // width)
        parts = [fn(pos[:, i:i + rows, None, :] - pos[:, None, :, :]) for i in range(0, N, rows)]
        return rearrange(torch.cat(parts, dim=1), "b i j h -> b h i j")

    def reference(self, h: torch.Tensor, pos: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *,
                  kernel: str | None = None) -> torch.Tensor:
        """The O(N^2) sum pair by pair, in the compute dtype of the inputs (float64 in the
        tests). ``kernel``: ``"features"``, ``f`` the cosine sum of the frequencies
        (:meth:`pair_kernel`; the same FAVOR+ draw); ``"exact"``, the exact kernels;
        ``"mesh"``, the mesh kernel of :func:`flt.ops.mesh.mesh_sum_reference`; None (the
        default), the one the block's engine computes."""
        kernel = kernel or ("mesh" if self.engine == "mesh" else "features")
        check_choice("kernel", kernel, ("features", "exact", "mesh"))
        pad = self._check(h, pos, key_padding_mask)
        pos, v, q, k = self._inputs(h, pos, pad)
        cdt = compute_dtype(pos, v)
        if kernel == "mesh":
            if q is not None:
                raise ValueError("kernel='mesh' sums the kernel alone; the block's content must be 'none'")
            values = v.to(cdt)
            if self.normalised:
                values = torch.cat([values, values.new_ones(*values.shape[:-1], 1)], dim=-1)
            out = mesh_sum_reference(pos.to(cdt), values, self.kernel.exact_mask, spacing=self.mesh_spacing,
                                     order=self.mesh_order, keep=~pad)
            return self._finish(h, safe_divide(out[..., :-1], out[..., -1:]) if self.normalised else out, pad)
        f = self.pair_kernel(pos.to(cdt), kernel=kernel).to(cdt) * (~pad)[:, None, None, :].to(cdt)
        content = None
        if q is not None and k is not None:
            if kernel == "exact" and self.content == "favor+":
                content = torch.exp((q.to(cdt) @ k.to(cdt).transpose(-1, -2)) / math.sqrt(q.shape[-1]))
            else:
                qf, kf = self._content_features(q, k)
                content = qf.to(cdt) @ kf.to(cdt).transpose(-1, -2)
        msg = dense_sum(f, v.to(cdt), content, normalised=self.normalised)
        return self._finish(h, msg, pad)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.heads}, frequencies={self.frequency_set!r}, "
                f"normalised={self.normalised}, content={self.content!r}" + (", exact=True" if self.exact else "")
                + (", neutral=True" if self.neutral else "")
                + (f", engine='mesh', mesh_spacing={self.mesh_spacing:g}, mesh_order={self.mesh_order}"
                   if self.engine == "mesh" else "")
                + (f", value_dim={self.value_dim}" if self.value_dim != self.dim // self.heads else ""))


__all__ = [
    "CONTENT",
    "ENGINES",
    "FREQUENCIES",
    "CoulombFrequencies",
    "DiscreteFrequencies",
    "Frequencies",
    "GridFrequencies",
    "LongRangeBlock",
    "RadialFrequencies",
    "RandomFrequencies",
    "build_frequencies",
    "call_reach",
    "check_block_options",
    "coulomb_tail",
    "coulomb_tail_quadrature",
    "dense_sum",
    "feature_sum",
    "radial_profile",
    "tail_reach",
]
