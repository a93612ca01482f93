"""Generated clouds of charged particles and their screened-Coulomb (Yukawa) potentials.

A cloud holds ``N`` particles in 3-D with charges ``+1`` and ``-1`` in equal numbers (a
neutral cloud), at a fixed mean density, so a larger ``N`` is a larger box with the same
local statistics. The target of particle ``i`` is the potential of all the others,

    y_i = sum_{j != i} q_j exp(-r_ij / screening) / sqrt(r_ij^2 + softening^2),

the Yukawa potential ``exp(-r / lambda) / r`` with Plummer softening (``softening = 0``
is the bare potential). ``screening=None`` (``--data-opt screening=none``; ``inf`` is the
same) drops the exponential: the bare softened Coulomb potential, whose interactions reach
across the whole box. Nothing is downloaded: every cloud is a function of
``(seed, split, index, N)``.

Why these choices (docs/nbody.md has the measurements):

* ``screening`` is a sizeable fraction of the box (3 mean spacings against a box of 6.3
  at ``N = 256``), so a cutoff cannot reach a low error: the exact sum over each
  particle's 15 nearest others explains 73% of the target's variance (docs/nbody.md).
* Without screening the potential of a neutral cloud of uncorrelated charges has a
  variance that grows with the box (the charges in a shell at distance ``r`` contribute
  ``~ r^2 dr / r^2``), so clouds of more particles at the same density have a wider
  target; a model that sums ``q_j / r_ij`` over the cloud is right at every size.
* ``softening`` of one mean spacing keeps the target from being ruled by the rare closest
  pair (the bare ``1 / r`` gives a heavy-tailed target whose variance sits in a few
  pairs, i.e. a short-range task).
* Neutral clouds make an attention *average* able to represent the *sum*: with a mask
  ``f = g + c`` (``g`` the potential, ``c`` a constant) the normalised attention of values
  ``q_j`` is ``(y_i + c sum_j q_j) / (sum_j g_ij + c N)``, and ``sum_j q_j = 0`` leaves
  ``y_i`` over a denominator that ``c N`` dominates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flt._checks import check_choice, check_positive_int

LAYOUTS = ("uniform", "blobs")
SPLITS = ("train", "valid", "test")
#: Blobs per cloud of the ``"blobs"`` layout and their standard deviation over the box side.
NUM_BLOBS, BLOB_WIDTH = 4, 0.12


@dataclass
class Clouds:
    """``S`` clouds of ``N`` particles: ``pos [S, N, 3]`` (float32), ``charge [S, N]``
    (float32, ``+-1``), ``y [S, N]`` (float32, computed in float64)."""

    pos: torch.Tensor
    charge: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return self.pos.shape[0]

    @property
    def num_particles(self) -> int:
        return self.pos.shape[1]


def check_cloud_size(name: str, value: object) -> None:
    """Refuse a cloud size that is not an even integer >= 2 (a neutral cloud holds as many
    +1 as -1 charges), naming the option."""
    check_positive_int(name, value)
    assert isinstance(value, int)
    if value < 2 or value % 2:
        raise ValueError(f"{name} must be an even number >= 2 (neutral clouds: as many +1 as -1 charges), got {value}")


def box_side(num_particles: int, density: float) -> float:
    """Side of the cubic box that holds ``num_particles`` at ``density`` per unit volume."""
    return (num_particles / density) ** (1.0 / 3.0)


def check_screening(screening: float | None) -> None:
    """Refuse a ``screening`` that is neither a positive number, ``inf`` nor None."""
    if screening is None:
        return
    if isinstance(screening, bool) or not isinstance(screening, (int, float)) or math.isnan(screening) or not screening > 0:
        raise ValueError(f"screening must be a positive finite number, or none (or inf) for the bare Coulomb potential, "
                         f"got {screening!r}")


def yukawa_potential(pos: torch.Tensor, charge: torch.Tensor, screening: float | None, softening: float,
                     chunk: int = 256, *, edges: Sequence[float] | None = None) -> torch.Tensor:
    """``y_i = sum_{j != i} q_j exp(-r_ij / screening) / sqrt(r_ij^2 + softening^2)`` in
    float64: ``pos [S, N, 3], charge [S, N] -> [S, N]``; ``screening`` None or ``inf``: the
    bare (softened) Coulomb potential, no exponential. Cloud by cloud, ``chunk`` queries
    at a time: memory ``O(chunk N)``, and blocks small enough to stay in cache (4 times
    faster than whole clouds at ``N = 1024`` here).

    ``edges`` (``B + 1`` increasing distances, the last may be ``inf``) splits the sum by
    the pairs' distance instead: ``[S, N, B]``, band ``b`` the pairs with ``edges[b] <=
    r_ij < edges[b + 1]``; with ``edges[0] = 0`` and ``edges[-1] = inf`` the bands add up
    to the potential."""
    pos, charge = pos.double(), charge.double()
    n = pos.shape[1]
    if edges is not None:
        bounds = torch.tensor([float(e) for e in edges], dtype=torch.float64)
        if bounds.ndim != 1 or len(bounds) < 2 or bool(torch.isnan(bounds).any()) or not bool((bounds[1:] > bounds[:-1]).all()) \
                or float(bounds[0]) < 0:
            raise ValueError(f"edges must be at least two increasing distances >= 0 (the bands' bounds), got {list(edges)!r}")
    out = torch.empty((*charge.shape, len(bounds) - 1) if edges is not None else charge.shape, dtype=torch.float64)
    length = screening if screening is not None and math.isfinite(screening) else None  # None: no exponential
    for s in range(pos.shape[0]):
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            r = torch.cdist(pos[s, start:stop], pos[s])  # [c, N]
            g = 1.0 / torch.sqrt(r * r + softening * softening)
            if length is not None:
                g = g * torch.exp(-r / length)
            rows = torch.arange(start, stop)
            g[rows - start, rows] = 0.0  # no self-interaction
            if edges is None:
                out[s, start:stop] = g @ charge[s]
            else:
                band = torch.bucketize(r, bounds, right=True) - 1  # [c, N]: -1 or B outside the edges
                for b in range(len(bounds) - 1):
                    out[s, start:stop, b] = (g * (band == b)) @ charge[s]
    return out


def _cloud(rng: np.random.Generator, num_particles: int, side: float, layout: str) -> tuple[np.ndarray, np.ndarray]:
    if layout == "uniform":
        pos = rng.uniform(0.0, side, (num_particles, 3))
    else:
        centres = rng.uniform(0.2 * side, 0.8 * side, (NUM_BLOBS, 3))
        member = rng.integers(0, NUM_BLOBS, num_particles)
        pos = centres[member] + rng.normal(0.0, BLOB_WIDTH * side, (num_particles, 3))
    charge = rng.permutation(np.repeat([-1.0, 1.0], num_particles // 2))
    return pos, charge


def generate_clouds(num_clouds: int, num_particles: int, *, seed: int, split: str, layout: str = "uniform",
                    density: float = 1.0, screening: float | None = 3.0, softening: float = 1.0) -> Clouds:
    """``num_clouds`` clouds of ``num_particles`` (even) particles for ``split`` (``screening``
    None or ``inf``: no screening, :func:`yukawa_potential`); cloud ``k``
    is a function of ``(seed, split, k, num_particles)`` alone, so the splits never share a
    cloud and a split's first clouds do not depend on how many are drawn."""
    check_positive_int("num_clouds", num_clouds)
    check_positive_int("num_particles", num_particles)
    if num_particles % 2:
        raise ValueError(f"num_particles must be even (neutral clouds: as many +1 as -1 charges), got {num_particles}")
    check_choice("split", split, SPLITS)
    check_choice("layout", layout, LAYOUTS)
    check_screening(screening)
    for name, value, low in (("density", density, 0.0), ("softening", softening, None)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                or (low is not None and value <= low):
            raise ValueError(f"{name} must be a {'positive' if low is not None else 'non-negative'} finite number, got {value!r}")
    side = box_side(num_particles, density)
    pos, charge = np.empty((num_clouds, num_particles, 3)), np.empty((num_clouds, num_particles))
    for k in range(num_clouds):
        rng = np.random.default_rng(np.random.SeedSequence([seed, SPLITS.index(split), k, num_particles]))
        pos[k], charge[k] = _cloud(rng, num_particles, side, layout)
    pos_t, charge_t = torch.from_numpy(pos), torch.from_numpy(charge)
    y = yukawa_potential(pos_t, charge_t, screening, softening)
    clouds = Clouds(pos_t.float(), charge_t.float(), y.float())
    # The clouds are float32: a box of side 1e100 (density 1e-300) is finite in float64 only.
    for name, t in (("positions", clouds.pos), ("targets", clouds.y)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"density={density!r}, screening={screening!r} and softening={softening!r} give {name} beyond "
                             f"float32's range (a box of side {side:.3g}); choose values nearer 1")
    return clouds


@dataclass(frozen=True)
class CloudSplits:
    """The task's three splits of clouds (training, validation, the held-out test)."""

    train: Clouds
    valid: Clouds
    test: Clouds


def cloud_splits(*, num_particles: int = 256, eval_particles: int | None = None, num_train: int = 1024,
                 num_valid: int = 32, num_test: int = 32, seed: int = 0, layout: str = "uniform", density: float = 1.0,
                 screening: float | None = 3.0, softening: float = 1.0) -> CloudSplits:
    """Training clouds of ``num_particles``, validation and test clouds of ``eval_particles``
    (default ``num_particles``): the bundled data of ``flt train nbody``."""
    for name, value in (("num_particles", num_particles), ("num_train", num_train), ("num_valid", num_valid),
                        ("num_test", num_test)):
        check_positive_int(name, value)
    eval_particles = num_particles if eval_particles is None else eval_particles
    for name, value in (("num_particles", num_particles), ("eval_particles", eval_particles)):
        check_cloud_size(name, value)
    common: dict[str, Any] = {"seed": seed, "layout": layout, "density": density, "screening": screening, "softening": softening}
    return CloudSplits(generate_clouds(num_train, num_particles, split="train", **common),
                       generate_clouds(num_valid, eval_particles, split="valid", **common),
                       generate_clouds(num_test, eval_particles, split="test", **common))
