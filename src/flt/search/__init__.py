"""Architecture search per layer: which attention mechanism should each layer use?

A supernet replaces every block's attention by a mixed op over named candidates
(:mod:`flt.search.mixed`), trains its weights on the training split and its architecture
weights on a held-out part of it (:mod:`flt.search.holdout`), then decides the layers one
at a time by perturbation: the candidate whose removal hurts the held-out metric most is
kept (:mod:`flt.search.select`), with the magnitude choice (``argmax alpha``) recorded
alongside. :func:`search` runs it (``flt search``); the result, ``search.json``, gives
``flt train --arch`` its per-layer mechanisms (:func:`arch_layers`).
"""

from flt.search.arch import arch_layers, read_search
from flt.search.mixed import Candidate, MixedAttention, build_supernet, check_candidates, mixed_slots, parse_candidates
from flt.search.run import SearchConfig, SearchInterrupted, check_search, search
from flt.search.select import magnitude_choice, perturbation_choice, removal_metrics, select_slot

__all__ = [
    "Candidate",
    "MixedAttention",
    "SearchConfig",
    "SearchInterrupted",
    "arch_layers",
    "build_supernet",
    "check_candidates",
    "check_search",
    "magnitude_choice",
    "mixed_slots",
    "parse_candidates",
    "perturbation_choice",
    "read_search",
    "removal_metrics",
    "search",
    "select_slot",
]
