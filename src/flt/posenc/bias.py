"""Deprecated alias of the relative bias tables and ALiBi, which now live in
:mod:`flt.relative` (:mod:`flt.relative.tables`, :mod:`flt.relative.alibi`): ``from
flt.posenc.bias import alibi_bias`` still works but warns (``DeprecationWarning``); the alias
is removed in 0.3.0. Import them from ``flt.relative``."""

import warnings

from flt.relative.alibi import AlibiBias, alibi_bias, alibi_slopes
from flt.relative.tables import (
    DEFAULT_TABLE_SCALE,
    ClippedBias,
    RelativeBiasTable,
    T5Bias,
    clipped_relative_indices,
    t5_relative_buckets,
)

__all__ = [
    "DEFAULT_TABLE_SCALE",
    "AlibiBias",
    "ClippedBias",
    "RelativeBiasTable",
    "T5Bias",
    "alibi_bias",
    "alibi_slopes",
    "clipped_relative_indices",
    "t5_relative_buckets",
]

warnings.warn("flt.posenc.bias is deprecated and is removed in 0.3.0; import flt.relative (flt.relative.tables, "
              "flt.relative.alibi) instead", DeprecationWarning, stacklevel=2)
