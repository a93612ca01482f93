"""Which parts of an attention layer may be combined: every rule in one table.

A layer is its projections plus parts (:mod:`flt.layers.parts`: kernel features, a relative
term, a near set, a coupling, settings). Most parts check their own values; the rules here
are the ones that involve two of them, such as "a band needs the logit coupling". Each rule
names the part that owns it, and :func:`check_rules` is the one place that applies them, to
a :class:`Facts` record of the layer being built (by its constructor, or by its builder from
flat options before any part exists). The table's order is the order the rules are checked
in, so the first broken one is the one reported.

``tests/library/test_rules.py`` lists every rule with its message. To relax a rule, change its
``when``; the band's need for FAVOR+ is ``band_needs_favor`` (the
nearest-keys set takes any feature map: its near pairs keep the features' own kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The relative terms of :class:`flt.layers.softmax.SoftmaxAttention` whose options are
#: flat keywords of its builder; other entries of :data:`flt.relative.RELATIVE` take theirs
#: as ``relative_options``.
BUILT_IN = ("t5", "clipped", "alibi", "spectrum")


@dataclass(frozen=True)
class Facts:
    """What the rules look at, of one layer. Fields a layer does not have keep their
    defaults (a softmax layer has no ``features``, a Performer no ``coupling``)."""

    features: str | None = None  # kind of the kernel features: "favor+", "relu", ...
    coupling: str | None = None  # "logit" or "multiplicative"
    near_field: int = 0  # band half-width w; 0 = no band
    near_neighbors: int = 0  # k nearest keys; 0 = none
    near_term: Any = None  # the near set's term as given (None: the default)
    near_term_options: bool = False  # options were given for the near set's term
    far_field: bool | str = True
    causal: bool = False
    backend: str | None = None
    rope: bool = False
    head_dim: int = 0
    pos_dim: int = 1
    relative: Any = None  # a softmax layer's relative term: a name, "module" or None
    spectrum_term: bool = False  # the relative term is a spectrum (FLT's always is)
    spectrum_options: tuple[str, ...] = ()  # flat spectrum options given to a softmax builder
    flat_relative_options: bool = False  # a softmax builder got relative_options

    @property
    def near_set(self) -> bool:
        return bool(self.near_field or self.near_neighbors)


@dataclass(frozen=True)
class Rule:
    """A rule about two or more parts: broken when ``when(facts)``; ``message(facts)`` says
    why and what to do instead."""

    name: str
    owner: str  # the part the rule belongs to
    when: Callable[[Facts], bool]
    message: Callable[[Facts], str]
    error: type[Exception] = ValueError


def _zero_term(term: Any) -> bool:
    """Whether a near set's term, as given (a name or a part with ``name``), is ``"zero"``."""
    return getattr(term, "name", term) == "zero"


RULES: tuple[Rule, ...] = (
    Rule("logit_needs_favor", "coupling",
         lambda f: f.coupling == "logit" and f.features not in (None, "favor+"),
         lambda f: f"coupling='logit' needs feature_map='favor+' (it estimates exp(q.k + f)), got {f.features!r}"),
    Rule("triton_needs_favor", "settings.backend",
         lambda f: f.backend in ("triton", "triton-split") and f.features not in (None, "favor+"),
         lambda f: f"backend={f.backend!r} computes FAVOR+ features inside its kernel: it needs feature_map='favor+', got {f.features!r}"),
    Rule("rope_fits_head_dim", "settings.rope",
         lambda f: f.rope and f.head_dim % (2 * f.pos_dim) != 0,
         lambda f: f"rope needs head_dim ({f.head_dim}) divisible by 2 * pos_dim ({2 * f.pos_dim})"),
    Rule("triton_has_no_neighbors", "Neighbors",
         lambda f: f.backend in ("triton", "triton-split") and bool(f.near_neighbors),
         lambda f: f"backend={f.backend!r} has no kernel for near_neighbors (the band, near_field, has them on backend='triton' "
                   "and 'triton-split'); use backend='torch'"),
    Rule("one_near_set", "near",
         lambda f: bool(f.near_field and f.near_neighbors),
         lambda f: f"near_field ({f.near_field}) and near_neighbors ({f.near_neighbors}) are exclusive: choose one near set, "
                   f"the token band or the k nearest keys"),
    Rule("band_needs_favor", "Band",
         lambda f: bool(f.near_field) and f.features != "favor+",
         lambda f: f"the band holds exact softmax weights exp(x_q.x_k) next to the estimate: it needs feature_map='favor+', "
                   f"got {f.features!r} (the k nearest keys, near_neighbors, take any feature map)"),
    Rule("neighbors_are_bidirectional", "Neighbors",
         lambda f: bool(f.near_neighbors) and f.causal,
         lambda f: "near_neighbors is bidirectional (the near set of a set of points has no causal order); use causal=False, "
                   "or near_field for causal sequences"),
    Rule("band_needs_logit", "Band",
         lambda f: bool(f.near_field) and f.coupling != "logit",
         lambda f: "near_field needs coupling='logit' (the band op holds exact softmax weights); pass near_field=0 "
                   "to turn it off, or use near_neighbors, which takes both couplings"),
    Rule("near_term_needs_near_set", "near",
         lambda f: f.near_term is not None and not f.near_set,
         lambda f: f"near_relative ({f.near_term!r}) is the near set's term: it needs near_field or near_neighbors"),
    Rule("near_options_need_term", "near",
         lambda f: f.near_term_options and f.near_term is None,
         lambda f: "near_relative_options need near_relative (the name of a term in flt.relative.RELATIVE)"),
    Rule("far_near_needs_near_set", "far_field",
         lambda f: f.far_field == "near" and not f.near_set,
         lambda f: "far_field='near' keeps f on the near set only: it needs near_field (a token band) or "
                   "near_neighbors (k nearest keys); without a near set use far_field=false"),
    Rule("far_constant_needs_near_set", "far_field",
         lambda f: f.far_field in ("constant", "positive") and not f.near_set,
         lambda f: f"far_field={f.far_field!r} keeps f on the near set and a learnt constant per head beyond it: it needs "
                   "near_field (a token band) or near_neighbors (k nearest keys); without a near set the constant "
                   "would be the whole mask (use far_field=false)"),
    Rule("no_far_field_needs_neighbors", "far_field",
         lambda f: f.far_field is False and f.coupling == "multiplicative" and not f.near_neighbors,
         lambda f: "far_field=False with coupling='multiplicative' leaves no pair any weight (f = 0 "
                   "multiplies every kernel value): add near_neighbors, or use coupling='logit'"),
    Rule("zero_near_term_needs_a_mask", "near",
         lambda f: _zero_term(f.near_term) and f.far_field is False and f.coupling == "multiplicative",
         lambda f: "near_relative='zero' (f_near = 0) with far_field=False and coupling='multiplicative' leaves no pair any "
                   "weight (the near mask f + f_near is 0): keep the far term (far_field=true or 'near'), give the near set "
                   "a term, or use coupling='logit'"),
    Rule("multiplicative_needs_spectrum", "coupling",
         lambda f: f.coupling == "multiplicative" and not f.spectrum_term,
         lambda f: "coupling='multiplicative' applies to relative_bias='spectrum' only"),
    Rule("tables_are_one_dimensional", "relative",
         lambda f: f.relative in ("t5", "clipped") and f.pos_dim != 1,
         lambda f: f"relative_bias={f.relative!r} is a table over 1-D integer offsets; got pos_dim = {f.pos_dim}"),
    Rule("spectrum_options_need_spectrum", "relative",
         lambda f: bool(f.spectrum_options) and f.relative != "spectrum",
         lambda f: f"unexpected options {sorted(f.spectrum_options)} (spectrum options need relative_bias='spectrum')"),
    Rule("relative_options_beyond_built_ins", "relative",
         lambda f: f.flat_relative_options and (not isinstance(f.relative, str) or f.relative in BUILT_IN),
         lambda f: "relative_options are for relative terms registered beyond t5, clipped, alibi and spectrum "
                   "(whose options are keywords)"),
)


def broken_rules(facts: Facts) -> list[Rule]:
    """The rules ``facts`` breaks, in table order."""
    return [rule for rule in RULES if rule.when(facts)]


def check_rules(facts: Facts) -> None:
    """Raise the first broken rule's error with its message (nothing when all hold)."""
    for rule in RULES:
        if rule.when(facts):
            raise rule.error(rule.message(facts))
