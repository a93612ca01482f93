"""Layers: modules that own parameters and buffers and call :mod:`flt.ops`."""

from flt.layers.base import AttentionBase, QKScaling
from flt.layers.features import FEATURE_MAPS, FeatureMap
from flt.layers.flt import COUPLINGS, FLTAttention
from flt.layers.kernel import DecodeState, KernelAttention
from flt.layers.performer import PerformerAttention
from flt.layers.registry import ATTENTION
from flt.layers.softmax import RELATIVE_BIASES, SoftmaxAttention
from flt.layers.toeplitz import ToeplitzAttention

__all__ = [
    "ATTENTION",
    "COUPLINGS",
    "FEATURE_MAPS",
    "RELATIVE_BIASES",
    "AttentionBase",
    "DecodeState",
    "FLTAttention",
    "FeatureMap",
    "KernelAttention",
    "PerformerAttention",
    "QKScaling",
    "SoftmaxAttention",
    "ToeplitzAttention",
]
