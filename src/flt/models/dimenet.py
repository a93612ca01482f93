"""Deprecated alias of :mod:`flt.baselines.dimenet`, the module's home in the lab since it
moved out of the library: ``from flt.models.dimenet import ...`` still works but warns
(``DeprecationWarning``); the alias is removed in 0.3.0. Import ``flt.baselines.dimenet``."""

import warnings

from flt.baselines.dimenet import PlainDimeNetPlusPlus

__all__ = ["PlainDimeNetPlusPlus"]

warnings.warn("flt.models.dimenet moved to flt.baselines.dimenet and is removed in 0.3.0; "
              "import flt.baselines.dimenet instead", DeprecationWarning, stacklevel=2)
