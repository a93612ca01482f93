"""PNG figures of the fits: reconstructions, PSNR against epochs, and the sweep's trade-off.

Built with matplotlib's object API (``matplotlib.figure.Figure``, rendered by Agg): no global
backend is switched and no window opens. Files are written atomically with the permissions
of a plain ``open()`` (:func:`flt._io.atomic_savefig`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from flt._io import atomic_savefig, new_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _figure(width: float, height: float, dpi: int = 110) -> Figure:
    # flt fit's plots come with the vision extra, so a missing matplotlib names that one.
    return new_figure(width, height, dpi, extra="vision")


def save(fig: Figure, path: str) -> None:
    atomic_savefig(fig, path)


def _show_image(ax: Axes, img: np.ndarray, title: str) -> None:
    img = np.clip(img, 0.0, 1.0)
    ax.imshow(img, cmap="gray" if img.ndim == 2 else None, vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_title(title, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_signals(coords: np.ndarray, targets: np.ndarray, preds: np.ndarray, train: np.ndarray, labels: Sequence[str], path: str,
                 *, title: str = "", max_rows: int = 4) -> Figure:
    """Up to ``max_rows`` 1-D fits: ground truth, training samples and the network, one
    panel each. ``coords [N]``, ``targets`` and ``preds [S, N]``, ``train [N]`` bool."""
    rows = min(len(targets), max_rows)
    fig = _figure(9, 1.9 * rows + 0.6)
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    for ax, t, p, label in zip(axes, targets, preds, labels, strict=False):
        ax.plot(coords, t, color="0.6", lw=1.0, label="signal (all samples)")
        ax.plot(coords[train], t[train], ".", ms=2.5, color="k", label="training samples")
        ax.plot(coords, p, color="C3", lw=1.0, label="network")
        ax.set_ylabel(f"{label}\nintensity", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("x (fraction of the row)")
    axes[0].legend(fontsize=7, ncols=3, loc="upper right")
    if title:
        fig.suptitle(title, fontsize=9)
    save(fig, path)
    return fig


def plot_image(target: np.ndarray, pred: np.ndarray, path: str, *, title: str = "") -> Figure:
    """Target, reconstruction and absolute error of a 2-D fit (``[H, W]`` or ``[H, W, 3]``)."""
    fig = _figure(9, 3.4)
    axes = fig.subplots(1, 3)
    _show_image(axes[0], target, "target (all pixels)")
    _show_image(axes[1], pred, "network")
    err = np.abs(pred - target)
    err = err.mean(-1) if err.ndim == 3 else err
    im = axes[2].imshow(err, cmap="magma", vmin=0.0, interpolation="nearest")
    axes[2].set_title("|error|", fontsize=8)
    axes[2].set_xticks([])
    axes[2].set_yticks([])
    fig.colorbar(im, ax=axes[2], shrink=0.8)
    if title:
        fig.suptitle(title, fontsize=9)
    save(fig, path)
    return fig


def plot_history(history: list[dict], path: str, *, title: str = "") -> Figure:
    """Train, test (all samples) and held-out (odd samples) PSNR against the epoch."""
    fig = _figure(6, 3.6)
    ax = fig.subplots()
    epochs = [h["epoch"] for h in history]
    for key, label, style in (("psnr_train", "train (even samples)", "-"), ("psnr_test", "test (all samples)", "-"),
                              ("psnr_odd", "held out (odd samples)", ":")):
        ax.plot(epochs, [h[key] for h in history], style, marker="o", ms=2.5, label=label)
    ax.set(xlabel="epoch (full-batch Adam steps)", ylabel="PSNR (dB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    save(fig, path)
    return fig


def _is_log(values: list[float]) -> bool:
    return all(v > 0 for v in values) and max(values) / min(values) >= 10


def plot_tradeoff(key: str, points: list[dict], path: str, *, title: str = "") -> Figure:
    """Train and test PSNR against the swept ``key`` (left axis) and, on the right axis, the
    two diagnostics of the encoding, each divided by its largest value over the sweep so
    that both lie in ``[0, 1]``: the stable rank of the training embedding and the distance
    preservation (the largest values are in the legend). Each ``point`` holds ``value``,
    ``final`` and ``diagnostics``."""
    values = [float(p["value"]) for p in points]
    fig = _figure(7, 4.4)
    ax = fig.subplots()
    ax.plot(values, [p["final"]["psnr_train"] for p in points], "o--", color="C0", label="train PSNR (even samples)")
    ax.plot(values, [p["final"]["psnr_test"] for p in points], "o-", color="C3", lw=2, label="test PSNR (all samples)")
    ax.set(xlabel=key, ylabel="PSNR (dB)")
    right = ax.twinx()
    for name, label, style, color in (("stable_rank_train", "stable rank of the training embedding", "s-", "C2"),
                                      ("distance_preservation", "distance preservation", "^-", "C1")):
        series = [p["diagnostics"][name] for p in points]
        top = max(series) or 1.0
        right.plot(values, [v / top for v in series], style, color=color, ms=4, label=f"{label} / {top:.3g}")
    right.set_ylim(0.0, 1.05)
    right.set_ylabel("diagnostic / its largest value")
    if _is_log(values):
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    fig.legend(handles, [str(h.get_label()) for h in handles], loc="outside lower center", ncols=2, fontsize=8)
    ax.set_title(title or f"test PSNR against {key}", fontsize=9)
    save(fig, path)
    return fig


def plot_sweep_reconstructions(key: str, points: list[dict], target: np.ndarray, preds: list[np.ndarray], path: str,
                               *, coords: np.ndarray | None = None, train: np.ndarray | None = None) -> Figure:
    """The reconstructions of every sweep value side by side: 1-D (``target [N]``, with
    ``coords`` and ``train``) as curves, 2-D as images after the target."""
    n = len(points)
    if target.ndim == 1:
        assert coords is not None and train is not None  # given for 1-D targets (docstring)
        cols = min(n, 4)
        rows = math.ceil(n / cols)
        fig = _figure(3.2 * cols + 0.4, 2.4 * rows + 0.5)
        axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
        for ax, point, pred in zip(axes, points, preds, strict=False):
            ax.plot(coords, target, color="0.6", lw=0.9)
            ax.plot(coords[train], target[train], ".", ms=1.5, color="k")
            ax.plot(coords, pred, color="C3", lw=0.9)
            ax.set_title(f"{key} = {point['value']:g}: test {point['final']['psnr_test']:.1f} dB", fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in axes[n:]:
            ax.axis("off")
        fig.suptitle("grey: signal, dots: training samples, red: network", fontsize=8)
    else:
        cols = n + 1
        fig = _figure(2.3 * cols, 2.7)
        axes = fig.subplots(1, cols, squeeze=False)[0]
        _show_image(axes[0], target, "target")
        for ax, point, pred in zip(axes[1:], points, preds, strict=True):
            _show_image(ax, pred, f"{key} = {point['value']:g}\ntest {point['final']['psnr_test']:.1f} dB")
    save(fig, path)
    return fig
