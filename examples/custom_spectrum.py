"""A new relative term for FLT: a spectrum written, registered and used from the command line.

FLT estimates a relative mask ``f(r_i - r_j)`` from random frequencies of its spectrum ``g``
(the Fourier transform of ``f``). A family of spectra is a ``flt.relative.Spectrum`` with
three methods: ``mask`` (the exact ``f``), ``density`` (``g``) and ``frequencies`` (the
frequencies and weights, differentiable in the parameters). This one is the Cauchy mask

    f(Delta) = a prod_p 1 / (1 + (Delta_p / l_p)^2),   g(xi) = a prod_p pi l_p exp(-2 pi l_p |xi_p|),

heavy-tailed in position (a slow decay with distance) and Laplace-distributed in frequency.
A Laplace draw is a normal times ``sqrt(z1^2 + z2^2)`` of two more normals, so the spectrum
asks the base class for ``2 P`` extra normals per frequency (QMC and orthogonal samplers
then apply to them too).

    python examples/custom_spectrum.py --smoke      # checks the estimate, trains the lm smoke preset with it
"""

from __future__ import annotations

import argparse
import math
import tempfile

import torch
from torch import nn
from torch.nn import functional as F

from flt import cli
from flt.relative import RELATIVE, SPECTRA, Spectrum


class CauchySpectrum(Spectrum):
    """Cauchy relative mask ``f(Delta) = a prod_p 1 / (1 + (Delta_p / l_p)^2)`` (module docstring)."""

    def __init__(self, heads: int, pos_dim: int, num_frequencies: int, *, amplitude: float = 1.0,
                 length_scale: float = 8.0, **kwargs):
        self.extra_normals = 2 * pos_dim  # read by the base class when it draws eps [H, R, P + extra]
        super().__init__(heads, pos_dim, num_frequencies, **kwargs)
        if not length_scale > 0:
            raise ValueError(f"length_scale must be positive, got {length_scale!r}")
        self.amplitude = nn.Parameter(torch.full((heads,), float(amplitude)))
        # l = softplus(raw) stays positive while it learns.
        raw = math.log(math.expm1(length_scale))
        self.raw_length = nn.Parameter(torch.full((heads, pos_dim), raw))

    def lengths(self, dtype=None):
        return F.softplus(self.raw_length if dtype is None else self.raw_length.to(dtype))

    def mask(self, delta):  # [..., P] -> [..., H]
        d = delta.unsqueeze(-2) / self.lengths(delta.dtype)  # [..., H, P]
        return self.amplitude.to(delta.dtype) * (1 / (1 + d * d)).prod(-1)

    def density(self, xi):  # [..., P] -> [..., H]
        ell = self.lengths(xi.dtype)
        g = math.pi * ell * torch.exp(-2 * math.pi * ell * xi.unsqueeze(-2).abs())
        return self.amplitude.to(xi.dtype) * g.prod(-1)

    def frequencies(self, dtype=None):  # (xi [H, R, P], w [H, R])
        P, R = self.pos_dim, self.num_frequencies
        eps = self.eps if dtype is None else self.eps.to(dtype)
        z, u, v = eps[..., :P], eps[..., P : 2 * P], eps[..., 2 * P :]
        scale = 2 * math.pi * self.lengths(dtype).unsqueeze(-2)  # [H, 1, P]
        xi = z * torch.sqrt(u * u + v * v) / scale  # Laplace(0, 1 / (2 pi l)) per axis
        w = (self.amplitude if dtype is None else self.amplitude.to(dtype)) / R
        return xi, w.unsqueeze(-1).expand(self.heads, R)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the smoke preset (seconds)")
    args = parser.parse_args()

    # Registering is one line per registry: FLT reads spectra from SPECTRA, softmax's
    # relative_bias from RELATIVE. Every entry point built on them (the command line, the
    # option checks, FLTAttention.from_options) then knows "cauchy".
    SPECTRA["cauchy"] = RELATIVE["cauchy"] = CauchySpectrum

    # The estimate converges to the exact mask as R grows (error ~ 1 / sqrt(R)).
    delta = torch.linspace(-40, 40, 81, dtype=torch.float64).unsqueeze(-1)
    for R in (64, 4096):
        spectrum = CauchySpectrum(heads=2, pos_dim=1, num_frequencies=R, seed=0).double()
        error = (spectrum.estimate(delta) - spectrum.mask(delta)).abs().max().item()
        print(f"R = {R}: largest error of the estimated mask {error:.3f}")

    # The command line, in this process (a registry entry lives in the process that made it).
    preset = "smoke" if args.smoke else "small"
    with tempfile.TemporaryDirectory() as out:
        code = cli.main(["train", "lm", "--preset", preset, "--attention", "flt:spectrum=cauchy:length_scale=4",
                         "--out-dir", f"{out}/run", "--threads", "1", "--no-plots", "--no-progress"])
    raise SystemExit(code)


if __name__ == "__main__":
    main()
