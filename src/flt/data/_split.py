"""Deterministic train/validation index splits shared by the image and molecule loaders."""

from __future__ import annotations

import numpy as np


def split_indices(n: int, valid_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(n)`` into disjoint sorted train and validation index arrays.

    The validation set has ``round(n * valid_fraction)`` items (at least 1 and at most
    ``n - 1``) drawn by a permutation from ``numpy.random.default_rng(seed)``, so the
    split depends only on ``n``, ``valid_fraction`` and ``seed``. Both arrays are int64.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"need at least 2 items to split into train and validation, got n = {n!r}")
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must lie strictly between 0 and 1, got {valid_fraction!r}")
    n_valid = min(max(int(round(n * valid_fraction)), 1), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    valid = np.sort(perm[:n_valid]).astype(np.int64)
    train = np.sort(perm[n_valid:]).astype(np.int64)
    return train, valid
