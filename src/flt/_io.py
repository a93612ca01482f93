"""Atomic file writes shared by checkpoints, metrics and dataset caches."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import IO


def fsync_dir(path: str) -> None:
    """Flush a directory entry (a rename inside it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[IO], None], *, binary: bool = False) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, fsync it and ``os.replace``
    it onto ``path``: readers see the old file or the whole new one, even if the process is
    killed mid-write. The temporary file never outlives a failure."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(folder)
