"""Benchmarks: approximation accuracy and speed."""

from __future__ import annotations

import math
import os
from typing import Any


def finite_or_null(value: Any) -> Any:
    """``value`` (nested dicts, lists and tuples) with every NaN or infinity replaced by
    None: a benchmark records a failed measurement (an error of NaN, a spread of infinity)
    rather than dropping the file, and JSON has no NaN or infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write a benchmark's results to ``path`` as JSON (indent 1), atomically and never
    through a link of that name (:func:`flt._io.atomic_write_json`), NaN and infinity as null."""
    from flt._io import atomic_write_json

    atomic_write_json(os.fspath(path), finite_or_null(data), indent=1)
