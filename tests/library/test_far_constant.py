"""``far_field="constant"``: ``f`` exact on the near set (with ``f_near``, as ``"near"``) and a
learnt constant ``c_h`` per head beyond it, in place of ``f``'s random-feature estimate: the
control that separates "attending beyond the near set at all" from "the shape of ``f``
there"."""

import pytest
import torch
from conftest import assert_close, assert_same_gradients

from flt import FLTAttention
from flt.options import parse_attention

F64 = torch.float64
CONSTANTS = (0.6, -0.4)  # one per head; the second below 0 (a negative weight or bias)


def layer(far_field="constant", **kw):
    torch.manual_seed(0)
    return FLTAttention.from_options(16, 2, num_features=32, num_frequencies=8, far_field=far_field, **kw).double()


def trained_look(lay):
    """Move the spectra and the constant away from their starting values, as training would."""
    with torch.no_grad():
        for p in lay.spectrum.parameters():
            p.add_(0.5 + 0.3 * torch.randn_like(p))
        if lay.far_constant is not None:
            lay.far_constant.copy_(torch.tensor(CONSTANTS, dtype=lay.far_constant.dtype))
    return lay


def inputs(n, pos_dim, seed=4):
    torch.manual_seed(seed)
    x = torch.randn(2, n, 16, dtype=F64)
    pos = torch.rand(n, 3, dtype=F64) * 3 if pos_dim == 3 else None
    return x, pos


def near_pairs(lay, pos, n):
    """``[N, N]`` booleans: the band ``|i - j| <= w``, or each query's k nearest keys (itself included)."""
    if lay.near_field:
        i = torch.arange(n)
        return (i.view(-1, 1) - i.view(1, -1)).abs() <= lay.near_field
    dist = torch.cdist(pos, pos)
    return torch.zeros(n, n, dtype=torch.bool).scatter(-1, dist.topk(lay.near_neighbors, largest=False).indices, True)


def brute_force(lay, x, pos, *, kernel):
    """The layer's definition written out in O(N^2): near pairs weigh ``f + f_near`` (the
    spectra's exact masks) and the pairs beyond weigh ``c_h``, each against ``kernel``:

    * ``"exact"``: the exact kernel ``exp(x_q.x_k)`` (what :meth:`exact` computes);
    * ``"features"``: the estimate the fast path uses beyond the near set: the feature map's
      own kernel (multiplicative), or FAVOR+ of ``[x_q, (c_h / t, 0, ...)]`` and ``[x_k, (t, 0, ...)]``, ``t = sqrt(|c_h|)``
      (logit: ``exp(x_q.x_k + c_h)`` in expectation); near pairs stay exact.

    Multiplicative: weight = mask * kernel; logit: kernel * exp(mask). Rows normalised,
    causal rows cut at the diagonal. ``[B, N, dim]`` like ``forward``."""
    p = lay.prepare(x, pos, None)
    xq, xk = lay.core.scaled_qk(p.q, p.k, p.pos)
    n = x.shape[1]
    r = p.pos.unsqueeze(2) - p.pos.unsqueeze(1)  # [1, N, N, P]
    f_near = (lay.spectrum.mask(r) + lay.near_spectrum.of_offsets(r)).permute(0, 3, 1, 2)  # [1, H, N, N]
    theta = lay.far_constant  # "positive" keeps softplus(theta) >= 0, "constant" theta itself
    c_h = torch.log1p(torch.exp(theta)) if lay.far_field == "positive" else theta
    c = c_h.view(1, -1, 1, 1)
    near = near_pairs(lay, p.pos[0], n)
    if lay.coupling == "multiplicative":
        qf, qs = lay.feature_map(xq)
        kf, ks = lay.feature_map(xk)
        estimate = qf @ kf.transpose(-1, -2)
        if qs is not None:  # FAVOR+'s log scales; deterministic maps have none
            estimate = estimate * torch.exp(qs.unsqueeze(-1) + ks.unsqueeze(-2))
        # FAVOR+ pairs are exact on the near set; other maps are their own kernel everywhere.
        exact = torch.exp(xq @ xk.transpose(-1, -2)) if lay.feature_map.kind == "favor+" else estimate
        beyond = estimate if kernel == "features" else exact
        w = torch.where(near, f_near * exact, c * beyond)
    else:
        exact = torch.exp(xq @ xk.transpose(-1, -2))
        beyond = exact * torch.exp(c)
        if kernel == "features":
            width = 2 * lay.spectrum.num_frequencies
            one = torch.zeros(1, 2, n, width, dtype=F64)
            a = one.clone()
            t = c_h.detach().abs().clamp_min(1e-6).sqrt().view(1, -1, 1)  # the layer's symmetric split
            a[..., 0] = c_h.view(1, -1, 1) / t
            one[..., 0] = t
            qf, qs = lay.feature_map.forward_split(xq, a)
            kf, ks = lay.feature_map.forward_split(xk, one)
            beyond = (qf @ kf.transpose(-1, -2)) * torch.exp(qs.unsqueeze(-1) + ks.unsqueeze(-2))
        w = torch.where(near, exact * torch.exp(f_near), beyond)
    if lay.causal:
        w = w.tril()
    return lay.finish((w @ p.v) / w.sum(-1, keepdim=True), x)


CASES = {
    "multiplicative, hedgehog, 5 nearest atoms": dict(coupling="multiplicative", feature_map="hedgehog",
                                                      near_neighbors=5, pos_dim=3),
    "multiplicative, favor+, 5 nearest atoms": dict(coupling="multiplicative", near_neighbors=5, pos_dim=3),
    "logit, band of 3": dict(coupling="logit", near_field=3, near_relative="clipped"),
    "logit, causal band of 3": dict(coupling="logit", near_field=3, near_relative="clipped", causal=True),
    "logit, 5 nearest atoms": dict(coupling="logit", near_neighbors=5, pos_dim=3),
}


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_forward_equals_reference_and_the_brute_force_formula_with_gradients_to_the_constant(kw):
    """float64, odd N: forward == the layer's O(N^2) reference == the formula written out
    here, forward and backward; the constant gets a nonzero gradient."""
    lay = trained_look(layer(**kw))
    x, pos = inputs(23, kw.get("pos_dim", 1))
    out = lay(x, pos)
    assert_close(out, lay.reference(x, pos))
    params = [lay.far_constant, *(p for p in lay.spectrum.parameters() if p.requires_grad)]
    grads = assert_same_gradients(out, brute_force(lay, x, pos, kernel="features"), params)
    assert float(grads[0].abs().min()) > 1e-6, "every head's constant must get a gradient"


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_exact_puts_the_constant_beyond_the_near_set(kw):
    """exact() equals the brute-force formula with the exact kernel, and differs from
    far_field='near' (the same parameters, no constant), so the check can fail."""
    lay = trained_look(layer(**kw))
    x, pos = inputs(20, kw.get("pos_dim", 1), seed=5)
    assert_same_gradients(lay.exact(x, pos), brute_force(lay, x, pos, kernel="exact"), [lay.far_constant])
    near = layer(far_field="near", **kw)
    loaded = near.load_state_dict(lay.state_dict(), strict=False)
    assert not loaded.missing_keys and loaded.unexpected_keys == ["core.far_constant"]  # all else carried over
    assert float((near.exact(x, pos) - lay.exact(x, pos)).abs().max().detach()) > 1e-3


def test_features_own_kernel_makes_forward_exact():
    """With a deterministic feature map (hedgehog) nothing is estimated: forward == exact()."""
    kw = CASES["multiplicative, hedgehog, 5 nearest atoms"]
    lay = trained_look(layer(**kw))
    x, pos = inputs(21, 3)
    assert_close(lay(x, pos), lay.exact(x, pos))


@pytest.mark.parametrize("kw", [CASES["multiplicative, hedgehog, 5 nearest atoms"],
                                CASES["multiplicative, favor+, 5 nearest atoms"]], ids=["hedgehog", "favor+"])
def test_a_zero_constant_is_far_field_near(kw):
    """The constant starts at 0, where the multiplicative layer is exactly far_field='near'
    (forward and exact()); moving it changes the output."""
    lay = layer(**kw)
    assert torch.equal(lay.far_constant.detach(), torch.zeros(2, dtype=F64))
    trained_look(lay)
    with torch.no_grad():
        lay.far_constant.zero_()
    near = layer(far_field="near", **kw)
    loaded = near.load_state_dict(lay.state_dict(), strict=False)
    assert not loaded.missing_keys and loaded.unexpected_keys == ["core.far_constant"]  # all else carried over
    x, pos = inputs(20, 3, seed=6)
    assert torch.equal(lay(x, pos), near(x, pos))
    assert_close(lay.exact(x, pos), near.exact(x, pos))
    with torch.no_grad():
        lay.far_constant.fill_(0.3)
    assert float((lay(x, pos) - near(x, pos)).abs().max().detach()) > 1e-4


def test_a_zero_constant_is_far_field_near_in_exact_for_the_logit_coupling():
    """Logit: at c_h = 0 exact() is far_field='near''s (the plain kernel beyond the band).
    The forward estimates exp(x_q.x_k + c_h) with one more FAVOR+ input, so it equals
    far_field='near' in expectation, not draw for draw."""
    kw = CASES["logit, band of 3"]
    lay = trained_look(layer(**kw))
    with torch.no_grad():
        lay.far_constant.zero_()
    near = layer(far_field="near", **kw)
    loaded = near.load_state_dict(lay.state_dict(), strict=False)
    assert not loaded.missing_keys and loaded.unexpected_keys == ["core.far_constant"]  # all else carried over
    x, _ = inputs(20, 1, seed=7)
    assert_close(lay.exact(x), near.exact(x))


def test_causal_band_decoding_matches_the_forward():
    lay = trained_look(layer(**CASES["logit, causal band of 3"]))
    lay.eval()
    x, _ = inputs(12, 1, seed=8)
    full = lay(x)
    y, state = lay.prefill(x[:, :7])
    assert_close(y, full[:, :7])
    for t in range(7, 12):
        y, state = lay.step(x[:, t], state)
        assert_close(y, full[:, t])


def test_the_constant_is_in_the_state_dict_and_round_trips():
    kw = CASES["multiplicative, favor+, 5 nearest atoms"]
    lay = trained_look(layer(**kw))
    state = lay.state_dict()
    assert torch.equal(state["core.far_constant"], torch.tensor(CONSTANTS, dtype=F64))
    assert "core.far_constant" not in layer(far_field="near", **kw).state_dict()
    fresh = layer(**kw)
    fresh.load_state_dict(state)
    x, pos = inputs(20, 3, seed=9)
    assert torch.equal(fresh(x, pos), lay(x, pos))


def test_the_constant_needs_a_near_set_and_a_known_spelling():
    for kw in (dict(coupling="logit"), dict(coupling="multiplicative")):
        with pytest.raises(ValueError, match="far_field='constant'.*near_field.*near_neighbors"):
            layer(**kw)
    with pytest.raises(ValueError, match="far_field='constant'"):
        FLTAttention(16, 2, far_field="constant")
    with pytest.raises(TypeError, match="far_field.*'constant'"):
        layer(near_field=3, far_field="constants")


POSITIVE_CASES = {k: CASES[k] for k in ("multiplicative, hedgehog, 5 nearest atoms", "logit, causal band of 3")}


@pytest.mark.parametrize("kw", POSITIVE_CASES.values(), ids=POSITIVE_CASES.keys())
def test_positive_constant_is_the_softplus_of_its_parameter_in_every_path(kw):
    """``far_field="positive"``: the same layer with ``c_h = softplus(theta_h)``; float64
    forward == reference == the formula (which takes the softplus itself), gradients to theta
    included, and a negative theta still gives a positive constant."""
    lay = trained_look(layer(far_field="positive", **kw))
    assert bool((lay.core.far_constant_value() > 0).all())  # CONSTANTS[1] < 0 as theta
    x, pos = inputs(23, kw.get("pos_dim", 1))
    out = lay(x, pos)
    assert_close(out, lay.reference(x, pos))
    params = [lay.far_constant, *(p for p in lay.spectrum.parameters() if p.requires_grad)]
    grads = assert_same_gradients(out, brute_force(lay, x, pos, kernel="features"), params)
    assert float(grads[0].abs().min()) > 1e-6
    assert_same_gradients(lay.exact(x, pos), brute_force(lay, x, pos, kernel="exact"), [lay.far_constant])


def test_positive_constant_starts_small_and_positive_and_needs_a_near_set():
    lay = layer(far_field="positive", coupling="multiplicative", near_neighbors=5, pos_dim=3)
    assert torch.equal(lay.far_constant.detach(), torch.full((2,), -4.0, dtype=F64))
    assert_close(lay.core.far_constant_value(), torch.log1p(torch.exp(torch.full((2,), -4.0, dtype=F64))))
    with pytest.raises(ValueError, match="far_field='positive'.*near_field.*near_neighbors"):
        FLTAttention(16, 2, coupling="multiplicative", far_field="positive")
    with pytest.raises(ValueError, match="far_constant_value needs far_field='constant' or 'positive'"):
        layer(far_field="near", near_neighbors=5, pos_dim=3).core.far_constant_value()
    name, options = parse_attention("flt:near_neighbors=16:far_field=positive")
    assert (name, options) == ("flt", {"near_neighbors": 16, "far_field": "positive"})
