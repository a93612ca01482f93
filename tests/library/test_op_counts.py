"""Causal attention runs a fixed number of operations whatever the length: no Python loop
over chunks, blocks or tokens (what made long sequences slow on CPU, where every operation
has a fixed overhead). Counted with torch.profiler over one forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from flt.layers.registry import ATTENTION

#: Small features so that the test is fast; chunk, group and block counts follow the shapes
#: the same way at any width.
CASES = {
    "softmax": ("softmax", {}),
    "performer": ("performer", dict(num_features=16)),
    "flt": ("flt", dict(num_features=16, num_frequencies=4)),
    "flt-multiplicative": ("flt", dict(coupling="multiplicative", num_features=16, num_frequencies=4, check_condition=False)),
    "flt-band": ("flt", dict(num_features=16, num_frequencies=4, near_field=8)),
    "toeplitz": ("toeplitz", dict(num_features=16)),
}


def aten_ops(name: str, options: dict, n: int) -> int:
    """aten operations of one forward and backward of a causal layer (dim 32, 2 heads)."""
    torch.manual_seed(0)
    layer = ATTENTION[name].from_options(32, 2, causal=True, **options)
    x = torch.randn(1, n, 32, requires_grad=True)
    layer(x).sum().backward()  # first-call work (conditioning checks, caches) out of the count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(x).sum().backward()
    return sum(1 for event in prof.events() if event.name.startswith("aten::"))


def test_every_attention_entry_is_counted():
    assert {name for name, _ in CASES.values()} == set(ATTENTION)


@pytest.mark.parametrize("case", CASES)
def test_causal_operation_count_does_not_grow_with_the_length(case):
    name, options = CASES[case]
    short, long = aten_ops(name, options, 1024), aten_ops(name, options, 4096)
    assert long <= 1.1 * short, f"{case}: {short} aten ops at N = 1024, {long} at N = 4096"


def near_neighbor_ops(n: int, coupling: str) -> int:
    """aten operations of one forward and backward of FLT with the 8 nearest of ``n`` random
    3-D points exact (bidirectional: near sets have no causal order; dim 32, 2 heads)."""
    torch.manual_seed(0)
    layer = ATTENTION["flt"].from_options(32, 2, pos_dim=3, coupling=coupling, num_features=16, num_frequencies=4, near_neighbors=8,
                                          check_condition=False)
    x, pos = torch.randn(1, n, 32, requires_grad=True), torch.rand(1, n, 3)
    layer(x, pos).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(x, pos).sum().backward()
    return sum(1 for event in prof.events() if event.name.startswith("aten::"))


@pytest.mark.slow  # profiles 4096 points: about 10 s idle, a minute on a loaded machine
@pytest.mark.parametrize("coupling", ["logit", "multiplicative"])
def test_near_neighbor_operation_count_does_not_grow_with_the_number_of_points(coupling):
    # The cell-list search and the sparse pair products (flt.ops.pairs) run no Python loop
    # whose length follows N (both sizes use the cell lists: N >= SPATIAL_FROM).
    short, long = near_neighbor_ops(1024, coupling), near_neighbor_ops(4096, coupling)
    assert long <= 1.1 * short, f"{coupling}: {short} aten ops at N = 1024, {long} at N = 4096"


def longrange_ops(n: int, frequencies: str, content: str, **extra) -> int:
    """aten operations of one forward and backward of the long-range block on ``n`` random
    3-D points, one padded (dim 16, 2 heads, small frequency sets; ``extra`` options on top)."""
    from flt.layers.longrange import LongRangeBlock

    small = {"discrete": {"num_frequencies": 8}, "radial": {"num_radii": 2, "quadrature": 4},
             "grid": {"frequency_cutoff": 0.1}, "random": {"num_frequencies": 8},
             "coulomb": {"num_radii": 2, "quadrature": 4, "alpha": 0.5, "reach": 2.0}}[frequencies]
    torch.manual_seed(0)
    block = LongRangeBlock(16, heads=2, frequencies=frequencies, content=content, num_features=4, **{**small, **extra})
    h, pos = torch.randn(1, n, 16, requires_grad=True), torch.rand(1, n, 3)
    pad = torch.zeros(1, n, dtype=torch.bool)
    pad[0, -1] = True
    block(h, pos, pad).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        block(h, pos, pad).sum().backward()
    return sum(1 for event in prof.events() if event.name.startswith("aten::"))


@pytest.mark.parametrize("content", ["none", "favor+"])
@pytest.mark.parametrize("frequencies", ["discrete", "radial", "grid", "random", "coulomb"])
def test_longrange_operation_count_does_not_grow_with_the_number_of_points(frequencies, content):
    """The block's fast path is a fixed sequence of products whatever N: no loop over points."""
    from flt.layers.longrange import FREQUENCIES

    assert frequencies in FREQUENCIES and set(FREQUENCIES) == {"discrete", "radial", "grid", "random", "coulomb"}
    short, long = longrange_ops(32, frequencies, content), longrange_ops(256, frequencies, content)
    assert long == short, f"{frequencies}/{content}: {short} aten ops at N = 32, {long} at N = 256"


@pytest.mark.parametrize("frequencies", ["radial", "coulomb"])
def test_profiled_shells_operation_count_does_not_grow_with_the_number_of_points(frequencies):
    """``width > 0`` adds the profile's radii once per call, not per point."""
    options = {"width": 0.05, "width_nodes": 3}
    short, long = longrange_ops(32, frequencies, "none", **options), longrange_ops(256, frequencies, "none", **options)
    assert long == short, f"{frequencies} with a width: {short} aten ops at N = 32, {long} at N = 256"



@pytest.mark.parametrize("frequencies", ["radial", "coulomb"])
def test_mesh_engine_operation_count_does_not_grow_with_the_number_of_points(frequencies):
    """The mesh engine spreads, convolves and gathers with a fixed sequence of operations:
    sparse products over all points at once, a loop over the axes, not over points. Between
    small and large sets torch's sparse and indexing kernels switch branches (a zero fill,
    a copy: 9 ops more from 32 to 2,048 points on the same mesh), so the count must be equal
    at 2,048 and 8,192 points and within a few ops of the small set's."""
    options = {"engine": "mesh", "mesh_spacing": 0.1}
    small, large, larger = (longrange_ops(n, frequencies, "none", **options) for n in (32, 2048, 8192))
    assert larger == large and abs(large - small) <= 16, \
        f"{frequencies} through the mesh: aten ops at N = 32, 2048, 8192: {small}, {large}, {larger}"
