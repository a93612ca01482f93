"""Layers built from parts: the parts' own checks, the flat options' builder, both seeds,
the constructors' size and the state dict names that checkpoints rely on."""

from __future__ import annotations

import inspect

import pytest
import torch

from flt._signatures import constructor_options
from flt.layers import (
    ATTENTION,
    Band,
    EluFeatures,
    FavorPlus,
    FLTAttention,
    Hedgehog,
    Neighbors,
    Settings,
    SoftmaxAttention,
    Term,
)
from flt.layers.base import CORE_ARGUMENTS, AttentionBase
from flt.layers.performer import PerformerCore
from flt.relative.spectra import SPECTRA

F64 = torch.float64


@pytest.mark.parametrize("cls", [FLTAttention, SoftmaxAttention])
def test_constructors_take_at_most_twelve_parameters(cls):
    assert len(inspect.signature(cls).parameters) <= 12
    assert not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values())


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_a_layer_takes_its_cores_parts_and_writes_no_constructor(name):
    """One signature per mechanism: the layer's keywords are its core's, read from the core."""
    cls = ATTENTION[name]
    assert "__init__" not in cls.__dict__
    layer_params = list(inspect.signature(cls).parameters)
    core_params = [p for p in inspect.signature(cls.core_class).parameters if p not in CORE_ARGUMENTS]
    assert layer_params == ["dim", "heads", "pos_dim", "causal", *core_params, "device", "dtype"]
    layer = cls(16, 2, dtype=F64)
    assert type(layer.core) is cls.core_class and layer.core.head_dim == 8
    assert [n for n, _ in layer.named_children()] == ["to_qkv", "to_out", "core"]  # parameter order of saved optimizers


def test_a_layer_class_without_flat_options_is_checked_against_its_cores_parts():
    class Plain(AttentionBase):
        core_class = PerformerCore

    options = constructor_options(Plain)
    assert not options.open and {"features", "settings"} <= set(options.params)
    assert not {"head_dim", "feature_dim"} & set(options.params)
    with pytest.raises(TypeError, match="unknown option 'feature'"):
        Plain.from_options(16, 2, feature=FavorPlus())
    assert Plain.from_options(16, 2, features=EluFeatures()).core.feature_map.kind == "elu"


def test_the_parts_read_on_a_layer_are_its_cores_and_are_set_there():
    layer = FLTAttention(16, 2, near=Band(2))
    assert layer.spectrum is layer.core.spectrum and layer.near is layer.core.near and layer.near_field == 2
    assert layer.feature_map is layer.core.feature_map
    with pytest.raises(AttributeError, match=r"set it on layer\.core"):
        layer.coupling = "multiplicative"
    assert layer.coupling == "logit"
    assert "far term" in FLTAttention.spectrum.__doc__


def _same_modules(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("near", ["band", "neighbors"])
def test_parts_and_flat_options_build_the_same_layer(near):
    flat = {"near_field": 3} if near == "band" else {"near_neighbors": 3}
    part = Band(3, term="clipped") if near == "band" else Neighbors(3, term="clipped")
    torch.manual_seed(0)
    a = FLTAttention.from_options(16, 2, spectrum="local", num_frequencies=8, num_features=32, seed=1,
                                  near_relative="clipped", dtype=F64, **flat)
    torch.manual_seed(0)
    b = FLTAttention(16, 2, relative=Term("local", num_frequencies=8), features=FavorPlus(num_features=32, seed=1),
                     near=part, dtype=F64)
    _same_modules(a, b)
    assert a.near == b.near and a.core.kernel == b.core.kernel
    x, pos = torch.randn(2, 9, 16, dtype=F64), torch.randint(-20, 20, (2, 9, 1)).to(F64)
    torch.testing.assert_close(a(x, pos), b(x, pos), rtol=0, atol=0)


def test_state_dict_names_are_those_of_the_flat_layer():
    """Checkpoints written before the parts load: the modules keep their names."""
    layer = FLTAttention.from_options(16, 2, near_field=2, causal=True, redraw_interval=3)
    prefixes = {key.split(".")[0] for key in layer.core.state_dict()}
    assert prefixes == {"scaling", "feature_map", "spectrum", "near_spectrum", "redraw_calls"}
    assert {key.split(".")[0] for key in layer.state_dict()} == {"to_qkv", "to_out", "core"}
    softmax = SoftmaxAttention.from_options(16, 2, relative_bias="t5", max_distance=40)
    assert {key.split(".")[0] for key in softmax.core.state_dict()} == {"relative"}


def test_the_spectrum_seed_and_the_feature_seed_are_both_set():
    a = FLTAttention.from_options(16, 2, seed=0, spectrum_seed=5)
    b = FLTAttention(16, 2, features=FavorPlus(seed=0), relative=Term("gaussian_mixture", seed=5))
    c = FLTAttention.from_options(16, 2, seed=0, spectrum_seed=6)
    assert a.spectrum.seed == b.spectrum.seed == 5
    assert torch.equal(a.spectrum.eps, b.spectrum.eps) and not torch.equal(a.spectrum.eps, c.spectrum.eps)
    assert torch.equal(a.feature_map.projection, c.feature_map.projection)  # the features' seed alone sets it


def test_a_spectrum_module_as_the_far_term():
    torch.manual_seed(0)
    spectrum = SPECTRA["gaussian"](heads=2, pos_dim=2, num_frequencies=8)
    layer = FLTAttention(16, 2, pos_dim=2, relative=spectrum, near=Neighbors(4, term="matern"))
    assert layer.spectrum is spectrum and layer.feature_map.dim == 8 + 2 * 8 and layer.near_spectrum.num_frequencies == 8
    assert layer(torch.randn(1, 6, 16), torch.randn(1, 6, 2)).shape == (1, 6, 16)
    with pytest.raises(ValueError, match="with a module as relative, give the near set its term"):
        FLTAttention(16, 2, pos_dim=2, relative=spectrum, near=Neighbors(4))
    with pytest.raises(TypeError, match="relative must be a spectrum"):
        FLTAttention(16, 2, relative=torch.nn.Linear(2, 2))


def test_parts_check_their_own_values():
    with pytest.raises(ValueError, match="width must be a positive int"):
        Band(0)
    with pytest.raises(ValueError, match="k must be a positive int"):
        Neighbors(-1)
    with pytest.raises(TypeError, match=r"FavorPlus: num_features must be an int, got 'x' \(str\)"):
        FavorPlus(num_features="x")
    with pytest.raises(ValueError, match="num_features must be even for feature_map='hedgehog'"):
        Hedgehog(num_features=3)
    with pytest.raises(ValueError, match="temperature must be positive"):
        EluFeatures(temperature=0.0)
    with pytest.raises(TypeError, match=r"Settings: chunk_size must be an int or None \(null\), got 1.5 \(float\)"):
        Settings(chunk_size=1.5)
    with pytest.raises(TypeError, match=r"near must be None, Band\(w\) or Neighbors\(k\), got 4 \(int\)"):
        FLTAttention(16, 2, near=4)
    with pytest.raises(TypeError, match=r"features must be a flt\.layers\.parts\.Features"):
        FLTAttention(16, 2, features="favor+")


def test_softmax_takes_any_term_by_name_with_its_options():
    torch.manual_seed(0)
    flat = SoftmaxAttention.from_options(16, 2, relative_bias="t5", max_distance=40, table_scale=1.0, learn_table_scale=False)
    torch.manual_seed(0)
    parts = SoftmaxAttention(16, 2, relative_bias="t5",
                             relative_options={"max_distance": 40, "table_scale": 1.0, "learn_scale": False, "num_buckets": None})
    _same_modules(flat, parts)
    spectral = SoftmaxAttention(16, 2, relative_bias="gaussian", relative_options={"num_frequencies": 4})
    assert spectral.core.relative_bias == "spectrum" and spectral.spectrum is spectral.relative
