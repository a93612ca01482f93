"""Shifted basis embeddings and their diagnostics (Zheng et al. 2021, "Rethinking
Positional Encoding"; docs/math.md section 7).

A coordinate ``x`` in a domain ``[a, b]`` is embedded as ``psi(x) = [phi(x - t_d)]_(d=1..D)``
with ``D`` equispaced centres ``t_d = a + (d - 1/2) h``, ``h = (b - a)/D`` (cell centres,
so the basis is symmetric about the middle of the domain). The paper shows that how well
such an embedding works is governed by a trade-off between the stable rank of the
embedded sample matrix and how far apart two coordinates can be while their embeddings
stay similar; :func:`stable_rank` and :func:`distance_preservation` measure both.

Kinds (``u = x - t_d``, ``w`` = ``width``, defaults in terms of the spacing ``h``):

    gaussian   exp(-u^2 / (2 w^2))              w = sigma, default h
    triangle   max(0, 1 - |u| / w)              w = half-support, default h (hat functions)
    square     1[|u| <= w]                      w = half-width, default h (a box pulse)
    impulse    1[t_d is the nearest centre]     no width (a one-hot lookup)
    sine       sin(2 pi u / w)                  w = period, default b - a
    rff        [cos(2 pi xi_k x), sin(2 pi xi_k x)] / sqrt(D/2),  xi_k ~ N(0, (2 pi w)^-2)
               (random Fourier features, not shifted; w = kernel length scale, default h,
               so psi(x).psi(y) -> exp(-(x - y)^2 / (2 w^2)))

Shifted sines of one frequency span only ``{sin, cos}``: their stable rank is at most 2,
which is the paper's example of an embedding that preserves distance but cannot
represent much.

For ``P > 1`` the shifted kinds embed each axis separately with ``dim / P`` centres and
concatenate; ``rff`` draws ``dim / 2`` joint frequencies in ``R^P``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from flt._checks import check_choice, check_positive_float, check_positive_int, check_tensor
from flt.posenc._common import check_abs_positions, compute_dtype

#: The basis functions of ``ShiftedBasisEncoding`` (``kind=``); ``rff`` is random Fourier features.
KINDS = ("gaussian", "triangle", "square", "impulse", "sine", "rff")


class ShiftedBasisEmbedding(nn.Module):
    """Fixed (parameter-free) shifted basis embedding ``psi``; see the module docstring.

    Args:
        dim: number of basis functions ``D`` in total (``dim / P`` per axis for the
            shifted kinds; ``dim`` must be even for ``rff``).
        pos_dim: ``P``.
        kind: one of ``KINDS``.
        width: the kind's scale (see the table); ``None`` picks the default; must be
            ``None`` for ``impulse``.
        domain: ``(a, b)`` with ``a < b``, the coordinate range the centres cover. Inputs
            outside it are allowed (they are simply far from every centre).
        generator: random source for the ``rff`` frequencies (drawn once, in float64 on
            the CPU, stored as a buffer).
        dtype: output dtype and ``rff`` buffer dtype; ``None`` returns the positions'
            dtype. Values are always computed in float32 or better.

    Shapes: ``forward(pos [B, N, P]) -> [B, N, dim]``.
    """

    def __init__(
        self,
        dim: int,
        pos_dim: int = 1,
        *,
        kind: str = "gaussian",
        width: float | None = None,
        domain: Sequence[float] = (0.0, 1.0),
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("pos_dim", pos_dim)
        check_choice("kind", kind, KINDS)
        if len(domain) != 2 or not all(math.isfinite(float(v)) for v in domain) or not float(domain[0]) < float(domain[1]):
            raise ValueError(f"domain must be (a, b) with finite a < b, got {domain!r}")
        self.dim, self.pos_dim, self.kind = dim, pos_dim, kind
        self.domain = (float(domain[0]), float(domain[1]))
        self.out_dtype = dtype
        length = self.domain[1] - self.domain[0]
        if kind == "rff":
            if dim % 2 != 0:
                raise ValueError(f"dim must be even for kind='rff' (cos and sin of dim/2 frequencies), got {dim}")
            self.num_centres = 0
            spacing = length / (dim // 2)
        else:
            if dim % pos_dim != 0:
                raise ValueError(f"dim = {dim} must be divisible by pos_dim = {pos_dim} (dim / P centres per axis)")
            self.num_centres = dim // pos_dim
            spacing = length / self.num_centres
        if kind == "impulse":
            if width is not None:
                raise ValueError("width must be None for kind='impulse' (a one-hot of the nearest centre)")
            self.width = None
        elif width is None:
            self.width = length if kind == "sine" else spacing
        else:
            self.width = check_positive_float("width", width)
        if kind == "rff":
            # Standard normal draws scaled by 1/(2 pi w): E[cos(2 pi xi (x - y))] = exp(-(x-y)^2/(2 w^2)).
            assert self.width is not None  # set above for every kind but impulse
            eps = torch.randn(dim // 2, pos_dim, generator=generator, dtype=torch.float64)
            freqs = eps / (2.0 * math.pi * self.width)
            self.register_buffer("freqs", freqs.to(device=device, dtype=dtype or torch.get_default_dtype()))
        else:
            self.freqs = None

    def centres(self, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The ``dim / P`` centres ``t_d`` of one axis: ``[D_axis]`` (empty for ``rff``)."""
        a, b = self.domain
        h = (b - a) / max(self.num_centres, 1)
        return a + (torch.arange(self.num_centres, device=device, dtype=dtype) + 0.5) * h

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        check_abs_positions("pos", pos, self.pos_dim)
        out_dtype = self.out_dtype or pos.dtype
        if self.kind == "rff":
            freqs = self.freqs
            assert freqs is not None  # a buffer for kind="rff"
            cdt = compute_dtype(pos, freqs)
            phase = 2.0 * math.pi * (pos.to(cdt) @ freqs.to(cdt).T)  # [B, N, dim/2]
            out = torch.cat((phase.cos(), phase.sin()), dim=-1) / math.sqrt(self.dim // 2)
            return out.to(out_dtype)
        cdt = compute_dtype(pos)
        u = pos.to(cdt).unsqueeze(-1) - self.centres(device=pos.device, dtype=cdt)  # [B, N, P, D_axis]
        phi = _BASIS[self.kind](u, self.width)
        return rearrange(phi, "b n p d -> b n (p d)").to(out_dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, pos_dim={self.pos_dim}, kind={self.kind!r}, width={self.width}, domain={self.domain}"


def _impulse(u: torch.Tensor, _width: object) -> torch.Tensor:
    nearest = u.abs().argmin(dim=-1)
    return F.one_hot(nearest, u.shape[-1]).to(u.dtype)


# Each basis takes the offsets ``u`` and the width (a float; None for "impulse", which has none).
_BASIS: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "gaussian": lambda u, w: torch.exp(-0.5 * (u / w) ** 2),
    "triangle": lambda u, w: torch.clamp(1.0 - u.abs() / w, min=0.0),
    "square": lambda u, w: (u.abs() <= w).to(u.dtype),
    "impulse": _impulse,
    "sine": lambda u, w: torch.sin(2.0 * math.pi * u / w),
}


def embedding_matrix(
    embed: Callable[[torch.Tensor], torch.Tensor], num_points: int, domain: Sequence[float] | None = None
) -> torch.Tensor:
    """``Psi [num_points, D]``: a 1-D embedding evaluated on ``num_points`` equispaced
    points covering ``domain`` (endpoints included), in float64.

    ``embed`` maps positions ``[1, n, 1]`` to ``[1, n, D]``; ``domain`` defaults to
    ``embed.domain``.
    """
    check_positive_int("num_points", num_points)
    a, b = _domain_of(embed, domain)
    x = torch.linspace(a, b, num_points, dtype=torch.float64)
    return embed(x.reshape(1, -1, 1))[0].to(torch.float64)


def stable_rank(psi: torch.Tensor) -> float:
    """Stable rank ``|Psi|_F^2 / |Psi|_2^2`` of a matrix ``[n, D]`` (computed in float64).

    Always in ``[1, rank(Psi)]``; a smooth surrogate for the rank.
    """
    check_tensor("psi", psi, ndim=2, layout="[n, D]")
    psi = psi.to(torch.float64)
    # |Psi|_2^2 is the top eigenvalue of the smaller Gram matrix: much cheaper than an SVD
    # of a tall sample matrix, and exact enough in float64 for the top eigenvalue.
    gram = psi.T @ psi if psi.shape[0] >= psi.shape[1] else psi @ psi.T
    top = torch.linalg.eigvalsh(gram)[-1]
    if not bool(top > 0):
        raise ValueError("psi is the zero matrix; its stable rank is undefined")
    return float(psi.pow(2).sum() / top)


def distance_preservation(
    embed: Callable[[torch.Tensor], torch.Tensor],
    *,
    num_points: int = 4001,
    threshold: float = 0.1,
    reference: float | None = None,
    domain: Sequence[float] | None = None,
) -> float:
    """How far apart two coordinates can be while their embeddings stay similar.

    Definition: with the normalised similarity
    ``s(x) = <psi(x0), psi(x)> / (|psi(x0)| |psi(x)|)`` (taken as 0 where a norm is 0),
    walk from the reference point ``x0`` (default: the middle of the domain) to the right
    and to the left on a grid of ``num_points`` equispaced points covering the domain, and
    find on each side the first distance ``delta`` at which ``s`` drops to ``threshold``
    or below (linearly interpolated between grid points). The result is the mean of the
    two one-sided distances divided by the domain length ``b - a``: a half-width in units
    of the domain. If ``s`` never drops to the threshold on a side, the distance to that
    edge is used, so the value is then a lower bound.

    For the Gaussian basis with dense centres, ``s(x0 + delta) = exp(-delta^2/(4 sigma^2))``,
    so the result is ``2 sigma sqrt(ln 10) / (b - a)``; with the stable rank of the
    dense sample matrix, ``(b - a) / (2 sigma sqrt(pi))``, the product is
    ``sqrt(ln 10 / pi) = 0.856`` independent of ``sigma``.
    """
    check_positive_int("num_points", num_points)
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must lie in (0, 1), got {threshold!r}")
    a, b = _domain_of(embed, domain)
    x0 = 0.5 * (a + b) if reference is None else float(reference)
    if not a <= x0 <= b:
        raise ValueError(f"reference = {reference!r} must lie in the domain [{a}, {b}]")
    left = torch.linspace(a, x0, max(2, round(num_points * (x0 - a) / (b - a))), dtype=torch.float64).flip(0)
    right = torch.linspace(x0, b, max(2, round(num_points * (b - x0) / (b - a))), dtype=torch.float64)
    ref = embed(torch.tensor([[[x0]]], dtype=torch.float64))[0, 0].to(torch.float64)
    widths = []
    for side in (right, left):
        psi = embed(side.reshape(1, -1, 1))[0].to(torch.float64)
        norms = psi.norm(dim=-1) * ref.norm()
        sim = torch.where(norms > 0, psi @ ref / torch.where(norms > 0, norms, 1.0), 0.0)
        dist = (side - x0).abs()
        below = torch.nonzero(sim <= threshold)
        if below.numel() == 0:
            widths.append(float(dist[-1]))
            continue
        k = int(below[0])
        if k == 0:
            widths.append(0.0)
            continue
        # Linear interpolation of the crossing between grid points k-1 and k.
        s0, s1 = float(sim[k - 1]), float(sim[k])
        frac = (s0 - threshold) / (s0 - s1)
        widths.append(float(dist[k - 1] + frac * (dist[k] - dist[k - 1])))
    return 0.5 * (widths[0] + widths[1]) / (b - a)


def _domain_of(embed: Callable[[torch.Tensor], torch.Tensor], domain: Sequence[float] | None) -> tuple[float, float]:
    if domain is None:
        domain = getattr(embed, "domain", None)
        if domain is None:
            raise ValueError("domain is required when embed has no .domain attribute")
    a, b = float(domain[0]), float(domain[1])
    if not a < b:
        raise ValueError(f"domain must be (a, b) with a < b, got {domain!r}")
    return a, b
