"""``near_relative="zero"``: a near set with no term of its own (``f_near = 0``), so it only
makes the far term ``f`` exact on its pairs (the library form of freezing ``f_near`` at 0)."""

from __future__ import annotations

import pytest
import torch

from flt.layers import FLTAttention
from flt.layers.near import Band, Neighbors, ZeroTerm
from flt.layers.parts import Hedgehog
from flt.options import check_attention_options, parse_attention

DTYPE = torch.float64


def pair(near_zero, near_default, **options):
    """Two layers with the same weights and draws: one with ``f_near = 0`` for good, one
    with the default term (a spectrum that starts at amplitude 0)."""
    torch.manual_seed(0)
    zero = FLTAttention(16, 2, near=near_zero, **options).to(DTYPE)
    default = FLTAttention(16, 2, near=near_default, **options).to(DTYPE)
    missing, unexpected = default.load_state_dict(zero.state_dict(), strict=False)
    assert unexpected == [] and missing and all(key.startswith("core.near_spectrum.") for key in missing)
    return zero, default


CASES = {
    "band, logit, causal": (Band(4, term="zero"), Band(4), dict(causal=True), 1),
    "neighbours, multiplicative": (Neighbors(6, term="zero"), Neighbors(6), dict(pos_dim=3, coupling="multiplicative"), 3),
    "neighbours, multiplicative, hedgehog": (Neighbors(6, term="zero"), Neighbors(6),
                                             dict(pos_dim=3, coupling="multiplicative", features=Hedgehog(num_features=8)), 3),
    "neighbours, logit, far field near": (Neighbors(6, term="zero"), Neighbors(6), dict(pos_dim=3, far_field="near"), 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_zero_term_equals_the_default_term_at_its_start(case):
    near_zero, near_default, options, pos_dim = CASES[case]
    zero, default = pair(near_zero, near_default, **options)
    assert isinstance(zero.near_spectrum, ZeroTerm) and list(zero.near_spectrum.parameters()) == []
    x = torch.randn(2, 20, 16, dtype=DTYPE)
    pos = torch.rand(2, 20, 3, dtype=DTYPE) * 4 if pos_dim == 3 else None
    torch.testing.assert_close(zero(x, pos), default(x, pos), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(zero.exact(x, pos), default.exact(x, pos), rtol=1e-12, atol=1e-12)


def test_zero_term_learns_only_the_far_term():
    zero, default = pair(Neighbors(6, term="zero"), Neighbors(6), pos_dim=3, coupling="multiplicative")
    x, pos = torch.randn(2, 20, 16, dtype=DTYPE), torch.rand(2, 20, 3, dtype=DTYPE) * 4
    zero(x, pos).square().sum().backward()
    default(x, pos).square().sum().backward()
    for (name, p), (_, q) in zip(zero.spectrum.named_parameters(), default.spectrum.named_parameters(), strict=True):
        assert p.grad is not None and p.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in default.near_spectrum.parameters())


def test_zero_term_decodes_a_causal_band_token_by_token():
    torch.manual_seed(0)
    layer = FLTAttention(16, 2, causal=True, near=Band(3, term="zero")).to(DTYPE).eval()
    x = torch.randn(1, 12, 16, dtype=DTYPE)
    full, state, steps = layer(x), None, []
    for t in range(x.shape[1]):
        y, state = layer.step(x[:, t], state)
        steps.append(y)
    torch.testing.assert_close(torch.stack(steps, dim=1), full, rtol=1e-10, atol=1e-10)


def test_zero_term_from_the_command_line_string():
    name, options = parse_attention("flt:near_neighbors=8:near_relative=zero:coupling=multiplicative")
    check_attention_options(name, {**options, "pos_dim": 3})
    layer = FLTAttention.from_options(16, 2, pos_dim=3, **options)
    assert isinstance(layer.near_spectrum, ZeroTerm)


def test_zero_term_takes_no_options():
    with pytest.raises(ValueError, match=r"near_relative='zero' \(f_near = 0\) takes no options, got \['amplitude'\]"):
        FLTAttention.from_options(16, 2, pos_dim=3, near_neighbors=8, near_relative="zero",
                                  near_relative_options={"amplitude": 1.0})


def test_zero_term_without_a_far_term_is_refused():
    with pytest.raises(ValueError, match="near_relative='zero'"):
        FLTAttention.from_options(16, 2, pos_dim=3, near_neighbors=8, near_relative="zero", coupling="multiplicative",
                                  far_field=False)
    with pytest.raises(ValueError, match="near_relative='zero'"):  # the module itself, not its name
        FLTAttention(16, 2, pos_dim=3, near=Neighbors(8, term=ZeroTerm(2, pos_dim=3)), coupling="multiplicative",
                     far_field=False)
    layer = FLTAttention.from_options(16, 2, pos_dim=3, near_neighbors=8, near_relative="zero", far_field=False)
    assert isinstance(layer.near_spectrum, ZeroTerm)  # logit: exp(q.k) on the near set, a Performer beyond
