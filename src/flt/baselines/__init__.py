"""The lab's models for the 3-D tasks: torch_geometric's message-passing baselines, the
long-range block on them, and the configs that choose between them and the library's
transformers.

The library (:mod:`flt.models`) holds the transformers every task can build
(:class:`flt.models.MoleculeRegressor`, ...); this package holds what the ``qm9``,
``nbody`` and ``separation`` tasks compare them with, and imports the library, never the
other way round:

* :mod:`~flt.baselines.qm9`: :class:`~flt.baselines.qm9.QM9Config` and
  :class:`~flt.baselines.qm9.QM9Regressor` (the molecule regressor, SchNet or DimeNet++,
  each with or without the long-range block).
* :mod:`~flt.baselines.particles`: :class:`~flt.baselines.particles.ParticleConfig`,
  the per-particle transformer and SchNet, and
  :func:`~flt.baselines.particles.particle_model`.
* :mod:`~flt.baselines.dimenet`: PyG's DimeNet++ on graphs computed in plain torch.
* :mod:`~flt.baselines.atom_graphs`: those graphs (radius graph, angle triplets).
* :mod:`~flt.baselines.longrange`: :class:`flt.layers.LongRangeBlock` wrapped around an
  existing model's own modules (the ``+lr`` encoders).

Only :mod:`~flt.baselines.dimenet` imports torch_geometric when imported; the other modules
import it when a model that needs it is built (install the qm9 extra). Up to 0.2.0 these
modules were ``flt.models.qm9``, ``flt.models.particles``, ...; those paths are aliases
that warn and are removed in 0.3.0.
"""
