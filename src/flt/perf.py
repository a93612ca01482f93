"""Running flt's layers near the machine's limit: one switch, :func:`compile`.

Two things stand between an eager CPU forward and its FLOP floor (docs/performance.md,
"Against the FLOP floor"):

* **Fresh memory for every large temporary.** glibc's ``malloc`` serves blocks above its
  ``mmap`` threshold (at most 32 MiB by default) straight from the operating system and
  returns them on ``free``; a ``[B, H, N, m]`` feature tensor is 64 MiB at N = 16384, so
  every call maps it anew and pays one page fault per 4 KiB page as it is first written
  (60 k faults per FLT forward at that size, about a fifth of its time).
  :func:`keep_freed_memory` raises the threshold and the trim threshold, so freed blocks
  stay in the heap and the next call reuses them: the behaviour of PyTorch's caching
  allocator on GPUs, for the CPU. The process's resident memory then stays at its peak.
* **Many passes over large tensors.** ``torch.compile`` (inductor) fuses the elementwise
  work of the feature maps into few loops.

:func:`compile` does both. Everything here is process-wide or returns a new module; nothing
runs at import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any, cast

import torch

#: ``mallopt`` parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Blocks up to this size come from the heap and are kept for reuse when freed (1 GiB;
#: larger ones are still mapped and unmapped one by one).
KEEP_UP_TO = 1 << 30
#: glibc's documented defaults, which ``keep_freed_memory(False)`` restores as fixed values.
_GLIBC_DEFAULT = 128 * 1024


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.gnu_get_libc_version.restype = ctypes.c_char_p  # only glibc has it: the check
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None
    return libc


def keep_freed_memory(enable: bool = True) -> bool:
    """Make glibc's ``malloc`` keep freed blocks of up to :data:`KEEP_UP_TO` bytes for
    reuse instead of returning them to the operating system (module docstring).

    Process-wide, for every allocation made afterwards (tensors and everything else). The
    cost is memory: the process's resident size no longer shrinks after a peak, as with a
    caching allocator. ``enable=False`` sets glibc's default thresholds back (128 KiB, as
    fixed values). glibc's environment variables are no substitute: at start-up it caps the
    ``mmap`` threshold it reads from ``MALLOC_MMAP_THRESHOLD_`` (a 64 MiB tensor still
    faulted 6.5 k pages per call with it set to 1 GiB, none after this call).

    Returns:
        True if the setting was applied; False where ``malloc`` is not glibc's (nothing
        changes there).
    """
    libc = _libc()
    if libc is None:
        return False
    value = KEEP_UP_TO if enable else _GLIBC_DEFAULT
    ok = libc.mallopt(_M_MMAP_THRESHOLD, value) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, value) == 1
    if not enable:
        libc.malloc_trim(0)
    return ok


def compile(module: torch.nn.Module, *, keep_memory: bool = True, **options: Any) -> torch.nn.Module:  # noqa: A001
    """``torch.compile(module)`` with the settings flt's speed figures are measured with.

    Args:
        module: any module (a layer, a model).
        keep_memory: also call :func:`keep_freed_memory` (process-wide; a no-op off glibc).
            Its gain is largest on CPUs, where nothing else caches freed tensors.
        **options: passed to ``torch.compile``; ``dynamic`` defaults to False (one graph per
            input shape: flt's layers need no dynamic shapes, and inductor's automatic
            dynamic shapes failed to compile the causal layer's backward at N = 16384 once
            it had seen a second shape).

    Returns:
        The compiled module; it shares its parameters with ``module`` (save and load
        ``module`` itself). The first call of each input shape compiles.
    """
    if keep_memory:
        keep_freed_memory()
    options.setdefault("dynamic", False)
    # torch.compile types its result as a callable; given a module it returns an OptimizedModule.
    return cast(torch.nn.Module, torch.compile(module, **options))
