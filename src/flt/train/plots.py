"""PNG plots: learning curves, every head's learned RPE function, comparison curves.

Figures are built with matplotlib's object API (``matplotlib.figure.Figure``, rendered by
Agg), so no global backend is switched and no window is ever opened. Files are written
atomically (:func:`flt._io.atomic_savefig`): a kill mid-plot leaves the previous file, and
a link of the file's name is replaced, never written through.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from flt._dtype import compute_dtype
from flt._io import atomic_savefig, new_figure
from flt.tasks import TASKS
from flt.train.metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

STEP_LABEL = "training step (optimizer updates)"


def task_axes(task: str | None = None, *, metric: str | None = None) -> dict[str, str]:
    """Axis labels with their units of ``task`` (the task's ``axes``; a task is found by
    its ``metric`` when None), or none."""
    if task is None and metric is not None:
        task = next((name for name, t in TASKS.items() if metric in t.axes and metric not in ("loss", "offset")), None)
    return dict(TASKS[task].axes) if task in TASKS else {}


def axis_label(name: str, task: str | None = None, *, metric: str | None = None) -> str:
    """``name`` with its unit for ``task`` (inferred from ``metric`` when None), else ``name``."""
    return task_axes(task, metric=metric or name).get(name, name)


#: Tick mantissas for a log axis, coarsest first (see :func:`log_ticks`).
_MANTISSAS = ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8))


def _linear_ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    """Evenly spaced round numbers (step 1, 2, 2.5 or 5 x 10^k), the first <= lo, the last >= hi."""
    raw = (hi - lo) / count
    exp = math.floor(math.log10(raw))
    step = next(m * 10.0**exp for m in (1, 2, 2.5, 5, 10) if m * 10.0**exp >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    digits = max(0, 2 - exp)
    return [round(k * step, digits) for k in range(first, last + 1)]


def log_ticks(lo: float, hi: float, *, min_inside: int = 3, max_ticks: int = 12) -> list[float]:
    """Round tick values for a log axis showing ``[lo, hi]`` (both > 0).

    The first tick is ``<= lo`` and the last ``>= hi``, so with the axis limits set to the
    end ticks every datum lies between two labelled ticks. The ticks are the coarsest of
    ``10^k``, ``{1, 2, 5} x 10^k``, ``{1, 1.5, 2, 3, 5, 7} x 10^k`` and
    ``{1, 1.2, ..., 8} x 10^k`` that puts at least ``min_inside`` ticks inside the range
    without widening it by more than half; a range too narrow for any of them (under about
    a factor 1.5) gets evenly spaced round numbers (``26, 26.5, 27, ...``).
    """
    if not (math.isfinite(lo) and math.isfinite(hi) and min(lo, hi) > 0):
        raise ValueError(f"log_ticks needs a finite positive range, got [{lo}, {hi}]")
    lo, hi = min(lo, hi), max(lo, hi)
    if hi < lo * 1.001:  # a single value: show a few percent around it
        lo, hi = lo / 1.05, hi * 1.05
    span = math.log(hi / lo)
    exps = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 2)
    fallback = None
    for mantissas in _MANTISSAS:
        values = sorted(float(f"{m}e{e}") for e in exps for m in mantissas)
        below = max(v for v in values if v <= lo)
        above = min(v for v in values if v >= hi)
        ticks = [v for v in values if below <= v <= above]
        if sum(lo <= v <= hi for v in ticks) < min_inside:
            continue
        if len(ticks) > max_ticks:  # many decades: every k-th one, still bracketing the range
            k = math.ceil((len(ticks) - 1) / (max_ticks - 1))
            ticks = ticks[::k] if (len(ticks) - 1) % k == 0 else [*ticks[::k], ticks[::k][-1] * 10.0**k]
        if math.log(lo / ticks[0]) + math.log(ticks[-1] / hi) <= 0.5 * span:
            return ticks
        fallback = fallback or ticks
    return fallback or _linear_ticks(lo, hi)


def _log_y(ax: Axes, values: list[float]) -> list[float] | None:
    """Log-scaled y axis labelled with plain numbers (``6``, ``8``, ``10``, ``15``) from the
    data's minimum to its maximum (:func:`log_ticks`); returns the ticks (None: no data)."""
    from matplotlib.ticker import FuncFormatter, NullLocator

    values = [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    if not values:
        return None
    ticks = log_ticks(min(values), max(values))
    ax.set_yscale("log")
    ax.set_yticks(ticks)
    ax.set_ylim(ticks[0], ticks[-1])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    return ticks


def plot_learning_curves(metrics_path: str, out_path: str, *, metric: str, title: str = "",
                         task: str | None = None) -> Figure:
    """Training and validation loss, and the validation ``metric``, against the step.

    Axis labels carry units (the task's ``axes``; ``task`` is inferred from ``metric`` when None).
    A perplexity axis is log-scaled with labelled ticks spanning its data (:func:`log_ticks`).
    Returns the ``matplotlib.figure.Figure`` (already saved to ``out_path``).
    """
    records = read_metrics(metrics_path)
    train = [r for r in records if r["split"] == "train" and r.get("loss") is not None]
    valid = [r for r in records if r["split"] == "valid"]
    scored = [r for r in valid if r.get(metric) is not None]
    fig = new_figure(10, 3.8)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train")
    ax1.plot([r["step"] for r in valid], [r["loss"] for r in valid], "o-", ms=3, label="valid")
    ax1.set(xlabel=STEP_LABEL, ylabel=axis_label("loss", task, metric=metric), title="loss")
    ax1.legend()
    ax2.plot([r["step"] for r in scored], [r[metric] for r in scored], "o-", ms=3, color="C1")
    ax2.set(xlabel=STEP_LABEL, ylabel=axis_label(metric, task), title=f"validation {metric}")
    if metric == "ppl":
        _log_y(ax2, [r[metric] for r in scored])
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    atomic_savefig(fig, out_path)
    return fig


def spectra_of(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(name, spectrum)`` for every attention layer that has a learned spectrum (``.spectrum.mask``)."""
    found = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        spec = getattr(module, "spectrum", None)
        # A layer reads its core's spectrum (``attn.spectrum`` is ``attn.core.spectrum``):
        # each spectrum once, under the outermost name.
        if isinstance(spec, torch.nn.Module) and callable(getattr(spec, "mask", None)) and id(spec) not in seen:
            seen.add(id(spec))
            found.append((name, spec))
    return found


#: When choosing the plotted range of offsets, ``|f|`` below this fraction of its largest
#: value (over every head of every layer) counts as zero ...
RPE_THRESHOLD = 0.01
#: ... and the range reaches this factor beyond the last offset above it (then rounded up).
RPE_MARGIN = 1.25


def _nice_ceil(x: float) -> float:
    """Smallest of ``{1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8} x 10^k`` that is ``>= x > 0``."""
    exp = math.floor(math.log10(x))
    return next(v for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if (v := float(f"{m}e{exp}")) >= x * (1 - 1e-12))


def support_radius(radius: torch.Tensor, f: torch.Tensor, *, threshold: float = RPE_THRESHOLD) -> float:
    """Largest ``radius`` at which some ``|f| >= threshold * max |f|``.

    ``radius``: ``[...]`` (``|Delta|``, or ``max(|Delta_1|, |Delta_2|)`` on a square);
    ``f``: ``[..., K]``, the functions (heads, layers) sampled there. 0 when ``f`` is 0.
    """
    a = f.abs()
    peak = float(a.max()) if a.numel() else 0.0
    if not peak > 0:
        return 0.0
    return float(radius[(a >= threshold * peak).any(-1)].max())


def rpe_range(support: float, extent: float, *, margin: float = RPE_MARGIN) -> float:
    """Plotted range of offsets (``[0, r]`` causal, ``[-r, r]`` otherwise) for functions
    that vanish beyond ``support``: ``margin * support`` rounded up, at most ``extent``
    (``extent`` when nothing is nonzero)."""
    if not support > 0:
        return float(extent)
    return float(min(extent, _nice_ceil(margin * support)))


def _mask(spec: Any, delta: torch.Tensor) -> torch.Tensor:
    """``spec.mask(delta)`` in float64 on the CPU; ``spec`` is a module with a ``mask``
    method, as :func:`spectra_of` finds them."""
    p = next(spec.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    return spec.mask(delta.to(device=device, dtype=_dtype(spec))).double().cpu()


@torch.no_grad()
def plot_rpe_functions(model: torch.nn.Module, out_path: str, *, extent: float, causal: bool, points: int = 256,
                       task: str | None = None, unit: str | None = None) -> Figure | None:
    """Plot ``f(Delta)`` (``spectrum.mask``) of every head of every layer with a spectrum.

    The plotted range is where ``f`` matters: up to :data:`RPE_MARGIN` times the largest
    offset at which some ``|f|`` is at least :data:`RPE_THRESHOLD` of its maximum over all
    heads and layers (:func:`support_radius`, :func:`rpe_range`), at most ``extent``.

    ``P = 1``: curves on that range (``[0, r]`` causal, else ``[-r, r]``), a column per
    layer, one legend of heads for the figure; when ``r`` is under 80% of ``extent`` a
    second row shows the whole ``[0, extent]`` with the zoomed window shaded. ``P >= 2``:
    heat maps of the slice ``(Delta_1, Delta_2, 0, ...)`` on ``[-r, r]^2``, a row per layer
    (with a labelled colour bar) and a column per head. ``unit`` (default from ``task``,
    the task's ``axes``; tokens when causal) labels the offsets. Returns the
    ``matplotlib.figure.Figure`` saved to ``out_path``, or None (and writes nothing) when
    no layer has a spectrum.
    """
    layers = spectra_of(model)
    if not layers:
        return None
    unit = unit or task_axes(task).get("offset") or ("tokens" if causal else None)
    in_unit = f" ({unit})" if unit else ""
    pos_dim = layers[0][1].pos_dim
    heads = max(s.heads for _, s in layers)
    if pos_dim == 1:
        full = torch.linspace(0.0 if causal else -extent, extent, 4097, dtype=torch.float64)
        f_full = [_mask(spec, full.view(-1, 1)) for _, spec in layers]
        r = rpe_range(support_radius(full.abs(), torch.cat(f_full, -1)), extent)
        zoomed = r < 0.8 * extent
        delta = torch.linspace(0.0 if causal else -r, r, points, dtype=torch.float64)
        fig = new_figure(max(5.5, 3.4 * len(layers) + 1.0), 4.8 if zoomed else 3.1, dpi=130)
        axes = fig.subplots(2 if zoomed else 1, len(layers), squeeze=False, height_ratios=(2, 1) if zoomed else None)
        handles: dict[str, Any] = {}
        for col, (name, spec) in enumerate(layers):
            f = _mask(spec, delta.view(-1, 1))
            for h in range(f.shape[-1]):
                (line,) = axes[0][col].plot(delta.numpy(), f[:, h].numpy(), lw=1.2, color=f"C{h}")
                handles.setdefault(f"head {h}", line)
            axes[0][col].set_xlim(float(delta[0]), r)
            axes[0][col].set_title(name, fontsize=9)
            if zoomed:
                ax = axes[1][col]
                for h in range(f_full[col].shape[-1]):
                    ax.plot(full.numpy(), f_full[col][:, h].numpy(), lw=1.0, color=f"C{h}")
                ax.axvspan(float(delta[0]), r, color="0.85", zorder=0, lw=0)
                ax.set_xlim(float(full[0]), extent)
                ax.set_title("whole range (shaded: the range above)", fontsize=8)
        for row in axes:
            row[0].set_ylabel("f(Δ)")
            for ax in row:
                ax.set_xlabel("Δ" + in_unit)
                ax.grid(alpha=0.3)
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=min(len(handles), 8), fontsize=8)
        what = f"{'Δ' if causal else '|Δ|'} ≤ {r:g}" + (f" {unit}" if unit else "")
        if zoomed:
            fig.suptitle(f"learned f(Δ) per head\ntop: {what} (|f| < {RPE_THRESHOLD:.0%} of its maximum beyond); bottom: whole range", fontsize=9)
    else:
        side = 129
        grid = torch.linspace(-extent, extent, side, dtype=torch.float64)
        d1, d2 = torch.meshgrid(grid, grid, indexing="ij")
        square = torch.zeros(side, side, pos_dim, dtype=torch.float64)
        square[..., 0], square[..., 1] = d1, d2
        radius = torch.maximum(d1.abs(), d2.abs())
        r = rpe_range(support_radius(radius, torch.cat([_mask(spec, square) for _, spec in layers], -1)), extent)
        r = r if r < 0.8 * extent else float(extent)  # zoom only when it shows much more
        side = max(33, min(points, 161))
        grid = torch.linspace(-r, r, side, dtype=torch.float64)
        d1, d2 = torch.meshgrid(grid, grid, indexing="ij")
        delta = torch.zeros(side, side, pos_dim, dtype=torch.float64)
        delta[..., 0], delta[..., 1] = d1, d2
        fig = new_figure(2.5 * heads + 1.3, 2.4 * len(layers) + 0.6, dpi=130)
        axes = fig.subplots(len(layers), heads, squeeze=False)
        for layer, (row, (name, spec)) in enumerate(zip(axes, layers, strict=True)):
            f = _mask(spec, delta)
            scale = float(f.abs().max()) or 1.0
            for h, ax in enumerate(row):
                if h >= f.shape[-1]:
                    ax.axis("off")
                    continue
                im = ax.imshow(f[..., h].numpy().T, origin="lower", extent=(-r, r, -r, r), cmap="RdBu_r", vmin=-scale, vmax=scale,
                               interpolation="nearest")
                ax.set_title(f"head {h}", fontsize=8)
                ax.tick_params(labelsize=7)
                if layer == len(layers) - 1:
                    ax.set_xlabel("Δ₁" + in_unit, fontsize=8)
            row[0].set_ylabel(f"{name}\nΔ₂{in_unit}", fontsize=8)
            bar = fig.colorbar(im, ax=list(row), shrink=0.85)
            bar.set_label("f(Δ)", fontsize=8)
            bar.ax.tick_params(labelsize=7)
        slice_note = f" on the slice Δ₃.. = 0 (P = {pos_dim})" if pos_dim > 2 else ""
        zoom_note = (f"\nshown: |Δ₁|, |Δ₂| ≤ {r:g}" + (f" {unit}" if unit else "") + f" of {extent:.3g}; |f| < {RPE_THRESHOLD:.0%} of its maximum beyond"
                     if r < extent else "")
        fig.suptitle(f"learned f(Δ){slice_note}{zoom_note}", fontsize=9)
    atomic_savefig(fig, out_path)
    return fig


def _dtype(module: torch.nn.Module) -> torch.dtype:
    p = next(module.parameters(), None)
    return compute_dtype(p) if p is not None else torch.float32


def comparison_curves(curves: dict[str, list[list[tuple[int, float]]]]) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Per label with data: the steps every seed reached and the values ``[seeds, steps]``."""
    out = {}
    for label, runs in curves.items():
        runs = [r for r in runs if r]
        if not runs:
            continue
        steps = sorted(set.intersection(*({s for s, _ in r} for r in runs)))
        if steps:
            out[label] = (steps, torch.tensor([[dict(r)[s] for s in steps] for r in runs], dtype=torch.float64))
    return out


def plot_comparison(curves: dict[str, list[list[tuple[int, float]]]], out_path: str, *, metric: str, title: str = "",
                    task: str | None = None) -> Figure | None:
    """Validation ``metric`` against the step: per label the mean over seeds and its min-max band.

    Returns the ``matplotlib.figure.Figure`` saved to ``out_path``; None, writing nothing,
    when no label has a validation point (every run failed before its first evaluation).
    """
    data = comparison_curves(curves)
    if not data:
        return None
    fig = new_figure(6.5, 4.0)
    ax = fig.subplots()
    for i, label in enumerate(curves):
        if label not in data:
            continue
        steps, values = data[label]
        if values.shape[0] > 1:
            ax.fill_between(steps, values.min(0).values.numpy(), values.max(0).values.numpy(), color=f"C{i}", alpha=0.2, lw=0)
        ax.plot(steps, values.mean(0).numpy(), "o-", ms=3, color=f"C{i}", label=label, zorder=3)
    ax.set(xlabel=STEP_LABEL, ylabel=f"validation {axis_label(metric, task)}", title=title or f"validation {metric}")
    if metric == "ppl":
        _log_y(ax, [float(v) for _, values in data.values() for v in values.flatten()])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    atomic_savefig(fig, out_path)
    return fig
