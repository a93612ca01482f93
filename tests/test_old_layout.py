"""State dicts written before a layer held its mechanism in ``layer.core`` load into the
current layers and give the same float64 outputs (tests/fixtures/old_layout/make.py wrote
them, with their outputs, at commit 3aaa523). Same to float64 rounding: the fast paths may
since add the same terms in another order (a transposed operand of a matmul, a contraction
by einsum); fresh weights differ from the file's by far more (the first check)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

from flt.layers.base import move_into_cores
from flt.models import LMConfig, build_model  # noqa: E402
from flt.train.checkpoint import MODEL_FILE, load_weights  # noqa: E402

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
    layer.load_state_dict(old, strict=True)
    with torch.no_grad():
        assert same(layer(x, pos), OUTPUTS[f"{name}.forward"])
        assert same(layer.exact(x, pos), OUTPUTS[f"{name}.exact"])
    # Every tensor of the file reached the layer: saved again, the same values.
    new = layer.state_dict()
    assert len(new) == len(old)
    assert sorted(torch.cat([t.flatten().double() for t in new.values()]).tolist()) == \
        sorted(torch.cat([t.flatten().double() for t in old.values()]).tolist())


def test_old_run_checkpoint_loads_through_the_resume_path(tmp_path: Path) -> None:
    """``flt.train.checkpoint.load_weights`` (resume, evaluate) takes an old model file."""
    config = LMConfig(**json.loads((OLD / "lm_config.json").read_text(encoding="utf-8")))
    torch.manual_seed(5)
    model = build_model(config, dtype=torch.float64).eval()
    shutil.copy(OLD / "lm.safetensors", tmp_path / MODEL_FILE)
    load_weights(str(tmp_path), model)
    tokens = torch.arange(make.N).remainder(11).view(1, make.N)
    with torch.no_grad():
        assert same(model(tokens), OUTPUTS["lm.logits"])


def test_old_optimizer_state_gives_each_parameter_its_own_moments(tmp_path: Path) -> None:
    """A run resumed from a checkpoint saved before cores loads the saved optimizer state
    as it is (``flt train --resume``): FLT's ``far_constant``, a parameter of the layer then
    and of its core now, is still listed first among the layer's parameters
    (:meth:`flt.layers.base.AttentionBase.named_modules`), so every parameter gets its own
    moments back."""
    from flt.train.loop import parameter_groups

    model = build_model(LMConfig(**make.CONSTANT_CONFIG), dtype=torch.float64)
    shutil.copy(OLD / "lm_constant.safetensors", tmp_path / MODEL_FILE)
    load_weights(str(tmp_path), model)
    moments = load_file(OLD / "lm_constant_moments.safetensors")
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-2)
    optimizer.load_state_dict(torch.load(OLD / "lm_constant_optimizer.pt", weights_only=True))
    got = {name.replace(".core.", "."): optimizer.state[p]["exp_avg"] for name, p in model.named_parameters()}
    assert sorted(got) == sorted(moments) and all(torch.equal(got[name], moments[name]) for name in moments)
    before = json.loads((OLD / "lm_constant_parameters.json").read_text(encoding="utf-8"))
    assert [name.replace(".core.", ".") for name, _ in model.named_parameters()] == before


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
    with pytest.raises(RuntimeError, match=f'Unexpected key.*"{old_key}"'):
        layer.load_state_dict(state, strict=True)
    assert old_key in move_into_cores(layer, state)  # flt evaluate reports it too
