"""Alias of :mod:`flt.relative.spectra`, where the spectral families now live with the
other relative terms: ``from flt.spectra import SPECTRA`` keeps working. New code imports
``flt.relative.spectra`` (the submodules, e.g. ``flt.relative.spectra.kernels``, are only
there)."""

from flt.relative.spectra import (
    MATERN_NU,
    SAMPLERS,
    SPECTRA,
    GaussianKernelSpectrum,
    GaussianMixtureSpectrum,
    LocalSpectrum,
    MaternSpectrum,
    NeuralSpectrum,
    Spectrum,
    standard_normal_draws,
)

__all__ = [
    "MATERN_NU",
    "SAMPLERS",
    "SPECTRA",
    "GaussianKernelSpectrum",
    "GaussianMixtureSpectrum",
    "LocalSpectrum",
    "MaternSpectrum",
    "NeuralSpectrum",
    "Spectrum",
    "standard_normal_draws",
]
