"""``search.png``: per slot, the held-out metric with each candidate removed and the
architecture weights, with the perturbation and magnitude choices marked."""

from __future__ import annotations

from typing import Any

from flt.train.plots import _figure, axis_label


def plot_search(result: dict[str, Any], out_path: str) -> str:
    """Draw ``result`` (the contents of ``search.json``) to ``out_path``; returns the path."""
    slots = result["slots"]
    labels = [c["label"] for c in result["candidates"]]
    metric, task = result["metric"], result["task"]
    fig = _figure(max(5.0, 2.6 * len(slots) + 1.0), 5.2)
    axes = fig.subplots(2, len(slots), squeeze=False)
    for i, entry in enumerate(slots):
        top, bottom = axes[0][i], axes[1][i]
        xs = list(range(len(labels)))
        removed = [entry["removed"].get(label, float("nan")) for label in labels]
        colours = ["tab:red" if label == entry["chosen"] else "tab:gray" for label in labels]
        top.bar(xs, removed, color=colours)
        top.axhline(entry["metric"], color="black", lw=1, ls="--", label="nothing removed")
        lo, hi = min(removed + [entry["metric"]]), max(removed + [entry["metric"]])
        pad = 0.1 * (hi - lo) or 0.05 * abs(hi) or 0.1
        top.set_ylim(lo - pad, hi + pad)
        top.set_title(f"layer {entry['layer']}: chose {entry['chosen']}", fontsize=8)
        # The weights magnitude selection read (end of the supernet phase), not those at the decision.
        ends = result.get("alpha_end")
        alpha = ends[entry["layer"]] if ends else [entry["alpha"].get(label, float("nan")) for label in labels]
        bottom.bar(xs, alpha, color=["tab:blue" if label == entry.get("magnitude") else "tab:gray" for label in labels])
        bottom.set_ylim(0, 1)
        for ax in (top, bottom):
            ax.set_xticks(xs)
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        if i == 0:
            top.set_ylabel(f"{axis_label(metric, task)}\nwith the candidate removed", fontsize=8)
            bottom.set_ylabel("softmax(alpha) after\nthe supernet phase", fontsize=8)
            top.legend(fontsize=7)
    fig.suptitle(f"{task}: perturbation choice (red) and magnitude choice (blue) per layer", fontsize=9)
    fig.savefig(out_path)
    return out_path
