"""Models for the three tasks, each taking any :data:`flt.ATTENTION` mechanism and any
:data:`flt.posenc.POSENC` encoding by name.

``MODELS[task]`` is the model class; ``build_model(config)`` builds it from its frozen
config (:mod:`flt.models.config`).
"""

from __future__ import annotations

import dataclasses

from flt.models.block import Block, Trunk, build_attention, build_posenc
from flt.models.config import (
    CONFIGS,
    ImageConfig,
    LMConfig,
    MoleculeConfig,
    config_from_dict,
    config_to_dict,
    replace_fields,
)
from flt.models.lm import CausalLM, LMState, sample_next
from flt.models.molecule import RADIAL_SPECTRA, MoleculeRegressor, tie_isotropic
from flt.models.vit import ViTClassifier

#: Model class per task; the constructor's keyword arguments are its config's fields.
MODELS: dict[str, type] = {"lm": CausalLM, "image": ViTClassifier, "molecule": MoleculeRegressor}


def build_model(config, *, device=None, dtype=None):
    """Build the model of ``config``'s task; the config's fields become constructor arguments.

    The option dicts are copied, so the model never holds (or mutates) the config's own.
    """
    if type(config) not in CONFIGS.values():
        raise TypeError(f"expected one of {[c.__name__ for c in CONFIGS.values()]}, got {type(config).__name__}")
    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    kwargs = {k: dict(v) if isinstance(v, dict) else v for k, v in kwargs.items()}
    return MODELS[config.task](**kwargs, device=device, dtype=dtype)


__all__ = [
    "CONFIGS",
    "MODELS",
    "RADIAL_SPECTRA",
    "Block",
    "CausalLM",
    "ImageConfig",
    "LMConfig",
    "LMState",
    "MoleculeConfig",
    "MoleculeRegressor",
    "Trunk",
    "ViTClassifier",
    "build_attention",
    "build_model",
    "build_posenc",
    "config_from_dict",
    "config_to_dict",
    "replace_fields",
    "sample_next",
    "tie_isotropic",
]
