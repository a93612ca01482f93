"""``search.png``: per slot, the held-out metric with each candidate removed and the
architecture weights, with the perturbation and magnitude choices marked."""

from __future__ import annotations

from typing import Any

from flt._io import atomic_savefig, new_figure
from flt.train.plots import axis_label


def plot_search(result: dict[str, Any], out_path: str) -> str:
    """Draw ``result`` (the contents of ``search.json``) to ``out_path``; returns the path."""
    attention = [c["label"] for c in result["candidates"]]
    ends = result.get("alpha_end")
    # (record, candidate labels, softmax(alpha) at the end of the supernet phase or None, title)
    panels = [(e, attention, ends[e["layer"]] if ends else None, f"layer {e['layer']}") for e in result["slots"]]
    if result.get("posenc_slot"):
        panels.append((result["posenc_slot"], [c["label"] for c in result["posenc_candidates"]], result.get("posenc_alpha_end"),
                       "absolute encoding"))
    metric, task = result["metric"], result["task"]
    fig = new_figure(max(5.0, 2.6 * len(panels) + 1.0), 5.2)
    axes = fig.subplots(2, len(panels), squeeze=False)
    for i, (entry, labels, end, title) in enumerate(panels):
        top, bottom = axes[0][i], axes[1][i]
        xs = list(range(len(labels)))
        removed = [entry["removed"].get(label, float("nan")) for label in labels]
        colours = ["tab:red" if label == entry["chosen"] else "tab:gray" for label in labels]
        # Points on stems from the metric with nothing removed: a stem's length is the
        # effect of the removal. Bars would need to start at 0, where differences of a
        # few thousandths would not show; bars cut off near the data exaggerate them.
        top.axhline(entry["metric"], color="black", lw=1, ls="--", label="nothing removed")
        top.vlines(xs, entry["metric"], removed, colors=colours, lw=2)
        top.scatter(xs, removed, color=colours, zorder=3)
        for x, value in zip(xs, removed, strict=True):
            top.annotate(f"{value:.4g}", (x, value), textcoords="offset points", xytext=(5, 0), va="center", fontsize=7)
        lo, hi = min([*removed, entry["metric"]]), max([*removed, entry["metric"]])
        pad = 0.15 * (hi - lo) or 0.05 * abs(hi) or 0.1
        top.set_ylim(lo - pad, hi + pad)
        top.set_xlim(-0.5, len(labels) - 0.5)
        top.set_title(f"{title}: chose {entry['chosen']}", fontsize=8)
        # The weights magnitude selection read (end of the supernet phase), not those at the decision.
        alpha = end if end else [entry["alpha"].get(label, float("nan")) for label in labels]
        bottom.bar(xs, alpha, color=["tab:blue" if label == entry.get("magnitude") else "tab:gray" for label in labels])
        bottom.set_ylim(0, 1)
        for ax in (top, bottom):
            ax.set_xticks(xs)
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        if i == 0:
            # The search measures on its held-out part, never on the validation split.
            label = axis_label(metric, task).replace("validation", "held-out")
            top.set_ylabel(f"{label}\nwith the candidate removed", fontsize=8)
            bottom.set_ylabel("softmax(alpha) after\nthe supernet phase", fontsize=8)
            top.legend(fontsize=7)
    fig.suptitle(f"{task}: perturbation choice (red) and magnitude choice (blue) per slot", fontsize=9)
    atomic_savefig(fig, out_path)
    return out_path
