"""Metrics as JSON lines: one record per line, ``{"step", "split", ...values}``.

``split`` is ``"train"`` (loss, learning rate, throughput) or ``"valid"`` (the task's
validation metrics). Records are flushed as they are written so a killed run keeps
them; on resume the records after the checkpoint's step are dropped, since the resumed
run writes them again.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from flt._io import atomic_write_text


def _clean(value: object) -> object:
    # JSON has no NaN or infinity; write them as null rather than invalid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Append records to ``path``; ``resume_step`` first drops records with ``step > resume_step``."""

    def __init__(self, path: str, *, resume_step: int | None = None) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if resume_step is not None and os.path.exists(path):
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
            atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        elif resume_step is None and os.path.exists(path):
            os.unlink(path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (held open across log() calls; close() closes it)

    def log(self, step: int, split: str, **values: Any) -> None:
        record = {"step": step, "split": split, **{k: _clean(v) for k, v in values.items()}}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a JSONL metrics file; a torn last line (killed mid-write) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    return records
