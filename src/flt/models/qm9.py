"""Deprecated alias of :mod:`flt.baselines.qm9`, the module's home in the lab since it
moved out of the library: ``from flt.models.qm9 import ...`` still works but warns
(``DeprecationWarning``); the alias is removed in 0.3.0. Import ``flt.baselines.qm9``."""

import warnings

from flt.baselines.atom_graphs import radius_graph, triplets
from flt.baselines.qm9 import BASES, CUTOFFS, ENCODERS, QM9Config, QM9Regressor

__all__ = [
    "BASES",
    "CUTOFFS",
    "ENCODERS",
    "QM9Config",
    "QM9Regressor",
    "radius_graph",
    "triplets",
]

warnings.warn("flt.models.qm9 moved to flt.baselines.qm9 and is removed in 0.3.0; "
              "import flt.baselines.qm9 instead", DeprecationWarning, stacklevel=2)
