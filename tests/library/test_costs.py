"""Each mechanism states its own cost beside its registry entry (flt.layers.registry.COSTS):
what the benchmarks ask of it instead of branching on its name."""

from __future__ import annotations

import pytest

from flt.layers.registry import ATTENTION, COSTS, forward_flops

SIZES = {"batch": 2, "heads": 4, "head_dim": 16}


def test_every_attention_entry_states_its_cost():
    assert set(COSTS) == set(ATTENTION)


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_exact_means_the_memory_estimate_grows_with_the_square_of_the_length(name):
    cls = ATTENTION[name]
    short, long = (cls.forward_values({}, batch=1, heads=2, length=n, head_dim=16) for n in (2**14, 2**15))
    assert long / short == pytest.approx(4.0 if COSTS[name].exact else 2.0, rel=1e-2)


@pytest.mark.parametrize("name", sorted(name for name, cost in COSTS.items() if cost.flops is not None))
@pytest.mark.parametrize("causal", [False, True])
def test_flops_past_the_projections_grow_as_the_mechanism_is_exact_or_linear(name, causal):
    """Doubling N doubles the projections and every linear part (the causal chunk size depends
    on the widths alone), and multiplies the pairs of an exact mechanism by 4."""
    short, long = (forward_flops(name, {}, length=n, causal=causal, **SIZES) for n in (4096, 8192))
    assert short is not None and long is not None and short.keys() == long.keys()
    assert long["projections"] == 2 * short["projections"]
    rest = [long[part] / short[part] for part in short if part != "projections"]
    assert rest and all(r == (4.0 if COSTS[name].exact else 2.0) for r in rest)


def test_a_kernel_mechanism_counts_the_options_its_class_has():
    """FLT's defaults (256 features, 32 frequencies, logit coupling) enter its feature maps;
    Performer has no frequencies, and a near set only where one is asked for."""
    flt, performer = (forward_flops(name, {}, length=1024, causal=False, **SIZES) for name in ("flt", "performer"))
    assert flt is not None and performer is not None
    bhn = 2 * 4 * 1024
    assert flt["feature maps"] == 2 * 2 * bhn * 256 * (16 + 64) and performer["feature maps"] == 2 * 2 * bhn * 256 * 16
    band = forward_flops("flt", {"near_field": 8}, length=1024, causal=False, **SIZES)
    assert band is not None and band["near set"] == 2 * bhn * 17 * (16 + 256 + 2 * 17) and "near set" not in flt
    assert forward_flops("toeplitz", {}, length=1024, causal=False, **SIZES) is None
