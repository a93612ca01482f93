"""The common interface of every spectral family (docs/math.md section 3).

A spectrum ``g`` on ``R^P`` defines the RPE mask ``f(Delta) = int g(xi) cos(2 pi xi.Delta) dxi``.
Each family estimates ``f`` with ``R`` frequencies and weights,
``f^(Delta) = sum_k w_k cos(2 pi xi_k.Delta)``, which factorises into query-side and
key-side features with ``a(r) . c(s) = f^(r - s)`` exactly.

Families made of components (``gaussian_mixture``, ``local``) can also learn a shift per
component, ``f(Delta) = sum_c f_c(Delta - delta_c)``: the mask is no longer even, so a
head can prefer keys on one side (docs/math.md section 3.2). The spectrum becomes
``sum_c g_c(xi) exp(-2 pi i xi.delta_c)``, the estimate
``sum_k w_k cos(2 pi xi_k.Delta - phi_k)`` with ``phi_k = 2 pi xi_k.delta_c``, and the phase
sits on the query side's features only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from einops import rearrange
from torch import nn

from flt._checks import check_choice, check_finite, check_positive_int, check_tensor
from flt._dtype import compute_dtype
from flt.relative.base import RelativeTerm
from flt.relative.spectra.sampling import SAMPLERS, standard_normal_draws

# Times 1 / R: weights smaller than this are split unevenly between the query and key
# features so that w = 0 stays differentiable (see Spectrum.features).
_WEIGHT_FLOOR = 1e-4


class Spectrum(RelativeTerm):
    """Base class of the spectral families.

    Subclasses implement :meth:`density` (``g``), :meth:`mask` (the exact ``f``) and
    :meth:`frequencies` (``xi [H, R, P]``, ``w [H, R]`` from the fixed base draws
    ``self.eps``, differentiable in the parameters), and set :attr:`extra_normals` when
    they need auxiliary normals per frequency.

    Args:
        heads: ``H``, one spectrum per head.
        pos_dim: ``P``.
        num_frequencies: ``R``; features have ``2R`` entries.
        sampler: ``"iid"``, ``"qmc"`` (Sobol) or ``"orthogonal"`` base draws.
        seed: seeds the base draws; ``None`` draws from torch's global generator.
        redraw: deprecated and ignored (kept so that configs which set it still load).
            Every spectrum's base draws can be replaced, by
            :meth:`redraw_random_features` through :mod:`flt.layers.draws`; nothing
            replaces them unless asked (the trainer does, every ``redraw_interval`` steps).
        shift: learn a shift ``delta_c`` per head and component, starting at 0 (families
            with ``supports_shift``: ``gaussian_mixture``, ``local``): ``f(Delta) =
            sum_c f_c(Delta - delta_c)``.
        shift_scale: position units per unit of the shift parameter (:meth:`_init_shift`).

    Shifts. Subclasses with components call :meth:`_init_shift` and pass offsets through
    :meth:`component_offsets` in :meth:`mask`; :meth:`phases` then gives the phase of
    every frequency (component-major layout, ``R / C`` frequencies per component), and
    :meth:`estimate` and :meth:`features` apply it. Without shifts ``phases()`` is None
    and nothing changes.

    Redraws. ``eps`` is a persistent buffer (saved with the weights) and the only random
    state: :meth:`redraw_random_features` replaces it in place and leaves the parameters
    alone, so the estimate stays differentiable in them. :attr:`has_random_features` is
    True unless the owner uses only the exact :meth:`mask` (e.g. FLT's near-field
    spectrum), in which case :mod:`flt.layers.draws` leaves the spectrum alone.

    As a :class:`flt.relative.RelativeTerm`: ``of_offsets`` is :meth:`mask`, ``bias(pos_q,
    pos_k)`` the exact ``f(r_q - r_k)`` ``[B|1, H, N, Nk]``, and :meth:`features` the
    linear-time factorisation (``linear = True``).
    """

    eps: torch.Tensor  # registered buffer: the base draws ``[H, R, P + extra_normals]``

    linear = True

    #: Whether the family takes ``shift=True`` (it calls :meth:`_init_shift`).
    supports_shift: bool = False
    #: Auxiliary standard normals per frequency beyond the ``P`` spatial ones.
    extra_normals: int = 0
    #: Names of the buffers that hold the draws (:mod:`flt.layers.draws`).
    random_feature_buffers: tuple[str, ...] = ("eps",)
    #: Whether the features are a fixed function of the parameters, with no density
    #: sampled: the discrete family's compute ``f`` exactly, the radial family's to its
    #: direction rule's stated error. Then there is nothing to redraw, and the seed sets the
    #: starting parameters (or nothing) instead of the draws.
    deterministic: bool = False

    def __init__(self, heads: int, pos_dim: int, num_frequencies: int, *, sampler: str = "iid", seed: int | None = None,
                 redraw: bool = False, shift: bool = False, shift_scale: float = 1.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_positive_int("heads", heads)
        check_positive_int("pos_dim", pos_dim)
        check_positive_int("num_frequencies", num_frequencies)
        check_choice("sampler", sampler, SAMPLERS)
        self.heads, self.pos_dim, self.num_frequencies = heads, pos_dim, num_frequencies
        self.sampler, self.seed = sampler, seed
        #: Whether the layer that owns this spectrum samples its frequencies.
        self.has_random_features = not self.deterministic
        self._factory: dict[str, Any] = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        self.register_buffer("eps", self._draw(seed), persistent=True)
        if not isinstance(shift, bool):
            raise ValueError(f"shift must be True or False (learn a shift per component), got {shift!r}")
        type(self).check_options({"shift": shift})
        if isinstance(shift_scale, bool) or not isinstance(shift_scale, (int, float)) or not (
            math.isfinite(shift_scale) and shift_scale > 0
        ):
            raise ValueError(f"shift_scale must be a positive finite number (position units per unit of the shift parameter), got {shift_scale!r}")
        self.shift_scale = float(shift_scale)
        self._learn_shift = shift
        self.shift: nn.Parameter | None = None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Spectrum:
        # Parameters and draws stay in float32 when the module is cast to a half type: the
        # gradient of a frequency, sum_n 2 pi r_n dL/dphase_n, grows with the positions and
        # overflows float16 (65504) from about a thousand tokens on. They are a few numbers.
        # They are restored from the values before the cast: a round trip through float16
        # would round them to 11 bits (a frequency by 5e-4 of itself, a phase at r = 10^4 by
        # a tenth of a turn).
        half = (torch.float16, torch.bfloat16)
        before = {key: (t.data, None if t.grad is None else t.grad.data) for tensors in (self._parameters, self._buffers)
                  for key, t in tensors.items() if t is not None}
        super()._apply(fn, recurse)
        for tensors in (self._parameters, self._buffers):
            for key, t in tensors.items():
                if t is None or t.dtype not in half:
                    continue
                data, grad = before.get(key, (t.data, t.grad))
                t.data = (data if data.dtype not in half else t.data).to(device=t.device, dtype=torch.float32)
                if t.grad is not None:
                    t.grad = (grad if grad is not None and grad.dtype not in half else t.grad).to(device=t.device,
                                                                                                  dtype=torch.float32)
        return self

    @classmethod
    def check_options(cls, options: dict) -> None:
        """Refuse option values that this family cannot take whatever their type (the option
        checker calls it before any data is loaded; the constructor calls it too)."""
        if options.get("shift") is True and not cls.supports_shift:
            raise ValueError(
                f"shift: the {cls.__name__} family has no components to shift; "
                "use spectrum='gaussian_mixture' or 'local', or shift=False"
            )

    def _init_shift(self, groups: int) -> None:
        """Create the learned shifts ``delta [H, groups, P]`` (zero at first) if the
        constructor's ``shift`` asks for them; subclasses with ``supports_shift`` call it.

        ``delta = shift_scale * theta`` with ``theta`` the parameter: Adam moves a parameter
        by about the learning rate per step, so ``shift_scale`` (position units) is how far
        a shift can travel; set it to the extent of the positions (e.g. the context length).
        """
        if self._learn_shift:
            self.shift = nn.Parameter(torch.zeros(self.heads, groups, self.pos_dim, **self._factory))

    def shifts(self) -> torch.Tensor | None:
        """``delta [H, C, P]`` in position units, or None without shifts."""
        return None if self.shift is None else self.shift * self.shift_scale

    def component_offsets(self, delta: torch.Tensor) -> torch.Tensor:
        """``Delta - delta_c``: ``[..., P] -> [..., H, C, P]`` (``[..., 1, 1, P]`` without shifts)."""
        d = delta.unsqueeze(-2).unsqueeze(-2)
        shifts = self.shifts()
        return d if shifts is None else d - shifts.to(d.dtype)

    def head_offsets(self, delta: list[torch.Tensor], h: torch.Tensor, c: int) -> list[torch.Tensor]:
        """``Delta - delta_c`` of head ``h`` and component ``c`` for one offset given as ``P``
        0-d coordinates: the per-score form of :meth:`component_offsets`
        (:meth:`flt.relative.RelativeTerm.head_value`)."""
        if self.shift is None:
            return delta
        return [d - self.shift[h, c, p] * self.shift_scale for p, d in enumerate(delta)]

    def phases(self, xi: torch.Tensor) -> torch.Tensor | None:
        """``phi_k = 2 pi xi_k.delta_c(k)``, ``[H, R]``, for the frequencies ``xi [H, R, P]`` of
        :meth:`frequencies`; None without shifts."""
        shifts = self.shifts()
        if shifts is None:
            return None
        H, C, P = shifts.shape
        per = xi.shape[1] // C
        xi = xi.reshape(H, C, per, P)
        return (2 * math.pi * (xi * shifts.to(xi.dtype).unsqueeze(-2)).sum(-1)).reshape(H, C * per)

    def shifted_turns(self, turns: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        """``turns - phi / (2 pi)`` reduced to ``[-1/2, 1/2]`` as in :func:`cycles` (``turns``
        unchanged without shifts): the query side's angles in turns, ``[..., H, R]``, with
        ``xi`` and ``turns`` in the same (phase) dtype."""
        phi = self.phases(xi)
        if phi is None:
            return turns
        t = turns - phi / (2 * math.pi)
        return t - torch.round(t.detach())

    def _check_unshifted(self, what: str) -> None:
        if self.shift is not None:
            raise ValueError(
                f"{what} of a shifted spectrum is complex (component c carries exp(-2 pi i xi.delta_c)); "
                "it is defined for shift=False only"
            )

    # -- subclass interface ------------------------------------------------------------
    def density(self, xi: torch.Tensor) -> torch.Tensor:
        """``g(xi)``: ``[..., P] -> [..., H]``."""
        raise NotImplementedError

    def mask(self, delta: torch.Tensor) -> torch.Tensor:
        """The exact mask ``f(Delta)``: ``[..., P] -> [..., H]``."""
        raise NotImplementedError

    def of_offsets(self, delta: torch.Tensor) -> torch.Tensor:
        return self.mask(delta)

    def frequencies(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(xi [H, R, P], w [H, R])`` with ``f^(Delta) = sum_k w_k cos(2 pi xi_k.Delta)``,
        computed from the parameters cast to ``dtype`` (default: as they are). :meth:`features`
        asks for float64: a frequency rounded to float32 moves the phase ``2 pi xi.r`` by
        ``1e-7 |2 pi xi.r|``, which at ``r = 10^4`` is already ``1e-4`` radians."""
        raise NotImplementedError

    # -- shared machinery --------------------------------------------------------------
    def _draw(self, seed: int | None) -> torch.Tensor:
        gen = None
        if seed is not None:
            gen = torch.Generator().manual_seed(int(seed))
        elif self.sampler == "qmc":
            # Sobol scrambling seeds come from the global generator, like iid draws.
            gen = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))
        draws = standard_normal_draws(
            self.heads,
            self.num_frequencies,
            self.pos_dim + self.extra_normals,
            method=self.sampler,
            spatial_dim=self.pos_dim,
            generator=gen,
        )
        return draws.to(**self._factory)

    @torch.no_grad()
    def redraw_random_features(self, generator: torch.Generator | None = None) -> None:
        """Replace the base draws ``eps`` in place, with the spectrum's sampler.

        The new draws are a function of one number taken from ``generator`` (a CPU
        generator; ``None``: torch's global generator), drawn on the CPU whatever the
        device. Parameters are untouched: gradients still reach them.
        """
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        self.eps.copy_(self._draw(seed))

    #: The historical name of :meth:`redraw_random_features`.
    redraw_frequencies = redraw_random_features

    def _check_points(self, name: str, x: torch.Tensor) -> None:
        check_tensor(name, x)
        if x.ndim < 1 or x.shape[-1] != self.pos_dim:
            raise ValueError(f"{name} must have last dimension P = {self.pos_dim}, got shape {tuple(x.shape)}")
        check_finite(name, x)

    def estimate(self, delta: torch.Tensor) -> torch.Tensor:
        """The random-feature estimate ``f^(Delta)``: ``[..., P] -> [..., H]``."""
        self._check_points("delta", delta)
        cdt = compute_dtype(delta)
        xi, w = self.precise_frequencies(delta)
        turns = self.shifted_turns(cycles(delta, xi), xi)  # [..., H, R]
        return (torch.cos(2 * math.pi * turns.to(cdt)) * w.to(cdt)).sum(dim=-1)

    def precise_frequencies(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`frequencies` in float64 (:func:`phase_dtype` of ``like``'s device), outside
        autocast: the frequencies that go into phases (:func:`cycles`)."""
        with torch.autocast(like.device.type, enabled=False):
            return self.frequencies(phase_dtype(like))

    def features(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Query- and key-side features of positions.

        Args:
            pos: ``[B, N, P]`` or ``[N, P]``.

        Returns:
            ``(a, c)``, each ``[B or 1, H, N, 2R]`` in float32 or better, with
            ``a_i . c_j = f^(r_i - r_j)``. ``sqrt|w_k|`` sits on both sides (the sign on the
            query side) so both vectors have norms independent of ``R``: with all the
            weight on one side the key norms would grow like ``sqrt(R)`` and FAVOR+ on the
            concatenated vectors would lose its accuracy. Weights below a floor are the
            exception: the key side carries ``rho_k = sqrt(max(|w_k|, floor))`` and the
            query side ``w_k / rho_k``, ``floor = 1e-4 / R``. The product is still exactly
            ``w_k``, and ``sqrt|w_k|`` on both sides is kept whenever ``|w_k| >= floor``
            (``w_k ~ f(0) / R``). With ``sqrt|w_k|`` on both sides down to 0, a
            zero-initialised spectrum (``amplitude=0``: a fresh logit-coupled layer) would
            get NaN gradients (``d sqrt|w| / dw`` is infinite at 0), and even with that
            patched it would sit at a saddle: with ``a = c = 0`` no gradient of ``a . c``
            reaches ``w``. With the floor, ``w = 0`` gives ``a = 0`` exactly (so
            ``a . c = 0``) and small key features ``|c|^2 = R floor = 1e-4``, and
            ``d(a . c) / dw_k`` is exact. With shifts the query side's angles are
            ``2 pi xi_k.r - phi_k`` (:meth:`phases`), so ``a_i . c_j = sum_k w_k
            cos(2 pi xi_k.(r_i - r_j) - phi_k)``.

            Precision: the products ``xi_k.r_n`` are formed in float64 from float64
            frequencies and reduced to whole cycles (:func:`cycles`) before the angle is
            taken in float32 or better, and autocast never touches them. A phase of
            ``2 pi xi.r ~ 5000`` radians (``r = 16384`` at the default length scales) in
            float32 is off by ``3e-4``, the mask by as much, and the signed sums of the
            multiplicative coupling amplify that (docs/math.md section 4, "Conditioning").
        """
        check_tensor("pos", pos, ndim=(2, 3), layout="[B, N, P] or [N, P]")
        if pos.ndim == 2:
            pos = pos.unsqueeze(0)
        self._check_points("pos", pos)
        cdt = compute_dtype(pos)
        xi, w = self.precise_frequencies(pos)
        turns = rearrange(cycles(pos, xi), "b n h r -> b h n r")
        w = w.to(cdt).unsqueeze(-2)  # [H, 1, R]
        root = w.abs().clamp_min(_WEIGHT_FLOOR / self.num_frequencies).sqrt()
        phase = 2 * math.pi * turns.to(cdt)
        cos, sin = torch.cos(phase), torch.sin(phase)
        c = torch.cat([root * cos, root * sin], dim=-1)
        if self.shift is not None:
            phase = 2 * math.pi * self.shifted_turns(turns.transpose(1, 2), xi).transpose(1, 2).to(cdt)
            cos, sin = torch.cos(phase), torch.sin(phase)
        a = torch.cat([(w / root) * cos, (w / root) * sin], dim=-1)
        return a, c

    def extra_repr(self) -> str:
        shift = "" if self.shift is None else f", shift_scale={self.shift_scale}"
        return (
            f"heads={self.heads}, pos_dim={self.pos_dim}, num_frequencies={self.num_frequencies}, "
            f"sampler={self.sampler!r}{shift}"
        )


def as_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` cast to ``dtype`` (unchanged for None): :meth:`Spectrum.frequencies` casts its
    parameters first, so that exponentials and products run in that dtype."""
    return t if dtype is None else t.to(dtype)


def phase_dtype(like: torch.Tensor) -> torch.dtype:
    """float64, the dtype of phase arithmetic, except on devices without it (Apple's MPS),
    where float32 is the best there is."""
    return torch.float32 if like.device.type == "mps" else torch.float64


def cycles(points: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
    """``xi_k . x`` less its nearest integer, in ``[-1/2, 1/2]``: ``points [..., P],
    xi [H, R, P] -> [..., H, R]`` in :func:`phase_dtype` (float64).

    ``cos(2 pi t)`` and ``sin(2 pi t)`` only need ``t`` modulo 1, and after the reduction
    the angle is at most ``pi``, so casting it to float32 costs one float32 rounding of a
    number below ``pi``, however large the positions. The reduction is not differentiated
    (whole cycles are locally constant): gradients are those of ``xi . x``. The products are
    one contraction over ``P``, with no ``[..., H, R, P]`` tensor of products.
    """
    dtype = phase_dtype(points)
    with torch.autocast(points.device.type, enabled=False):
        t = torch.einsum("...p,hrp->...hr", points.to(dtype), xi.to(dtype))
    return t - torch.round(t.detach())


def positive(raw: torch.Tensor) -> torch.Tensor:
    """Map an unconstrained parameter to a positive value (log-parameterisation)."""
    return torch.exp(raw)


def inverse_positive(value: object, *, shape: tuple[int, ...] | torch.Size, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Unconstrained initial value for :func:`positive`, broadcast to ``shape``.

    ``value`` is a number or anything ``torch.as_tensor`` accepts; it must be positive.
    """
    t = torch.as_tensor(value, dtype=torch.float64)
    if not bool((t > 0).all()) or not bool(torch.isfinite(t).all()):
        raise ValueError(f"expected positive finite values, got {value!r}")
    return torch.log(t).expand(shape).clone().to(device=device, dtype=dtype or torch.get_default_dtype())
