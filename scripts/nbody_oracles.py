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
  FLT far field, i.i.d. draws, stratified by component), as a normalised error.

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
    for k in range(len(clouds)):
        x, q, y = clouds.pos[k].double().numpy(), clouds.charge[k].double().numpy(), clouds.y[k].double().numpy()
        d = torch.cdist(torch.from_numpy(x), torch.from_numpy(x)).numpy()
        g = np.exp(-d / args.screening) / np.sqrt(d * d + args.softening**2)
        np.fill_diagonal(g, 0.0)
        idx = np.argsort(d, 1)[:, 1:16]
        near.append((np.take_along_axis(g, idx, 1) * q[idx]).sum(1))
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


if __name__ == "__main__":
    main()
