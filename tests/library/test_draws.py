"""flt.layers.draws: one redraw mechanism for FAVOR+ projections and spectral base draws."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flt import FLTAttention
from flt.layers import FeatureMap, PerformerAttention, SoftmaxAttention, ToeplitzAttention
from flt.layers.draws import (
    draw_generator,
    fixed_draw,
    has_random_features,
    random_feature_modules,
    redraw,
)
from flt.layers.upgrade import upgrade_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")


def model():
    """One of each random-feature mechanism: FLT (both couplings, one with a near field),
    Performer and Toeplitz."""
    return nn.ModuleDict({
        "logit": FLTAttention.from_options(16, 2, num_features=16, num_frequencies=4, amplitude=0.5),
        "mult": FLTAttention.from_options(16, 2, coupling="multiplicative", num_features=16, num_frequencies=4, spectrum="gaussian"),
        "near": FLTAttention.from_options(16, 2, num_features=16, num_frequencies=4, spectrum="local", near_field=2, causal=True),
        "performer": PerformerAttention.from_options(16, 2, num_features=16),
        "toeplitz": ToeplitzAttention.from_options(16, 2, num_features=16, max_distance=8),
    })


def draws(m):
    return {f"{name}.{b}": getattr(mod, b).clone() for name, mod in random_feature_modules(m) for b in mod.random_feature_buffers}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_mechanism_takes_part_and_only_sampled_draws_count():
    names = [n for n, _ in random_feature_modules(model())]
    assert names == [
        "logit.feature_map", "logit.spectrum", "mult.feature_map", "mult.spectrum",
        "near.feature_map", "near.spectrum", "performer.feature_map", "toeplitz.feature_map",
    ]  # near.near_spectrum: only its exact mask is used
    assert has_random_features(model())
    assert not has_random_features(SoftmaxAttention.from_options(16, 2, relative_bias="alibi"))
    assert not has_random_features(PerformerAttention.from_options(16, 2, feature_map="elu"))
    assert has_random_features(PerformerAttention.from_options(16, 2, feature_map="relu"))


def test_redraw_changes_every_draw_and_is_reproducible_from_the_generator():
    a = model()
    b = model()
    b.load_state_dict(a.state_dict())
    before = draws(a)
    assert redraw(a, torch.Generator().manual_seed(5)) == 8
    after = draws(a)
    assert all(not torch.equal(before[k], after[k]) for k in before)
    redraw(b, torch.Generator().manual_seed(5))
    assert same(draws(b), after)
    redraw(b, torch.Generator().manual_seed(6))
    assert not any(torch.equal(draws(b)[k], after[k]) for k in after)
    # Parameters are untouched; the near-field spectrum keeps its draws.
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert torch.equal(a["near"].near_spectrum.eps, b["near"].near_spectrum.eps)


def test_redrawn_draws_keep_their_distribution():
    """A redrawn spectrum keeps its sampler's shape; a redrawn projection its orthogonal blocks."""
    m = model()
    redraw(m, torch.Generator().manual_seed(0))
    proj = m["performer"].feature_map.projection.double()  # 16 rows of dim 8: two orthogonal blocks
    block = proj[:8] / proj[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(8, dtype=torch.float64), atol=1e-6, rtol=0)
    assert m["logit"].spectrum.eps.shape == model()["logit"].spectrum.eps.shape


def test_fixed_draw_is_deterministic_restores_and_does_not_depend_on_the_training_draw():
    a, b = model(), model()
    b.load_state_dict(a.state_dict())
    redraw(b, torch.Generator().manual_seed(1))  # another training draw
    own_a, own_b = draws(a), draws(b)
    x = torch.randn(2, 6, 16)
    with fixed_draw(a, 7):
        fixed_a, out_a = draws(a), a["logit"](x)
    with fixed_draw(b, 7):
        assert same(draws(b), fixed_a)
        torch.testing.assert_close(b["logit"](x), out_a, rtol=0, atol=0)
    assert same(draws(a), own_a) and same(draws(b), own_b)
    with fixed_draw(a, 8):
        assert not any(torch.equal(draws(a)[k], fixed_a[k]) for k in fixed_a)
    # Per module: the draw of (seed, name), whatever else the model holds.
    alone = nn.ModuleDict({"performer": PerformerAttention.from_options(16, 2, num_features=16)})
    fixed_draw(alone, 7)  # used as a function: the model stays on the draw
    assert torch.equal(alone["performer"].feature_map.projection, fixed_a["performer.feature_map.projection"])


def test_fixed_draw_names_ignore_ddp_style_wrappers():
    inner = model()
    wrapped = nn.DataParallel(inner)
    with fixed_draw(inner, 3):
        expected = draws(inner)
    with fixed_draw(wrapped, 3):
        assert same(draws(inner), expected)


@pytest.mark.parametrize("coupling, spectrum", [("logit", "gaussian_mixture"), ("multiplicative", "gaussian"), ("logit", "local")])
def test_gradients_reach_spectral_parameters_after_a_redraw(coupling, spectrum):
    torch.manual_seed(0)
    lay = FLTAttention.from_options(16, 2, coupling=coupling, spectrum=spectrum, num_features=16, num_frequencies=4, amplitude=0.5).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    before = lay(x).detach()
    redraw(lay, torch.Generator().manual_seed(0))
    assert not lay.spectrum.eps.requires_grad
    out = lay(x)
    assert not torch.equal(out.detach(), before)
    out.square().sum().backward()
    grads = {n: p.grad for n, p in lay.spectrum.named_parameters()}
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values()), grads


def test_layer_redraw_interval_is_a_thin_wrapper_around_redraw():
    """``redraw_interval=k`` on a layer redraws all of its draws (projection and spectrum)
    every k-th training forward call, from the seeded generator; never in eval mode."""
    def build():
        return FLTAttention.from_options(16, 2, num_features=16, num_frequencies=4, amplitude=0.5, redraw_interval=2, seed=3)

    lay, twin = build(), build()
    x = torch.randn(1, 5, 16)
    first = draws(lay)
    lay.train()
    lay(x)
    lay(x)
    assert same(draws(lay), first) and int(lay.core.redraw_calls) == 2
    lay(x)
    third = draws(lay)
    assert not any(torch.equal(third[k], first[k]) for k in first)
    lay.eval()
    lay(x)
    assert same(draws(lay), third)
    twin.train()
    for _ in range(3):
        twin(x)
    assert same(draws(twin), third)  # reproducible from the seed
    # The counter is saved with the weights.
    twin.load_state_dict(lay.state_dict())
    assert int(twin.core.redraw_calls) == 3
    with pytest.raises(ValueError, match="redraw_interval"):
        FLTAttention.from_options(16, 2, redraw_interval=0)


def test_checkpoints_from_before_the_protocol_load():
    """Feature maps used to hold a forward-call counter ``calls``; it is dropped on load
    (or becomes the layer's ``redraw_calls`` when the layer has a schedule)."""
    lay = PerformerAttention.from_options(16, 2, num_features=16)
    old = {**lay.state_dict(), "feature_map.calls": torch.tensor(4)}
    lay.load_state_dict(upgrade_state_dict(lay, old))
    sched = PerformerAttention.from_options(16, 2, num_features=16, redraw_interval=3)
    old = {k: v for k, v in sched.state_dict().items() if k != "core.redraw_calls"}
    sched.load_state_dict(upgrade_state_dict(sched, {**old, "feature_map.calls": torch.tensor(4)}))
    assert int(sched.core.redraw_calls) == 4


def test_feature_map_redraw_uses_its_seed_or_the_given_generator():
    a, b = FeatureMap(4, 8, seed=0), FeatureMap(4, 8, seed=0)
    assert torch.equal(a.projection, b.projection)
    a.redraw_random_features()
    b.redraw_random_features()
    assert torch.equal(a.projection, b.projection)
    a.redraw_random_features(draw_generator(1, "x"))
    b.redraw_random_features(draw_generator(1, "x"))
    assert torch.equal(a.projection, b.projection)
    elu = FeatureMap(4, 8, kind="elu")
    elu.redraw_random_features()
    assert elu.projection is None and not elu.has_random_features
