"""A layer is its projections plus a core: the core computes, the layer projects around it,
reads and writes of the core's attributes through the layer reach the core, and names that
seed draws or key saved states are those of the layers before they had cores."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange

from flt.functional import AttentionCore
from flt.layers import ATTENTION, CoreBase, FLTAttention
from flt.layers.base import move_into_cores
from flt.layers.draws import random_feature_modules
from flt.models import LMConfig, build_model
from flt.train.rng import rng_state

F64 = torch.float64
OPTIONS = {"flt": {"num_features": 8, "num_frequencies": 4, "seed": 0, "near_field": 2}, "performer": {"num_features": 8, "seed": 0},
           "toeplitz": {"num_features": 8, "seed": 0, "max_distance": 4}, "softmax": {"relative_bias": "alibi"}}


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_layer_is_its_projections_around_its_core(name: str) -> None:
    torch.manual_seed(0)
    layer = ATTENTION[name].from_options(16, 2, causal=True, dtype=F64, **OPTIONS[name]).eval()
    assert set(dict(layer.named_children())) == {"to_qkv", "to_out", "core"}
    assert isinstance(layer.core, CoreBase)
    assert not dict(layer.named_parameters(recurse=False)) and not dict(layer.named_buffers(recurse=False))
    x = torch.randn(2, 7, 16, dtype=F64)
    q, k, v = rearrange(layer.to_qkv(x), "b n (three h d) -> three b h n d", three=3, h=2)
    pos = torch.arange(7, dtype=F64).view(1, 7, 1)
    for method in ("forward", "reference", "exact"):
        by_hand = layer.to_out(rearrange(getattr(layer.core, method)(q, k, v, pos), "b h n d -> b n (h d)"))
        assert torch.equal(by_hand, getattr(layer, method)(x))
    assert all(key.split(".")[0] in ("to_qkv", "to_out", "core") for key in layer.state_dict())
    assert AttentionCore.from_layer(layer).attention is layer.core


def test_reads_and_writes_of_core_attributes_through_the_layer_reach_the_core() -> None:
    layer = FLTAttention.from_options(16, 2, coupling="multiplicative", num_features=8, num_frequencies=4)
    assert layer.spectrum is layer.core.spectrum and layer.feature_map is layer.core.feature_map
    assert layer.near is None and layer.coupling == "multiplicative"
    layer.check_condition = False
    assert layer.core.check_condition is False and "check_condition" not in layer.__dict__
    layer.causal = True  # held by both: set on both
    assert layer.causal and layer.core.causal
    layer.note = "mine"  # a name the core does not have stays the layer's
    assert layer.note == "mine" and not hasattr(layer.core, "note")
    with pytest.raises(AttributeError, match="no_such_part"):
        layer.no_such_part  # noqa: B018


def test_draw_and_generator_names_are_those_before_cores() -> None:
    """Fixed draws are seeded by module name and a run saves its modules' generators by
    name: the core adds no part to those names, so older checkpoints get the same draws."""
    torch.manual_seed(0)
    config = LMConfig(vocab_size=11, max_len=8, dim=8, depth=1, heads=2, attention="flt",
                      attention_options={"num_features": 8, "num_frequencies": 4, "seed": 0})
    model = build_model(config)
    names = [name for name, _ in random_feature_modules(model)]
    assert names == ["trunk.blocks.0.attn.feature_map", "trunk.blocks.0.attn.spectrum"]
    pytest.importorskip("numpy")
    assert sorted(rng_state(model)["modules"]) == ["trunk.blocks.0.attn.feature_map._generator"]


def test_move_into_cores_renames_an_old_state_dict_to_the_model_keys() -> None:
    torch.manual_seed(0)
    config = LMConfig(vocab_size=11, max_len=8, dim=8, depth=1, heads=2, attention="performer",
                      attention_options={"num_features": 8, "redraw_interval": 2})
    model = build_model(config)
    new = model.state_dict()
    old = {k.replace(".attn.core.", ".attn."): v for k, v in new.items()}
    assert old != new and move_into_cores(model, old) == new


def test_toeplitz_refuses_prefill_as_it_refuses_step() -> None:
    """Its bias depends on every offset: no constant-size state (a prefill used to return
    the linear state without the bias)."""
    layer = ATTENTION["toeplitz"].from_options(16, 2, causal=True, **OPTIONS["toeplitz"])
    x = torch.randn(1, 5, 16)
    with pytest.raises(NotImplementedError, match="recurrent state"):
        layer.prefill(x)
    with pytest.raises(NotImplementedError, match="recurrent state"):
        layer.step(x[:, 0])
