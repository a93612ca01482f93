"""The models with every registered attention mechanism: shapes, gradients, causality,
decoding, symmetries, CAPE; the token model's two heads."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close, random_rotation

from flt import ATTENTION
from flt.models import (
    CausalLM,
    ImageConfig,
    LMConfig,
    MoleculeConfig,
    TokenModel,
    build_model,
    replace_fields,
    tie_isotropic,
)
from flt.relative.spectra import GaussianKernelSpectrum
from flt.tasks import config_from_dict, config_keys, config_to_dict
from flt.train.presets import ATTENTION_DEFAULTS

NAMES = sorted(ATTENTION)
TRUNK = {"dim": 24, "depth": 2, "heads": 2}


pytestmark = pytest.mark.usefixtures("one_thread")


def make(cls, attention: str, *, dtype=None, **fields):
    """A small model of config ``cls`` with the task's default options for ``attention``.

    Mechanisms other than FLT that reject a model's setting (e.g. a 1-D-only mechanism in
    the image model) are skipped with the reason; FLT must support everything.
    """
    options = dict(ATTENTION_DEFAULTS[config_keys()[cls]].get(attention, {}))
    options.update(fields.pop("attention_options", {}))
    cfg = cls(**TRUNK, attention=attention, attention_options=options, **fields)
    try:
        return build_model(cfg, dtype=dtype)
    except (ValueError, NotImplementedError) as e:
        if attention == "flt":
            raise
        pytest.skip(f"{attention} does not support this model: {e}")


def molecules(B=3, N=7, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(1, 80, (B, N), generator=g)
    pos = 3.0 * torch.randn(B, N, 3, generator=g, dtype=dtype)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, N - 2 :] = True  # a padded structure
    z[pad] = 0  # the padding element
    return z, pos, pad


def _check_grads(model, out):
    out.float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is None or torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0


@pytest.mark.parametrize("posenc", ["none", "sinusoidal"])
@pytest.mark.parametrize("attention", NAMES)
def test_lm_forward_backward(attention, posenc):
    model = make(LMConfig, attention, vocab_size=11, max_len=16, posenc=posenc)
    logits = model(torch.randint(0, 11, (2, 9)))
    assert logits.shape == (2, 9, 11) and torch.isfinite(logits).all()
    _check_grads(model, logits)


@pytest.mark.parametrize("posenc", ["none", "sinusoidal", "fourier"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("attention", NAMES)
def test_vit_forward_backward(attention, pooling, posenc):
    model = make(ImageConfig, attention, image_size=8, channels=3, num_classes=5, patch_size=2, pooling=pooling, posenc=posenc)
    logits = model(torch.randn(2, 3, 8, 8))
    assert logits.shape == (2, 5) and torch.isfinite(logits).all()
    _check_grads(model, logits)


@pytest.mark.parametrize("posenc", ["none", "sinusoidal", "fourier"])
@pytest.mark.parametrize("readout", ["mean", "sum"])
@pytest.mark.parametrize("attention", NAMES)
def test_molecule_forward_backward(attention, readout, posenc):
    model = make(MoleculeConfig, attention, readout=readout, posenc=posenc, target_mean=-3.0, target_std=2.0)
    out = model(*molecules())
    assert out.shape == (3,) and torch.isfinite(out).all()
    _check_grads(model, out)


@pytest.mark.parametrize("attention", NAMES)
def test_lm_is_causal(attention):
    model = make(LMConfig, attention, vocab_size=13, max_len=32, dtype=torch.float64).eval()
    tokens = torch.randint(0, 13, (2, 21))
    changed = tokens.clone()
    changed[:, 12:] = torch.randint(0, 13, (2, 9))
    a, b = model(tokens), model(changed)
    assert_close(b[:, :12], a[:, :12])
    assert not torch.allclose(b[:, 12:], a[:, 12:])


DECODERS = [n for n in NAMES if getattr(ATTENTION[n], "supports_decoding", False)]


@pytest.mark.parametrize("attention", DECODERS)
def test_step_decoding_matches_forward_and_greedy_generation(attention):
    # The plain estimator is decoded here (the LM preset's banded one is tested below).
    options = {"near_field": 0, "near_relative": None} if attention == "flt" else {}
    model = make(
        LMConfig, attention, vocab_size=17, max_len=40, dtype=torch.float64, posenc="sinusoidal",
        attention_options=options,
    ).eval()
    assert model.supports_decoding
    tokens = torch.randint(0, 17, (2, 19))
    full = model(tokens)
    state, steps = None, []
    for t in range(tokens.shape[1]):
        logits, state = model.step(tokens[:, t], state)
        steps.append(logits)
    assert_close(torch.stack(steps, dim=1), full, scale=100)
    prompt = tokens[:, :5]
    recurrent = model.generate(prompt, 25, temperature=0, recurrent=True)
    recompute = model.generate(prompt, 25, temperature=0, recurrent=False)
    assert recurrent.shape == (2, 30)
    assert torch.equal(recurrent, recompute)
    assert torch.equal(recurrent[:, :5], prompt)


def test_banded_flt_lm_decodes_with_constant_memory():
    # The LM preset's banded FLT decodes from a ring buffer of the band and the far field's
    # linear state (flt.layers.band_decode): the same logits as forward, the same greedy text.
    model = make(LMConfig, "flt", vocab_size=11, max_len=24, dtype=torch.float64,
                 attention_options={"near_field": 4, "spectrum": "local", "amplitude": 1.0}).eval()
    assert model.supports_decoding
    tokens = torch.randint(0, 11, (2, 15))
    state, steps = None, []
    for t in range(tokens.shape[1]):
        logits, state = model.step(tokens[:, t], state)
        steps.append(logits)
    assert_close(torch.stack(steps, dim=1), model(tokens), scale=100)
    prompt = tokens[:, :3]
    recurrent = model.generate(prompt, 9, temperature=0, recurrent=True)
    assert torch.equal(recurrent, model.generate(prompt, 9, temperature=0, recurrent=False))


def test_generation_samples_valid_tokens_and_is_seeded():
    model = make(LMConfig, "flt", vocab_size=9, max_len=16).eval()
    prompt = torch.zeros(1, 3, dtype=torch.long)
    a = model.generate(prompt, 30, temperature=1.0, top_k=4, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 30, temperature=1.0, top_k=4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.min() >= 0 and a.max() < 9
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 3, temperature=-1.0)


@pytest.mark.parametrize("attention", NAMES)
def test_molecule_permutation_and_translation_invariance(attention):
    """Both hold on the fast path (any mechanism: centring and no token indices)."""
    model = make(MoleculeConfig, attention, dtype=torch.float64).eval()
    z, pos, mask = molecules(dtype=torch.float64)
    out = model(z, pos, mask)
    perm = torch.randperm(5)  # structure 0 has 5 real atoms then padding
    z2, pos2 = z.clone(), pos.clone()
    z2[0, :5], pos2[0, :5] = z[0, perm], pos[0, perm]
    perm_all = torch.randperm(7)
    z2[1:], pos2[1:] = z[1:, perm_all], pos[1:, perm_all]
    assert_close(model(z2, pos2, mask), out, scale=100)
    shifted = pos + torch.tensor([[[4.0, -7.5, 2.25]], [[0.5, 1.0, -3.0]], [[-10.0, 0.0, 6.0]]], dtype=torch.float64)
    assert_close(model(z, shifted, mask), out, scale=1e3)
    # Padding atoms' values are irrelevant.
    junk = pos.clone()
    junk[0, 5:] = 1e3
    assert_close(model(z, junk, mask), out, scale=100)


@torch.no_grad()
def test_molecule_rotation_invariance_exact_and_approximate():
    """Radial spectrum, multiplicative coupling (the FLT paper's form): exact O(N^2) path
    invariant to rounding; fast path up to O(R^-1/2)."""
    def build(R, seed=0):
        torch.manual_seed(seed)
        options = {"num_frequencies": R, "seed": 7, "coupling": "multiplicative", "near_neighbors": 0}
        return make(MoleculeConfig, "flt", dtype=torch.float64, attention_options=options).eval()

    small, large = build(8), build(2048)
    state = {k: v for k, v in small.state_dict().items() if not k.endswith("spectrum.eps")}
    large.load_state_dict(state, strict=False)
    z, pos, mask = molecules(B=4, N=9, dtype=torch.float64)
    rotations = [random_rotation(s) for s in range(3)]
    exact = small(z, pos, mask, exact=True)
    assert_close(large(z, pos, mask, exact=True), exact)
    for rot in rotations:
        assert_close(small(z, pos @ rot.T, mask, exact=True), exact, scale=1e3)
    errors = {}
    for name, model in (("small", small), ("large", large)):
        base = model(z, pos, mask)
        errors[name] = max(float((model(z, pos @ rot.T, mask) - base).abs().max()) for rot in rotations)
    assert errors["large"] < errors["small"] / 3, errors
    assert errors["large"] < 0.05


@torch.no_grad()
def test_molecule_default_flt_exact_path_is_rotation_invariant():
    """The task's default FLT (logit, nearest-keys near set): the near sets and a radial f
    depend on distances only, so the exact path is invariant to rounding."""
    torch.manual_seed(0)
    model = make(MoleculeConfig, "flt", dtype=torch.float64).eval()
    z, pos, mask = molecules(B=4, N=9, dtype=torch.float64)
    exact = model(z, pos, mask, exact=True)
    for s in range(3):
        assert_close(model(z, pos @ random_rotation(s).T, mask, exact=True), exact, scale=1e3)


@torch.no_grad()
def test_molecule_with_the_radial_spectrum_is_rotation_invariant_on_both_paths():
    """spectrum=radial needs no tying: the exact path is invariant to rounding, the fast path
    to its direction rule's error, which a coarser rule makes larger."""
    z, pos, mask = molecules(B=4, N=9, dtype=torch.float64)  # offsets up to 13 A
    moved = {}
    for quadrature in (8, 4):
        torch.manual_seed(0)
        options = {"spectrum": "radial", "num_frequencies": 128, "quadrature": quadrature, "length_scale": 3.0,
                   "coupling": "multiplicative", "near_neighbors": 0}
        model = make(MoleculeConfig, "flt", dtype=torch.float64, attention_options=options).eval()
        exact, fast = model(z, pos, mask, exact=True), model(z, pos, mask)
        scale = float(fast.abs().max())
        gap = float((fast - exact).abs().max()) / scale
        assert gap < 1e-6 if quadrature == 8 else gap > 1e-4  # order 4 is exact only below degree 8
        for s in range(3):
            rotated = pos @ random_rotation(s).T
            assert_close(model(z, rotated, mask, exact=True), exact, scale=1e3)
        moved[quadrature] = max(float((model(z, pos @ random_rotation(s).T, mask) - fast).abs().max()) / scale
                                for s in range(3))
    assert moved[8] < 3e-6 and moved[4] > 10 * moved[8], moved


def test_isotropic_lengths_stay_tied_through_training():
    model = make(MoleculeConfig, "flt", attention_options={"length_scale": [1.0, 2.0, 4.0]})
    spectra = [m for m in model.modules() if isinstance(m, GaussianKernelSpectrum)]
    assert spectra and all(torch.allclose(s.lengths(), s.lengths()[:, :1].expand(-1, 3)) for s in spectra)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(3):
        model(*molecules()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for s in spectra:
        lengths = s.lengths()
        assert torch.equal(lengths, lengths[:, :1].expand_as(lengths))
    local = MoleculeConfig(**TRUNK, attention_options={"spectrum": "local", "coupling": "multiplicative", "num_frequencies": 16})
    with pytest.raises(ValueError, match="radial"):
        build_model(local)
    build_model(replace_fields(local, isotropic=False))


def test_tie_isotropic_rejects_non_radial_spectra():
    from flt.layers import FLTAttention

    layer = FLTAttention.from_options(16, 2, pos_dim=3, spectrum="local", num_frequencies=8)
    with pytest.raises(ValueError, match="radial"):
        tie_isotropic(layer)
    shifted = FLTAttention.from_options(16, 2, pos_dim=3, spectrum="gaussian_mixture", num_frequencies=8, shift=True)
    with pytest.raises(ValueError, match="shift"):
        tie_isotropic(shifted)
    assert tie_isotropic(FLTAttention.from_options(16, 2, pos_dim=3, spectrum="matern", num_frequencies=8)) == 1
    assert tie_isotropic(FLTAttention.from_options(16, 2, pos_dim=3, spectrum="radial", num_frequencies=64)) == 1


def test_isotropic_mixture_is_radial_with_several_lengths_per_head():
    """Tied, a mixture keeps its means at the origin and one length per component, so its
    mask is a sum of radial Gaussians of different lengths, also after training steps."""
    from flt.layers import FLTAttention
    from flt.relative.spectra import GaussianMixtureSpectrum

    torch.manual_seed(0)
    options = dict(pos_dim=3, spectrum="gaussian_mixture", num_frequencies=16, components=4, length_scale=1.0,
                   length_spread=8.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="nonzero means.*mean_scale=0"):  # means drawn off the origin are not radial
        tie_isotropic(FLTAttention.from_options(16, 2, mean_scale=0.5, **options))
    layer = FLTAttention.from_options(16, 2, **options)
    assert tie_isotropic(layer) == 1
    spectrum = next(m for m in layer.modules() if isinstance(m, GaussianMixtureSpectrum))
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    x, pos = torch.randn(2, 7, 16, dtype=torch.float64), torch.randn(2, 7, 3, dtype=torch.float64)
    for _ in range(3):
        layer(x, pos=pos).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(spectrum.mu, torch.zeros_like(spectrum.mu))
    lengths = spectrum.lengths()
    assert torch.equal(lengths, lengths[..., :1].expand_as(lengths))
    assert lengths[0, -1, 0] > 4 * lengths[0, 0, 0]  # the components keep distinct ranges
    delta = torch.randn(5, 3, dtype=torch.float64)
    assert_close(spectrum.mask(delta @ random_rotation(1).T), spectrum.mask(delta))


@pytest.mark.parametrize("attention", NAMES)
def test_vit_cape_random_in_training_identity_in_eval(attention):
    torch.manual_seed(0)
    with_cape = make(ImageConfig, attention, cape=True, posenc="sinusoidal", patch_size=2)
    torch.manual_seed(0)
    without = make(ImageConfig, attention, cape=False, posenc="sinusoidal", patch_size=2)
    without.load_state_dict(with_cape.state_dict())
    images = torch.randn(3, 1, 8, 8)
    with_cape.eval(), without.eval()
    assert torch.equal(with_cape.positions(3), without.positions(3))
    assert_close(with_cape(images), without(images))
    with_cape.train(), without.train()
    assert not torch.equal(with_cape.positions(3), without.positions(3))
    assert not torch.allclose(with_cape(images), with_cape(images))


@torch.no_grad()
def test_exact_mode_matches_fast_path_with_many_features():
    """The exact path is what the fast path estimates (FLT, logit coupling with a nonzero bias)."""
    torch.manual_seed(0)
    opts = {"num_features": 4096, "num_frequencies": 512, "amplitude": 0.5, "seed": 3}
    model = make(ImageConfig, "flt", dtype=torch.float64, attention_options=opts).eval()
    images = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    fast, exact = model(images), model(images, exact=True)
    assert float((fast - exact).abs().max()) < 0.1 * float(exact.abs().max())


def test_exact_mode_needs_an_exact_method():
    model = make(LMConfig, "flt", vocab_size=5, max_len=8)
    model.trunk.blocks[0].attn.exact = None
    with pytest.raises(ValueError, match="no exact"):
        model(torch.zeros(1, 4, dtype=torch.long), exact=True)


def test_configs_are_frozen_and_round_trip():
    cfg = LMConfig(vocab_size=7, attention_options={"spectrum": "local"})
    with pytest.raises(AttributeError):
        cfg.dim = 3
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert replace_fields(cfg, depth=1).depth == 1
    with pytest.raises(ValueError, match="unknown"):
        replace_fields(cfg, depht=1)
    with pytest.raises(ValueError, match="divisible"):
        LMConfig(dim=10, heads=3)
    with pytest.raises(ValueError, match="attention"):
        build_model(LMConfig(attention="no-such-mechanism"))
    with pytest.raises(ValueError, match="posenc"):
        build_model(LMConfig(posenc="no-such-encoding"))
    assert isinstance(build_model(LMConfig(dim=16, depth=1, heads=2, attention_options={"num_features": 8})), CausalLM)


@torch.no_grad()
def test_model_input_errors():
    model = make(MoleculeConfig, "flt")
    z, pos, mask = molecules()
    with pytest.raises(ValueError, match="bool key_padding_mask"):
        model(z, pos, mask.long())
    with pytest.raises(ValueError, match="atomic numbers"):
        model(z + 200, pos, mask)
    with pytest.raises(ValueError, match="True for padding"):  # the real-atom polarity is refused
        model(z, pos, ~mask)
    vit = make(ImageConfig, "flt")
    with pytest.raises(ValueError, match="images must be"):
        vit(torch.randn(2, 3, 8, 8))
    assert math.isfinite(float(vit(torch.randn(1, 1, 8, 8)).sum()))


def token_model(head: str, causal: bool, attention: str = "flt") -> TokenModel:
    torch.manual_seed(0)
    options = dict(ATTENTION_DEFAULTS["listops"].get(attention, {}))
    return TokenModel(vocab_size=11, out_dim=3, head=head, causal=causal, **TRUNK, mlp_ratio=2.0, dropout=0.0,
                      attention=attention, attention_options=options, posenc="none", posenc_options={},
                      dtype=torch.float64).eval()


@torch.no_grad()
@pytest.mark.parametrize("attention", ["flt", "softmax"])
def test_token_model_mean_head_is_the_mean_of_the_token_head(attention):
    # The two heads hold the same parameters under the same names (a strict load), and the
    # head is linear: the mean head's output is the token head's averaged over the valid tokens.
    mean, token = token_model("mean", False, attention), token_model("token", False, attention)
    assert [name for name, _ in mean.named_children()] == ["embed", "posenc", "drop", "trunk", "head"]
    token.load_state_dict(mean.state_dict(), strict=True)
    tokens = torch.randint(0, 11, (2, 9))
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True
    per_token, pooled = token(tokens, pad), mean(tokens, pad)
    assert per_token.shape == (2, 9, 3) and pooled.shape == (2, 3)
    assert_close(pooled[0], per_token[0].mean(0))
    assert_close(pooled[1], per_token[1, :6].mean(0))
    assert_close(mean(tokens), token(tokens).mean(1))


@torch.no_grad()
def test_token_model_causal_flag():
    causal, bidirectional = token_model("token", True), token_model("token", False)
    tokens = torch.randint(0, 11, (2, 12))
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 11
    assert_close(causal(changed)[:, :8], causal(tokens)[:, :8])
    assert not torch.allclose(causal(changed)[:, 8:], causal(tokens)[:, 8:])
    assert not torch.allclose(bidirectional(changed)[:, :8], bidirectional(tokens)[:, :8])
    with pytest.raises(ValueError, match="head"):
        token_model("sum", False)
