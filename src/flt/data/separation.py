"""Pairs of charged clusters at a distance and their exact Coulomb energy: the data of
``flt train separation``, a test that a distance cutoff cannot pass.

A system is two clusters, ``A`` (the first ``n`` particles) and ``B`` (the last ``n``),
each ``n`` charges ``+1`` / ``-1`` uniform in a ball of radius ``R = (3 n / 4 pi)^(1/3)``
(unit density, as ``nbody``: the mean spacing is 1), their centres ``d`` apart along a
random direction; the system is centred on the midpoint. Each cluster's net charge ``Q``
is drawn from ``{-max_charge, ..., max_charge}`` with the parity of ``n``, so the
clusters attract, repel or barely interact. The energy is the bare Coulomb sum with
Plummer softening ``s`` over all pairs,

    E = sum_{i < j} q_i q_j / sqrt(r_ij^2 + s^2),

each particle's potential is ``phi_i = sum_{j != i} q_j / sqrt(r_ij^2 + s^2)`` (so
``E = sum_i q_i phi_i / 2``), and the interaction energy ``E_int(d) = E - E_A - E_B``
(``E_A``, ``E_B``: each cluster alone) is the sum over the pairs that straddle the
clusters; it tends to ``Q_A Q_B / d`` as ``d`` grows (the dipoles add ``O(1 / d^2)``).

Separations: training systems have ``d`` uniform on ``[d_min, train_max]``, with
``d_min = 2 R + 1`` (the balls' surfaces at least one spacing apart); validation and test
systems alternate, even indices inside that range and odd ones beyond it, uniform on
``(train_max, test_max]``, so any two consecutive systems hold both. A model with a
distance cutoff ``c`` sees no pair across the clusters once ``d > 2 R + c``: its predicted
``E_int`` is 0 there (up to rounding), inside the training range when
``train_max > 2 R + c``.

Nothing is downloaded: system ``k`` of a split is a function of ``(seed, split, k, n)``
and the separation options alone. Energies are computed in float64 and stored as float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from flt._checks import check_choice, check_positive_int
from flt.data.nbody import yukawa_potential

SPLITS = ("train", "valid", "test")
#: Gap between the two balls' surfaces at the smallest separation, in mean spacings.
MIN_GAP = 1.0


@dataclass
class Pairs:
    """``S`` systems of two clusters of ``n`` particles: ``pos [S, 2n, 3]`` (cluster A
    first), ``charge [S, 2n]`` (``+-1``), ``potential [S, 2n]`` (each particle's, from all
    the others), ``energy``, ``energy_a``, ``energy_b``, ``interaction`` (``E - E_A -
    E_B``), ``separation`` (``d``, between the balls' centres) ``[S]``, ``direction [S, 3]`` (unit, from A to B), ``beyond [S]`` (bool:
    ``d`` past the training range). Float32; energies computed in float64."""

    pos: torch.Tensor
    charge: torch.Tensor
    potential: torch.Tensor
    energy: torch.Tensor
    energy_a: torch.Tensor
    energy_b: torch.Tensor
    interaction: torch.Tensor
    separation: torch.Tensor
    direction: torch.Tensor
    beyond: torch.Tensor

    def __len__(self) -> int:
        return self.pos.shape[0]

    @property
    def num_particles(self) -> int:
        return self.pos.shape[1]

    @property
    def cluster_particles(self) -> int:
        return self.pos.shape[1] // 2


def cluster_radius(cluster_particles: int) -> float:
    """Radius of the ball that holds ``cluster_particles`` at unit density."""
    return (3.0 * cluster_particles / (4.0 * math.pi)) ** (1.0 / 3.0)


def min_separation(cluster_particles: int) -> float:
    """The smallest separation of any split: ``2 R + 1`` (surfaces one spacing apart)."""
    return 2.0 * cluster_radius(cluster_particles) + MIN_GAP


def coulomb_energy(pos: torch.Tensor, charge: torch.Tensor, softening: float,
                   potential: torch.Tensor | None = None) -> torch.Tensor:
    """``E = sum_{i < j} q_i q_j / sqrt(r_ij^2 + softening^2) = 1/2 sum_i q_i phi_i`` in
    float64, ``phi`` the bare potential of :func:`flt.data.nbody.yukawa_potential` (pass it
    as ``potential`` when it is already computed): ``pos [S, N, 3], charge [S, N] -> [S]``."""
    if potential is None:
        potential = yukawa_potential(pos, charge, None, softening)
    return 0.5 * (charge.double() * potential.double()).sum(-1)


def interaction_energy(pos_a: torch.Tensor, charge_a: torch.Tensor, pos_b: torch.Tensor, charge_b: torch.Tensor,
                       softening: float) -> torch.Tensor:
    """``sum_{i in A, j in B} q_i q_j / sqrt(r_ij^2 + softening^2)`` in float64:
    ``pos_a [S, Na, 3], charge_a [S, Na], pos_b [S, Nb, 3], charge_b [S, Nb] -> [S]``."""
    r = torch.cdist(pos_a.double(), pos_b.double())
    return torch.einsum("si,sij,sj->s", charge_a.double(), 1.0 / torch.sqrt(r * r + softening * softening), charge_b.double())


def move_apart(pos: torch.Tensor, direction: torch.Tensor, separation: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The systems ``pos [S, 2n, 3]`` with their clusters ``new [S]`` apart instead of
    ``separation [S]``, along ``direction [S, 3]``, still centred on the midpoint."""
    n = pos.shape[1] // 2
    shift = 0.5 * (new - separation)[:, None, None] * direction[:, None, :]
    return torch.cat([pos[:, :n] - shift, pos[:, n:] + shift], dim=1)


def _ball(rng: np.random.Generator, n: int, radius: float) -> np.ndarray:
    v = rng.normal(size=(n, 3))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v * radius * rng.uniform(size=(n, 1)) ** (1.0 / 3.0)


def _charges(rng: np.random.Generator, n: int, max_charge: int) -> np.ndarray:
    nets = [q for q in range(-max_charge, max_charge + 1) if (q - n) % 2 == 0]
    net = int(rng.choice(nets))
    return rng.permutation(np.repeat([1.0, -1.0], [(n + net) // 2, (n - net) // 2]))


def _check_number(name: str, value: object, low: float, strict: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (value <= low if strict else value < low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")
    return float(value)


def check_separations(cluster_particles: int, train_max: float, test_max: float) -> None:
    """Refuse a training range that is empty or a beyond-range that is."""
    d_min = min_separation(cluster_particles)
    _check_number("train_max", train_max, d_min, strict=True)
    _check_number("test_max", test_max, train_max, strict=True)


def generate_pairs(num_systems: int, cluster_particles: int, *, seed: int, split: str, train_max: float = 10.0,
                   test_max: float = 20.0, max_charge: int = 4, softening: float = 1.0) -> Pairs:
    """``num_systems`` systems of two clusters of ``cluster_particles`` for ``split``
    (separations as the module says); system ``k`` is a function of ``(seed, split, k,
    cluster_particles)`` and the options, so a split's first systems do not depend on how
    many are drawn."""
    check_positive_int("num_systems", num_systems)
    check_positive_int("cluster_particles", cluster_particles)
    check_choice("split", split, SPLITS)
    check_separations(cluster_particles, train_max, test_max)
    if isinstance(max_charge, bool) or not isinstance(max_charge, int) or not 0 <= max_charge <= cluster_particles \
            or (max_charge == 0 and cluster_particles % 2):
        raise ValueError(f"max_charge must be an integer from {cluster_particles % 2} to cluster_particles "
                         f"({cluster_particles}), got {max_charge!r}")
    softening = _check_number("softening", softening, 0.0, strict=False)
    n, radius, d_min = cluster_particles, cluster_radius(cluster_particles), min_separation(cluster_particles)
    local = np.empty((num_systems, 2 * n, 3))
    charge = np.empty((num_systems, 2 * n))
    direction = np.empty((num_systems, 3))
    separation = np.empty(num_systems)
    beyond = np.array([split != "train" and k % 2 == 1 for k in range(num_systems)])
    for k in range(num_systems):
        rng = np.random.default_rng(np.random.SeedSequence([seed, SPLITS.index(split), k, n]))
        local[k, :n], local[k, n:] = _ball(rng, n, radius), _ball(rng, n, radius)
        charge[k, :n], charge[k, n:] = _charges(rng, n, max_charge), _charges(rng, n, max_charge)
        u = rng.normal(size=3)
        direction[k] = u / np.linalg.norm(u)
        # uniform() draws from [low, high): counted down from test_max, a beyond-range
        # separation is in (train_max, test_max], never train_max itself.
        separation[k] = test_max - rng.uniform(0.0, test_max - train_max) if beyond[k] else rng.uniform(d_min, train_max)
    direction_t, separation_t = torch.from_numpy(direction), torch.from_numpy(separation)
    pos = move_apart(torch.from_numpy(local), direction_t, torch.zeros(num_systems, dtype=torch.float64), separation_t)
    # The energies of the positions as stored (float32), so a target is exact for its input.
    pos = pos.float().double()
    charge_t = torch.from_numpy(charge)
    potential = yukawa_potential(pos, charge_t, None, softening)
    energy = coulomb_energy(pos, charge_t, softening, potential)
    energy_a = coulomb_energy(pos[:, :n], charge_t[:, :n], softening)
    energy_b = coulomb_energy(pos[:, n:], charge_t[:, n:], softening)
    interaction = interaction_energy(pos[:, :n], charge_t[:, :n], pos[:, n:], charge_t[:, n:], softening)
    return Pairs(pos.float(), charge_t.float(), potential.float(), energy.float(), energy_a.float(), energy_b.float(),
                 interaction.float(), separation_t.float(), direction_t.float(), torch.from_numpy(beyond))


@dataclass(frozen=True)
class PairSplits:
    """The task's three splits of systems (training, validation, the held-out test)."""

    train: Pairs
    valid: Pairs
    test: Pairs


def separation_splits(*, cluster_particles: int = 16, num_train: int = 4096, num_valid: int = 128, num_test: int = 512,
                      seed: int = 0, train_max: float = 10.0, test_max: float = 20.0, max_charge: int = 4,
                      softening: float = 1.0) -> PairSplits:
    """Training systems inside ``[d_min, train_max]``, validation and test systems half
    inside, half beyond: the bundled data of ``flt train separation``."""
    for name, value in (("num_train", num_train), ("num_valid", num_valid), ("num_test", num_test)):
        check_positive_int(name, value)
    def split(name: str, num: int) -> Pairs:
        return generate_pairs(num, cluster_particles, seed=seed, split=name, train_max=train_max, test_max=test_max,
                              max_charge=max_charge, softening=softening)

    return PairSplits(split("train", num_train), split("valid", num_valid), split("test", num_test))
