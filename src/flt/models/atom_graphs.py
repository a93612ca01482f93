"""Deprecated alias of :mod:`flt.baselines.atom_graphs`, the module's home in the lab since it
moved out of the library: ``from flt.models.atom_graphs import ...`` still works but warns
(``DeprecationWarning``); the alias is removed in 0.3.0. Import ``flt.baselines.atom_graphs``."""

import warnings

from flt.baselines.atom_graphs import radius_graph, triplets

__all__ = [
    "radius_graph",
    "triplets",
]

warnings.warn("flt.models.atom_graphs moved to flt.baselines.atom_graphs and is removed in 0.3.0; "
              "import flt.baselines.atom_graphs instead", DeprecationWarning, stacklevel=2)
