"""Relative positional terms: one package, one interface (:class:`RelativeTerm`), one registry.

:data:`RELATIVE` (in :mod:`flt.relative.registry`) maps a name to a term class: the
learned offset tables (``"t5"``, ``"clipped"``, :mod:`flt.relative.tables`), ``"alibi"``
(:mod:`flt.relative.alibi`), the hop-distance table of graphs (``"spd"``,
:mod:`flt.relative.shortest_path`, over anchor-distance or distance-matrix positions), and
every spectrum of :data:`SPECTRA` (:mod:`flt.relative.spectra`) under its own name (the
terms FLT can estimate in linear time). :func:`build_relative` builds one with the
arguments a layer knows (heads, position dimension, causality). docs/extending.md says how
to add one.
"""

from flt.relative.alibi import AlibiBias, alibi_bias, alibi_slopes
from flt.relative.base import RelativeTerm, pair_positions
from flt.relative.registry import RELATIVE, build_relative
from flt.relative.shortest_path import ShortestPathBias, hop_positions
from flt.relative.spectra import SPECTRA, Spectrum
from flt.relative.tables import (
    ClippedBias,
    RelativeBiasTable,
    T5Bias,
    clipped_relative_indices,
    t5_relative_buckets,
)

__all__ = [
    "RELATIVE",
    "SPECTRA",
    "AlibiBias",
    "ClippedBias",
    "RelativeBiasTable",
    "RelativeTerm",
    "ShortestPathBias",
    "Spectrum",
    "T5Bias",
    "alibi_bias",
    "alibi_slopes",
    "build_relative",
    "clipped_relative_indices",
    "hop_positions",
    "pair_positions",
    "t5_relative_buckets",
]
