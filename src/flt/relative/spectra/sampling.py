"""Base draws for frequency sampling: iid, quasi-Monte Carlo (Sobol) and orthogonal.

Every spectrum turns fixed standard-normal draws ``eps`` into frequencies by a
reparameterisation ``xi = T_theta(eps)``, so gradients reach the spectrum's parameters
while the randomness stays a fixed buffer (docs/math.md section 3). A spectrum asks for
``dim = P + extra`` normals per frequency: the first ``P`` become the frequency
direction, the ``extra`` ones feed auxiliary variables (e.g. the chi-square of a
Matern spectrum is a sum of ``2 nu`` squared normals).
"""

from __future__ import annotations

import torch

from flt._checks import check_choice, check_positive_int
from flt.ops.features import gaussian_orthogonal_random_matrix

SAMPLERS = ("iid", "qmc", "orthogonal")

# Sobol points are mapped through the inverse normal CDF; clamping keeps the tails finite.
_UNIT_EPS = 1e-7


def standard_normal_draws(
    sets: int,
    count: int,
    dim: int,
    *,
    method: str = "iid",
    spatial_dim: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw ``[sets, count, dim]`` standard normals, float64, on the CPU.

    Args:
        sets: independent sets (one per head).
        count: draws per set (number of frequencies ``R``).
        dim: normals per draw.
        method: ``"iid"``; ``"qmc"``: scrambled Sobol points through the inverse normal
            CDF (lower error at equal ``count``); ``"orthogonal"``: the first
            ``spatial_dim`` coordinates come in blocks of mutually orthogonal vectors
            with chi-distributed norms (each row still marginally N(0, I)); other
            coordinates iid.
        spatial_dim: coordinates that ``"orthogonal"`` treats as a direction (default ``dim``).
        generator: a seeded generator for reproducible draws.
    """
    check_positive_int("sets", sets)
    check_positive_int("count", count)
    check_positive_int("dim", dim)
    check_choice("sampler", method, SAMPLERS)
    if method == "iid":
        return torch.randn(sets, count, dim, generator=generator, dtype=torch.float64)
    if method == "qmc":
        out = []
        for _ in range(sets):
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
            engine = torch.quasirandom.SobolEngine(dim, scramble=True, seed=seed)
            u = engine.draw(count, dtype=torch.float64).clamp(_UNIT_EPS, 1 - _UNIT_EPS)
            out.append(torch.special.ndtri(u))
        return torch.stack(out)
    spatial = dim if spatial_dim is None else spatial_dim
    draws = torch.randn(sets, count, dim, generator=generator, dtype=torch.float64)
    for h in range(sets):
        draws[h, :, :spatial] = gaussian_orthogonal_random_matrix(
            count, spatial, orthogonal=True, generator=generator, dtype=torch.float64
        )
    return draws
