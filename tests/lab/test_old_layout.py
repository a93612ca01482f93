"""State dicts written before a layer held its mechanism in ``layer.core`` are upgraded once
where they are loaded (:mod:`flt.layers.upgrade`) and give the same float64 outputs in the
current layers (tests/lab/fixtures/old_layout/make.py wrote them, with their outputs, at commit
3aaa523). Same to float64 rounding: the fast paths may since add the same terms in another
order (a transposed operand of a matmul, a contraction by einsum); fresh weights differ from
the file's by far more (the first check)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
from safetensors.torch import load_file

from flt.layers.upgrade import parameters_before_cores, upgrade_state_dict
from flt.models import LMConfig, build_model
from flt.train.checkpoint import MODEL_FILE, load_weights, optimizer_state_before_cores

OLD = Path(__file__).parent / "fixtures" / "old_layout"
_spec = importlib.util.spec_from_file_location("old_layout_make", OLD / "make.py")
assert _spec is not None and _spec.loader is not None
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)
OUTPUTS = load_file(OLD / "outputs.safetensors")

#: The outputs were computed on one thread, and float64 sums may round differently on more.
pytestmark = pytest.mark.usefixtures("one_thread")


def same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal to float64 rounding (module docstring)."""
    return torch.allclose(got, expected, rtol=1e-12, atol=1e-13)


def fresh(name: str) -> torch.nn.Module:
    """The layer of ``name`` built again, with other weights than the file's (another seed)."""
    cls, options, pos_dim, causal = make.LAYERS[name]
    torch.manual_seed(1)
    layer = cls.from_options(make.DIM, make.HEADS, pos_dim=pos_dim, causal=causal, dtype=torch.float64, **options)
    make.perturb(layer, 1000)
    return layer.eval()


@pytest.mark.parametrize("name", sorted(make.LAYERS))
def test_old_state_dict_loads_and_gives_the_same_outputs(name: str) -> None:
    layer = fresh(name)
    x, pos = make.inputs(make.LAYERS[name][2])
    with torch.no_grad():
        assert not same(layer(x, pos), OUTPUTS[f"{name}.forward"])  # the fresh weights differ
    old = load_file(OLD / f"{name}.safetensors")
    # The file is of the old layout: as it is, the layer refuses it; upgraded, it has
    # exactly the layer's keys.
    with pytest.raises(RuntimeError, match="Missing key"):
        layer.load_state_dict(old, strict=True)
    upgraded = upgrade_state_dict(layer, old)
    assert set(upgraded) != set(old) and set(upgraded) == set(layer.state_dict())
    assert all(upgraded[k] is old[k.replace("core.", "", 1)] for k in upgraded if k not in old)
    layer.load_state_dict(upgraded, strict=True)
    with torch.no_grad():
        assert same(layer(x, pos), OUTPUTS[f"{name}.forward"])
        assert same(layer.exact(x, pos), OUTPUTS[f"{name}.exact"])
    # Every tensor of the file reached the layer: saved again, the same values.
    new = layer.state_dict()
    assert len(new) == len(old)
    assert sorted(torch.cat([t.flatten().double() for t in new.values()]).tolist()) == \
        sorted(torch.cat([t.flatten().double() for t in old.values()]).tolist())
    # A state dict of the current layout comes back as it is.
    assert upgrade_state_dict(layer, new) == new


def test_a_current_layout_is_not_upgraded(tmp_path: Path) -> None:
    """``load_weights`` says whether it upgraded: not a file of the current layout."""
    from safetensors.torch import save_model

    model = build_model(LMConfig(**make.CONSTANT_CONFIG), dtype=torch.float64)
    save_model(model, str(tmp_path / MODEL_FILE))
    assert load_weights(str(tmp_path), model) is False


def test_old_run_checkpoint_loads_through_the_resume_path(tmp_path: Path) -> None:
    """``flt.train.checkpoint.load_weights`` (resume, evaluate) takes an old model file."""
    config = LMConfig(**json.loads((OLD / "lm_config.json").read_text(encoding="utf-8")))
    torch.manual_seed(5)
    model = build_model(config, dtype=torch.float64).eval()
    shutil.copy(OLD / "lm.safetensors", tmp_path / MODEL_FILE)
    assert load_weights(str(tmp_path), model) is True
    tokens = torch.arange(make.N).remainder(11).view(1, make.N)
    with torch.no_grad():
        assert same(model(tokens), OUTPUTS["lm.logits"])


def test_old_optimizer_state_gives_each_parameter_its_own_moments(tmp_path: Path) -> None:
    """A run resumed from a checkpoint saved before cores gives every parameter its own
    moments back: FLT's ``far_constant``, a parameter of the layer then and of its core now,
    was listed first among the layer's parameters and is now listed after the projections,
    so the saved optimizer state is renumbered (:func:`optimizer_state_before_cores`)."""
    from flt.train.loop import parameter_groups

    model = build_model(LMConfig(**make.CONSTANT_CONFIG), dtype=torch.float64)
    shutil.copy(OLD / "lm_constant.safetensors", tmp_path / MODEL_FILE)
    assert load_weights(str(tmp_path), model) is True
    names = {id(p): name.replace(".core.", ".") for name, p in model.named_parameters()}
    before = json.loads((OLD / "lm_constant_parameters.json").read_text(encoding="utf-8"))
    assert [names[id(p)] for p in parameters_before_cores(model)] == before
    assert list(names.values()) != before  # the order changed: the state must be renumbered
    moments = load_file(OLD / "lm_constant_moments.safetensors")
    saved = torch.load(OLD / "lm_constant_optimizer.pt", weights_only=True)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-2)
    optimizer.load_state_dict(optimizer_state_before_cores(optimizer, saved, model))
    got = {names[id(p)]: optimizer.state[p]["exp_avg"] for _, p in model.named_parameters()}
    assert sorted(got) == sorted(moments) and all(torch.equal(got[name], moments[name]) for name in moments)


def test_old_run_resumes_with_its_weights_and_moments(tmp_path: Path) -> None:
    """``flt train --resume`` of a run saved before cores (:func:`flt.train.loop.restore`):
    the weights are upgraded and the optimizer state renumbered."""
    pytest.importorskip("numpy")
    from flt.train import RunConfig, distributed as D
    from flt.train.checkpoint import STATE_FILE
    from flt.train.loop import Origin, StepHooks, parameter_groups, restore
    from flt.train.rng import rng_state

    model = build_model(LMConfig(**make.CONSTANT_CONFIG), dtype=torch.float64)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-2)
    shutil.copy(OLD / "lm_constant.safetensors", tmp_path / MODEL_FILE)
    torch.save({"step": 1, "world_size": 1, "rng": [rng_state(model)],
                "optimizer": torch.load(OLD / "lm_constant_optimizer.pt", weights_only=True)}, tmp_path / STATE_FILE)
    origin = Origin(checkpoint=str(tmp_path), step=1, saved_steps=1)
    step, _, _ = restore(origin, model, optimizer, RunConfig(steps=1), D.Context(0, 1, torch.device("cpu")), StepHooks())
    assert step == 1
    weights = load_file(OLD / "lm_constant.safetensors")
    moments = load_file(OLD / "lm_constant_moments.safetensors")
    for name, p in model.named_parameters():
        old_name = name.replace(".core.", ".")
        assert torch.equal(p, weights[old_name]) and torch.equal(optimizer.state[p]["exp_avg"], moments[old_name])


def test_flt_evaluate_loads_an_old_checkpoint() -> None:
    """``flt evaluate`` compares the file's keys with the model's before loading them."""
    from flt.commands.evaluate import load_with_draws

    config = LMConfig(**json.loads((OLD / "lm_config.json").read_text(encoding="utf-8")))
    model = build_model(config, dtype=torch.float64).eval()
    assert load_with_draws(model, load_file(OLD / "lm.safetensors"), {}) is True
    tokens = torch.arange(make.N).remainder(11).view(1, make.N)
    with torch.no_grad():
        assert same(model(tokens), OUTPUTS["lm.logits"])


@pytest.mark.parametrize("name", ["performer", "flt_band"])
def test_a_tensor_in_both_layouts_is_reported_not_dropped(name: str) -> None:
    """A file that holds a tensor both under ``core.`` and under its old key is ambiguous:
    strict loading names the old key as unexpected instead of discarding it unseen."""
    layer = fresh(name)
    state = layer.state_dict()
    new_key = next(k for k in state if k.startswith("core."))
    old_key = new_key.removeprefix("core.")
    state[old_key] = torch.zeros_like(state[new_key])
    upgraded = upgrade_state_dict(layer, state)
    assert upgraded[new_key] is state[new_key] and old_key in upgraded  # flt evaluate reports it too
    with pytest.raises(RuntimeError, match=f'Unexpected key.*"{old_key}"'):
        layer.load_state_dict(upgraded, strict=True)
