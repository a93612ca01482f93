"""PNG plots: learning curves, every head's learned RPE function, comparison curves.

Figures are built with matplotlib's object API (``matplotlib.figure.Figure``, rendered by
Agg), so no global backend is switched and no window is ever opened.
"""

from __future__ import annotations

from typing import Any

import torch

from flt.train.metrics import read_metrics


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install flt[train], or pass --no-plots") from e
    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _log_y(ax) -> None:
    """Log-scaled y axis with plain numbers (``7``, ``10``) rather than ``7 x 10^0`` on its ticks."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)


def plot_learning_curves(metrics_path: str, out_path: str, *, metric: str, title: str = "") -> None:
    """Training and validation loss, and the validation ``metric``, against the step."""
    records = read_metrics(metrics_path)
    train = [r for r in records if r["split"] == "train" and r.get("loss") is not None]
    valid = [r for r in records if r["split"] == "valid"]
    fig = _figure(10, 3.8)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train")
    ax1.plot([r["step"] for r in valid], [r["loss"] for r in valid], "o-", ms=3, label="valid")
    ax1.set(xlabel="step", ylabel="loss", title="loss")
    ax1.legend()
    ax2.plot([r["step"] for r in valid], [r.get(metric) for r in valid], "o-", ms=3, color="C1")
    ax2.set(xlabel="step", ylabel=metric, title=f"validation {metric}")
    if metric == "ppl":
        _log_y(ax2)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.savefig(out_path)


def spectra_of(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(name, spectrum)`` for every attention layer that has a learned spectrum (``.spectrum.mask``)."""
    found = []
    for name, module in model.named_modules():
        spec = getattr(module, "spectrum", None)
        if isinstance(spec, torch.nn.Module) and callable(getattr(spec, "mask", None)):
            found.append((name, spec))
    return found


@torch.no_grad()
def plot_rpe_functions(model: torch.nn.Module, out_path: str, *, extent: float, causal: bool, points: int = 256) -> bool:
    """Plot ``f(Delta)`` (``spectrum.mask``) of every head of every layer with a spectrum.

    ``P = 1``: curves on ``[0, extent]`` (causal) or ``[-extent, extent]``, one panel per
    layer. ``P >= 2``: heat maps of the slice ``(Delta_1, Delta_2, 0, ...)`` on
    ``[-extent, extent]^2``, a row per layer and a column per head. Returns False (and
    writes nothing) when no layer has a spectrum.
    """
    layers = spectra_of(model)
    if not layers:
        return False
    pos_dim = layers[0][1].pos_dim
    heads = max(s.heads for _, s in layers)
    if pos_dim == 1:
        lo = 0.0 if causal else -extent
        delta = torch.linspace(lo, extent, points, dtype=torch.float64)
        fig = _figure(3.2 * len(layers), 3.0)
        axes = fig.subplots(1, len(layers), squeeze=False)[0]
        for ax, (name, spec) in zip(axes, layers):
            f = spec.mask(delta.to(_dtype(spec)).view(-1, 1)).double().cpu()
            for h in range(f.shape[-1]):
                ax.plot(delta.numpy(), f[:, h].numpy(), lw=1.2, label=f"head {h}")
            ax.set(title=name, xlabel="Delta (tokens)" if causal else "Delta")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("f(Delta)")
        axes[-1].legend(fontsize=7)
    else:
        side = min(points, 96)
        grid = torch.linspace(-extent, extent, side, dtype=torch.float64)
        d1, d2 = torch.meshgrid(grid, grid, indexing="ij")
        delta = torch.zeros(side, side, pos_dim, dtype=torch.float64)
        delta[..., 0], delta[..., 1] = d1, d2
        fig = _figure(2.2 * heads, 2.1 * len(layers))
        axes = fig.subplots(len(layers), heads, squeeze=False)
        for layer, (row, (name, spec)) in enumerate(zip(axes, layers)):
            f = spec.mask(delta.to(_dtype(spec))).double().cpu()
            for h, ax in enumerate(row):
                if h >= f.shape[-1]:
                    ax.axis("off")
                    continue
                im = ax.imshow(f[..., h].numpy().T, origin="lower", extent=(-extent, extent, -extent, extent), cmap="RdBu_r",
                               vmin=-float(f.abs().max()), vmax=float(f.abs().max()))
                ax.set_title(f"layer {layer} head {h}", fontsize=7)
                ax.tick_params(labelsize=6)
            fig.colorbar(im, ax=row[-1], shrink=0.8)
        if pos_dim > 2:
            fig.suptitle(f"f(Delta) on the slice Delta_3.. = 0 (P = {pos_dim})", fontsize=9)
    fig.savefig(out_path)
    return True


def _dtype(module: torch.nn.Module) -> torch.dtype:
    p = next(module.parameters(), None)
    return torch.promote_types(p.dtype, torch.float32) if p is not None else torch.float32


def plot_comparison(curves: dict[str, list[list[tuple[int, float]]]], out_path: str, *, metric: str, title: str = "") -> None:
    """Validation ``metric`` against the step: per label the mean over seeds and its min-max band."""
    fig = _figure(6.5, 4.0)
    ax = fig.subplots()
    for i, (label, runs) in enumerate(curves.items()):
        runs = [r for r in runs if r]
        if not runs:
            continue
        steps = sorted(set.intersection(*(set(s for s, _ in r) for r in runs)))
        if not steps:
            continue
        values = torch.tensor([[dict(r)[s] for s in steps] for r in runs], dtype=torch.float64)
        if len(runs) > 1:
            ax.fill_between(steps, values.min(0).values.numpy(), values.max(0).values.numpy(), color=f"C{i}", alpha=0.2, lw=0)
        ax.plot(steps, values.mean(0).numpy(), "o-", ms=3, color=f"C{i}", label=label, zorder=3)
    ax.set(xlabel="step", ylabel=f"validation {metric}", title=title or f"validation {metric}")
    if metric == "ppl":
        _log_y(ax)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # every run may have failed
        ax.legend(fontsize=8)
    fig.savefig(out_path)
