"""Alias of :mod:`flt.relative.spectra`, where the spectral families now live with the
other relative terms: ``from flt.spectra import SPECTRA`` keeps working. New code imports
``flt.relative.spectra`` (the submodules, e.g. ``flt.relative.spectra.kernels``, are only
there)."""

from flt.relative.spectra import *  # noqa: F403  (the alias exports exactly what the package does)
from flt.relative.spectra import __all__ as __all__
