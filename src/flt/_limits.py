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
one that nearly fits. Here: the limit and the estimate of one attention layer given its
class (what a layer's constructor checks, so this module sits below :mod:`flt.layers` and
imports nothing from it); :mod:`flt.models.memory` estimates whole models from their
configs, which name their mechanisms.

The limit: ``FLT_MEMORY_LIMIT`` (bytes, or a number with a K/M/G/T suffix: ``8G``) if set;
otherwise the free memory of the CUDA device (``torch.cuda.mem_get_info``), or on the CPU
the available RAM (``MemAvailable`` of ``/proc/meminfo``, else ``os.sysconf``).
"""

from __future__ import annotations

import inspect
import math
import os
import re
from typing import TYPE_CHECKING, Any

from flt._signatures import constructor_options

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
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            return int(free), f"free memory of {device}"
    return _cpu_available()


def check_memory(what: str, nbytes: float, *, device: torch.device | str | None = None, hint: str = "") -> None:
    """Raise :class:`MemoryLimitError` when ``nbytes`` (an estimate for ``what``) exceeds
    the limit of ``device`` (:func:`memory_limit`); ``hint`` says how to shrink it."""
    limit, source = memory_limit(device)
    if nbytes > limit:
        tail = f"; {hint}" if hint else ""
        raise MemoryLimitError(
            f"{what} needs about {format_bytes(nbytes)}, more than the {format_bytes(limit)} of {source}{tail} "
            f"(set {LIMIT_VARIABLE} to change the limit)"
        )


# -- estimates -------------------------------------------------------------------------


def _option(cls: type, options: dict, name: str, default: Any = None) -> Any:
    """``options[name]``, else the default of ``cls``'s constructor (following ``**kwargs``)."""
    if name in options:
        return options[name]
    param = constructor_options(cls).params.get(name)
    return default if param is None or param.default is inspect.Parameter.empty else param.default


def _spectrum_option(cls: type, options: dict, name: str) -> Any:
    """An option of the spectrum a layer builds (its ``spectrum`` option or default)."""
    if name in options:
        return options[name]
    from flt.relative.spectra import SPECTRA

    spectrum = _option(cls, options, "spectrum")
    return _option(SPECTRA[spectrum], {}, name) if isinstance(spectrum, str) and spectrum in SPECTRA else None


def _int(value: object, fallback: int = 0) -> int:
    """An int option's value, or ``fallback`` for anything else (the constructor reports it)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else fallback


def attention_parameter_values(cls: type | None, options: dict, *, dim: int, heads: int, pos_dim: int = 1) -> int:
    """Values held by one attention layer of class ``cls`` (None: an unknown mechanism, its
    projections only): projections (``4 dim^2``), the random feature projection (``m x`` its
    input size), the spectrum's frequencies and parameters (``H R P`` a few times) and
    relative tables."""
    head_dim = max(dim // max(heads, 1), 1)
    total = 4 * dim * dim + dim
    if cls is None:
        return total
    m = _int(_option(cls, options, "num_features"))
    r = _int(_option(cls, options, "num_frequencies"))
    coupling = _option(cls, options, "coupling", "logit")
    feature_dim = head_dim + 2 * r if coupling == "logit" else head_dim
    total += m * feature_dim
    total += 4 * heads * r * max(pos_dim, 1)
    if r and (_option(cls, options, "near_field") or _option(cls, options, "near_neighbors")):
        total += 4 * heads * r * max(pos_dim, 1)  # the near set's own spectrum
    hidden = _int(_spectrum_option(cls, options, "hidden"))
    total += 2 * heads * hidden * (hidden + max(pos_dim, 1) + 3)  # a neural spectrum's MLP (and the near set's)
    buckets = _int(_option(cls, options, "num_buckets"))
    total += heads * buckets
    distance = _int(_option(cls, options, "max_distance"))
    total += heads * (2 * distance + 1)
    return total


def attention_activation_values(cls: type | None, options: dict, *, batch: int, heads: int, length: int, head_dim: int,
                                training: bool) -> int:
    """Values of the largest tensors of the forward pass of one attention layer of class
    ``cls`` (None: an unknown mechanism, counted as softmax) over ``batch`` sequences of
    ``length`` tokens, twice that when training (what backward keeps):

    * softmax: the weights, ``B H N N``;
    * kernel mechanisms (Performer, FLT): the features of queries and keys, ``2 B H N m``,
      and the state ``B H m Dv``; FLT's multiplicative coupling the spectral features
      ``2 B H N 2R`` and a state ``B H m 2R Dv``; a band of ``w`` tokens ``2 B H N (2w + 1)``,
      ``k`` nearest keys ``2 B H N k``;
    * Toeplitz: ``B H N N`` up to ``dense_below`` tokens, else FFTs of ``B H 2N m (Dv + 1)``
      complex values.
    """
    b, h, n, dv = batch, heads, length, head_dim
    if cls is None or "num_features" not in _parameter_names(cls):
        values = b * h * n * n
    else:
        m = _int(_option(cls, options, "num_features"), 1)
        r = _int(_option(cls, options, "num_frequencies"))
        values = 2 * b * h * n * m + b * h * m * dv
        if _option(cls, options, "coupling", "logit") == "multiplicative":
            values += 2 * b * h * n * 2 * r + b * h * m * 2 * r * dv
        w = _int(_option(cls, options, "near_field"))
        k = _int(_option(cls, options, "near_neighbors"))
        values += 2 * b * h * n * (2 * w + 1 if w else 0) + 2 * b * h * n * k
        dense = _option(cls, options, "dense_below")
        if isinstance(dense, int) and not isinstance(dense, bool):
            values += b * h * n * n if n <= dense else 4 * b * h * 2 * n * m * (dv + 1)
    return values * (2 if training else 1)


def _registry_name(cls: object) -> str:
    name = getattr(cls, "__dict__", {}).get("registry_name")
    return repr(name) if name else getattr(cls, "__name__", str(cls))


def _parameter_names(cls: type) -> set[str]:
    return set(constructor_options(cls).params)


#: Attention options that size a layer (named in the messages of :func:`check_attention_memory`
#: and :func:`flt.models.memory.check_model_memory`).
SIZE_OPTIONS = ("num_features", "num_frequencies", "near_field", "near_neighbors", "max_distance", "dense_below",
                 "chunk_size", "hidden", "num_buckets")


def check_attention_memory(cls: type, options: dict, *, dim: int, heads: int, pos_dim: int = 1, device: torch.device | str | None = None) -> None:
    """Refuse an attention layer of class ``cls`` whose parameters and buffers alone exceed
    the limit (a ``num_features`` or ``num_frequencies`` of 10^9), before its constructor
    allocates them. Non-int sizes are left to the constructor's own checks."""
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (dim, heads, pos_dim)):
        return
    values = attention_parameter_values(cls, options, dim=dim, heads=heads, pos_dim=pos_dim)
    sizes = {k: v for k, v in options.items() if k in SIZE_OPTIONS}
    check_memory(f"attention {_registry_name(cls)} (dim={dim}, heads={heads}{''.join(f', {k}={v}' for k, v in sizes.items())})",
                 values * FLOAT_BYTES, device=device, hint="make these sizes smaller")
