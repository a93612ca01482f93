"""Relative positional terms behind one interface (:class:`RelativeTerm`) and one registry.

:data:`RELATIVE` (in :mod:`flt.relative.registry`) maps a name to a term class: the
learned offset tables (``"t5"``, ``"clipped"``), ``"alibi"``, the hop-distance table of
graphs (``"spd"``, over anchor-distance or distance-matrix positions), and every spectrum of
:data:`flt.spectra.SPECTRA` under its own name (the terms FLT can estimate in linear
time). :func:`build_relative` builds one with the arguments a layer knows (heads, position
dimension, causality). docs/extending.md says how to add one.
"""

from flt.relative.base import RelativeTerm, pair_positions

__all__ = ["RELATIVE", "RelativeTerm", "build_relative", "pair_positions"]


def __getattr__(name: str):
    # The registry imports the terms (tables, ALiBi, spectra), which import this package's
    # base: loaded on first use so that either side can be imported first.
    if name in ("RELATIVE", "build_relative"):
        from flt.relative import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'flt.relative' has no attribute {name!r}")
