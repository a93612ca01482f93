"""``far_field=False``: the control that fixes FLT's random-feature relative term at f = 0;
``far_field="near"``: the control that keeps ``f`` exactly on the near set and drops only its
random-feature estimate beyond it."""

import pytest
import torch

from conftest import assert_close, assert_same_gradients
from flt import FLTAttention
from flt.models import build_model
from flt.options import check_attention_options, parse_attention
from flt.cli import build_parser
from flt.commands.train import preset_from_args

F64 = torch.float64


def layer(**kw):
    torch.manual_seed(0)
    return FLTAttention.from_options(16, 2, num_features=32, num_frequencies=8, **kw).double()


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


def decode_token_by_token(lay, x):
    """The layer's ``step()`` outputs over ``x [B, N, dim]``, one token at a time."""
    state, outs = None, []
    for t in range(x.shape[1]):
        y, state = lay.step(x[:, t], state)
        outs.append(y.unsqueeze(1))
    return torch.cat(outs, dim=1)


def test_causal_band_decoding_matches_the_forward():
    lay = layer(coupling="logit", causal=True, near_field=3, near_relative="clipped", far_field=False)
    lay.eval()
    torch.manual_seed(3)
    x = torch.randn(1, 12, 16, dtype=F64)
    full = lay(x)
    assert_close(decode_token_by_token(lay, x), full)


# far_field="near": f exact on the near set, its random-feature estimate beyond it dropped.


def near_set_reference(lay, x, pos, causal):
    """The O(N^2) formula, written out from the layer's parts: weights
    ``exp(x_q.x_k + f + f_near)`` on the near set (``f`` the spectrum's exact mask) and,
    beyond it, the FAVOR+ estimate of the plain kernel ``exp(x_q.x_k)`` (logit) or 0
    (multiplicative); normalised rows. ``[B, N, dim]`` like ``forward``."""
    p = lay.prepare(x, pos, None)
    xq, xk = lay.core.scaled_qk(p.q, p.k, p.pos)
    r = p.pos.unsqueeze(2) - p.pos.unsqueeze(1)  # [1, N, N, P]
    f = (lay.spectrum.mask(r) + lay.near_spectrum.of_offsets(r)).permute(0, 3, 1, 2)  # [1, H, N, N]
    n = x.shape[1]
    if lay.near_field:
        i = torch.arange(n)
        near = (i.view(-1, 1) - i.view(1, -1)).abs() <= lay.near_field
    else:  # the k nearest keys of each query in position space, itself included
        dist = torch.cdist(p.pos[0], p.pos[0])
        near = torch.zeros(n, n, dtype=torch.bool).scatter(-1, dist.topk(lay.near_neighbors, largest=False).indices, True)
    kernel = torch.exp(xq @ xk.transpose(-1, -2))
    if lay.coupling == "logit":
        zeros = torch.zeros(*xq.shape[:-1], 2 * lay.spectrum.num_frequencies, dtype=F64)
        qf, qs = lay.feature_map.forward_split(xq, zeros)
        kf, ks = lay.feature_map.forward_split(xk, zeros)
        beyond = (qf @ kf.transpose(-1, -2)) * torch.exp(qs.unsqueeze(-1) + ks.unsqueeze(-2))
        w = torch.where(near, kernel * torch.exp(f), beyond)
    else:
        w = torch.where(near, kernel * f, torch.zeros_like(kernel))
    if causal:
        w = w.tril()
    return lay.finish((w @ p.v) / w.sum(-1, keepdim=True), x)


NEAR_CASES = [
    dict(coupling="logit", near_field=3, near_relative="clipped", causal=True),
    dict(coupling="logit", near_field=3, near_relative="clipped"),
    dict(coupling="logit", near_field=4),
    dict(coupling="logit", near_neighbors=5, pos_dim=3),
    dict(coupling="multiplicative", near_neighbors=5, pos_dim=3),
]


@pytest.mark.parametrize("kw", NEAR_CASES)
def test_near_only_matches_its_quadratic_formula_and_trains_the_spectrum(kw):
    """float64: the fast path equals the O(N^2) formula with f on the near set and no f
    beyond it, forward and backward, and the spectrum's parameters get the same gradients
    (nonzero: f is learnt through the near set)."""
    lay = layer(far_field="near", **kw)
    perturb_spectrum(lay)
    torch.manual_seed(4)
    n = 23  # odd, not a multiple of the band's blocks
    x = torch.randn(2, n, 16, dtype=F64)
    pos = torch.rand(n, 3, dtype=F64) * 3 if kw.get("pos_dim") else None
    params = [p for p in lay.spectrum.parameters() if p.requires_grad]
    assert params, "the spectrum must stay trainable with far_field='near'"
    grads = assert_same_gradients(lay(x, pos), near_set_reference(lay, x, pos, kw.get("causal", False)), params)
    assert max(float(g.abs().max()) for g in grads if g is not None) > 1e-6


@pytest.mark.parametrize("kw", NEAR_CASES)
def test_near_only_ignores_the_spectrum_draws_and_full_flt_does_not(kw):
    """Redrawing the spectrum's random frequencies leaves the output unchanged with
    far_field='near' (nothing is estimated with them) and changes it with far_field=True
    (the same layer otherwise), so the check can fail."""
    torch.manual_seed(5)
    x = torch.randn(2, 20, 16, dtype=F64)
    pos = torch.rand(20, 3, dtype=F64) * 3 if kw.get("pos_dim") else None
    for far_field in ("near", True):
        lay = layer(far_field=far_field, **kw)
        perturb_spectrum(lay)
        with torch.no_grad():
            before = lay(x, pos)
            lay.spectrum.redraw_random_features(torch.Generator().manual_seed(9))
            moved = float((lay(x, pos) - before).abs().max())
        assert moved == 0.0 if far_field == "near" else moved > 1e-6


def test_near_only_exact_keeps_f_on_the_near_set_only():
    """exact(): the multiplicative coupling's fast path is exact here (no weight beyond
    the near set), so it must equal exact(), which must differ from full FLT's exact()."""
    kw = dict(coupling="multiplicative", near_neighbors=5, pos_dim=3)
    lay = layer(far_field="near", **kw)
    perturb_spectrum(lay)
    torch.manual_seed(6)
    x, pos = torch.randn(2, 20, 16, dtype=F64), torch.randn(20, 3, dtype=F64)
    assert_close(lay(x, pos), lay.exact(x, pos))
    full = layer(far_field=True, **kw)
    full.load_state_dict(lay.state_dict())
    assert float((full.exact(x, pos) - lay.exact(x, pos)).abs().max().detach()) > 1e-3


def test_near_only_band_decoding_matches_the_causal_forward():
    lay = layer(coupling="logit", causal=True, near_field=3, near_relative="clipped", far_field="near")
    perturb_spectrum(lay)
    lay.eval()
    torch.manual_seed(7)
    x = torch.randn(1, 12, 16, dtype=F64)
    full = lay(x)
    assert_close(decode_token_by_token(lay, x), full)
    y, state = lay.prefill(x[:, :8])
    assert_close(y, full[:, :8])
    for t in range(8, 12):
        y, state = lay.step(x[:, t], state)
        assert_close(y, full[:, t])


def test_near_only_needs_a_near_set_and_parses_from_the_cli_string():
    with pytest.raises(ValueError, match="far_field='near'.*near_field.*near_neighbors"):
        layer(far_field="near")
    with pytest.raises(TypeError, match="far_field.*'near'"):
        layer(near_field=3, far_field="nearby")
    name, options = parse_attention("flt:near_field=16:far_field=near")
    assert (name, options) == ("flt", {"near_field": 16, "far_field": "near"})
    check_attention_options(name, options)
    with pytest.raises(TypeError, match="far_field"):
        check_attention_options("flt", {"far_field": "far"})
    args = build_parser().parse_args(["train", "lm", "--preset", "smoke", "--attention", "flt:far_field=near"])
    model = build_model(preset_from_args(args, *parse_attention(args.attention)).model)
    layers = [m for m in model.modules() if isinstance(m, FLTAttention)]
    assert layers and all(m.far_field == "near" and m.near_field == 16 for m in layers)
