"""The plot of a linearisation's run: ``learning_curves.png`` (:func:`plot_linearization`).
matplotlib is imported by :func:`flt._io.new_figure`, only when a plot is drawn."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flt._io import atomic_savefig, new_figure
from flt.train.linearize.data import METRIC
from flt.train.plots import STEP_LABEL

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_linearization(records: list[dict[str, Any]], out_path: str, *, transfer_steps: int, title: str = "") -> Figure:
    """Three panels against the step: each layer's matching error during transfer (log
    scale; solid: the output error, dashed: the weights' KL when weights are matched), the fine-tuning loss with the validation loss, and the validation perplexity
    with the softmax model's as a dashed line; a dotted line marks the end of transfer.
    Returns the saved ``matplotlib.figure.Figure``."""
    transfer = [rec for rec in records if rec["split"] == "transfer"]
    train = [rec for rec in records if rec["split"] == "train"]
    valid = [rec for rec in records if rec["split"] == "valid"]
    softmax = next(rec for rec in records if rec["split"] == "softmax")
    fig = new_figure(13, 3.8)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for layer in range(len(transfer[0]["layers"]) if transfer else 0):
        steps = [rec["step"] for rec in transfer]
        ax1.plot(steps, [rec["layers"][layer] for rec in transfer], lw=1, color=f"C{layer}", label=f"layer {layer}")
        if "kl" in transfer[0]:
            ax1.plot(steps, [rec["kl"][layer] for rec in transfer], lw=1, ls="--", color=f"C{layer}", label=f"layer {layer}, weights' KL")
    if transfer:
        ax1.set_yscale("log")
        ax1.legend(fontsize=8)
    ylabel = "relative squared error" + (" / KL (nats)" if transfer and "kl" in transfer[0] else "")
    ax1.set(xlabel=STEP_LABEL, ylabel=ylabel, title="attention transfer: matching error")
    ax2.plot([rec["step"] for rec in train], [rec["loss"] for rec in train], lw=1, label="fine-tuning (train)")
    ax2.plot([rec["step"] for rec in valid], [rec["loss"] for rec in valid], "o-", ms=3, label="valid")
    ax2.axhline(softmax["loss"], color="k", ls="--", lw=1, label="softmax model (valid)")
    ax2.set(xlabel=STEP_LABEL, ylabel="cross-entropy (nats/token)", title="loss")
    ax2.legend(fontsize=8)
    ax3.plot([rec["step"] for rec in valid], [rec[METRIC] for rec in valid], "o-", ms=3, color="C1", label="converted model")
    ax3.axhline(softmax[METRIC], color="k", ls="--", lw=1, label="softmax model")
    ax3.set(xlabel=STEP_LABEL, ylabel="perplexity (per token)", title="validation perplexity")
    ax3.legend(fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        if transfer_steps:
            ax.axvline(transfer_steps, color="grey", ls=":", lw=1)
    if title:
        fig.suptitle(title)
    atomic_savefig(fig, out_path)
    return fig
