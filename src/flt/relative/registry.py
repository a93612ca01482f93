"""The registry of relative positional terms: one line per term.

``RELATIVE[name]`` is a :class:`flt.relative.RelativeTerm` subclass whose constructor takes
``heads`` first and, as keywords, ``pos_dim``, ``device``, ``dtype`` and (if it cares)
``causal``, then its own options. Adding a term: one file with the class, one line here;
the tests in ``tests/library/test_relative.py`` are parametrised from this dict.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from flt._checks import check_choice
from flt.relative.alibi import AlibiBias
from flt.relative.base import RelativeTerm
from flt.relative.shortest_path import ShortestPathBias
from flt.relative.spectra import SPECTRA
from flt.relative.tables import ClippedBias, T5Bias

#: Every relative term by name, one interface (``bias(pos_q, pos_k)``): the tables, ALiBi,
#: graph shortest paths and every spectrum of ``SPECTRA``.
RELATIVE: dict[str, type[RelativeTerm]] = {
    "t5": T5Bias,
    "clipped": ClippedBias,
    "alibi": AlibiBias,
    "spd": ShortestPathBias,
    **SPECTRA,
}


def build_relative(name: str, *, heads: int, pos_dim: int = 1, causal: bool = False, device: torch.device | str | None = None, dtype: torch.dtype | None = None, **options: Any) -> RelativeTerm:
    """``RELATIVE[name]`` built for a layer with ``heads`` heads on ``pos_dim``-dimensional
    positions; ``causal`` reaches the terms that take it (the tables keep one side)."""
    check_choice("relative term", name, RELATIVE)
    cls = RELATIVE[name]
    if "causal" in inspect.signature(cls.__init__).parameters:
        options["causal"] = causal
    return cls(heads, pos_dim=pos_dim, device=device, dtype=dtype, **options)
