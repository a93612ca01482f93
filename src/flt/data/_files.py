"""Opening data files: regular files only, and sizes checked before anything is read.

A name that looks like data (``cat.png`` in an image class folder, ``a.xyz``) may be a
FIFO, a device, a socket or a directory: opening a FIFO for reading blocks until a
writer appears, so a loader that opens whatever a folder lists can hang forever. Every
loader here opens through :func:`open_regular`, which opens without blocking and checks
what it opened (no window between a check and the open), and lists folders through
:func:`regular_files`, which refuses such entries by name.

A file's size (or a size its header declares) becomes memory once read; it is compared
with the memory limit of :mod:`flt._limits` (``FLT_MEMORY_LIMIT``) before the read, so a
sparse 20 GB file is refused by name instead of ending in an out-of-memory error.
"""

from __future__ import annotations

import os
import stat
from typing import IO, Any

from flt._io import file_kind, regular_files as _regular_files

from .errors import DataError, MissingDataError


def one_line(error: object, width: int = 200) -> str:
    """The text of an error on one line, cut to about ``width`` characters: a parser's
    message may span lines (a traceback excerpt, an array's repr)."""
    text = " ".join(str(error).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def open_regular(path: str | os.PathLike, what: str, *, encoding: str | None = None, newline: str | None = None) -> IO[Any]:
    """``path`` opened for reading (binary, or text in ``encoding``), refusing anything but
    a regular file (links are followed) with a :class:`DataError` that names it and what
    it is; :class:`MissingDataError` if it does not exist. The open itself never blocks."""
    path = os.fspath(path)
    # O_NONBLOCK: opening a FIFO without a writer returns at once instead of waiting, and
    # the fstat below then refuses it. Regular files ignore the flag.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise MissingDataError(f"{what} not found: {path}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DataError(f"{what} {path} is {file_kind(mode)}, not a regular file; data files must be regular files")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        if encoding is None:
            return os.fdopen(fd, "rb")
        return os.fdopen(fd, "r", encoding=encoding, newline=newline)
    except BaseException:
        os.close(fd)
        raise


def regular_files(folder: str, suffixes: tuple[str, ...], what: str) -> list[str]:
    """:func:`flt._io.regular_files`, refusing with a :class:`DataError`."""
    return _regular_files(folder, suffixes, what, DataError)


def check_file_memory(path: str, nbytes: float, what: str, *, detail: str = "", hint: str = "") -> None:
    """Refuse a file whose contents would need ``nbytes`` (an estimate from its size or
    from a size its header declares, said in ``detail``) beyond the memory limit, naming
    the file and ``FLT_MEMORY_LIMIT``."""
    from flt._limits import check_memory

    check_memory(f"{what} {path}" + (f" ({detail})" if detail else ""), nbytes, hint=hint)


def check_file_size(path: str, size: int, what: str, *, bytes_per_byte: float = 1.0, hint: str = "") -> None:
    """:func:`check_file_memory` for a file of ``size`` bytes whose every byte costs
    ``bytes_per_byte`` once read and parsed."""
    from flt._limits import format_bytes

    check_file_memory(path, size * bytes_per_byte, what, detail=f"{format_bytes(size)} on disk", hint=hint)


def read_regular(path: str | os.PathLike, what: str, *, bytes_per_byte: float = 1.0, hint: str = "") -> bytes:
    """The whole of the regular file ``path``, its size checked against the memory limit
    first (``bytes_per_byte``: what each byte of the file costs once the caller has turned
    it into what it holds)."""
    with open_regular(path, what) as fh:
        check_file_size(os.fspath(path), os.fstat(fh.fileno()).st_size, what, bytes_per_byte=bytes_per_byte, hint=hint)
        return fh.read()


#: Largest finite float32: numbers read in float64 must stay below it, since the models
#: and the targets they are compared with hold them in float32 (1e308 passes a float64
#: check and becomes infinity there).
FLOAT32_MAX = 3.4028234663852886e38


def check_float32(value: float, where: str) -> float:
    """``value`` if it is finite in float32; else a :class:`DataError` naming ``where``."""
    if not abs(value) <= FLOAT32_MAX:  # also catches NaN
        raise DataError(f"{where}: {value:g} does not fit float32 (|x| <= {FLOAT32_MAX:.4g}), the precision it is used in")
    return value


def load_npz(path: str, what: str, fix: str) -> dict[str, Any]:
    """The arrays of the ``.npz`` archive ``path`` (no pickles), each member's header
    checked first: the shape a header declares is allocated before its data is read, so a
    member declaring more bytes than it holds (a crafted or damaged cache) is refused, and
    the members together are checked against the memory limit. Any damage is a
    :class:`DataError` naming the file and ending with ``fix``."""
    import zipfile
    import zlib

    import numpy as np

    with open_regular(path, what) as fh:
        try:
            with zipfile.ZipFile(fh) as archive:
                total = 0
                for info in archive.infolist():
                    with archive.open(info) as member:
                        declared = _npy_declared_bytes(member)
                    if declared is not None and declared > info.file_size:
                        raise DataError(f"{what} {path} is corrupt: its member {info.filename} declares {declared:,} bytes "
                                        f"but holds {info.file_size:,}; {fix}")
                    total += info.file_size
                check_file_memory(path, total, what, detail=f"{total:,} bytes of arrays")
            fh.seek(0)
            loaded = np.load(fh, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise DataError(f"{what} {path} is not an .npz archive; {fix}")
            with loaded:
                return {k: loaded[k] for k in loaded.files}
        except DataError:
            raise
        # What numpy and zipfile raise for a damaged archive: a bad header or zip directory,
        # truncated or undecompressable data, an encrypted or unsupported member.
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, AttributeError, RuntimeError,
                NotImplementedError, zlib.error) as e:
            raise DataError(f"{what} {path} is corrupt ({type(e).__name__}: {one_line(e)}); {fix}") from None


def _npy_declared_bytes(member: IO[bytes]) -> int | None:
    """Bytes the ``.npy`` header at the start of ``member`` declares (shape times item
    size); None for a header this check does not read (numpy's loader reports it)."""
    import numpy as np

    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(member)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(member)
    else:
        return None
    count = 1
    for n in shape:
        count *= n
    return count * dtype.itemsize


def torch_load_error(error: BaseException) -> str:
    """What a failed ``torch.load(..., weights_only=True)`` says, on one line: for a refused
    pickle, only the global it refused (torch's text spans lines, holds terminal escape
    codes, and advises loading the file without ``weights_only``, which would run its code);
    otherwise the error's type and :func:`one_line` text."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    if "WeightsUnpickler error:" in text:
        # What follows the marker is the reason, then advice this message leaves out.
        reason = re.split(r"Check the documentation|Please use", text.split("WeightsUnpickler error:", 1)[1])[0]
        reason = one_line(reason).rstrip(". ")
        return "torch.load with weights_only=True refused to unpickle it" + (f" ({reason})" if reason else "")
    return f"{type(error).__name__}: {one_line(text) or f'{type(error).__name__} without a message'}"
