"""File I/O shared by checkpoints, metrics, run files and dataset caches: atomic writes,
fsync, hashes, the temporaries a killed process leaves, file names confined to a folder,
and JSON read and written safely.

Nothing here writes through a link: a file is replaced by renaming a new one onto its
name (:func:`atomic_write`, which replaces a link of that name instead of following it),
and the files that are appended to or locked are opened without following links and must
be plain files of their own (:func:`open_own_file`). JSON is written without NaN or
infinity (:func:`dumps_json`) and read into an error that names the file for any text that
is not a JSON document of bounded depth (:func:`loads_json`).

Files and directories written here get the permissions a plain ``open()`` or
``os.makedirs`` would give them (``0o666 & ~umask`` and ``0o777 & ~umask``: 0644 and 0755
under the usual umask 022), not the private 0600 / 0700 of ``tempfile``'s temporaries:
run directories and caches are meant to be shared like any other output.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import stat
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


def atomic_write_json(path: str, data: object, **dump_options: Any) -> None:
    """Write ``data`` as JSON (:func:`dumps_json`, with ``dump_options`` such as ``indent``)
    and a final newline to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write_text(path, dumps_json(data, path, **dump_options) + "\n")


def new_figure(width: float, height: float, dpi: int = 110, *, extra: str = "train") -> Any:
    """A matplotlib ``Figure`` (constrained layout, no pyplot state), or an ``ImportError``
    naming ``extra``, the extra that installs matplotlib for the command at hand. The one figure factory of the training
    plots and of the tasks' own plots, which cannot import the training package."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        from flt._extras import install_hint

        raise ImportError(f"plots need matplotlib: {install_hint(extra)}, or pass --no-plots") from e
    return Figure(figsize=(width, height), dpi=dpi, layout="constrained")


def atomic_savefig(fig: Any, path: str, **savefig_options: Any) -> None:
    """Save a matplotlib figure as a PNG to ``path`` atomically (:func:`atomic_write`): a
    kill mid-plot leaves the previous file, and a link named ``path`` is replaced, not
    written through."""
    atomic_write(path, lambda f: fig.savefig(f, format="png", **savefig_options), binary=True)


def open_own_file(path: str, flags: int, what: str = "file") -> int:
    """``os.open(path, flags | O_NOFOLLOW)`` for a file that is written in place (appended
    to, locked), refused with a ``ValueError`` naming it unless ``path`` is a plain file with
    no other name: a symbolic link, a hard link to a file elsewhere, a FIFO or a device
    would make the write land outside the folder, or hang. ``what`` names the file's role
    in the error. Returns the open descriptor."""
    try:
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0), 0o666)
    except OSError as e:
        if os.path.islink(path):
            raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}), not the {what} flt writes there; "
                             "flt does not write through links: remove it") from None
        if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
            # A FIFO without a reader (ENXIO for a write-only open), a socket, a directory.
            raise ValueError(f"{path} is not a regular file, not the {what} flt writes there; "
                             "flt does not write into it: remove it") from None
        raise e from None
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_nlink > 1:
        problem = f"has {st.st_nlink} names (a hard link shared with another file)"
    if problem is not None:
        os.close(fd)
        raise ValueError(f"{path} {problem}, not the {what} flt writes there; flt does not write into it: remove it")
    if hasattr(os, "O_NONBLOCK"):
        os.set_blocking(fd, True)
    return fd


def open_append_text(path: str, what: str = "file") -> IO[str]:
    """``path`` opened for appending UTF-8 text, created if missing, through
    :func:`open_own_file` (no links, plain files only)."""
    fd = open_own_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, what)
    return os.fdopen(fd, "a", encoding="utf-8")


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


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words: ``"a FIFO"``, ``"a directory"``, ..."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def regular_files(folder: str, suffixes: tuple[str, ...], what: str, error: type[ValueError] = ValueError) -> list[str]:
    """Sorted full paths of the entries of ``folder`` whose names end with one of
    ``suffixes`` (case-insensitive) and do not start with a dot. An entry with such a name
    that is not a regular file (a FIFO, a device, a socket, a directory, a broken link) is
    refused with ``error`` (a ``ValueError``) naming it and ``what`` it was meant as:
    opening a FIFO to read it would block until a writer came, and the others would fail
    later without a name. Links to regular files are regular files here (a Hugging Face
    cache folder is made of them)."""
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.lower().endswith(suffixes):
                continue
            try:
                mode = entry.stat().st_mode  # follows links: a link to a regular file is one
            except FileNotFoundError:
                raise error(f"{what} {entry.path} is a broken link; flt reads only regular files") from None
            if not stat.S_ISREG(mode):
                raise error(f"{what} {entry.path} is {file_kind(mode)}, not a regular file; "
                            "flt reads only regular files (remove or rename it)")
            found.append(entry.path)
    return sorted(found)


#: How deeply JSON that flt reads may nest: its own files nest a few levels; a document
#: nested thousands deep is crafted, and would end in a RecursionError where it is read
#: or used.
MAX_JSON_DEPTH = 64


class JSONError(ValueError):
    """Text that is not a JSON document flt can read; the message names where it came from."""


def nests_deeper_than(value: object, limit: int) -> bool:
    """True if ``value`` nests lists and dicts more than ``limit`` deep (walked without
    recursion)."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            if depth >= limit:
                return True
            stack.extend((v, depth + 1) for v in item)
    return False


def loads_json(text: str | bytes, where: str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)`` for text read from ``where`` (a file, an option), refusing with
    a one-line :class:`JSONError` that names ``where`` text that is not JSON, not UTF-8,
    or nested more than ``max_depth`` deep (which would otherwise be a ``RecursionError``)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONError(f"{where} is not a JSON document flt can read: it nests more than {max_depth} levels deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise JSONError(f"{where} is not valid JSON: {_one_line(e)}") from None
    if nests_deeper_than(value, max_depth):
        raise JSONError(f"{where} is not a JSON document flt can read: it nests more than {max_depth} levels deep")
    return value


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text[:200] + ("..." if len(text) > 200 else "")


def read_json_file(path: str, what: str | None = None, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON document in the file ``path`` (:func:`loads_json`; errors name ``what``,
    default the path). A missing file raises ``FileNotFoundError``; a FIFO, device or
    directory, which no JSON file is, is refused before it is opened (opening a FIFO would
    wait for a writer)."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise JSONError(f"{what or path} is not a regular file")
    with open(path, "rb") as f:
        raw = f.read()
    return loads_json(raw, what or path, max_depth=max_depth)


def read_json(path: str, missing: str, corrupt: Callable[[Exception], Exception]) -> Any:
    """The JSON document in ``path``: no such file raises ``FileNotFoundError(missing)``,
    text that is not UTF-8 JSON of bounded depth (:func:`loads_json`) raises
    ``corrupt(error)``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(missing)
    try:
        return read_json_file(path)
    except JSONError as e:
        raise corrupt(e) from None


def _non_finite(value: object, where: str = "") -> str | None:
    """The first place in ``value`` (``final.mae``, ``rows[2]``) that holds NaN or an infinity, or None."""
    stack: list[tuple[object, str]] = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return f"{at or 'the value'} is {item}"
        if isinstance(item, dict):
            stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))
    return None


def dumps_json(data: object, where: str, **dump_options: Any) -> str:
    """``json.dumps(data, allow_nan=False, ...)``: JSON has no NaN or infinity, and a file
    that holds them is not JSON, so writing one to ``where`` is refused with a
    ``ValueError`` that names the value."""
    try:
        return json.dumps(data, allow_nan=False, **dump_options)
    except ValueError:
        found = _non_finite(data)
        if found is None:
            raise
        raise ValueError(f"refusing to write {where}: {found}, which is not a finite number (JSON has no NaN or infinity)") from None
