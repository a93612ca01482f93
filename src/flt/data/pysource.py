"""The long-context byte corpus: the ``.py`` files of the running interpreter's standard library.

Every Python installation ships its standard library as source, so this corpus needs no
download: the files under ``sysconfig.get_paths()["stdlib"]``, without ``site-packages``
(installed third-party code), ``__pycache__`` and the test suites (directories named
``test``, ``tests`` or ``idle_test``, most of them regression tests). CPython 3.11.7 gives
12.1 MB in 734 files (674 train, 60 validation with the defaults: 11.4 MB and 0.70 MB).

The split is by file: a file goes to validation when the CRC-32 of ``"{seed}:{relative
path}"``, scaled to ``[0, 1)``, is below ``valid_fraction``. It depends on the file's path
alone (adding or removing other files moves no file across the split) and no file
straddles it. Within a split, files are sorted by path and joined by a blank line; the
result is raw bytes (no decoding: the handful of files that are not UTF-8 stay as they are).
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass

import torch

from flt.data._files import read_regular, regular_files
from flt.data.errors import DataError

#: Directory names skipped under the stdlib directory.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class SourceSplits:
    """Byte tokens ``[N]`` (uint8) of each split and the relative paths of their files."""

    train: torch.Tensor
    valid: torch.Tensor
    train_files: tuple[str, ...]
    valid_files: tuple[str, ...]
    root: str
    name: str = "python-stdlib-source"
    test: torch.Tensor | None = None
    test_files: tuple[str, ...] = ()


def stdlib_dir() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def source_files(root: str | os.PathLike | None = None) -> list[str]:
    """Sorted relative paths (``/``-separated) of the ``.py`` files under ``root`` (default:
    :func:`stdlib_dir`), without the directories of :data:`EXCLUDED_DIRS`."""
    root = os.fspath(root) if root is not None else stdlib_dir()
    if not os.path.isdir(root):
        raise DataError(f"source root {root!r} is not a directory")
    found = []
    for folder, dirs, _ in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        rel = os.path.relpath(folder, root)
        # os.walk lists FIFOs and devices among the files: regular_files refuses them by name.
        for path in regular_files(folder, (".py",), "source file"):
            name = os.path.basename(path)
            found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return sorted(found)


def is_valid_file(relative_path: str, valid_fraction: float, seed: int) -> bool:
    """Whether a file goes to validation (module docstring): a function of its path and ``seed``."""
    return zlib.crc32(f"{seed}:{relative_path}".encode()) / 2**32 < valid_fraction


def is_test_file(relative_path: str, test_fraction: float, seed: int) -> bool:
    """Whether a training file goes to the test split: a function of its path and ``seed``,
    hashed apart from :func:`is_valid_file`'s draw."""
    return zlib.crc32(f"test:{seed}:{relative_path}".encode()) / 2**32 < test_fraction


def split_files(files: list[str], valid_fraction: float = 0.1, seed: int = 0) -> tuple[list[str], list[str]]:
    """``(train, valid)`` relative paths, each sorted."""
    if isinstance(valid_fraction, bool) or not isinstance(valid_fraction, (int, float)) or not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must lie strictly between 0 and 1, got {valid_fraction!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    valid = [f for f in sorted(files) if is_valid_file(f, valid_fraction, seed)]
    chosen = set(valid)
    return [f for f in sorted(files) if f not in chosen], valid


def _join(root: str, files: list[str], budget: int | None) -> torch.Tensor:
    parts, total = [], 0
    for rel in files:
        data = read_regular(os.path.join(root, rel), "source file")
        parts.append(data)
        total += len(data) + len(_SEPARATOR)
        if budget is not None and total >= budget:
            break
    joined = _SEPARATOR.join(parts)
    if budget is not None:
        joined = joined[:budget]
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.zeros(0, dtype=torch.uint8)


def load_python_source(*, root: str | os.PathLike | None = None, valid_fraction: float = 0.1, seed: int = 0,
                       max_bytes: int | None = None, test_fraction: float = 0.0) -> SourceSplits:
    """The standard library's source as byte tokens, split by file (module docstring).

    ``test_fraction > 0`` moves the training files for which :func:`is_test_file` holds
    (about that fraction of them) to a test split; validation is unchanged. ``max_bytes``
    caps the total: validation and test keep their first ``valid_fraction * max_bytes`` and
    ``test_fraction * max_bytes`` bytes, train the rest of the budget (whole files first,
    the last one cut).
    ``root`` replaces the stdlib directory (any tree of ``.py`` files).
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 2):
        raise ValueError(f"max_bytes must be None or an integer >= 2, got {max_bytes!r}")
    root = os.fspath(root) if root is not None else stdlib_dir()
    train_files, valid_files = split_files(source_files(root), valid_fraction, seed)
    if not train_files or not valid_files:
        raise DataError(f"the source tree {root!r} gives an empty split ({len(train_files)} train, {len(valid_files)} "
                        f"validation files); it needs more .py files or another valid_fraction")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in [0, 1), got {test_fraction!r}")
    test_files = [f for f in train_files if test_fraction and is_test_file(f, test_fraction, seed)]
    if test_fraction and (not test_files or len(test_files) == len(train_files)):
        raise DataError(f"the source tree {root!r} gives an empty split for test_fraction {test_fraction}")
    train_files = [f for f in train_files if f not in set(test_files)]
    n_valid: int | None = None
    n_test: int | None = None
    n_train: int | None = None
    if max_bytes is not None:
        n_valid = max(1, int(round(max_bytes * valid_fraction)))
        n_test = max(1, int(round(max_bytes * test_fraction)))
        n_train = max_bytes - n_valid - (n_test if test_files else 0)
    train = _join(root, train_files, n_train)
    valid = _join(root, valid_files, n_valid)
    test = _join(root, test_files, n_test) if test_files else None
    return SourceSplits(train, valid, tuple(train_files), tuple(valid_files), root, test=test, test_files=tuple(test_files))
