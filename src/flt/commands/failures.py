"""What ``flt`` tells its user when a command fails: every expected failure as one line
``flt COMMAND: error: CAUSE`` and an exit status (:func:`explain`), the rest as a bug.

Exit statuses: 2 for bad input (an option, a file given), 1 for a failure at run time
(disk full, out of memory, a diverged loss, a missing optional dependency), 130 for
Ctrl-C. ``flt --debug`` shows the traceback of any of them instead.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from dataclasses import dataclass

BAD_INPUT, RUNTIME, INTERRUPTED = 2, 1, 130

#: Text of the RuntimeError torch's checkpoint writer raises when a write fails (a full
#: disk), which says neither "disk" nor the file: ``[enforce fail at inline_container.cc:672]
#: unexpected pos ...``, ``PytorchStreamWriter failed writing file data/0``. A bare
#: "enforce fail" counts only inside ``torch.save`` (the reader raises it too).
TORCH_WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter")
#: Text of errors that mean the process ran out of memory without a MemoryError.
OUT_OF_MEMORY_TEXT = ("out of memory", "can't allocate memory", "DefaultCPUAllocator: not enough memory")
#: Local variables that hold the file a failing writer or reader was working on.
PATH_LOCALS = ("path", "filename", "fname", "file", "f")


@dataclass(frozen=True)
class Failure:
    """An expected failure: the exit status and the one line that explains it."""

    code: int
    message: str
    #: Printed between the command and the message (none for Ctrl-C, which is no error).
    kind: str | None = "error"

    def line(self, command: str) -> str:
        return f"flt {command}: " + (f"{self.kind}: " if self.kind else "") + self.message


def command_name(args: argparse.Namespace) -> str:
    """``train``, ``bench speed``: the words after ``flt`` that name the command."""
    name = getattr(args, "command", None) or "?"
    sub = getattr(args, "bench_command", None)
    return f"{name} {sub}" if sub else name


def explain(err: BaseException, args: argparse.Namespace | None) -> Failure | None:
    """The exit status and the one line for an expected failure; None for a bug (an
    exception no user input or machine condition explains), which keeps its traceback.
    ``args`` is None when the failure came before the command line was parsed."""
    for explainer in (_interrupted, _no_space, _out_of_memory, _torch_writer, _safetensors, _diverged, _missing_extra,
                      _os_error, _bad_input):
        failure = explainer(err, args)
        if failure is not None:
            return failure
    return None


def _interrupted(err: BaseException, args: argparse.Namespace | None) -> Failure | None:
    if isinstance(err, KeyboardInterrupt):
        return Failure(INTERRUPTED, "interrupted (Ctrl-C)", kind=None)
    return None


def _no_space(err: BaseException, args: argparse.Namespace | None) -> Failure | None:
    text = str(err)
    full = (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left on device" in text \
        or "StorageFull" in text or "Disk quota exceeded" in text
    if not full:
        return None
    return Failure(RUNTIME, f"no space left on device while writing {_written_path(err, args)}; {_after_write_failure(args)}")


def _torch_writer(err: BaseException, args: argparse.Namespace | None) -> Failure | None:
    text = str(err)
    if isinstance(err, RuntimeError) and (any(t in text for t in TORCH_WRITE_FAILURES)
                                          or ("enforce fail" in text and _inside_torch_save(err))):
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return Failure(RUNTIME, f"writing {_written_path(err, args)} failed, most likely because the disk is full "
                       f"(torch: {first[:160]}); {_after_write_failure(args)}")
    return None


def _out_of_memory(err: BaseException, args: argparse.Namespace | None) -> Failure | None:
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    text = str(err)
    if not (isinstance(err, MemoryError) or (oom_type is not None and isinstance(err, oom_type))
            or (isinstance(err, RuntimeError) and any(t in text for t in OUT_OF_MEMORY_TEXT))):
        return None
    first = text.strip().splitlines()[0][:160] if text.strip() else type(err).__name__
    return Failure(RUNTIME, f"out of memory ({first}); try a smaller --batch-size (--run-opt eval_batch_size=N for "
                   "evaluation alone) or a smaller model (--model-opt dim=N, depth=N)")


def _safetensors(err: BaseException, args: argparse.Namespace | None) -> Failure | None:
    if type(err).__name__ != "SafetensorError":
        return None
    path = _path_in_traceback(err) or "a weights file"
    return Failure(BAD_INPUT, f"{path} is not a readable safetensors weights file, corrupt or truncated ({err}); "
                   "use another checkpoint of the run or train it again")


def _diverged(err: BaseException, args: argparse.Namespace | None) -> Failure | None:
    if isinstance(err, FloatingPointError):
        return Failure(RUNTIME, str(err) or "a computation produced NaN or infinity")
    return None


def _missing_extra(err: BaseException, args: argparse.Namespace | None) -> Failure | None:
    if not isinstance(err, ImportError):
        return None
    from flt._extras import EXTRA_OF_MODULE, install_hint

    if "pip install" in str(err):  # flt's own message, which names the extra
        return Failure(RUNTIME, str(err))
    top = (err.name or "").split(".")[0]
    if top in EXTRA_OF_MODULE:
        return Failure(RUNTIME, f"this needs {top}, an optional dependency that is not installed: "
                       f"{install_hint(EXTRA_OF_MODULE[top])}")
    return None


def _os_error(err: BaseException, args: argparse.Namespace | None) -> Failure | None:
    """A file or directory that cannot be used as given: bad input; any other OSError
    (an I/O error of the device): a failure at run time."""
    if not isinstance(err, OSError) or (isinstance(err, FileNotFoundError) and err.filename is None):
        return None
    what = err.strerror or str(err)
    where = " -> ".join(str(p) for p in (err.filename, err.filename2) if p is not None)
    line = f"{what}: {where}" if where else what
    if isinstance(err, (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)):
        return Failure(BAD_INPUT, line)
    return Failure(RUNTIME, line)


def _bad_input(err: BaseException, args: argparse.Namespace | None) -> Failure | None:
    # Options and files are checked where they are read, raising these with a message
    # that names the option or the file.
    if isinstance(err, (ValueError, TypeError, FileNotFoundError)):
        return Failure(BAD_INPUT, str(err))
    return None


def _written_path(err: BaseException, args: argparse.Namespace | None) -> str:
    """The file a failed write was writing: the error's own, the one a writer in the
    traceback held, or else the command's output directory."""
    if isinstance(err, OSError) and err.filename is not None:
        return str(err.filename)
    path = _path_in_traceback(err)
    if path is not None:
        return path
    out = getattr(args, "out_dir", None) or getattr(args, "out", None)
    return f"in {out}" if out else "a file"


def _frames(err: BaseException) -> list:
    """The frames of ``err``'s traceback, outermost first."""
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _inside_torch_save(err: BaseException) -> bool:
    return any(f.f_code.co_name in ("save", "_save") and f.f_code.co_filename.endswith(os.path.join("torch", "serialization.py"))
               for f in _frames(err))


def _path_in_traceback(err: BaseException) -> str | None:
    """The path a function in ``err``'s traceback was working on when it failed (the
    innermost frame with a local named as in :data:`PATH_LOCALS` that holds a path):
    ``flt._io.atomic_write``'s ``path``, safetensors' ``filename``, matplotlib's ``fname``.
    Writers such as ``torch.save`` into an open file do not name their file."""
    for frame in reversed(_frames(err)):
        for name in PATH_LOCALS:
            value = frame.f_locals.get(name)
            if isinstance(value, (str, os.PathLike)) and str(value):
                return os.fspath(value)
            if name in ("file", "f") and isinstance(getattr(value, "name", None), str):
                return value.name
    return None


def _after_write_failure(args: argparse.Namespace | None) -> str:
    """What the user can do after a write failed: free space, and continue a run from its
    last checkpoint where it has one (``args.out_dir`` is the run directory; the commands
    that train set it to the one they chose)."""
    command, out = getattr(args, "command", None), getattr(args, "out_dir", None)
    if command in ("train", "search") and out:
        from flt.train.checkpoint import has_checkpoint

        # A fresh run started in a directory without a run: a summary.json there is its own.
        if command == "train" and not getattr(args, "resume", False) and os.path.isfile(os.path.join(out, "summary.json")):
            return f"the training had finished (results in {os.path.join(out, 'summary.json')}); free some space for the rest"
        if has_checkpoint(out):
            return "free some space and continue with the same command and --resume (the last checkpoint is intact)"
    if command == "compare":
        return "free some space and continue with the same command and --resume"
    return "free some space and run the command again"
