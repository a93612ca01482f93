"""RoPE at real-valued positions, 1-D and axial."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close

from flt.posenc import apply_rope, rope_angles


def _scores(q, k, pos_q, pos_k):
    return apply_rope(q, pos_q) @ apply_rope(k, pos_k).transpose(-1, -2)


@pytest.mark.parametrize("pos_dim", [1, 2, 3])
def test_scores_are_invariant_to_translating_all_positions(pos_dim):
    B, H, N, D = 2, 3, 7, 12
    q, k = torch.randn(2, B, H, N, D, dtype=torch.float64)
    pos = 10 * torch.randn(B, N, pos_dim, dtype=torch.float64)
    shift = 25 * torch.randn(B, 1, pos_dim, dtype=torch.float64)
    ref = _scores(q, k, pos, pos)
    assert_close(_scores(q, k, pos + shift, pos + shift), ref)
    assert not torch.allclose(apply_rope(q, pos + shift), apply_rope(q, pos))  # the vectors do rotate


@pytest.mark.parametrize("pos_dim", [1, 2])
def test_scores_depend_only_on_offsets(pos_dim):
    # score(q at r_i, k at r_j) == score(q at r_i - r_j, k at 0), pair by pair.
    H, N, D = 2, 5, 8
    q, k = torch.randn(2, 1, H, N, D, dtype=torch.float64)
    pos = 4 * torch.randn(1, N, pos_dim, dtype=torch.float64)
    full = _scores(q, k, pos, pos)
    for i in range(N):
        for j in range(N):
            qi, kj = q[:, :, i : i + 1], k[:, :, j : j + 1]
            offset = (pos[:, i] - pos[:, j]).reshape(1, 1, pos_dim)
            s = _scores(qi, kj, offset, torch.zeros_like(offset))
            assert_close(s[..., 0, 0], full[..., i, j])


def test_rotation_preserves_norms_and_zero_position_is_identity():
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    pos = 100 * torch.randn(2, 6, 2, dtype=torch.float64)
    assert_close(apply_rope(x, pos).norm(dim=-1), x.norm(dim=-1))
    assert_close(apply_rope(x, torch.zeros(6, 2, dtype=torch.float64)), x)


def test_matches_hand_built_rotation_matrices():
    # D = 4, rotate-half pairs (0, 2) and (1, 3), angles pos * 1 and pos * base^(-2/4).
    base, p = 10000.0, 2.5
    x = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    a0, a1 = p, p * base ** (-0.5)
    rot = torch.zeros(4, 4, dtype=torch.float64)
    for (i, j), a in (((0, 2), a0), ((1, 3), a1)):
        rot[i, i], rot[i, j], rot[j, i], rot[j, j] = math.cos(a), -math.sin(a), math.sin(a), math.cos(a)
    expected = (rot @ x[0, 0, 0]).reshape(1, 1, 1, 4)
    assert_close(apply_rope(x, torch.tensor([[[p]]], dtype=torch.float64), base=base), expected)
    angles = rope_angles(torch.tensor([[p]], dtype=torch.float64), 4, base=base)
    assert_close(angles, torch.tensor([[[a0, a1]]], dtype=torch.float64))


def test_axial_2d_is_1d_rope_per_block_of_pairs():
    # D = 8, P = 2: pairs 0, 1 (channels 0/4, 1/5) follow axis 0; pairs 2, 3 (channels 2/6, 3/7)
    # follow axis 1, each with the 1-D ladder of a head of size D/P = 4.
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    pos = 3 * torch.randn(2, 5, 2, dtype=torch.float64)
    out = apply_rope(x, pos)
    block0, block1 = [0, 1, 4, 5], [2, 3, 6, 7]
    assert_close(out[..., block0], apply_rope(x[..., block0], pos[..., :1]))
    assert_close(out[..., block1], apply_rope(x[..., block1], pos[..., 1:]))
    # Moving only along axis 1 leaves axis 0's channels untouched.
    moved = apply_rope(x, pos + torch.tensor([0.0, 1.7], dtype=torch.float64))
    assert_close(moved[..., block0], out[..., block0])
    assert not torch.allclose(moved[..., block1], out[..., block1])


def test_angles_argument_and_low_precision():
    x = torch.randn(2, 2, 9, 16, dtype=torch.float64)
    pos = 1000 * torch.rand(2, 9, 1, dtype=torch.float64)
    ref = apply_rope(x, pos)
    assert_close(apply_rope(x, angles=rope_angles(pos, 16)), ref)
    low = apply_rope(x.to(torch.bfloat16), pos.float())
    assert low.dtype == torch.bfloat16
    assert_close(low, ref, dtype=torch.bfloat16)


def test_gradients_are_finite_and_rotate_back():
    # The rotation is orthogonal, so the gradient w.r.t. x is the inverse rotation of the
    # upstream gradient: rotating it forward again recovers the upstream gradient.
    x = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    pos = torch.randn(1, 4, 2, dtype=torch.float64, requires_grad=True)
    up = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    (apply_rope(x, pos) * up).sum().backward()
    assert bool(torch.isfinite(pos.grad).all()) and bool(pos.grad.abs().sum() > 0)
    assert_close(apply_rope(x.grad, pos.detach()), up)


def test_bad_inputs():
    x = torch.randn(1, 2, 4, 12)
    with pytest.raises(ValueError, match="head_dim"):
        apply_rope(x, torch.zeros(1, 4, 5))  # 12 is not divisible by 2 * 5
    with pytest.raises(ValueError, match="head_dim"):
        rope_angles(torch.zeros(1, 4, 2), 6)
    with pytest.raises(ValueError, match="exactly one"):
        apply_rope(x)
    with pytest.raises(ValueError, match="exactly one"):
        apply_rope(x, torch.zeros(1, 4, 1), angles=torch.zeros(1, 4, 6))
    with pytest.raises(ValueError, match="N = 4"):
        apply_rope(x, torch.zeros(1, 5, 1))
    with pytest.raises(ValueError, match="non-finite"):
        apply_rope(x, torch.full((1, 4, 1), float("nan")))
    with pytest.raises(ValueError, match="rank 4"):
        apply_rope(torch.randn(2, 4, 12), torch.zeros(1, 4, 1))
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.randn(1, 1, 4, 5), torch.zeros(1, 4, 1))
    with pytest.raises(ValueError, match="D/2"):
        apply_rope(x, angles=torch.zeros(1, 4, 5))
    with pytest.raises(TypeError, match="floating"):
        apply_rope(x, torch.zeros(1, 4, 1, dtype=torch.long))
