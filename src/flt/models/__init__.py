"""Models for the built-in tasks, each taking any :data:`flt.ATTENTION` mechanism and any
:data:`flt.posenc.POSENC` encoding by name.

``MODELS[type(config)]`` is the model class of a config of this package;
``build_model(config)`` builds it from its frozen config (:mod:`flt.models.config`). Tasks
name their config and model class in their own file (:mod:`flt.tasks`); a task with a
model of its own does not need to be listed here. :class:`TokenModel` is the model over
token sequences that tasks with a config of their own share (``listops``, ``offsets``),
with the head and causality they choose. The models the 3-D tasks compare these with
(torch_geometric's SchNet and DimeNet++, the long-range block on models) are the lab's,
:mod:`flt.baselines`; ``flt.models.qm9`` and its siblings are deprecated aliases of them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from flt.models.block import Block, Trunk, build_attention, build_posenc
from flt.models.config import (
    ImageConfig,
    LMConfig,
    MoleculeConfig,
    config_from_fields,
    replace_fields,
)
from flt.models.lm import CausalLM, LMState, sample_next
from flt.models.molecule import RADIAL_SPECTRA, MoleculeRegressor, tie_isotropic
from flt.models.token import TOKEN_HEADS, TokenModel
from flt.models.vit import ViTClassifier

#: Model class per config class; the constructor's keyword arguments are the config's fields.
MODELS: dict[type, type] = {LMConfig: CausalLM, ImageConfig: ViTClassifier, MoleculeConfig: MoleculeRegressor}


def config_kwargs(config: Any) -> dict:
    """A config's fields as constructor arguments; the option dicts are copied, so the model
    never holds (or mutates) the config's own (a copy of checked options stays checked,
    :class:`flt.options.CheckedOptions`)."""
    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {k: copy.copy(v) if isinstance(v, dict) else v for k, v in kwargs.items()}


def build_model(config: Any, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Build the model of ``config`` (a config class of :data:`MODELS`); the config's fields become
    constructor arguments (:func:`config_kwargs`)."""
    if type(config) not in MODELS:
        raise TypeError(f"expected one of {[c.__name__ for c in MODELS]}, got {type(config).__name__}")
    return MODELS[type(config)](**config_kwargs(config), device=device, dtype=dtype)


__all__ = [
    "MODELS",
    "RADIAL_SPECTRA",
    "TOKEN_HEADS",
    "Block",
    "CausalLM",
    "ImageConfig",
    "LMConfig",
    "LMState",
    "MoleculeConfig",
    "MoleculeRegressor",
    "TokenModel",
    "Trunk",
    "ViTClassifier",
    "build_attention",
    "build_model",
    "build_posenc",
    "config_from_fields",
    "config_kwargs",
    "replace_fields",
    "sample_next",
    "tie_isotropic",
]
