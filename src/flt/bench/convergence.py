"""Convergence plots for ``flt bench approx``: mask error vs R, attention error vs m.

The numbers come from :mod:`flt.bench.approx` (live, float64, against the exact
references); this module only sweeps and draws them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flt._io import atomic_savefig
from flt.bench.approx import AttentionError, MaskError, attention_errors

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def attention_error_sweeps(ms: Sequence[int], Rs: Sequence[int], *, fixed_R: int, fixed_m: int, seeds: Sequence[int] = (0, 1), N: int = 65) -> dict[str, list[AttentionError]]:
    """FLT vs its exact layer for both couplings, bidirectional and causal:
    ``"vs_m"`` sweeps ``m`` at ``R = fixed_R``, ``"vs_R"`` sweeps ``R`` at ``m = fixed_m``."""
    return {
        "vs_m": attention_errors(tuple((m, fixed_R) for m in ms), N=N, seeds=seeds),
        "vs_R": attention_errors(tuple((fixed_m, R) for R in Rs), N=N, seeds=seeds),
    }


def _guide(ax: Axes, xs: Sequence[float], ys: Sequence[float], slope: float, label: str) -> None:
    """A dotted ``x^slope`` line through the first point, for reading rates off the plot."""
    x0, y0 = xs[0], ys[0]
    ax.loglog(xs, [y0 * (x / x0) ** slope for x in xs], ":", color="gray", label=label)


def _size_ticks(ax: Axes, values: Sequence[int]) -> None:
    """Label a log x axis at the sizes measured (R or m, powers of 2), as plain integers and
    at most five of them, with no minor labels: matplotlib's default '2x10^1 4x10^1 ...'
    minor labels overlap."""
    from matplotlib.ticker import FixedLocator, NullFormatter

    sizes = sorted({int(v) for v in values})
    step = -(-len(sizes) // 5)
    shown = sizes[::-1][::step][::-1]  # keep the largest size labelled
    ax.xaxis.set_major_locator(FixedLocator(shown))
    ax.set_xticklabels([str(v) for v in shown], fontsize=7)
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_convergence(masks: list[MaskError], sweeps: dict[str, list[AttentionError]], path: str | os.PathLike) -> None:
    """One panel per spectrum (max mask error vs R, a line per sampler and P) and two panels
    of attention error (vs m, vs R), a line per coupling and causality; log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spectra = sorted({r.spectrum for r in masks})
    fig, axes = plt.subplots(1, len(spectra) + 2, figsize=(3.4 * (len(spectra) + 2), 3.2), squeeze=False)
    for ax, name in zip(axes[0], spectra, strict=False):
        for sampler, pos_dim in sorted({(r.sampler, r.pos_dim) for r in masks if r.spectrum == name}):
            points = sorted((r for r in masks if (r.spectrum, r.sampler, r.pos_dim) == (name, sampler, pos_dim)), key=lambda r: r.R)
            ax.loglog([r.R for r in points], [r.max_error for r in points], marker="o", ms=3, label=f"{sampler}, P={pos_dim}")
        first = sorted((r for r in masks if r.spectrum == name), key=lambda r: r.R)
        _guide(ax, [r.R for r in first], [r.max_error for r in first], -0.5, "R^-1/2")
        ax.set_title(f"mask: {name}", fontsize=9)
        ax.set_xlabel("R")
        _size_ticks(ax, [r.R for r in first])
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("max |a.c - f| / |f(0)|")
    for ax, (key, xname) in zip(axes[0][len(spectra):], (("vs_m", "m"), ("vs_R", "R")), strict=True):
        rows = sweeps[key]
        for coupling, causal in sorted({(r.coupling, r.causal) for r in rows}):
            sel = [r for r in rows if (r.coupling, r.causal) == (coupling, causal)]
            xs = [getattr(r, xname) for r in sel]
            ax.loglog(xs, [r.rel_error for r in sel], "--" if causal else "-", marker="o", ms=3, label=f"{coupling}{' causal' if causal else ''}")
        _guide(ax, [getattr(r, xname) for r in rows[: len(rows) // 4]], [r.rel_error for r in rows[: len(rows) // 4]], -0.5, f"{xname}^-1/2")
        fixed = f"R={rows[0].R}" if xname == "m" else f"m={rows[0].m}"
        ax.set_title(f"FLT vs exact layer, {fixed}", fontsize=9)
        ax.set_xlabel(xname)
        _size_ticks(ax, [getattr(r, xname) for r in rows])
        ax.set_ylabel("relative output error")
        ax.legend(fontsize=6)
    fig.tight_layout()
    atomic_savefig(fig, os.fspath(path), dpi=110)
    plt.close(fig)
