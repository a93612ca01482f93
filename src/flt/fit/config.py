"""The configuration of a fit and its presets.

Presets (``flt fit TASK --preset NAME``; ``camera``, the default ``basic`` encoding; times
measured on a 2-core CPU shared with other jobs, one thread, so only indicative; docs/fit.md):

    signal smoke   4 rows, 4 x 64 MLP, 200 epochs          fit 2 s; test PSNR 22.8 dB
    signal paper   8 rows, 4 x 256 MLP, 2000 epochs         about 4 min; test PSNR 30.3 dB
                   (the paper's setting on 8 of the 512 rows; --rows 512 for all of them)
    image smoke    32 x 32, 4 x 64 MLP, 200 epochs          fit 8 s; test PSNR 22.5 dB
    image paper    128 x 128, 4 x 256 MLP, 1000 epochs      about 2 min; test PSNR 24.6 dB

Every field can be changed from the command line (``--epochs``, ``--rows``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from flt._checks import check_choice, check_positive_int

TASKS = ("signal", "image")
MODELS = ("mlp", "linear")
OUTPUTS = ("sigmoid", "linear")
DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class FitConfig:
    """One fit.

    Attributes:
        task: ``signal`` (rows of a grey image, ``P = 1``) or ``image`` (``P = 2``).
        image: a name in :data:`flt.fit.images.SHIPPED` or a PNG/JPEG path.
        posenc, posenc_options: the encoding (:data:`flt.fit.encodings.ENCODINGS`).
        dim: number of features ``D``; None: 256 (raw and basic: fixed by ``P``).
        axes: ``joint``, ``concat`` or ``product`` (:mod:`flt.fit.encodings`; image only).
        model: ``mlp`` (``depth`` layers of ``width``) or ``linear`` (one layer).
        output: ``sigmoid`` or ``linear``; None: sigmoid for an image MLP, else linear.
        rows: signal: how many rows, evenly spaced (or a list of row indices).
        size: resize the image to ``size x size`` first (None: keep it).
        mode: ``gray`` or ``rgb`` (image only; signals are grey).
        epochs, lr: full-batch Adam steps and learning rate.
        eval_every: epochs between PSNR evaluations (the history).
        seed: network ``s`` starts from ``seed + s``; random encodings draw from ``seed``.
        dtype: ``float32`` or ``float64``.
    """

    task: str = "signal"
    image: str = "camera"
    posenc: str = "basic"
    posenc_options: dict = field(default_factory=dict)
    dim: int | None = None
    axes: str = "joint"
    model: str = "mlp"
    depth: int = 4
    width: int = 256
    output: str | None = None
    rows: int | tuple[int, ...] = 8
    size: int | None = None
    mode: str = "gray"
    epochs: int = 2000
    lr: float = 1e-3
    eval_every: int = 100
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_choice("task", self.task, TASKS)
        check_choice("model", self.model, MODELS)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("mode", self.mode, ("gray", "rgb"))
        if self.output is not None:
            check_choice("output", self.output, OUTPUTS)
        for name in ("depth", "width", "epochs", "eval_every"):
            check_positive_int(name, getattr(self, name))
        if self.model == "mlp" and self.depth < 2:
            raise ValueError(f"depth must be at least 2 for the MLP (1 is --model linear), got {self.depth}")
        if self.dim is not None:
            check_positive_int("dim", self.dim)
        if isinstance(self.rows, int):
            check_positive_int("rows", self.rows)
        elif not self.rows or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in self.rows):
            raise ValueError(f"rows must be a positive count or a list of row indices >= 0, got {self.rows!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be a number > 0, got {self.lr!r}")
        if self.task == "signal" and self.axes != "joint":
            raise ValueError("--axes applies to 2-D fits (flt fit image); a signal has one axis")
        if self.task == "signal" and self.mode != "gray":
            raise ValueError("signals are rows of the grey image; --mode rgb applies to flt fit image")

    @property
    def resolved_output(self) -> str:
        if self.output is not None:
            return self.output
        return "sigmoid" if self.task == "image" and self.model == "mlp" else "linear"


def row_indices(rows: int | tuple[int, ...], height: int) -> list[int]:
    """``rows`` evenly spaced rows (the centres of ``rows`` equal bands) or the given indices."""
    if isinstance(rows, int):
        if rows > height:
            raise ValueError(f"--rows {rows}: the image has only {height} rows")
        return [(2 * k + 1) * height // (2 * rows) for k in range(rows)]
    return list(rows)


PRESETS: dict[str, dict[str, FitConfig]] = {
    "signal": {
        "smoke": FitConfig(task="signal", rows=4, width=64, epochs=200, eval_every=50),
        "paper": FitConfig(task="signal", rows=8, width=256, epochs=2000, eval_every=100),
    },
    "image": {
        "smoke": FitConfig(task="image", size=32, width=64, epochs=200, eval_every=50),
        "paper": FitConfig(task="image", size=128, width=256, epochs=1000, eval_every=100),
    },
}


def get_preset(task: str, name: str, **changes: Any) -> FitConfig:
    """The preset ``name`` of ``task`` with ``changes`` applied (validated)."""
    check_choice("task", task, TASKS)
    check_choice("--preset", name, PRESETS[task])
    return replace(PRESETS[task][name], **changes)
