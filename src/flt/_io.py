"""File I/O shared by checkpoints, metrics, run files and dataset caches: atomic writes,
fsync, hashes, the temporaries a killed process leaves, and file names confined to a folder.

Files and directories written here get the permissions a plain ``open()`` or
``os.makedirs`` would give them (``0o666 & ~umask`` and ``0o777 & ~umask``: 0644 and 0755
under the usual umask 022), not the private 0600 / 0700 of ``tempfile``'s temporaries:
run directories and caches are meant to be shared like any other output.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import IO, Any

_UMASK_LOCK = threading.Lock()

#: Names of the temporaries made here: ``.NAME.XXXXXXXX.tmp`` (``tempfile``'s 8 random
#: characters), for a file of :func:`atomic_write`, a directory of :func:`make_temp_dir`
#: or one being deleted by :func:`discard_dir`.
TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")


def current_umask() -> int:
    """The process's file mode creation mask, left unchanged.

    ``os.umask`` only sets the mask (returning the old one), so it is read from the
    ``Umask:`` line of ``/proc/self/status`` (Linux 4.7 and later), which changes nothing.
    Elsewhere the mask is set to 0o077 and put back at once, under a lock so that two
    callers cannot restore each other's value; a file that another thread creates in that
    instant gets fewer permissions than it should, never more.
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass  # no /proc (macOS, Windows, a chroot): set and restore below
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """The permission bits ``open(path, "w")`` gives a new file: ``0o666 & ~umask``."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """The permission bits ``os.makedirs`` gives a new directory: ``0o777 & ~umask``."""
    return 0o777 & ~current_umask()


def make_temp_dir(folder: str, prefix: str, suffix: str) -> str:
    """``tempfile.mkdtemp`` in ``folder``, with the permissions of ``os.makedirs``
    (:func:`dir_mode`) instead of 0700, for a directory that is renamed into place."""
    path = tempfile.mkdtemp(dir=folder, prefix=prefix, suffix=suffix)
    os.chmod(path, dir_mode())
    return path


def fsync_dir(path: str) -> None:
    """Flush a directory entry (a rename inside it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Flush a file's contents to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ``write``'s return value (a count of characters, say) is ignored.
def atomic_write(path: str, write: Callable[[IO], object], *, binary: bool = False) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, fsync it and ``os.replace``
    it onto ``path``: readers see the old file or the whole new one, even if the process is
    killed mid-write. The temporary file never outlives a failure. ``path`` gets the
    permissions of a plain ``open()`` (:func:`file_mode`), whatever it had before."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            # mkstemp creates the file 0600; give it the mode open() would have.
            os.chmod(tmp, file_mode())
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(folder)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(text))


def discard_dir(path: str) -> None:
    """Delete the directory ``path`` so that no process killed meanwhile leaves it half
    deleted under its own name: it is first renamed to a temporary name (atomic), which
    :func:`remove_temporaries` recognises, then removed."""
    folder, name = os.path.split(os.path.abspath(path))
    doomed = tempfile.mkdtemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    # rename(2) may replace an empty directory.
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def atomic_dir(folder: str, name: str, fill: Callable[[str], object]) -> str:
    """Create the directory ``folder/name`` atomically: ``fill(tmp)`` writes its files into a
    temporary directory beside it (:func:`make_temp_dir`), which is flushed and renamed into
    place, replacing (:func:`discard_dir`) a directory of that name a killed process left.
    Readers see the whole directory or none; the temporary never outlives a failure.
    Returns the final path."""
    tmp = make_temp_dir(folder, prefix=f".{name}.", suffix=".tmp")
    final = os.path.join(folder, name)
    try:
        fill(tmp)
        fsync_dir(tmp)
        if os.path.exists(final):
            discard_dir(final)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    fsync_dir(folder)
    return final


def remove_temporaries(folder: str) -> list[str]:
    """Delete the temporaries (:data:`TEMPORARY`) in ``folder`` that a killed process left
    behind; returns their names. Only safe while no other process writes in ``folder``
    (a run directory's lock, :mod:`flt.train.lock`)."""
    if not os.path.isdir(folder):
        return []
    removed = []
    for name in sorted(os.listdir(folder)):
        if not TEMPORARY.match(name):
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        removed.append(name)
    return removed


def confined_path(folder: str, name: object, what: str, error: type[ValueError] = ValueError) -> str:
    """``folder/name`` for a file name read from a file in ``folder`` (a checkpoint's
    ``config.json``, a ``latest`` pointer), refused before anything is opened unless it
    names an entry of ``folder`` itself: a plain name, not absolute, without ``..`` or a
    separator, and not a symbolic link that leads out of ``folder``. ``what`` names the
    file the name came from, for the error (``error``, a ``ValueError``)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or os.sep in name \
            or (os.altsep is not None and os.altsep in name) or "\0" in name:
        raise error(f"{what} names {name!r}, which is not a file name inside {folder}; refusing to open it")
    path = os.path.join(folder, name)
    real_folder = os.path.realpath(folder)
    if os.path.dirname(os.path.realpath(path)) != real_folder:
        raise error(f"{what} names {name!r}, a link to {os.path.realpath(path)}, outside {folder}; refusing to open it")
    return path


def read_json(path: str, missing: str, corrupt: Callable[[Exception], Exception]) -> Any:
    """The JSON document in ``path``: no such file raises ``FileNotFoundError(missing)``,
    text that is not UTF-8 JSON raises ``corrupt(error)``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(missing)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise corrupt(e) from None
