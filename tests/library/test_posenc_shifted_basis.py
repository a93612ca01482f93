"""Shifted basis embeddings and their diagnostics (Zheng et al. 2021)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close

from flt.posenc import ShiftedBasisEmbedding, distance_preservation, embedding_matrix, stable_rank

GAUSSIAN_PRODUCT = math.sqrt(math.log(10) / math.pi)  # 0.856


def _x(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64).reshape(1, -1, 1)


@pytest.mark.parametrize("sigma", [0.01, 0.02])
def test_gaussian_stable_rank_times_distance_preservation(sigma):
    # Setup: domain [0, 1], centre spacing sigma/4 (dense basis), 2000 samples over the
    # domain, sigma << 1 so edge effects are O(sigma). In the continuum limit the stable
    # rank is 1/(2 sigma sqrt(pi)) and the distance preservation 2 sigma sqrt(ln 10), so the
    # product is sqrt(ln 10 / pi) for every sigma. Measured: 0.8524 (sigma 0.01), 0.8499 (0.02).
    embed = ShiftedBasisEmbedding(round(4 / sigma), kind="gaussian", width=sigma, dtype=torch.float64)
    sr = stable_rank(embedding_matrix(embed, 2000))
    dp = distance_preservation(embed)
    assert abs(sr / (1 / (2 * sigma * math.sqrt(math.pi))) - 1) < 0.02
    assert abs(dp / (2 * sigma * math.sqrt(math.log(10))) - 1) < 0.005
    assert abs(sr * dp / GAUSSIAN_PRODUCT - 1) < 0.02


def test_product_is_specific_to_the_gaussian():
    # The same diagnostics give clearly different products for other shapes (measured
    # 0.92 for a box of half-width 0.01, 0.54 for the impulse), so the Gaussian check above
    # is not satisfied by any basis.
    for kind, width, lo, hi in (("square", 0.01, 0.88, 0.96), ("impulse", None, 0.45, 0.6)):
        embed = ShiftedBasisEmbedding(400, kind=kind, width=width, dtype=torch.float64)
        product = stable_rank(embedding_matrix(embed, 2000)) * distance_preservation(embed)
        assert lo < product < hi, (kind, product)


def test_basis_formulas_with_cell_centred_centres():
    x = torch.tensor([-0.1, 0.0, 0.13, 0.5, 0.77, 1.0], dtype=torch.float64)
    centres = (torch.arange(5, dtype=torch.float64) + 0.5) / 5  # 0.1, 0.3, ..., 0.9
    u = x[:, None] - centres
    cases = {
        "gaussian": (0.07, torch.exp(-(u**2) / (2 * 0.07**2))),
        "triangle": (0.25, torch.clamp(1 - u.abs() / 0.25, min=0)),
        "square": (0.15, (u.abs() <= 0.15).double()),
        "sine": (0.4, torch.sin(2 * math.pi * u / 0.4)),
        "impulse": (None, torch.nn.functional.one_hot(u.abs().argmin(-1), 5).double()),
    }
    for kind, (width, expected) in cases.items():
        embed = ShiftedBasisEmbedding(5, kind=kind, width=width, dtype=torch.float64)
        assert_close(embed.centres(), centres)
        assert_close(embed(_x(x))[0], expected, msg=kind)


def test_hat_functions_are_a_partition_of_unity():
    embed = ShiftedBasisEmbedding(10, kind="triangle", domain=(-2.0, 3.0), dtype=torch.float64)  # width = spacing
    x = torch.linspace(-1.75, 2.75, 101, dtype=torch.float64)  # between the first and last centre
    assert_close(embed(_x(x))[0].sum(-1), torch.ones(101, dtype=torch.float64))


def test_shifted_sines_have_stable_rank_at_most_two():
    embed = ShiftedBasisEmbedding(64, kind="sine", width=0.3, dtype=torch.float64)
    sr = stable_rank(embedding_matrix(embed, 500))
    assert 1.0 <= sr <= 2.0 + 1e-9


def test_rff_kernel():
    # psi(x).psi(y) = (2/D) sum_k cos(2 pi xi_k (x - y)) -> exp(-(x-y)^2 / (2 w^2)); 20000
    # frequencies give a standard error below 0.005.
    w = 0.05
    embed = ShiftedBasisEmbedding(40000, kind="rff", width=w, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    delta = torch.tensor([0.0, 0.02, 0.05, 0.1, 0.2], dtype=torch.float64)
    psi = embed(_x(torch.cat((torch.zeros(1, dtype=torch.float64) + 0.3, 0.3 + delta))))[0]
    estimate = psi[1:] @ psi[0]
    assert (estimate - torch.exp(-(delta**2) / (2 * w**2))).abs().max() < 0.025
    assert_close(estimate[0], torch.tensor(1.0, dtype=torch.float64))


def test_stable_rank_of_known_matrices():
    assert stable_rank(torch.eye(7, dtype=torch.float64)) == pytest.approx(7.0, rel=1e-12)
    rank_one = torch.randn(9, 1, dtype=torch.float64) @ torch.randn(1, 4, dtype=torch.float64)
    assert stable_rank(rank_one) == pytest.approx(1.0, rel=1e-9)
    assert stable_rank(torch.diag(torch.tensor([3.0, 1.0]))) == pytest.approx(10 / 9, rel=1e-6)
    with pytest.raises(ValueError, match="zero"):
        stable_rank(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="psi"):
        stable_rank(torch.zeros(3))


def test_distance_preservation_of_a_known_similarity():
    # A 2-d embedding [cos(a x), sin(a x)] has similarity cos(a delta), which first reaches 0.1
    # at delta = arccos(0.1) / a; on the domain (0, 2) that is a half-width / 2.
    a = 3.0

    def embed(x):
        return torch.cat((torch.cos(a * x), torch.sin(a * x)), dim=-1)

    dp = distance_preservation(embed, domain=(0.0, 2.0))
    assert dp == pytest.approx(math.acos(0.1) / a / 2.0, rel=1e-4)
    with pytest.raises(ValueError, match="domain"):
        distance_preservation(embed)
    with pytest.raises(ValueError, match="threshold"):
        distance_preservation(embed, domain=(0.0, 2.0), threshold=1.5)
    with pytest.raises(ValueError, match="reference"):
        distance_preservation(embed, domain=(0.0, 2.0), reference=3.0)


def test_multi_axis_embedding_concatenates_axes():
    embed = ShiftedBasisEmbedding(12, 3, kind="gaussian", width=0.1, dtype=torch.float64)
    one_axis = ShiftedBasisEmbedding(4, 1, kind="gaussian", width=0.1, dtype=torch.float64)
    pos = torch.rand(2, 5, 3, dtype=torch.float64)
    out = embed(pos)
    for p in range(3):
        assert_close(out[..., 4 * p : 4 * (p + 1)], one_axis(pos[..., p : p + 1]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": "wavelet"}, "kind"),
        ({"kind": "impulse", "width": 0.1}, "width"),
        ({"width": -0.1}, "width"),
        ({"domain": (1.0, 0.0)}, "domain"),
        ({"domain": (0.0, float("inf"))}, "domain"),
        ({"kind": "rff", "dim": 7}, "even"),
        ({"dim": 7, "pos_dim": 2}, "pos_dim"),
    ],
)
def test_bad_options(kwargs, match):
    options = {"dim": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        ShiftedBasisEmbedding(**options)
