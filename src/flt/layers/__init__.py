"""Layers: modules that own parameters and buffers and call :mod:`flt.ops`."""

from flt.layers.base import AttentionBase, QKScaling
from flt.layers.features import FEATURE_MAPS, FeatureMap
from flt.layers.flt import COUPLINGS, FLTAttention
from flt.layers.kernel import DecodeState, KernelAttention
from flt.layers.near import Band, Neighbors
from flt.layers.parts import (
    FEATURES,
    EluFeatures,
    FavorPlus,
    Features,
    Hedgehog,
    ReLUFeatures,
    Settings,
    TaylorFeatures,
    Term,
)
from flt.layers.performer import PerformerAttention
from flt.layers.registry import ATTENTION
from flt.layers.softmax import RELATIVE_BIASES, SoftmaxAttention
from flt.layers.toeplitz import ToeplitzAttention

__all__ = [
    "ATTENTION",
    "COUPLINGS",
    "FEATURES",
    "FEATURE_MAPS",
    "RELATIVE_BIASES",
    "AttentionBase",
    "Band",
    "DecodeState",
    "EluFeatures",
    "FLTAttention",
    "FavorPlus",
    "FeatureMap",
    "Features",
    "Hedgehog",
    "KernelAttention",
    "Neighbors",
    "PerformerAttention",
    "QKScaling",
    "ReLUFeatures",
    "Settings",
    "SoftmaxAttention",
    "TaylorFeatures",
    "Term",
    "ToeplitzAttention",
]
