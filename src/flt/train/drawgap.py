"""Draw-robust training and the draw gap (docs/math.md section 5.2).

A model with random features (FLT, Performer, Toeplitz with FAVOR+) computes with random
draws: FAVOR+ projections and spectral base draws (:mod:`flt.layers.draws`). Trained on
one fixed draw it adapts to that draw, and its metric on any other draw, or with exact
attention, can be far worse (issue 10: catalysis MAE 0.23 eV on its own draw, 3.0 to 3.7 eV
on fresh draws or exact). The trainer therefore, by default:

* redraws every random draw before every ``RunConfig.redraw_interval``-th step
  (:func:`redraw_for_step`), from a generator that is a function of ``(seed, step)``
  alone, like the batches: a resumed run and every DDP process see the same draws, and no
  generator state needs saving (the current draws are buffers in the checkpoint);
* validates on one fixed draw, the same at every evaluation (:func:`evaluation_draw`); the
  final checkpoint is left on that draw, so a loaded model reproduces the final metric;
* reports the draw gap at the end (:func:`draw_gap`): the validation metric on the model's
  own draw (the evaluation draw; without redraws, its only draw), on 3 fresh draws (mean
  and sample standard deviation) and with exact attention (``model(..., exact=True)``)
  where every attention layer has an exact form and the ``[B, H, N, N]`` weights fit.
  ``summary.json`` gets ``"draw_gap": {"own", "fresh_mean", "fresh_std", "exact"}`` in the
  task's metric (``exact`` null when not computed). A model without random features
  (softmax attention, ``elu`` feature maps) has no draw gap: the key is absent and no line
  is printed.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from flt.layers.base import AttentionBase
from flt.layers.draws import fixed_draw, has_random_features, redraw
from flt.models.config import TrunkConfig
from flt.tasks.base import Task, step_generator

if TYPE_CHECKING:
    from flt.tasks.preset import RunConfig

#: ``step_generator`` stream of the training redraws (0: LM batches, 1: epoch permutations, 3: the order of length-sorted batches).
REDRAW_STREAM = 2
#: Number of fresh draws in the draw gap.
FRESH_DRAWS = 3
#: Exact attention is evaluated only if one sample's weights ``H * N * N`` fit this many
#: elements; batches are shrunk so that ``B * H * N * N`` does too (64 MiB in float32).
EXACT_MAX_ELEMENTS = 2**24


def redraws_enabled(model: nn.Module, run: RunConfig) -> bool:
    """True when the run redraws: ``run.redraw_interval`` is set and the model has random features."""
    return bool(run.redraw_interval) and has_random_features(model)


def redraw_for_step(model: nn.Module, run: RunConfig, step: int) -> bool:
    """Before (1-based) ``step``: redraw every draw of ``model`` if a redraw is due
    (steps ``1, 1 + k, 1 + 2k, ...`` for ``k = run.redraw_interval``). Returns whether it did."""
    interval = run.redraw_interval  # set whenever the run redraws
    if not interval or not redraws_enabled(model, run) or (step - 1) % interval:
        return False
    redraw(model, step_generator(run.seed, step, REDRAW_STREAM))
    return True


def draw_seed(run_seed: int, label: str) -> int:
    """Seed of a named fixed draw of run ``run_seed`` (``"eval"``, ``"fresh-0"``, ...)."""
    digest = hashlib.sha256(f"flt-run-draw/{int(run_seed)}/{label}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def evaluation_draw(model: nn.Module, run: RunConfig, *, keep: bool = False) -> contextlib.AbstractContextManager[object]:
    """A context in which ``model`` is on the run's fixed evaluation draw, when the run
    redraws (otherwise the model keeps its one draw and this does nothing). ``keep``
    leaves the model on that draw after the context."""
    if not redraws_enabled(model, run):
        return contextlib.nullcontext()
    applied = fixed_draw(model, draw_seed(run.seed, "eval"))
    return contextlib.nullcontext(applied) if keep else applied


class ExactForward(nn.Module):
    """``model`` called with ``exact=True``: every attention layer's O(N^2) ``exact()``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, exact=True, **kwargs)


def gap_batches(run: RunConfig, batch_size: int) -> int | None:
    """Batches of ``batch_size`` that hold the draw gap's samples: ``draw_gap_batches`` of
    the run's evaluation batch size, rounded up (None: the whole split). A smaller batch,
    such as the exact evaluation's, changes memory, not the samples."""
    if run.draw_gap_batches is None:
        return None
    return math.ceil(run.draw_gap_batches * (run.eval_batch_size or run.batch_size) / batch_size)


def exact_batch_size(task: Task, model: nn.Module, model_cfg: TrunkConfig, batch_size: int, max_elements: int = EXACT_MAX_ELEMENTS) -> int | None:
    """Batch size for the exact evaluation, or None when it is not possible: some attention
    layer has no ``exact`` (e.g. Toeplitz), or one sample's weights exceed ``max_elements``."""
    layers = [m for m in model.modules() if isinstance(m, AttentionBase)]
    if not layers or not all(callable(getattr(m, "exact", None)) for m in layers):
        return None
    n = task.longest_sequence(model_cfg)
    if n is None:
        return None
    per_sample = max(m.heads for m in layers) * max(n, 1) ** 2
    if per_sample > max_elements:
        return None
    return max(1, min(batch_size, max_elements // per_sample))


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def draw_gap(
    task: Task,
    model: nn.Module,
    model_cfg: TrunkConfig,
    run: RunConfig,
    evaluate: Callable[[nn.Module, int], dict[str, float]],
    batch_size: int,
    *,
    own: dict[str, float] | None = None,
    fresh: int = FRESH_DRAWS,
    max_elements: int = EXACT_MAX_ELEMENTS,
) -> dict[str, Any] | None:
    """The draw gap of ``model`` in ``task.metric``, or None without random features.

    Args:
        evaluate: ``(model, batch_size) -> metrics`` over the validation batches of the
            draw gap (the whole split, or the first ``run.draw_gap_batches``; every
            process must call it: it reduces across processes).
        own: the metrics already measured on the model's own draw over the same batches
            (the final validation when the draw gap uses the whole split), to avoid
            evaluating them again; None evaluates them.
        fresh: number of fresh draws (seeds ``draw_seed(run.seed, "fresh-i")``).

    Returns ``{"own", "fresh_mean", "fresh_std", "exact"}``: floats (``fresh_std`` the
    sample standard deviation; 0 for one draw), ``exact`` None when not computed; a
    non-finite metric is reported as None. The model's draws are left as they were.
    """
    if not getattr(run, "draw_gap", True) or not has_random_features(model):
        return None
    metric = task.metric
    if own is None:
        with evaluation_draw(model, run):
            own = evaluate(model, batch_size)
    values = []
    for i in range(fresh):
        with fixed_draw(model, draw_seed(run.seed, f"fresh-{i}")):
            values.append(float(evaluate(model, batch_size)[metric]))
    exact = None
    exact_bs = exact_batch_size(task, model, model_cfg, batch_size, max_elements)
    if exact_bs is not None:
        exact = float(evaluate(ExactForward(model), exact_bs)[metric])
    return {
        "own": _finite(float(own[metric])),
        "fresh_mean": _finite(statistics.fmean(values)) if values else None,
        "fresh_std": _finite(statistics.stdev(values)) if len(values) > 1 else (0.0 if values else None),
        "exact": None if exact is None else _finite(exact),
    }


def mean_and_spread(mean: float | None, std: float | None) -> str:
    """``"0.2386 ± 0.0394"``: the mean to 4 significant digits and the spread to as many
    decimals, so that the spread shows no digits the mean does not have."""
    num = lambda x: "n/a" if x is None else f"{x:.4g}"  # noqa: E731
    if mean is None or std is None or not (math.isfinite(mean) and math.isfinite(std)):
        return f"{num(mean)} ± {num(std)}"
    text = f"{mean:#.4g}".rstrip(".")  # '#' keeps trailing zeros: 0.3000, not 0.3
    if "e" in text:
        return f"{text} ± {std:.2g}"
    decimals = len(text.partition(".")[2])
    return f"{text} ± {std:.{decimals}f}"


def format_draw_gap(gap: dict[str, Any], metric: str, fresh: int = FRESH_DRAWS) -> str:
    """One line for the end of ``flt train``."""
    num = lambda x: "n/a" if x is None else f"{x:.4g}"  # noqa: E731
    return (f"draw gap ({metric}): own draw {num(gap['own'])}, fresh draws {mean_and_spread(gap['fresh_mean'], gap['fresh_std'])} "
            f"(n={fresh}), exact {num(gap['exact'])}")
