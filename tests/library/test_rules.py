"""Every rule about combining a layer's parts, with its message, in one table
(:mod:`flt.layers.rules`), and each one reached through the layer that it guards."""

from __future__ import annotations

import re

import pytest

from flt.layers import FLTAttention, SoftmaxAttention
from flt.layers.near import Band, Neighbors
from flt.layers.parts import EluFeatures, Hedgehog, ReLUFeatures, Settings
from flt.layers.performer import PerformerAttention
from flt.layers.rules import RULES, Facts, broken_rules, check_rules

#: rule -> (facts that break it and no earlier rule, its message, a layer call that breaks it)
CASES = {
    "logit_needs_favor": (
        Facts(features="relu", coupling="logit"),
        "coupling='logit' needs feature_map='favor+' (it estimates exp(q.k + f)), got 'relu'",
        lambda: FLTAttention(16, 2, features=ReLUFeatures()),
    ),
    "triton_needs_favor": (
        Facts(features="elu", backend="triton"),
        "backend='triton' computes FAVOR+ features inside its kernel: it needs feature_map='favor+', got 'elu'",
        lambda: PerformerAttention.from_options(16, 2, feature_map="elu", backend="triton"),
    ),
    "rope_fits_head_dim": (
        Facts(rope=True, head_dim=8, pos_dim=3),
        "rope needs head_dim (8) divisible by 2 * pos_dim (6)",
        lambda: FLTAttention(16, 2, pos_dim=3, settings=Settings(rope=True)),
    ),
    "triton_has_no_neighbors": (
        Facts(features="favor+", backend="triton", near_neighbors=4, coupling="logit"),
        "backend='triton' has no kernel for near_neighbors (the band, near_field, has them on backend='triton' and 'triton-split'); "
        "use backend='torch'",
        lambda: FLTAttention(16, 2, near=Neighbors(4), settings=Settings(backend="triton")),
    ),
    "one_near_set": (
        Facts(features="favor+", coupling="logit", near_field=2, near_neighbors=3),
        "near_field (2) and near_neighbors (3) are exclusive: choose one near set, the token band or the k nearest keys",
        lambda: FLTAttention.from_options(16, 2, near_field=2, near_neighbors=3),
    ),
    "band_needs_favor": (
        Facts(features="hedgehog", coupling="multiplicative", near_field=4),
        "the band holds exact softmax weights exp(x_q.x_k) next to the estimate: it needs feature_map='favor+', got 'hedgehog' "
        "(the k nearest keys, near_neighbors, take any feature map)",
        lambda: FLTAttention(16, 2, coupling="multiplicative", features=Hedgehog(num_features=8), near=Band(4)),
    ),
    "neighbors_are_bidirectional": (
        Facts(features="favor+", coupling="logit", near_neighbors=4, causal=True),
        "near_neighbors is bidirectional (the near set of a set of points has no causal order); use causal=False, "
        "or near_field for causal sequences",
        lambda: FLTAttention(16, 2, causal=True, near=Neighbors(4)),
    ),
    "band_needs_logit": (
        Facts(features="favor+", coupling="multiplicative", near_field=4),
        "near_field needs coupling='logit' (the band op holds exact softmax weights); pass near_field=0 "
        "to turn it off, or use near_neighbors, which takes both couplings",
        lambda: FLTAttention(16, 2, coupling="multiplicative", near=Band(4)),
    ),
    "near_term_needs_near_set": (
        Facts(features="favor+", coupling="logit", near_term="clipped"),
        "near_relative ('clipped') is the near set's term: it needs near_field or near_neighbors",
        lambda: FLTAttention.from_options(16, 2, near_relative="clipped"),
    ),
    "near_options_need_term": (
        Facts(features="favor+", coupling="logit", near_field=2, near_term_options=True),
        "near_relative_options need near_relative (the name of a term in flt.relative.RELATIVE)",
        lambda: FLTAttention.from_options(16, 2, near_field=2, near_relative_options={"max_distance": 3}),
    ),
    "far_near_needs_near_set": (
        Facts(features="favor+", coupling="logit", far_field="near"),
        "far_field='near' keeps f on the near set only: it needs near_field (a token band) or "
        "near_neighbors (k nearest keys); without a near set use far_field=false",
        lambda: FLTAttention(16, 2, far_field="near"),
    ),
    "far_constant_needs_near_set": (
        Facts(features="favor+", coupling="multiplicative", far_field="constant", spectrum_term=True),
        "far_field='constant' keeps f on the near set and a learnt constant per head beyond it: it needs "
        "near_field (a token band) or near_neighbors (k nearest keys); without a near set the constant "
        "would be the whole mask (use far_field=false)",
        lambda: FLTAttention(16, 2, coupling="multiplicative", far_field="constant"),
    ),
    "no_far_field_needs_neighbors": (
        Facts(features="elu", coupling="multiplicative", far_field=False, spectrum_term=True),
        "far_field=False with coupling='multiplicative' leaves no pair any weight (f = 0 "
        "multiplies every kernel value): add near_neighbors, or use coupling='logit'",
        lambda: FLTAttention(16, 2, coupling="multiplicative", features=EluFeatures(), far_field=False),
    ),
    "zero_near_term_needs_a_mask": (
        Facts(features="favor+", coupling="multiplicative", near_neighbors=8, near_term="zero", far_field=False,
              spectrum_term=True),
        "near_relative='zero' (f_near = 0) with far_field=False and coupling='multiplicative' leaves no pair any weight "
        "(the near mask f + f_near is 0): keep the far term (far_field=true or 'near'), give the near set a term, or use "
        "coupling='logit'",
        lambda: FLTAttention(16, 2, coupling="multiplicative", near=Neighbors(8, term="zero"), far_field=False),
    ),
    "multiplicative_needs_spectrum": (
        Facts(coupling="multiplicative", relative="alibi"),
        "coupling='multiplicative' applies to relative_bias='spectrum' only",
        lambda: SoftmaxAttention(16, 2, relative_bias="alibi", coupling="multiplicative"),
    ),
    "tables_are_one_dimensional": (
        Facts(relative="t5", pos_dim=2),
        "relative_bias='t5' is a table over 1-D integer offsets; got pos_dim = 2",
        lambda: SoftmaxAttention(16, 2, pos_dim=2, relative_bias="t5"),
    ),
    "spectrum_options_need_spectrum": (
        Facts(relative="alibi", spectrum_options=("amplitude",)),
        "unexpected options ['amplitude'] (spectrum options need relative_bias='spectrum')",
        lambda: SoftmaxAttention.from_options(16, 2, relative_bias="alibi", amplitude=1.0),
    ),
    "relative_options_beyond_built_ins": (
        Facts(relative="t5", flat_relative_options=True),
        "relative_options are for relative terms registered beyond t5, clipped, alibi and spectrum (whose options are keywords)",
        lambda: SoftmaxAttention.from_options(16, 2, relative_bias="t5", relative_options={"max_distance": 3}),
    ),
}


def test_the_table_lists_every_rule_once():
    names = [rule.name for rule in RULES]
    assert len(set(names)) == len(names)
    assert set(names) == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_each_rule_breaks_with_its_message(name):
    facts, message, _ = CASES[name]
    assert broken_rules(facts)[0].name == name
    with pytest.raises(ValueError, match=re.escape(message)):
        check_rules(facts)


@pytest.mark.parametrize("name", list(CASES))
def test_each_rule_guards_its_layer(name):
    _, message, build = CASES[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def test_the_defaults_break_no_rule():
    assert broken_rules(Facts()) == []
    assert broken_rules(Facts(features="favor+", coupling="logit", backend="triton-split", spectrum_term=True)) == []
    assert broken_rules(Facts(features="favor+", coupling="multiplicative", backend="triton-split", spectrum_term=True)) == []
    assert broken_rules(Facts(features="favor+", coupling="logit", near_field=16, spectrum_term=True)) == []
    assert broken_rules(Facts(features="favor+", coupling="logit", near_field=16, backend="triton-split", spectrum_term=True)) == []
    assert broken_rules(Facts(features="favor+", coupling="multiplicative", near_neighbors=8, far_field=False,
                              spectrum_term=True)) == []
