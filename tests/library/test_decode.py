"""Decoding: exact softmax from a KV cache, and the parallel prefill of every decoding layer.

Identities, float64: feeding a sequence token by token (``step``) equals the causal
forward; a prefill of the first ``T0`` tokens followed by steps equals it too, and leaves
the state the steps would have built; the language model's prefill and generation agree
with its forward and with generation by recomputation.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close
from flt.layers import ATTENTION
from flt.layers.band_decode import BandDecodeState
from flt.layers.flt import FLTAttention
from flt.layers.kernel import DecodeState
from flt.layers.performer import PerformerAttention
from flt.layers.softmax import KVCache, SoftmaxAttention
from flt.models import LMConfig, build_model
from flt.relative import RELATIVE
from flt.relative.spectra import SPECTRA

F64 = torch.float64

#: Every relative term of flt.relative.RELATIVE that a causal 1-D softmax layer takes, both
#: couplings of the spectra, RoPE alone and with a table.
SOFTMAX_TERMS = {
    "none": {},
    "t5": {"relative_bias": "t5", "max_distance": 12, "num_buckets": 8},
    "clipped": {"relative_bias": "clipped", "max_distance": 5},
    "alibi": {"relative_bias": "alibi"},
    "alibi-learnable": {"relative_bias": "alibi", "alibi_learnable": True},
    "spd": {"relative_bias": "spd", "relative_options": {"max_distance": 6}},  # hop counts; on a line, |i - j|
    "rope": {"rope": True},
    "t5+rope": {"relative_bias": "t5", "rope": True},
    **{f"{s}-{c}": {"relative_bias": "spectrum", "spectrum": s, "coupling": c} for s in SPECTRA for c in ("logit", "multiplicative")},
}


def randomised(layer):
    """The layer in float64 and eval mode, its zero-initialised parameters (tables, spectra
    at amplitude 0) drawn at random so that every term contributes."""
    layer = layer.double().eval()
    with torch.no_grad():
        for p in layer.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.5)
    return layer


def stepped(layer, x, pos=None, state=None, start=0):
    """Outputs ``[B, N - start, dim]`` of feeding ``x[:, start:]`` token by token, and the state."""
    outs = []
    for t in range(start, x.shape[1]):
        y, state = layer.step(x[:, t], state, None if pos is None else pos[:, t])
        outs.append(y)
    return torch.stack(outs, dim=1), state


def integer_positions(batch: int, n: int) -> torch.Tensor:
    """Increasing, irregular integer positions ``[B, N, 1]`` (the tables need integers)."""
    return torch.randint(1, 4, (batch, n, 1)).cumsum(1).to(F64) + 5.0


def test_the_relative_terms_cover_the_registry():
    # A term added to RELATIVE must be added to SOFTMAX_TERMS (through "spectrum" for spectra).
    covered = {o.get("relative_bias") for o in SOFTMAX_TERMS.values()} | {o.get("spectrum") for o in SOFTMAX_TERMS.values()}
    assert set(RELATIVE) <= covered


@pytest.mark.parametrize("term", list(SOFTMAX_TERMS))
def test_softmax_steps_from_a_kv_cache_equal_the_causal_forward(term):
    layer = randomised(SoftmaxAttention.from_options(16, 2, causal=True, **SOFTMAX_TERMS[term]))
    assert layer.supports_decoding
    x = torch.randn(2, 21, 16, dtype=F64)
    pos = integer_positions(2, 21)
    with torch.no_grad():  # in-place appends; the cache outgrows its first capacity (16)
        out, cache = stepped(layer, x)
        assert_close(out, layer(x))
        assert isinstance(cache, KVCache) and cache.length == 21 and cache.k.shape[2] > 21
        out, _ = stepped(layer, x, pos)
        assert_close(out, layer(x, pos))


@pytest.mark.parametrize("term", ["t5", "alibi", "gaussian_mixture-multiplicative", "rope"])
@pytest.mark.parametrize("prompt", [1, 6, 20])
def test_softmax_prefill_then_steps_equal_the_causal_forward(term, prompt):
    layer = randomised(SoftmaxAttention.from_options(16, 2, causal=True, **SOFTMAX_TERMS[term]))
    x = torch.randn(2, 20, 16, dtype=F64)
    pos = integer_positions(2, 20)
    full = layer(x, pos)
    y, cache = layer.prefill(x[:, :prompt], pos[:, :prompt])
    assert_close(y, full[:, :prompt])
    assert cache.length == prompt
    if prompt < 20:
        rest, _ = stepped(layer, x, pos, cache, start=prompt)
        assert_close(rest, full[:, prompt:])


def test_a_kv_cache_can_be_branched():
    # Two continuations of one state share its buffer's spare capacity: the second must
    # not overwrite the first's token, and neither may see the other's.
    layer = randomised(SoftmaxAttention.from_options(16, 2, causal=True, relative_bias="alibi"))
    x = torch.randn(1, 8, 16, dtype=F64)
    p, q, r = torch.randn(3, 1, 16, dtype=F64)
    with torch.no_grad():  # with autograd the cache is concatenated, never shared
        _, cache = layer.prefill(x[:, :7])
        _, cache = layer.step(x[:, 7], cache)  # the cache has grown: spare capacity follows
        assert cache.k.shape[2] > cache.length == 8
        y_p, cache_p = layer.step(p, cache)
        y_q, cache_q = layer.step(q, cache)
        y_pr, _ = layer.step(r, cache_p)
        y_qr, _ = layer.step(r, cache_q)
    for prefix, y in ((p, y_p), (q, y_q)):
        assert_close(y, layer(torch.cat([x, prefix[:, None]], 1))[:, 8])
    for prefix, y in ((p, y_pr), (q, y_qr)):
        assert_close(y, layer(torch.cat([x, prefix[:, None], r[:, None]], 1))[:, 9])
    assert cache.length == 8 and cache_p.length == cache_q.length == 9


def test_softmax_decoding_keeps_gradients():
    layer = randomised(SoftmaxAttention.from_options(16, 2, causal=True, relative_bias="t5"))
    x = torch.randn(2, 9, 16, dtype=F64, requires_grad=True)
    up = torch.randn(2, 9, 16, dtype=F64)
    y, cache = layer.prefill(x[:, :4])
    rest, _ = stepped(layer, x, state=cache, start=4)
    (g_step,) = torch.autograd.grad((torch.cat([y, rest], 1) * up).sum(), x)
    (g_full,) = torch.autograd.grad((layer(x) * up).sum(), x)
    assert_close(g_step, g_full)


KERNEL_LAYERS = {
    "flt-logit": lambda: FLTAttention.from_options(16, 2, causal=True, num_features=8, num_frequencies=4),
    "flt-multiplicative": lambda: FLTAttention.from_options(16, 2, causal=True, num_features=8, num_frequencies=4, coupling="multiplicative", amplitude=0.5,
                                               chunk_size=4),  # the prefill state sums in several chunks
    "flt-multiplicative-relu": lambda: FLTAttention.from_options(16, 2, causal=True, num_features=8, num_frequencies=4, coupling="multiplicative", feature_map="relu"),
    "flt-band": lambda: FLTAttention.from_options(16, 2, causal=True, num_features=8, num_frequencies=4, near_field=4, spectrum="local", amplitude=1.0),
    "flt-band-shifted": lambda: FLTAttention.from_options(16, 2, causal=True, num_features=8, num_frequencies=4, near_field=4, spectrum="local", amplitude=1.0,
                                             windows=2, shift=True, shift_scale=4.0),  # far and near windows moved off the origin
    "flt-band-rope": lambda: FLTAttention.from_options(16, 2, causal=True, num_features=8, num_frequencies=4, near_field=3, rope=True),
    "flt-band-wider-than-prompts": lambda: FLTAttention.from_options(16, 2, causal=True, num_features=8, num_frequencies=4, near_field=30),
    "performer": lambda: PerformerAttention.from_options(16, 2, causal=True, num_features=8),
    "performer-rope": lambda: PerformerAttention.from_options(16, 2, causal=True, num_features=8, rope=True),
    "softmax-t5": lambda: SoftmaxAttention.from_options(16, 2, causal=True, relative_bias="t5", max_distance=12, num_buckets=8),
    "softmax-alibi": lambda: SoftmaxAttention.from_options(16, 2, causal=True, relative_bias="alibi"),
}


@pytest.mark.parametrize("name", list(KERNEL_LAYERS))
@pytest.mark.parametrize("prompt", [1, 3, 9, 16])
def test_prefill_then_steps_equal_the_full_forward(name, prompt):
    layer = randomised(KERNEL_LAYERS[name]())
    x = torch.randn(2, 16, 16, dtype=F64)
    pos = integer_positions(2, 16)
    full = layer(x, pos)
    y, state = layer.prefill(x[:, :prompt], pos[:, :prompt])
    assert_close(y, full[:, :prompt])
    if prompt < 16:
        rest, _ = stepped(layer, x, pos, state, start=prompt)
        # The multiplicative coupling's signed weights cancel: its sums lose a few digits.
        assert_close(rest, full[:, prompt:], scale=10)


@pytest.mark.parametrize("name", [n for n in KERNEL_LAYERS if not n.startswith("softmax")])
def test_left_padded_prefill_then_steps_decode_each_row_as_alone(name):
    """Prompts of 2 and 11 tokens padded on the left to 11 (padded keys masked), then 4
    steps: each row's outputs are those of its prompt prefilled alone. With w = 4 the short
    row's ring holds 3 padded slots and its far field only padding; neither may leak."""
    layer = randomised(KERNEL_LAYERS[name]())
    lengths, total, steps = (2, 11), 11, 4
    x = torch.randn(2, total + steps, 16, dtype=F64)
    pad = torch.arange(total + steps).view(1, -1) < (total - torch.tensor(lengths)).view(-1, 1)  # [B, N]
    pos = integer_positions(2, total + steps).masked_fill(pad.unsqueeze(-1), 0.0)  # as Hugging Face's position ids
    y, state = layer.prefill(x[:, :total], pos[:, :total], pad[:, :total])
    rest, _ = stepped(layer, x, pos, state, start=total)
    for b, n in enumerate(lengths):
        row = slice(b, b + 1)
        alone, alone_state = layer.prefill(x[row, total - n:total], pos[row, total - n:total])
        alone_rest, _ = stepped(layer, x[row, total - n:], pos[row, total - n:], alone_state, start=n)
        assert_close(y[row, total - n:], alone, msg=f"prompt of row {b}")
        assert_close(rest[row], alone_rest, scale=10, msg=f"steps of row {b}")


def test_softmax_prefill_refuses_a_padding_mask():
    layer = randomised(KERNEL_LAYERS["softmax-alibi"]())
    with pytest.raises(ValueError, match="key_padding_mask"):
        layer.prefill(torch.randn(1, 3, 16, dtype=F64), None, torch.tensor([[True, False, False]]))


@pytest.mark.parametrize("prompt", [2, 5, 6, 13])
def test_band_prefill_builds_the_state_the_steps_build(prompt):
    layer = randomised(KERNEL_LAYERS["flt-band"]())  # w = 4: the ring holds 5 tokens
    x = torch.randn(2, prompt, 16, dtype=F64)
    _, by_prefill = layer.prefill(x)
    _, by_steps = stepped(layer, x)
    assert isinstance(by_prefill, BandDecodeState) and by_prefill.position == by_steps.position == prompt
    for name in ("xk", "v", "kf", "kls", "pos"):
        assert_close(getattr(by_prefill, name), getattr(by_steps, name), msg=name)
    assert torch.equal(torch.isinf(by_prefill.level), torch.isinf(by_steps.level))
    assert torch.isinf(by_prefill.level).all() == (prompt <= 5)  # the far field is empty until a token leaves the band
    if prompt > 5:
        # The far sums are kept relative to exp(level): compare them on one scale.
        shift = torch.exp(by_prefill.level - by_steps.level)
        assert_close(by_prefill.kv * shift[..., None, None], by_steps.kv)
        assert_close(by_prefill.z * shift[..., None], by_steps.z)


def test_linear_prefill_builds_the_state_the_steps_build():
    layer = randomised(KERNEL_LAYERS["flt-multiplicative"]())
    x = torch.randn(2, 7, 16, dtype=F64)
    _, by_prefill = layer.prefill(x)
    _, by_steps = stepped(layer, x)
    assert isinstance(by_prefill, DecodeState) and by_prefill.position == by_steps.position == 7
    a, b = by_prefill.inner, by_steps.inner
    shift = torch.exp(a.level - b.level)
    assert_close(a.kv * shift[..., None, None], b.kv)
    assert_close(a.z * shift[..., None, None], b.z)


@pytest.mark.parametrize(
    "layer",
    [
        lambda: SoftmaxAttention.from_options(16, 2),
        lambda: PerformerAttention.from_options(16, 2),
        lambda: FLTAttention.from_options(16, 2, near_field=2),
    ],
    ids=["softmax", "performer", "flt-band"],
)
def test_bidirectional_layers_refuse_to_decode(layer):
    lay = layer()
    with pytest.raises(ValueError, match="causal=True"):
        lay.prefill(torch.randn(1, 4, 16))
    with pytest.raises(ValueError, match="causal=True"):
        lay.step(torch.randn(1, 16))


def test_softmax_decodes_only_when_causal_and_names_bad_states():
    assert SoftmaxAttention.from_options(16, 2, causal=True).supports_decoding
    assert not SoftmaxAttention.from_options(16, 2).supports_decoding
    layer = SoftmaxAttention.from_options(16, 2, causal=True)
    with pytest.raises(TypeError, match="KVCache"):
        layer.step(torch.randn(1, 16), DecodeState())
    with pytest.raises(ValueError, match=r"x must be \[B, dim\]|\[B, dim\]"):
        layer.step(torch.randn(1, 2, 16))
    _, cache = layer.prefill(torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="batch 2"):
        layer.step(torch.randn(3, 16), cache)


def lm(attention: str, options: dict, **fields) -> torch.nn.Module:
    cfg = LMConfig(vocab_size=13, max_len=40, dim=16, depth=2, heads=2, mlp_ratio=2.0, dropout=0.0,
                   attention=attention, attention_options=options, **fields)
    return randomised(build_model(cfg))


LMS = {
    "flt-band": ("flt", {"near_field": 4, "spectrum": "local", "amplitude": 1.0, "num_features": 8, "num_frequencies": 4}),
    "flt-multiplicative": ("flt", {"coupling": "multiplicative", "num_features": 8, "num_frequencies": 4}),
    "performer": ("performer", {"num_features": 8}),
    "softmax-t5": ("softmax", {"relative_bias": "t5"}),
    "softmax-alibi": ("softmax", {"relative_bias": "alibi"}),
}


@pytest.mark.parametrize("name", list(LMS))
def test_lm_prefill_and_generation_match_the_forward(name):
    model = lm(*LMS[name])
    assert model.supports_decoding
    tokens = torch.randint(0, 13, (2, 17))
    full = model(tokens)
    logits, state = model.prefill(tokens[:, :6])
    assert_close(logits, full[:, :6])
    assert state.position == 6 and len(state.layers) == 2
    steps = []
    for t in range(6, 17):
        step_logits, state = model.step(tokens[:, t], state)
        steps.append(step_logits)
    assert_close(torch.stack(steps, 1), full[:, 6:], scale=100)
    prompt = tokens[:, :5]
    recurrent = model.generate(prompt, 20, temperature=0, recurrent=True)
    assert torch.equal(recurrent, model.generate(prompt, 20, temperature=0, recurrent=False))
    assert recurrent.shape == (2, 25) and torch.equal(recurrent[:, :5], prompt)


def test_lm_without_a_decoding_layer_names_it():
    model = lm("toeplitz", {})
    assert not model.supports_decoding
    with pytest.raises(ValueError, match="toeplitz"):
        model.prefill(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="recurrent"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, recurrent=True)
    assert model.generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=0).shape == (1, 5)


def test_every_registered_causal_layer_that_decodes_prefills():
    decoders = []
    for name, cls in ATTENTION.items():
        layer = cls(16, 2, causal=True).eval()
        if layer.supports_decoding:
            decoders.append(name)
            x = torch.randn(1, 5, 16)
            y, _ = layer.prefill(x)
            torch.testing.assert_close(y, layer(x))
    assert set(decoders) == {"softmax", "performer", "flt"}
