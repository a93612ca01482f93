"""What each mechanism family can reach on the ``nbody`` task at best, with no training.

    python scripts/nbody_oracles.py [--particles 256] [--clouds 8]

Prints, on validation clouds of ``flt.data.nbody`` (float64, least-squares readouts of
features a model has, its own charge included):

* ``cutoff``: the exact potential of each particle's 15 nearest others (the near set of
  ``near_neighbors=16``, itself included), the best a cutoff model can use;
* ``exact mask``: the normalised attention average ``sum_j f_ij q_j / sum_j f_ij`` with a
  4-Gaussian mask fitted to the potential plus a constant (the mask family of the
  softmax reference and of FLT), i.e. what exact attention with that term represents;
* ``random features R``: the same numerator estimated with ``R`` random frequencies (the
  FLT far field, i.i.d. draws, stratified by component), as a normalised error;
* ``near + smooth far``: the cutoff's exact near sum plus a far field of Gaussians no
  shorter than ``l_min`` fitted to the potential outside the near set, exact and
  estimated with ``R`` random frequencies (the estimate of the near pairs removed, as
  FLT's near set does): what FLT with ``near_neighbors=16`` and a far spectrum floored
  at ``min_length = l_min`` can reach at best.

Scores are ``1 - R^2`` (normalised MSE, lower is better).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from scipy.optimize import nnls

from flt.data.nbody import box_side, generate_clouds

LENGTHS = np.array([0.8, 2.0, 4.5, 9.0])  # mixture component lengths, in mean spacings


def nmse_of_fit(features: list[np.ndarray], y: np.ndarray) -> float:
    """``1 - R^2`` of the least-squares fit of ``y`` on ``features`` and a constant."""
    a = np.column_stack([*features, np.ones_like(y)])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(np.var(y - a @ coef) / np.var(y))


def fitted_mixture(screening: float, softening: float, side: float) -> np.ndarray:
    """Nonnegative weights of Gaussians of :data:`LENGTHS` fitted to the potential, each
    offset weighted by ``r`` (a shell of radius ``r`` holds ``~ r^2`` particles, and the
    error enters squared)."""
    r = np.linspace(0.0, 2 * side, 600)
    g = np.exp(-r / screening) / np.sqrt(r * r + softening * softening)
    basis = np.stack([np.exp(-r * r / (2 * l * l)) for l in LENGTHS], 1)
    weights, _ = nnls(basis * r[:, None], g * r)
    return weights


def fitted_far_mixture(lengths: np.ndarray, screening: float, softening: float, side: float, r_near: float) -> np.ndarray:
    """As :func:`fitted_mixture`, for the given ``lengths`` and offsets beyond ``r_near``
    only (the near set holds the rest exactly)."""
    r = np.linspace(r_near, 2 * side, 600)
    g = np.exp(-r / screening) / np.sqrt(r * r + softening * softening)
    basis = np.stack([np.exp(-r * r / (2 * l * l)) for l in lengths], 1)
    weights, _ = nnls(basis * r[:, None], g * r)
    return weights


def random_feature_sum(x: np.ndarray, q: np.ndarray, weights, lengths, num: int, rng) -> np.ndarray:
    """``sum_j f^(x_i - x_j) q_j`` with ``num`` i.i.d. frequencies stratified over the
    Gaussians of ``lengths`` (weights ``weights``), in ``O(N num)``."""
    est = np.zeros(len(q))
    for w, l in zip(weights, lengths):
        xi = rng.normal(0.0, 1.0 / l, (num // len(lengths), 3))
        phase = x @ xi.T
        cos, sin = np.cos(phase), np.sin(phase)
        est += w / xi.shape[0] * (cos @ (cos.T @ q) + sin @ (sin.T @ q))
    return est


def random_feature_pairs(x: np.ndarray, idx: np.ndarray, weights, lengths, num: int, rng) -> np.ndarray:
    """The same draws' ``f^`` on the pairs ``(i, idx[i, k])`` only: ``[N, K]``. Uses the
    generator's state as :func:`random_feature_sum` does, so call it on a copy."""
    est = np.zeros(idx.shape)
    for w, l in zip(weights, lengths):
        xi = rng.normal(0.0, 1.0 / l, (num // len(lengths), 3))
        delta = x[:, None, :] - x[idx]  # [N, K, 3]
        est += w / xi.shape[0] * np.cos(delta @ xi.T).sum(-1)
    return est


def near_far(x, q, d, g, idx, l_min, settings, nums, rng) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Exact far sum of a mixture floored at ``l_min`` outside the near set ``idx`` (itself
    included), and its random-feature estimates for each ``R`` in ``nums``."""
    screening, softening, side = settings
    lengths = l_min * np.array([1.0, 2.0, 4.0, 8.0])
    r_near = float(np.take_along_axis(d, idx, 1)[:, -1].mean())
    weights = fitted_far_mixture(lengths, screening, softening, side, r_near)
    f = sum(w * np.exp(-d * d / (2 * l * l)) for w, l in zip(weights, lengths))
    outside = np.ones_like(f, dtype=bool)
    np.put_along_axis(outside, idx, False, 1)
    exact = (f * outside) @ q
    estimates = {}
    for num in nums:
        state = rng.bit_generator.state
        total = random_feature_sum(x, q, weights, lengths, num, rng)
        rng.bit_generator.state = state
        on_near = random_feature_pairs(x, idx, weights, lengths, num, rng)
        estimates[num] = total - (on_near * q[idx]).sum(1)
    return exact, estimates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--particles", type=int, default=256)
    p.add_argument("--clouds", type=int, default=8)
    p.add_argument("--screening", type=float, default=3.0)
    p.add_argument("--softening", type=float, default=1.0)
    args = p.parse_args()
    clouds = generate_clouds(args.clouds, args.particles, seed=0, split="valid", screening=args.screening,
                             softening=args.softening)
    weights = fitted_mixture(args.screening, args.softening, box_side(args.particles, 1.0))
    rng = np.random.default_rng(0)
    ys, charges, near, average = [], [], [], []
    errors: dict[int, list[float]] = {64: [], 256: [], 1024: []}
    floors = (1.5, 2.0, 3.0, 4.0)
    far_exact: dict[float, list] = {l: [] for l in floors}
    far_est: dict[tuple[float, int], list] = {(l, n): [] for l in floors for n in errors}
    settings = (args.screening, args.softening, box_side(args.particles, 1.0))
    for k in range(len(clouds)):
        x, q, y = clouds.pos[k].double().numpy(), clouds.charge[k].double().numpy(), clouds.y[k].double().numpy()
        d = torch.cdist(torch.from_numpy(x), torch.from_numpy(x)).numpy()
        g = np.exp(-d / args.screening) / np.sqrt(d * d + args.softening**2)
        np.fill_diagonal(g, 0.0)
        idx = np.argsort(d, 1)[:, 1:16]
        near.append((np.take_along_axis(g, idx, 1) * q[idx]).sum(1))
        for l_min in floors:
            exact, est = near_far(x, q, d, g, np.argsort(d, 1)[:, :16], l_min, settings, errors, rng)
            far_exact[l_min].append(exact)
            for num, e in est.items():
                far_est[l_min, num].append(e)
        f = sum(w * np.exp(-d * d / (2 * l * l)) for w, l in zip(weights, LENGTHS))
        c = 10 * f.sum(1).mean() / len(q)  # a constant that dominates the normaliser
        average.append(((f + c) @ q) / (f + c).sum(1))
        ys.append(y)
        charges.append(q)
        for num in errors:
            est = np.zeros(len(q))
            for w, l in zip(weights, LENGTHS):
                xi = rng.normal(0.0, 1.0 / l, (num // len(LENGTHS), 3))
                phase = x @ xi.T
                cos, sin = np.cos(phase), np.sin(phase)
                est += w / xi.shape[0] * (cos @ (cos.T @ q) + sin @ (sin.T @ q))
            errors[num].append(float(np.mean((est - f @ q) ** 2) / np.var(f @ q)))
    y, q, near, average = (np.concatenate(a) for a in (ys, charges, near, average))
    print(f"N = {args.particles}, box {box_side(args.particles, 1.0):.1f}, screening {args.screening}, "
          f"softening {args.softening}; 1 - R^2 (lower is better)")
    print(f"cutoff (exact potential of the 15 nearest): {nmse_of_fit([near, q, near * q], y):.3f}")
    print(f"exact mask (fitted 4-Gaussian mixture + constant), attention average: {nmse_of_fit([average, q, average * q], y):.3f}")
    for num, err in errors.items():
        print(f"random features R = {num}: error of the mask-weighted charge sum {np.mean(err):.2f}")
    for l_min in floors:
        exact = np.concatenate(far_exact[l_min])
        line = f"near 16 exact + far field of lengths >= {l_min}: exact {nmse_of_fit([near, exact, q, near * q], y):.3f}"
        for num in errors:
            est = np.concatenate(far_est[l_min, num])
            line += (f"; R = {num}: {nmse_of_fit([near, est, q, near * q], y):.3f} "
                     f"(far-sum error {np.mean((est - exact) ** 2) / np.var(exact):.2f})")
        print(line)


if __name__ == "__main__":
    main()
