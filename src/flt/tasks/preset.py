"""What a run computes: :class:`RunConfig` (optimisation and bookkeeping) and
:class:`Preset` (a task's model config, run config and data options together).

Both are frozen dataclasses saved in every checkpoint as JSON; ``--resume`` requires the
same configuration, so a resumed run continues the identical computation, except that a
larger ``RunConfig.steps`` extends the run (see :class:`RunConfig` for its learning rate).
Every task file defines its presets (:mod:`flt.tasks`); the training loop
(:mod:`flt.train`) runs them. Checks that need the registry (a known task, the task's
config class) are :func:`flt.tasks.check_preset`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from flt._checks import check_positive_int
from flt.models.config import TrunkConfig
from flt.options import check_fields, check_seed

#: Arithmetic of a training step (:attr:`RunConfig.precision`).
PRECISIONS = ("bf16", "fp32")


def default_precision(device_type: str) -> str:
    """The precision a run takes when its config leaves it unset: bfloat16 autocast on CUDA
    (tensor-core speed), float32 elsewhere (CPU bfloat16 matmuls are rarely faster)."""
    return "bf16" if device_type == "cuda" else "fp32"


@dataclass(frozen=True)
class RunConfig:
    """Optimisation and bookkeeping of one training run.

    ``batch_size`` is the *global* batch: with ``W`` processes each takes ``batch_size / W``
    samples of the same global batch, so the run computes the same thing for any ``W``.
    The learning rate warms up linearly for ``warmup_steps`` then follows a cosine to
    ``min_lr_ratio * lr`` at ``steps`` (:meth:`lr_at`), so the schedule is a function of
    the step and of ``steps``. Resuming with a larger ``steps`` extends a run (``flt train
    --resume --steps M``): the steps already trained keep the rates of the old budget and
    the remaining ones follow the schedule of the new one: step ``s > N`` of a run of ``N``
    steps extended to ``M`` trains at ``RunConfig(steps=M).lr_at(s)``, so a finished run
    goes from its floor back up to the new schedule's rate and decays again to the floor at
    ``M`` (a warm restart). The extended run equals a run started with ``steps=M``, bit for
    bit, exactly when both budgets give every step up to ``N`` the same rate: always with
    ``min_lr_ratio=1`` (constant after warm-up), otherwise only if ``N <= warmup_steps``.
    ``eval_batches`` caps the validation batches per evaluation (``None``: the whole
    validation split). AdamW decays only the weights of linear, convolution and embedding
    layers.

    Random features (:mod:`flt.train.drawgap`). For models with random features (FLT,
    Performer, Toeplitz with FAVOR+) every random draw is redrawn before every
    ``redraw_interval``-th step (default 1: every step; ``0`` or ``None``: never, the
    model trains on its initial draw), from a generator determined by ``(seed, step)``.
    Validation then uses one fixed draw, the same at every evaluation, and the run ends
    with the draw gap (``draw_gap``: own draw, 3 fresh draws, exact attention), each on
    the first ``draw_gap_batches`` validation batches (``None``: the whole split; when set,
    the own draw is evaluated again on those batches so that all numbers share them).
    Models without random features ignore these fields.

    ``compile=True`` trains through ``torch.compile(model)`` (inductor; the first steps pay
    the compilation, reported as the first step's time): the same computation, faster where
    the compiled kernels are (docs/performance.md). Evaluation, the draw gap and checkpoints
    use the module itself, so a run's checkpoints do not depend on the switch.

    ``init_from`` (a run or checkpoint directory) starts a fresh run from that run's
    weights instead of a random initialisation: fine-tuning, or a curriculum from one
    preset to another (ListOps-short, then the long expressions). Only the weights carry
    over, with the random draws saved beside them (every tensor must fit the new model:
    same task, width and depth; redraws replace the draws as usual); the optimizer,
    the step and the schedule start anew. ``--resume`` needs the same ``init_from``, as every
    other option, and continues from the run's own checkpoints, not from ``init_from``;
    the checkpoint started from and its step are recorded as ``init`` in ``run.json`` and in
    every checkpoint's ``config.json``.

    ``precision`` is the training step's arithmetic (:data:`PRECISIONS`): ``"bf16"`` runs the
    forward pass and the loss under bfloat16 autocast (weights, gradients and the optimizer
    stay float32; no loss scaling is needed), ``"fp32"`` runs everything in float32.
    ``None`` (default) means ``"bf16"`` on CUDA and ``"fp32"`` on a CPU, decided when the
    run starts and recorded as such; ``--resume`` keeps the recorded precision (runs saved
    before the field existed trained in float32). Evaluation, the draw gap and checkpoints
    run in float32 either way.
    """

    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float | None = 1.0
    eval_every: int = 100
    eval_batches: int | None = None
    eval_batch_size: int | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0
    redraw_interval: int | None = 1
    draw_gap: bool = True
    draw_gap_batches: int | None = None
    compile: bool = False
    init_from: str | None = None
    precision: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)  # a bool is not a number: lr=true must not train at 1.0
        for name in ("steps", "batch_size", "eval_every", "checkpoint_every", "keep_checkpoints", "log_every"):
            check_positive_int(name, getattr(self, name))
        for name in ("eval_batches", "eval_batch_size", "draw_gap_batches"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        if self.redraw_interval is not None and (
            isinstance(self.redraw_interval, bool) or not isinstance(self.redraw_interval, int) or self.redraw_interval < 0
        ):
            raise ValueError(f"redraw_interval must be None or a non-negative integer (0: no redraws), got {self.redraw_interval!r}")
        for name in ("draw_gap", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        check_seed(self.seed, "seed")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if not (isinstance(self.min_lr_ratio, (int, float)) and 0 <= self.min_lr_ratio <= 1):  # NaN fails too
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio!r}")
        if not (isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if self.grad_clip is not None and not (isinstance(self.grad_clip, (int, float)) and math.isfinite(self.grad_clip)
                                               and self.grad_clip > 0):
            raise ValueError(f"grad_clip must be None (no clipping) or a positive finite number, got {self.grad_clip!r}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)} (or None: bf16 on CUDA, fp32 on a CPU), got {self.precision!r}")
        if self.init_from is not None and not (isinstance(self.init_from, str) and self.init_from):
            raise ValueError(f"init_from must be None or the path of a run or checkpoint directory, got {self.init_from!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate of (1-based) ``step``: linear warm-up, then cosine decay to the
        floor at ``self.steps`` (a function of ``step`` and ``self.steps`` alone)."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.min_lr_ratio * self.lr
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Preset:
    """Everything that defines a run: task, model config, run config, data options.

    ``task`` is a name in :data:`flt.tasks.TASKS`, ``model`` that task's config and
    ``data`` keyword arguments of its loader.
    """

    task: str
    model: TrunkConfig
    run: RunConfig = field(default_factory=RunConfig)
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.task, str):
            raise TypeError(f"task must be a task name (str), got {self.task!r}")
        if not dataclasses.is_dataclass(self.model) or isinstance(self.model, type):
            raise TypeError(f"model must be a model config (a dataclass instance), got {type(self.model).__name__}")
        if not isinstance(self.run, RunConfig):
            raise TypeError(f"run must be a RunConfig, got {type(self.run).__name__}")
        if not isinstance(self.data, dict):
            raise TypeError(f"data must be a dict of loader options, got {type(self.data).__name__}")


def preset_to_dict(preset: Preset) -> dict[str, Any]:
    """JSON-serialisable form of a preset (saved in checkpoints); the inverse is
    :func:`flt.tasks.preset_from_dict`."""
    from flt.tasks import config_to_dict  # the registry of tasks imports this module

    return {
        "task": preset.task,
        "model": config_to_dict(preset.model),
        "run": dataclasses.asdict(preset.run),
        "data": dict(preset.data),
    }


def run_config_from_dict(run: dict[str, Any]) -> RunConfig:
    """The :class:`RunConfig` of a saved preset; unknown fields raise ``ValueError``."""
    if not isinstance(run, dict):
        raise ValueError(f"a saved run configuration must be a dict, got {type(run).__name__}")
    names = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(run) - names)
    if unknown:
        raise ValueError(f"unknown RunConfig fields {unknown}")
    if "redraw_interval" not in run:
        # Saved before redraws existed: such runs trained on one fixed draw.
        run = {**run, "redraw_interval": 0}
    return RunConfig(**run)


def record_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted names of the fields that differ between two :func:`preset_to_dict` records."""
    # The JSON round trip makes tuples and lists (as a saved config holds them) compare equal.
    da, db = json.loads(json.dumps(a)), json.loads(json.dumps(b))
    out = []
    for section in ("task", "model", "run", "data"):
        x, y = da[section], db[section]
        if isinstance(x, dict) and isinstance(y, dict):
            out += [f"{section}.{k}" for k in sorted(set(x) | set(y)) if x.get(k, object()) != y.get(k, object())]
        elif x != y:
            out.append(section)
    return out


def preset_differences(a: Preset, b: Preset) -> list[str]:
    """Dotted names of the fields that differ between two presets (after a JSON round trip)."""
    return record_differences(preset_to_dict(a), preset_to_dict(b))
