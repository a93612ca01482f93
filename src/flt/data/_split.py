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


#: ``numpy.random.default_rng([seed, TEST_STREAM])`` draws the test set, a stream apart
#: from the validation permutation of ``default_rng(seed)``.
TEST_STREAM = 7


def carve_test(train: np.ndarray, n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split the training indices ``train`` (of ``n`` items in all) into disjoint sorted
    ``(train, test)`` arrays, leaving the validation split untouched.

    The test set has ``round(n * test_fraction)`` items (at least 1, at most
    ``len(train) - 1``), drawn from ``train`` by ``default_rng([seed, TEST_STREAM])``: a
    function of the training indices, ``n``, ``test_fraction`` and ``seed`` alone. Carving
    from the training pool rather than from validation keeps validation metrics comparable
    with runs made before the test split existed (those runs trained on the test items).
    """
    train = np.asarray(train, dtype=np.int64)
    if train.size < 2:
        raise ValueError(f"need at least 2 training items to carve a test set, got {train.size}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction!r}")
    n_test = min(max(int(round(n * test_fraction)), 1), train.size - 1)
    perm = np.random.default_rng([seed, TEST_STREAM]).permutation(train.size)
    return np.sort(train[perm[n_test:]]), np.sort(train[perm[:n_test]])
