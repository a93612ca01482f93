"""The run configuration, :class:`RunConfig`, and :class:`Preset`, defined with the tasks
that offer them (:mod:`flt.tasks.preset`) and re-exported here, where the training loop
reads them."""

from flt.tasks import TASKS, preset_from_dict
from flt.tasks.preset import (
    Preset,
    RunConfig,
    preset_differences,
    preset_to_dict,
    record_differences,
)

__all__ = ["TASKS", "Preset", "RunConfig", "preset_differences", "preset_from_dict", "preset_to_dict", "record_differences"]
