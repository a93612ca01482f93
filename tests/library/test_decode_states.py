"""``step()`` refuses a state that is not the one its layer returned for this batch (another
kind, another layer's sizes, another batch), by name, instead of failing in a broadcast."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flt import FLTAttention
from flt.layers import ATTENTION
from flt.ops.linear import RecurrentState, recurrent_step

pytestmark = pytest.mark.usefixtures("one_thread")


def _decoders():
    out = {name: (lambda name=name: ATTENTION[name](16, 2, causal=True)) for name in ATTENTION
           if ATTENTION[name](16, 2, causal=True).supports_decoding}
    out["flt-band"] = lambda: FLTAttention.from_options(16, 2, causal=True, near_field=4)
    return out


DECODERS = _decoders()


@pytest.mark.parametrize("name", sorted(DECODERS))
@pytest.mark.parametrize("state", [object(), {"position": 1}, (1, 2), torch.zeros(3)])
def test_a_foreign_object_is_refused_as_a_state(name, state):
    layer = DECODERS[name]()
    with pytest.raises(TypeError, match=r"state must be the \w+ of the previous step \(or None\), got"):
        layer.step(torch.randn(2, 16), state)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_a_state_of_another_layer_or_batch_is_refused_by_name(name):
    torch.manual_seed(0)
    layer = DECODERS[name]()
    _, state = layer.step(torch.randn(2, 16))
    other = DECODERS[name]().__class__.from_options(32, 4, causal=True, **({"near_field": 4} if name == "flt-band" else {}))
    with pytest.raises(ValueError, match=r"state is not a \w+ of this layer for this batch: its \w+ has shape"):
        other.step(torch.randn(2, 32), state)
    with pytest.raises(ValueError, match=r"batch|state is not a"):
        layer.step(torch.randn(3, 16), state)
    # The state it returned still continues.
    y, state = layer.step(torch.randn(2, 16), state)
    assert y.shape == (2, 16) and torch.isfinite(y).all()


def test_a_state_with_a_bad_position_is_refused():
    layer = FLTAttention(16, 2, causal=True)
    _, state = layer.step(torch.randn(2, 16))
    with pytest.raises(TypeError, match=r"DecodeState of the previous step .* with position -3"):
        layer.step(torch.randn(2, 16), replace(state, position=-3))


def test_recurrent_step_checks_its_state():
    q, k, v = torch.rand(2, 3, 4), torch.rand(2, 3, 4), torch.randn(2, 3, 5)
    _, state = recurrent_step(q, k, v)
    assert isinstance(state, RecurrentState)
    with pytest.raises(TypeError, match=r"state must be the RecurrentState"):
        recurrent_step(q, k, v, {"kv": state.kv})
    with pytest.raises(ValueError, match=r"its kv has shape \(2, 3, 1, 20\) on cpu, this step needs \(2, 3, 1, 24\)"):
        recurrent_step(q, k, torch.randn(2, 3, 6), state)
