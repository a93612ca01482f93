"""Checks of a command's output paths and optional plotting, made before any work starts:
a run directory that is a file, or a folder nobody may write in, is refused at once rather
than after the data has loaded or a model has trained."""

from __future__ import annotations

import os
import sys


def _existing_ancestor(path: str) -> str:
    """The nearest folder above ``path`` (or ``path`` itself) that exists."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return probe


def _check_creatable(path: str, flag: str, folder: str | None = None) -> None:
    """``folder`` (default ``path``) does not exist yet: refuse ``path`` when a file stands
    where a folder above it must be, or when that folder may not be written."""
    above = _existing_ancestor(folder or path)
    if not os.path.isdir(above):
        raise ValueError(f"{flag} {path}: {above} is a file, not a folder; choose another {flag}")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot create it, {above} is not writable; choose another {flag}")


def check_output_dir(path: str, flag: str = "--out-dir") -> None:
    """Refuse an output directory that is a file, or that cannot be created or written in."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a file, not a directory; choose another {flag}")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path} is not writable; choose another {flag}")
        return
    _check_creatable(path, flag)


def check_output_file(path: str, flag: str) -> None:
    """Refuse an output file that is a directory, or whose folder cannot be written in."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory, not a file; give a file name such as {os.path.join(path, 'result.json')}")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(folder):
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: its folder {folder} is not writable; choose another {flag}")
        return
    _check_creatable(path, flag, folder)


def check_run_path(path: str, what: str = "a run directory or a checkpoint directory") -> None:
    """Refuse a run or checkpoint path that is a file (which would otherwise read as 'not found')."""
    if os.path.isfile(path):
        raise ValueError(f"{path} is a file, not {what}")


def plots_available(command: str, extra: str = "plot", silence: str | None = "--no-plots") -> bool:
    """Whether matplotlib imports. When it does not, say once that the command makes no
    plots (instead of failing after the work, when the plots are written) and how to
    install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from flt._extras import install_hint

        quiet = f"; {silence} silences this note" if silence else ""
        print(f"flt {command}: matplotlib is not installed, so no plots are written ({install_hint(extra)} to get them{quiet})",
              file=sys.stderr, flush=True)
        return False
    return True
