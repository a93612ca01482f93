"""Layers: modules that own parameters and buffers and call :mod:`flt.ops`."""

from flt.layers.base import AttentionBase, QKScaling
from flt.layers.features import FEATURE_MAPS, FeatureMap
from flt.layers.flt import COUPLINGS, DecodeState, FLTAttention
from flt.layers.registry import ATTENTION

__all__ = ["ATTENTION", "COUPLINGS", "FEATURE_MAPS", "AttentionBase", "DecodeState", "FLTAttention", "FeatureMap", "QKScaling"]
