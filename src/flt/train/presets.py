"""Presets by task, as views of :data:`flt.tasks.TASKS`: each task file defines its presets
and its mechanism defaults (:mod:`flt.tasks`, where the measurement conventions of the
presets' docstrings are described). These dicts are built from the registry when this
module is imported; code that must see tasks registered later reads ``TASKS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flt.tasks import TASKS, Preset, get_preset, mechanism_options as _mechanism_options

#: ``PRESETS[task][name](attention, posenc) -> Preset``.
PRESETS: dict[str, dict[str, Callable[..., Preset]]] = {name: dict(task.presets) for name, task in TASKS.items()}
#: Per task, options for mechanisms by name.
ATTENTION_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {name: task.attention_defaults for name, task in TASKS.items()}
#: Per task, options for absolute encodings whose defaults assume another position range.
POSENC_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {name: task.posenc_defaults for name, task in TASKS.items()}


def mechanism_options(task: str, attention: str, posenc: str, **overrides: Any) -> dict[str, Any]:
    """``attention_options`` and ``posenc_options`` for a model config of ``task``."""
    return _mechanism_options(TASKS[task], attention, posenc, **overrides)


__all__ = ["ATTENTION_DEFAULTS", "POSENC_DEFAULTS", "PRESETS", "get_preset", "mechanism_options"]
