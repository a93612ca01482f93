"""The lab's baseline models (flt.baselines) at their old library paths: ``flt.models.qm9``,
``particles``, ``dimenet``, ``atom_graphs`` and ``longrange`` still import, warn that they
go in 0.3.0, and give the very objects of flt.baselines (so a model built through an old
path is the same class, with the same state-dict keys)."""

from __future__ import annotations

import importlib
import re
import warnings

import pytest

#: Old path -> the names it gave before the move, each now from its flt.baselines module.
OLD_NAMES = {
    "qm9": ["BASES", "CUTOFFS", "ENCODERS", "QM9Config", "QM9Regressor", "radius_graph", "triplets"],
    "particles": ["PARTICLE_ENCODERS", "PARTICLE_MODELS", "ParticleConfig", "ParticleRegressor", "ParticleSchNet",
                  "check_particles", "cloud_radius_graph", "particle_model"],
    "dimenet": ["PlainDimeNetPlusPlus"],
    "atom_graphs": ["radius_graph", "triplets"],
    "longrange": ["PLACEMENTS", "AfterBlock", "AfterOutput", "AfterResidual", "LongRangeContext", "blocks_of",
                  "check_longrange", "check_placement", "list_slots", "wrap_modules"],
}


@pytest.mark.parametrize("name", list(OLD_NAMES))
def test_an_old_path_warns_that_it_goes_and_gives_the_moved_objects(name: str) -> None:
    if name == "dimenet":
        pytest.importorskip("torch_geometric")
    new = importlib.import_module(f"flt.baselines.{name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module(f"flt.models.{name}")  # imported once already, it would not warn again
    with pytest.warns(DeprecationWarning, match=rf"^flt\.models\.{name} moved to flt\.baselines\.{name} and is removed in "
                                                rf"0\.3\.0; import flt\.baselines\.{re.escape(name)} instead$"):
        importlib.reload(old)
    assert sorted(old.__all__) == sorted(OLD_NAMES[name])
    homes = [new, importlib.import_module("flt.baselines.atom_graphs")]
    for attr in OLD_NAMES[name]:
        assert any(getattr(old, attr) is getattr(home, attr, None) for home in homes), attr


#: The state-dict keys of two ``+lr`` models as they were saved before the move (depth 1):
#: a run directory holds the config and these weights, and loads through the task registry
#: (``flt.tasks.config_from_dict``), never a module path, so the keys are what must not change.
BLOCK = [f"block.{k}" for k in ("kernel.spectrum.theta", "kernel.spectrum.beta", "kernel.spectrum.eps", "norm.weight",
                                "norm.bias", "value.weight", "value.bias", "out.weight", "out.bias")]
SAVED_KEYS = {
    "qm9 transformer+lr": ["net.embed.weight",
                           *(f"net.trunk.blocks.0.inner.{k}" for k in (
                               "norm1.weight", "norm1.bias", "attn.to_qkv.weight", "attn.to_out.weight", "attn.to_out.bias",
                               "norm2.weight", "norm2.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")),
                           *(f"net.trunk.blocks.0.{k}" for k in BLOCK),
                           "net.trunk.norm.weight", "net.trunk.norm.bias", "net.head.weight", "net.head.bias"],
    "particles schnet+lr": ["embed.weight", "expand.offset",
                            *(f"interactions.0.inner.{k}" for k in (
                                "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias", "conv.lin1.weight",
                                "conv.lin2.weight", "conv.lin2.bias", "conv.nn.0.weight", "conv.nn.0.bias", "conv.nn.2.weight",
                                "conv.nn.2.bias", "lin.weight", "lin.bias")),
                            *(f"interactions.0.{k}" for k in BLOCK),
                            "head.0.weight", "head.0.bias", "head.2.weight", "head.2.bias"],
}


@pytest.mark.parametrize("model", list(SAVED_KEYS))
def test_the_moved_models_keep_the_state_dict_keys_of_saved_runs(model: str) -> None:
    from flt.baselines.particles import ParticleConfig, particle_model
    from flt.baselines.qm9 import QM9Config, QM9Regressor
    from flt.models import config_kwargs

    task, encoder = model.split()
    if encoder.startswith("schnet"):
        pytest.importorskip("torch_geometric")
    if task == "qm9":
        built = QM9Regressor(**config_kwargs(QM9Config(encoder=encoder, dim=8, depth=1, heads=2, attention="softmax")))
    else:
        built = particle_model(ParticleConfig(encoder=encoder, dim=8, depth=1, heads=2, attention="softmax"))
    assert list(built.state_dict()) == SAVED_KEYS[model]
