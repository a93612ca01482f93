"""Deprecated alias of :mod:`flt.baselines.particles`, the module's home in the lab since it
moved out of the library: ``from flt.models.particles import ...`` still works but warns
(``DeprecationWarning``); the alias is removed in 0.3.0. Import ``flt.baselines.particles``."""

import warnings

from flt.baselines.particles import (
    PARTICLE_ENCODERS,
    PARTICLE_MODELS,
    ParticleConfig,
    ParticleRegressor,
    ParticleSchNet,
    check_particles,
    cloud_radius_graph,
    particle_model,
)

__all__ = [
    "PARTICLE_ENCODERS",
    "PARTICLE_MODELS",
    "ParticleConfig",
    "ParticleRegressor",
    "ParticleSchNet",
    "check_particles",
    "cloud_radius_graph",
    "particle_model",
]

warnings.warn("flt.models.particles moved to flt.baselines.particles and is removed in 0.3.0; "
              "import flt.baselines.particles instead", DeprecationWarning, stacklevel=2)
