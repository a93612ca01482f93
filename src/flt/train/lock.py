"""One trainer per run directory: an exclusive lock held for the life of ``flt train``.

Two trainers writing one run directory corrupt it: each rewrites the other's
``metrics.jsonl`` and ``run.json`` and prunes the other's checkpoints, and both may exit 0.
:func:`lock_run_dir` therefore takes ``RUN/.lock`` before anything in the directory is
read or written, for a fresh run and for ``--resume`` alike:

* the lock is an ``fcntl.flock`` on that file, which the kernel drops when its process
  ends, however it ends (``kill -9`` included): a lock left by a dead trainer is simply
  free, and the next trainer takes it over without guessing from pids whether its holder
  still runs;
* the file holds the holder's pid, host, start time and command, so that a second trainer
  is refused at once with a message naming the first;
* on release the file is deleted while still locked (a process that opened it just before
  sees, once it holds the lock, that the path now names another file, and tries again);
  a lock file found with a holder's record in it was therefore left by a trainer that was
  killed, which :attr:`RunLock.note` says.

The lock file is opened without following links and must be a plain file with one name
(:func:`flt._io.open_own_file`): a ``.lock`` that is a link, or a hard link to another
file, is refused with a message naming it, so the record is never written outside the run
directory. A record that is not a small JSON object (torn, corrupt, nested thousands deep)
is treated as no record.

Readers of a run (``flt evaluate``, ``flt generate``) take no lock. On a file system
without ``flock`` (some network mounts) the run goes on unlocked, with a note saying so.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from dataclasses import dataclass

from flt._io import JSONError, loads_json, open_own_file

LOCK_FILE = ".lock"
#: How long a refused trainer waits for the holder's record to appear (the holder writes
#: it just after locking).
_RECORD_WAIT_S = 0.5


class RunDirectoryInUse(OSError):
    """Another live process holds the run directory's lock; the message names it."""


@dataclass
class RunLock:
    """The lock on ``run_dir`` (``fd`` is None where the file system cannot lock)."""

    run_dir: str
    path: str
    fd: int | None
    #: A line for the user: the lock was taken over from a killed trainer, or could not be taken.
    note: str | None = None
    created_dir: bool = False

    def release(self) -> None:
        """Delete the lock file (while still holding it) and unlock; a run directory that
        this lock created and nothing else filled is removed again."""
        if self.fd is None:
            return
        try:
            if _same_file(self.fd, self.path):
                os.unlink(self.path)
        finally:
            os.close(self.fd)
            self.fd = None
        if self.created_dir:
            # Not empty (OSError): the run wrote files, or another trainer has just arrived.
            with contextlib.suppress(OSError):
                os.rmdir(self.run_dir)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_run_dir(run_dir: str, command: str = "flt train") -> RunLock:
    """Lock ``run_dir`` (created if missing) for this process, recording ``command`` as
    what holds it. Raises :class:`RunDirectoryInUse` naming the holder's pid, host, start
    time and command if another process holds it."""
    try:
        import fcntl
    except ImportError:  # Windows
        return RunLock(run_dir, os.path.join(run_dir, LOCK_FILE), None, note=_unlocked_note(run_dir, "no fcntl on this platform"))
    path = os.path.join(run_dir, LOCK_FILE)
    created = not os.path.isdir(run_dir)
    for _ in range(20):
        os.makedirs(run_dir, exist_ok=True)
        try:
            fd = open_own_file(path, os.O_RDWR | os.O_CREAT, "lock file")
        except FileNotFoundError:
            continue  # the directory was removed by a releasing trainer that had created it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _wait_for_record(fd)
            os.close(fd)
            raise RunDirectoryInUse(f"{run_dir} is in use by {_describe(holder)}; wait for it to finish or use another --out-dir") from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return RunLock(run_dir, path, None, note=_unlocked_note(run_dir, e.strerror or str(e)))
            raise
        if _same_file(fd, path):
            break
        os.close(fd)  # locked a file that its holder deleted on release: take the new one
    else:
        raise OSError(f"could not lock {path}: it kept being replaced by other processes")
    previous = _read_record(fd)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    note = None
    if previous:
        note = (f"{run_dir} was still marked as in use by {_describe(previous)}, which ended without releasing it "
                "(killed?); taking it over")
    return RunLock(run_dir, path, fd, note=note, created_dir=created)


def _same_file(fd: int, path: str) -> bool:
    """True if ``path`` still names the file open as ``fd`` (itself, not through a link)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _read_record(fd: int) -> dict | None:
    """The holder's record in the lock file, or None if it is empty or unreadable."""
    raw = os.pread(fd, 1 << 16, 0)
    try:
        record = loads_json(raw, "lock file", max_depth=2)
    except JSONError:
        return None
    return record if isinstance(record, dict) else None


def _wait_for_record(fd: int) -> dict | None:
    """The holder's record, waiting briefly for a holder that has locked but not yet written."""
    deadline = time.monotonic() + _RECORD_WAIT_S
    while True:
        record = _read_record(fd)
        if record is not None or time.monotonic() > deadline:
            return record
        time.sleep(0.02)


def _describe(record: dict | None) -> str:
    """``flt train (pid 1234 on host, started 2026-01-01 10:00:00 UTC)``."""
    if not record:
        return "another process (its pid is not recorded yet)"
    host = record.get("host")
    where = f"pid {record.get('pid')}" + (f" on {host}" if host and host != socket.gethostname() else "")
    return f"{record.get('command', 'another process')} ({where}, started {record.get('started', 'at an unknown time')})"


def _unlocked_note(run_dir: str, why: str) -> str:
    return f"cannot lock {run_dir} ({why}); another trainer started on it would not be stopped"
