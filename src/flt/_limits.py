"""Sizes checked against the memory the machine has, before anything is allocated.

A size given by a user (``num_features``, ``dim``, ``depth``, ``batch_size``, an image
``size``) or read from a file's header (a node count, a row length) may ask for more memory
than the machine holds; allocating it first ends in an out-of-memory error, an overflow
traceback or a process that runs for minutes. Here each such size becomes a closed-form
estimate of the bytes it needs, compared with a limit, and refused by name with the
estimate and the limit (:class:`MemoryLimitError`, a ``ValueError``).

The estimates count float32 values and are deliberately simple, one formula per
mechanism (the largest tensors of a forward pass and, for training, what backward keeps),
so they are orders of magnitude right, not exact: they catch a size that cannot fit, not
one that nearly fits. Here: the limit and the check, below :mod:`flt.layers`; each
mechanism states its own estimate (``parameter_values`` and ``activation_values`` of
:class:`flt.layers.base.AttentionBase` and its layers), and :mod:`flt.models.memory`
estimates whole models from their configs, which name their mechanisms.

The limit: ``FLT_MEMORY_LIMIT`` (bytes, or a number with a K/M/G/T suffix: ``8G``) if set;
otherwise the free memory of the CUDA device (``torch.cuda.mem_get_info``), or on the CPU
the available RAM (``MemAvailable`` of ``/proc/meminfo``, else ``os.sysconf``).
"""

from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device is asked about, not at import
    import torch

#: Bytes of one value in the estimates (float32).
FLOAT_BYTES = 4
#: Environment variable that overrides the limit.
LIMIT_VARIABLE = "FLT_MEMORY_LIMIT"

_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class MemoryLimitError(ValueError):
    """A size whose estimated memory exceeds the limit; the message names the size, the
    estimate and the limit."""


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} PiB"  # pragma: no cover


def parse_bytes(text: str, name: str = LIMIT_VARIABLE) -> int:
    """``"8G" -> 8 * 2**30``; a plain number is bytes. Raises ValueError naming ``name``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"{name} must be a number of bytes, optionally with a K, M, G or T suffix (e.g. 8G), got {text!r}")
    value = float(match.group(1)) * _SUFFIXES[match.group(2).upper()]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{name} must be a positive number of bytes, got {text!r}")
    return int(value)


def _cpu_available() -> tuple[int, str]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM (MemAvailable)"
    except (OSError, ValueError, IndexError):
        pass  # no /proc (macOS, Windows): ask sysconf below
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in os.sysconf_names else os.sysconf("SC_PHYS_PAGES")
        return int(pages) * int(os.sysconf("SC_PAGE_SIZE")), "available RAM (sysconf)"
    except (ValueError, OSError, AttributeError):
        return 2**62, "unknown RAM"


def memory_limit(device: torch.device | str | None = None) -> tuple[int, str]:
    """``(bytes, where the number comes from)``: ``FLT_MEMORY_LIMIT``, else the free memory
    of ``device`` (a CUDA device), else the available RAM."""
    text = os.environ.get(LIMIT_VARIABLE)
    if text:
        return parse_bytes(text), LIMIT_VARIABLE
    if device is not None and str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            dev = torch.device(device)
            free, _ = torch.cuda.mem_get_info(dev)
            # What the caching allocator holds but no tensor uses is free to this process,
            # though the driver counts it as taken.
            cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            return int(free + cached), f"free memory of {device}"
    return _cpu_available()


def check_memory(what: str, nbytes: float, *, device: torch.device | str | None = None, hint: str = "",
                 limit: tuple[int, str] | None = None) -> None:
    """Raise :class:`MemoryLimitError` when ``nbytes`` (an estimate for ``what``) exceeds
    the limit of ``device`` (:func:`memory_limit`, or ``limit`` as it returned it);
    ``hint`` says how to shrink it."""
    bound, source = memory_limit(device) if limit is None else limit
    if nbytes > bound:
        tail = f"; {hint}" if hint else ""
        raise MemoryLimitError(
            f"{what} needs about {format_bytes(nbytes)}, more than the {format_bytes(bound)} of {source}{tail} "
            f"(set {LIMIT_VARIABLE} to change the limit)"
        )
