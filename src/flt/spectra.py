"""Deprecated alias of :mod:`flt.relative.spectra`, where the spectral families now live with
the other relative terms: ``from flt.spectra import SPECTRA`` still works but warns
(``DeprecationWarning``); the alias is removed in 0.3.0. Import ``flt.relative.spectra``
(the submodules, e.g. ``flt.relative.spectra.kernels``, are only there)."""

import warnings

from flt.relative.spectra import *  # noqa: F403  (the alias exports exactly what the package does)
from flt.relative.spectra import __all__ as __all__

warnings.warn("flt.spectra is deprecated and is removed in 0.3.0; import flt.relative.spectra instead",
              DeprecationWarning, stacklevel=2)
