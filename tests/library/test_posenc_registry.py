"""The POSENC registry: one constructor, one forward, for every absolute encoding."""

from __future__ import annotations

import pytest
import torch

from flt.posenc import POSENC, NoEncoding

DIM = 12  # divisible by 2P for P = 1, 2, 3


def _positions(name: str, pos_dim: int) -> torch.Tensor:
    if name == "learned":
        return torch.randint(0, 50, (2, 5, pos_dim)).double()
    return torch.rand(2, 5, pos_dim, dtype=torch.float64)  # inside shifted_basis's default domain


CASES = [(name, p) for name in POSENC for p in (1, 2, 3) if not (name == "learned" and p != 1)]


@pytest.mark.parametrize("name, pos_dim", CASES)
def test_forward_backward_shapes_and_finite_gradients(name, pos_dim):
    enc = POSENC[name](DIM, pos_dim, dtype=torch.float64)
    pos = _positions(name, pos_dim).requires_grad_(name != "learned")
    out = enc(pos)
    assert out.shape == (2, 5, DIM) and out.dtype == torch.float64
    assert bool(torch.isfinite(out).all())
    if name == "none":
        assert bool((out == 0).all())
        return
    assert bool(out.abs().sum() > 0)
    (out * torch.randn_like(out)).sum().backward()
    grads = [p.grad for p in enc.parameters()] + ([pos.grad] if pos.requires_grad else [])
    assert grads, name  # every non-trivial encoding is differentiable in something
    for g in grads:
        assert g is not None and bool(torch.isfinite(g).all()) and bool(g.abs().sum() > 0)


def test_learned_is_one_dimensional_only():
    with pytest.raises(ValueError, match="pos_dim"):
        POSENC["learned"](DIM, 2)


def test_registry_entries_are_modules_with_the_shared_signature():
    assert set(POSENC) == {"none", "sinusoidal", "learned", "fourier", "shifted_basis"}
    assert POSENC["none"] is NoEncoding
    for name, cls in POSENC.items():
        enc = cls(DIM, 1)
        assert isinstance(enc, torch.nn.Module)
        assert (enc.dim, enc.pos_dim) == (DIM, 1), name


@pytest.mark.parametrize("name", sorted(POSENC))
def test_bad_positions_name_the_argument(name):
    enc = POSENC[name](DIM, 1)
    with pytest.raises(ValueError, match="pos"):
        enc(torch.zeros(5, 1))  # missing batch dimension
    with pytest.raises(ValueError, match="P"):
        enc(torch.zeros(2, 5, 2))
    with pytest.raises(ValueError, match="non-finite"):
        enc(torch.tensor([[[0.0], [float("nan")]]]))
    with pytest.raises(TypeError, match="pos"):
        enc(torch.zeros(2, 5, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="pos"):
        enc([[[0.0]]])


@pytest.mark.parametrize("name", sorted(POSENC))
def test_bad_sizes(name):
    with pytest.raises(ValueError, match="dim"):
        POSENC[name](0, 1)
    with pytest.raises(ValueError, match="pos_dim"):
        POSENC[name](DIM, 0)
