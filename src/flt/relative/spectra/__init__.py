"""Spectral families ``g`` whose Fourier transforms are the learned RPE masks ``f``.

``SPECTRA`` maps a name to a class constructed as
``SPECTRA[name](heads=H, pos_dim=P, num_frequencies=R, **options)``; every family takes
an ``amplitude`` option (the initial ``f(0)``; ``0`` gives ``f == 0``).
"""

from flt.relative.spectra.base import Spectrum
from flt.relative.spectra.discrete import DiscreteSpectrum
from flt.relative.spectra.gaussian_mixture import GaussianMixtureSpectrum
from flt.relative.spectra.kernels import MATERN_NU, GaussianKernelSpectrum, MaternSpectrum
from flt.relative.spectra.local import LocalSpectrum
from flt.relative.spectra.neural import NeuralSpectrum
from flt.relative.spectra.radial import RadialSpectrum
from flt.relative.spectra.sampling import SAMPLERS, standard_normal_draws

#: The spectral families ``g`` by name: each gives its exact ``f`` and the random-feature
#: factorisation ``f(r_i - r_j) ~ a(r_i) . c(r_j)`` FLT uses.
SPECTRA: dict[str, type[Spectrum]] = {
    "gaussian_mixture": GaussianMixtureSpectrum,
    "gaussian": GaussianKernelSpectrum,
    "matern": MaternSpectrum,
    "local": LocalSpectrum,
    "neural": NeuralSpectrum,
    "discrete": DiscreteSpectrum,
    "radial": RadialSpectrum,
}

__all__ = [
    "MATERN_NU",
    "SAMPLERS",
    "SPECTRA",
    "DiscreteSpectrum",
    "GaussianKernelSpectrum",
    "GaussianMixtureSpectrum",
    "LocalSpectrum",
    "MaternSpectrum",
    "NeuralSpectrum",
    "RadialSpectrum",
    "Spectrum",
    "standard_normal_draws",
]
