"""Deprecated alias of :mod:`flt.baselines.longrange`, the module's home in the lab since it
moved out of the library: ``from flt.models.longrange import ...`` still works but warns
(``DeprecationWarning``); the alias is removed in 0.3.0. Import ``flt.baselines.longrange``."""

import warnings

from flt.baselines.longrange import *  # noqa: F403  (the alias exports exactly what the module does)
from flt.baselines.longrange import __all__ as __all__

warnings.warn("flt.models.longrange moved to flt.baselines.longrange and is removed in 0.3.0; "
              "import flt.baselines.longrange instead", DeprecationWarning, stacklevel=2)
