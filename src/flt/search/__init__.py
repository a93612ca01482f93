"""Architecture search per layer: which attention mechanism should each layer use?

A supernet replaces every block's attention by a mixed op over named candidates
(:mod:`flt.search.mixed`), trains its weights on the training split and its architecture
weights on a held-out part of it (:mod:`flt.search.holdout`), then decides the layers one
at a time by perturbation: the candidate whose removal hurts the held-out metric most is
kept (:mod:`flt.search.select`), with the magnitude choice (``argmax alpha``) recorded
alongside. :func:`search` runs it (``flt search``); the result, ``search.json``, gives
``flt train --arch`` its per-layer mechanisms (:func:`arch_layers`). The model's absolute
positional encoding can be one more slot (``posenc_candidates``, a :class:`MixedEncoding`;
:func:`arch_posenc`, :func:`arch_fields`).
"""

from flt.search.arch import arch_fields, arch_layers, arch_posenc, read_search
from flt.search.config import SearchConfig
from flt.search.mixed import (
    Candidate,
    EncodingCandidate,
    MixedAttention,
    MixedEncoding,
    MixedOp,
    build_supernet,
    check_candidates,
    check_posenc_candidates,
    encoding_slot,
    mixed_slots,
    parse_candidates,
    parse_posenc_candidates,
)
from flt.search.run import SearchInterrupted, check_search, search
from flt.search.select import magnitude_choice, perturbation_choice, removal_metrics, select_slot

__all__ = [
    "Candidate",
    "EncodingCandidate",
    "MixedAttention",
    "MixedEncoding",
    "MixedOp",
    "SearchConfig",
    "SearchInterrupted",
    "arch_fields",
    "arch_layers",
    "arch_posenc",
    "build_supernet",
    "check_candidates",
    "check_posenc_candidates",
    "check_search",
    "encoding_slot",
    "magnitude_choice",
    "mixed_slots",
    "parse_candidates",
    "parse_posenc_candidates",
    "perturbation_choice",
    "read_search",
    "removal_metrics",
    "search",
    "select_slot",
]
