"""Every random state a run depends on: seeding it, and saving and restoring it per
process in checkpoints so that a resumed run continues bit for bit."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from flt.layers.draws import stable_named_modules


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's global generator and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _module_generators(model: nn.Module) -> dict[str, torch.Generator]:
    """Private ``torch.Generator`` attributes of submodules (e.g. feature redraws)."""
    found = {}
    # Named as before layers had cores (``attn.feature_map``, not ``attn.core.feature_map``),
    # so that an older checkpoint's generators restore.
    for name, module in stable_named_modules(model):
        for attr, value in vars(module).items():
            if isinstance(value, torch.Generator):
                found[f"{name}.{attr}" if name else attr] = value
    return found


def rng_state(model: nn.Module) -> dict[str, Any]:
    """Every random state the run depends on, as tensors and plain containers."""
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple), "numpy's global generator is MT19937, whose legacy state is a tuple"
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "torch": torch.get_rng_state(),
        "modules": {k: g.get_state() for k, g in _module_generators(model).items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], model: nn.Module) -> None:
    """Inverse of :func:`rng_state`."""
    random.setstate(_to_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    gens = _module_generators(model)
    if set(gens) != set(state["modules"]):
        raise ValueError(f"the checkpoint's module generators {sorted(state['modules'])} differ from the model's {sorted(gens)}")
    for k, g in gens.items():
        g.set_state(state["modules"][k])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_tuple(x: Any) -> Any:
    # JSON lists back into the nested tuples of random.getstate().
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
