"""Layers: modules that own parameters and buffers and call :mod:`flt.ops`.

Each attention layer is its projections plus a mechanism core (``layer.core``: :class:`FLTCore`,
:class:`PerformerCore`, :class:`ToeplitzCore`, :class:`SoftmaxCore`) that computes on queries,
keys and values. :class:`LongRangeBlock` is not attention: it adds a sum over all points
weighed by a learned kernel of their offsets (:mod:`flt.layers.longrange`)."""

from flt.layers.base import AttentionBase, CoreBase, QKScaling
from flt.layers.features import FEATURE_MAPS, FeatureMap
from flt.layers.flt import COUPLINGS, FLTAttention, FLTCore
from flt.layers.kernel import DecodeState, KernelAttention, KernelCore
from flt.layers.longrange import FREQUENCIES, LongRangeBlock
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
from flt.layers.performer import PerformerAttention, PerformerCore
from flt.layers.registry import ATTENTION
from flt.layers.softmax import RELATIVE_BIASES, SoftmaxAttention, SoftmaxCore
from flt.layers.toeplitz import ToeplitzAttention, ToeplitzCore

__all__ = [
    "ATTENTION",
    "COUPLINGS",
    "FEATURES",
    "FEATURE_MAPS",
    "FREQUENCIES",
    "RELATIVE_BIASES",
    "AttentionBase",
    "Band",
    "CoreBase",
    "DecodeState",
    "EluFeatures",
    "FLTAttention",
    "FLTCore",
    "FavorPlus",
    "FeatureMap",
    "Features",
    "Hedgehog",
    "KernelAttention",
    "KernelCore",
    "LongRangeBlock",
    "Neighbors",
    "PerformerAttention",
    "PerformerCore",
    "QKScaling",
    "ReLUFeatures",
    "Settings",
    "SoftmaxAttention",
    "SoftmaxCore",
    "TaylorFeatures",
    "Term",
    "ToeplitzAttention",
    "ToeplitzCore",
]
