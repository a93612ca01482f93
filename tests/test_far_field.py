"""``far_field=False``: the control that fixes FLT's random-feature relative term at f = 0."""

import pytest
import torch

from conftest import assert_close
from flt import FLTAttention

F64 = torch.float64


def layer(**kw):
    torch.manual_seed(0)
    return FLTAttention(16, 2, num_features=32, num_frequencies=8, **kw).double()


def perturb_spectrum(lay):
    with torch.no_grad():
        for p in lay.spectrum.parameters():
            p.add_(0.5 + 0.3 * torch.randn_like(p))


@pytest.mark.parametrize("kw", [
    dict(coupling="logit"),
    dict(coupling="logit", near_field=4, near_relative="clipped"),
    dict(coupling="logit", near_neighbors=5, pos_dim=3),
    dict(coupling="multiplicative", near_neighbors=5, pos_dim=3),
])
def test_the_spectrum_has_no_effect_and_no_gradient(kw):
    """Off: moving the spectrum's parameters changes neither the fast path nor exact();
    on (the same layer otherwise), it changes both, so the check can fail."""
    torch.manual_seed(1)
    n = 24
    x = torch.randn(2, n, 16, dtype=F64)
    pos = torch.rand(n, kw.get("pos_dim", 1), dtype=F64) * 4 if "pos_dim" in kw else None
    for far_field in (False, True):
        lay = layer(far_field=far_field, **kw)
        lay.eval()
        before = (lay(x, pos), lay.exact(x, pos))
        perturb_spectrum(lay)
        after = (lay(x, pos), lay.exact(x, pos))
        moved = max(((b - a).abs().max().item() for b, a in zip(before, after)))
        if far_field:
            assert moved > 1e-3
        else:
            assert moved == 0.0
            assert not any(p.requires_grad for p in lay.spectrum.parameters())


def test_multiplicative_cutoff_is_exact():
    """Multiplicative coupling, far field off: only the k nearest keys carry weight, and
    those are computed exactly, so the fast path equals exact() (a cutoff model)."""
    lay = layer(coupling="multiplicative", near_neighbors=6, pos_dim=3, far_field=False)
    torch.manual_seed(2)
    x, pos = torch.randn(2, 20, 16, dtype=F64), torch.randn(20, 3, dtype=F64)
    with torch.no_grad():
        for p in lay.near_spectrum.parameters():
            p.add_(0.2)
    assert_close(lay(x, pos), lay.exact(x, pos))


@pytest.mark.parametrize("near_relative", [None, "gaussian"])
def test_a_fresh_multiplicative_cutoff_attends_and_its_mask_learns(near_relative):
    """Without a far field the near set's mask is f_near alone: it must not start at 0
    (every weight 0, no gradient to the mask, a cutoff model that can never learn)."""
    lay = layer(coupling="multiplicative", near_neighbors=6, pos_dim=3, far_field=False, near_relative=near_relative)
    torch.manual_seed(3)
    x, pos = torch.randn(2, 20, 16, dtype=F64), torch.randn(20, 3, dtype=F64)
    lay(x, pos).pow(2).sum().backward()
    grads = [p.grad for p in lay.near_spectrum.parameters() if p.requires_grad]
    assert grads and max(float(g.abs().max()) for g in grads if g is not None) > 1e-6
    # The logit coupling and a layer with a far field keep f_near = 0 at the start.
    for kw in (dict(coupling="logit", far_field=False), dict(coupling="multiplicative", far_field=True)):
        other = layer(near_neighbors=6, pos_dim=3, near_relative=near_relative, **kw)
        assert_close(other.near_spectrum.of_offsets(pos), torch.zeros(20, 2, dtype=F64))


def test_multiplicative_without_a_near_set_is_refused():
    with pytest.raises(ValueError, match="far_field=False"):
        layer(coupling="multiplicative", far_field=False)
    with pytest.raises(TypeError, match="far_field"):
        layer(far_field="no")


def test_causal_band_decoding_matches_the_forward():
    lay = layer(coupling="logit", causal=True, near_field=3, near_relative="clipped", far_field=False)
    lay.eval()
    torch.manual_seed(3)
    x = torch.randn(1, 12, 16, dtype=F64)
    full = lay(x)
    state, outs = None, []
    for t in range(12):
        y, state = lay.step(x[:, t], state)
        outs.append(y.unsqueeze(1))
    assert_close(torch.cat(outs, dim=1), full)
