"""Metrics as JSON lines: one record per line, ``{"step", "split", ...values}``.

``split`` is ``"train"`` (loss, learning rate, throughput) or ``"valid"`` (the task's
validation metrics). Records are flushed as they are written so a killed run keeps
them; on resume the records after the checkpoint's step are dropped, since the resumed
run writes them again.

The file is appended to through :func:`flt._io.open_append_text` (never through a link;
a link or special file of its name is deleted by a fresh run and refused by a resumed one),
and read back record by record, each checked to be an object with an integer ``step`` and
a string ``split``: a file of another shape is refused with a message naming its line.
"""

from __future__ import annotations

import math
import os
from typing import Any

from flt._io import JSONError, atomic_write_text, dumps_json, loads_json, open_append_text


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
        if resume_step is not None and os.path.lexists(path):
            if os.path.islink(path) or not os.path.isfile(path):
                # Reading it would follow the link, or wait forever on a FIFO.
                kind = "a symbolic link" if os.path.islink(path) else "not a regular file"
                raise ValueError(f"{path} is {kind}, not the metrics file flt writes; move it away to resume "
                                 "(the run's checkpoints do not need it)")
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
            atomic_write_text(path, "".join(dumps_json(r, path, sort_keys=True) + "\n" for r in kept))
        elif resume_step is None and os.path.lexists(path):
            os.unlink(path)
        self._file = open_append_text(path, "metrics file")

    def log(self, step: int, split: str, **values: Any) -> None:
        record = {"step": step, "split": split, **{k: _clean(v) for k, v in values.items()}}
        self._file.write(dumps_json(record, self.path, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a JSONL metrics file; a torn last line (killed mid-write) is skipped.
    A line that is not a record (an object with an integer ``step`` and a string ``split``)
    raises a ``ValueError`` naming the file and line."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}: line {i + 1}"
        try:
            record = loads_json(line, where, max_depth=2)
        except JSONError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{where} is not valid JSON") from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(record.get("split"), str):
            raise ValueError(f"{where} is not a metrics record (an object with an integer \"step\" and a string \"split\")")
        records.append(record)
    return records
