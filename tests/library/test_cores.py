"""A layer is its projections plus a core: the core computes, the layer projects around it,
the layer's properties read (and ``check_condition`` writes) the core's parts while no other
name reaches through, and names that seed draws or key saved states are those of the layers
before they had cores."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange

from flt.functional import AttentionCore
from flt.layers import (
    ATTENTION,
    CoreBase,
    FLTAttention,
    PerformerAttention,
    SoftmaxAttention,
    ToeplitzAttention,
)
from flt.layers.base import AttentionBase
from flt.layers.draws import random_feature_modules
from flt.layers.upgrade import upgrade_state_dict
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


def test_the_base_class_forwards_nothing_and_lists_modules_as_torch_does() -> None:
    """No attribute lookup, write or module listing of its own: a miss on a layer is an
    ``AttributeError`` at once, and ``parameters()`` lists what ``nn.Module`` lists."""
    for name in ("__getattr__", "__setattr__", "named_modules", "_load_from_state_dict", "move_into_core"):
        assert name not in AttentionBase.__dict__, name
    layer = FLTAttention.from_options(16, 2, num_features=8, num_frequencies=4, far_field="constant", near_field=2)
    assert not hasattr(layer, "scaled_qk") and hasattr(layer.core, "scaled_qk")  # a core's method stays the core's
    with pytest.raises(AttributeError, match="no_such_part"):
        layer.no_such_part
    layer.note = "mine"
    assert layer.note == "mine" and not hasattr(layer.core, "note")
    names = [name for name, _ in layer.named_parameters()]
    assert names[:3] == ["to_qkv.weight", "to_out.weight", "to_out.bias"] and names[3] == "core.far_constant"


def test_flt_properties_read_the_core_and_check_condition_writes_it() -> None:
    layer = FLTAttention.from_options(16, 2, coupling="multiplicative", num_features=8, num_frequencies=4,
                                      near_neighbors=3, far_field="constant", pos_dim=2)
    core = layer.core
    assert layer.spectrum is core.spectrum and layer.near_spectrum is core.near_spectrum is not None
    assert layer.feature_map is core.feature_map and layer.scaling is core.scaling
    assert layer.near is core.near and layer.near_neighbors == 3 and layer.near_field == 0
    assert layer.coupling == "multiplicative" and layer.far_field == "constant"
    assert layer.far_constant is core.far_constant and layer.far_constant.shape == (2,)
    assert layer.check_condition is True
    layer.check_condition = False
    assert core.check_condition is False and "check_condition" not in layer.__dict__
    with pytest.raises(ValueError, match="check_condition must be True or False"):
        layer.check_condition = 1  # type: ignore[assignment]
    plain = FLTAttention.from_options(16, 2, num_features=8, num_frequencies=4)
    assert plain.near is None and plain.near_spectrum is None and plain.far_constant is None and plain.far_field is True


def test_other_layers_properties_read_their_cores() -> None:
    performer = PerformerAttention.from_options(16, 2, num_features=8)
    assert performer.feature_map is performer.core.feature_map and performer.scaling is performer.core.scaling
    toeplitz = ToeplitzAttention.from_options(16, 2, num_features=8, max_distance=4)
    assert toeplitz.table is toeplitz.core.table and toeplitz.feature_map is toeplitz.core.feature_map
    table = SoftmaxAttention.from_options(16, 2, relative_bias="t5")
    assert table.relative is table.core.relative is table.table and table.spectrum is None
    spectrum = SoftmaxAttention.from_options(16, 2, relative_bias="spectrum", num_frequencies=4)
    assert spectrum.relative is spectrum.core.relative is spectrum.spectrum and spectrum.table is None
    assert SoftmaxAttention(16, 2).relative is None


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


def test_upgrade_state_dict_renames_an_old_state_dict_to_the_model_keys() -> None:
    torch.manual_seed(0)
    config = LMConfig(vocab_size=11, max_len=8, dim=8, depth=1, heads=2, attention="performer",
                      attention_options={"num_features": 8, "redraw_interval": 2})
    model = build_model(config)
    new = model.state_dict()
    old = {k.replace(".attn.core.", ".attn."): v for k, v in new.items()}
    assert old != new and upgrade_state_dict(model, old) == new


def test_toeplitz_refuses_prefill_as_it_refuses_step() -> None:
    """Its bias depends on every offset: no constant-size state (a prefill used to return
    the linear state without the bias)."""
    layer = ATTENTION["toeplitz"].from_options(16, 2, causal=True, **OPTIONS["toeplitz"])
    x = torch.randn(1, 5, 16)
    with pytest.raises(NotImplementedError, match="recurrent state"):
        layer.prefill(x)
    with pytest.raises(NotImplementedError, match="recurrent state"):
        layer.step(x[:, 0])
