"""Training: one loop for every task of :data:`flt.tasks.TASKS`, atomic checkpoints,
metrics, plots; the presets and task adapters are re-exported from :mod:`flt.tasks`.

``train(get_preset("lm", "small"), "runs/lm")`` is what ``flt train lm --preset small``
runs. Optional dependencies: ``safetensors`` (checkpoints), ``tqdm`` (progress bar),
``matplotlib`` (plots) and the data extras (``scikit-learn`` for digits, ``ase`` for
molecules): ``pip install "flt-attention[train,mol]"``.
"""

from flt.tasks import TASKS, generate_text, load_task, tokenizer_from_extra
from flt.train.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_checkpoint_model,
    load_weights,
    read_checkpoint_config,
)
from flt.train.config import Preset, RunConfig, preset_from_dict, preset_to_dict
from flt.train.loop import evaluate, train
from flt.train.presets import ATTENTION_DEFAULTS, POSENC_DEFAULTS, PRESETS, get_preset

#: The task registry under its former name.
TASK_CLASSES = TASKS

__all__ = [
    "ATTENTION_DEFAULTS",
    "POSENC_DEFAULTS",
    "PRESETS",
    "TASKS",
    "TASK_CLASSES",
    "CheckpointError",
    "Preset",
    "RunConfig",
    "evaluate",
    "find_checkpoint",
    "generate_text",
    "get_preset",
    "load_checkpoint_model",
    "load_task",
    "load_weights",
    "preset_from_dict",
    "preset_to_dict",
    "read_checkpoint_config",
    "tokenizer_from_extra",
    "train",
]

