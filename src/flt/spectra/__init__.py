"""Spectral families ``g`` whose Fourier transforms are the learned RPE masks ``f``.

``SPECTRA`` maps a name to a class constructed as
``SPECTRA[name](heads=H, pos_dim=P, num_frequencies=R, **options)``.
"""

from flt.spectra.base import Spectrum
from flt.spectra.gaussian_mixture import GaussianMixtureSpectrum
from flt.spectra.sampling import SAMPLERS, standard_normal_draws

SPECTRA: dict[str, type[Spectrum]] = {
    "gaussian_mixture": GaussianMixtureSpectrum,
}

__all__ = ["SAMPLERS", "SPECTRA", "GaussianMixtureSpectrum", "Spectrum", "standard_normal_draws"]
