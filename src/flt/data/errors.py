"""Errors raised by the data loaders.

Every loader reports a bad input (missing, empty, truncated, corrupt, wrong layout) with
one of these exceptions and a message that names the offending file or folder, so a user
can tell at a glance which file to fix.
"""

from __future__ import annotations

import os


class DataError(ValueError):
    """A data file or folder exists but cannot be used; the message names it."""


class MissingDataError(DataError, FileNotFoundError):
    """A required data file or folder does not exist.

    It is both a :class:`DataError` and a :class:`FileNotFoundError`, so callers may
    catch either.
    """


def require_file(path: str | os.PathLike, what: str) -> str:
    """Return ``path`` as a string, raising :class:`MissingDataError` unless it is a file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MissingDataError(f"{what} not found: {path}")
    if not os.path.isfile(path):
        raise DataError(f"{what} must be a file, but {path} is not a regular file")
    return path


def require_dir(path: str | os.PathLike, what: str) -> str:
    """Return ``path`` as a string, raising :class:`MissingDataError` unless it is a folder."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MissingDataError(f"{what} not found: {path}")
    if not os.path.isdir(path):
        raise DataError(f"{what} must be a directory, but {path} is not one")
    return path
