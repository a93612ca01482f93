"""The training plots read well: ticks span the data, offsets cover where f matters, units label every axis."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("matplotlib")

from flt.train import plots  # noqa: E402


def _tick_values(ax, axis="y"):
    """The numbers the rendered tick labels show, and the visible range."""
    ax.figure.canvas.draw()
    labels = ax.get_yticklabels() if axis == "y" else ax.get_xticklabels()
    lo, hi = sorted(ax.get_ylim() if axis == "y" else ax.get_xlim())
    shown = [float(t.get_text().replace("\u2212", "-")) for t, v in zip(labels, ax.get_yticks() if axis == "y" else ax.get_xticks())
             if t.get_text() and lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9)]
    return shown, (lo, hi)


@pytest.mark.parametrize("lo, hi", [(6.6, 14.5), (26.18, 27.71), (3.0, 25.0), (1.5, 1000.0), (0.3, 0.95), (7.0, 7.0), (1e-3, 1e12)])
def test_log_ticks_bracket_the_range_with_round_numbers(lo, hi):
    ticks = plots.log_ticks(lo, hi)
    assert ticks == sorted(ticks) and len(ticks) >= 3
    assert ticks[0] <= lo and ticks[-1] >= hi
    assert len(ticks) <= 13
    assert all(len(f"{t:g}") <= 6 for t in ticks)  # plain, short labels
    with pytest.raises(ValueError):
        plots.log_ticks(0.0, 1.0)


def test_learning_curves_label_the_whole_perplexity_range_with_units(tmp_path):
    ppl = [14.5, 11.0, 9.2, 8.1, 7.4, 6.9, 6.6]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i, p in enumerate(ppl):
            f.write(json.dumps({"split": "train", "step": 10 * i + 5, "loss": math.log(p) + 0.1}) + "\n")
            f.write(json.dumps({"split": "valid", "step": 10 * (i + 1), "loss": math.log(p), "ppl": p}) + "\n")
    fig = plots.plot_learning_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "lc.png"), metric="ppl", title="lm")
    assert (tmp_path / "lc.png").read_bytes()[:4] == b"\x89PNG"
    loss_ax, ppl_ax = fig.axes
    assert ppl_ax.get_yscale() == "log"
    shown, (lo, hi) = _tick_values(ppl_ax)
    # Labelled ticks at or beyond both ends of the data, all of it inside the axis.
    assert min(shown) <= min(ppl) and max(shown) >= max(ppl) and len(shown) >= 4
    assert lo <= min(ppl) and hi >= max(ppl)
    assert [t.get_text() for t in ppl_ax.get_yticklabels(minor=True)] in ([], [""] * len(ppl_ax.get_yticklabels(minor=True)))
    for ax in fig.axes:  # units on every axis
        assert "(" in ax.get_xlabel() and "(" in ax.get_ylabel(), (ax.get_xlabel(), ax.get_ylabel())
    assert "nats/token" in loss_ax.get_ylabel() and "step" in loss_ax.get_xlabel()


class _Triangle(torch.nn.Module):
    """A spectrum-like module whose f is zero beyond a known offset: ``relu(1 - |Delta| / w_h)``."""

    def __init__(self, widths, pos_dim=1):
        super().__init__()
        self.widths = torch.nn.Parameter(torch.tensor(widths, dtype=torch.float64))
        self.heads, self.pos_dim = len(widths), pos_dim

    def mask(self, delta):
        r = delta.norm(dim=-1, keepdim=True)
        return torch.relu(1 - r / self.widths)


class _Model(torch.nn.Module):
    def __init__(self, *spectra):
        super().__init__()
        self.blocks = torch.nn.ModuleList()
        for s in spectra:
            attn = torch.nn.Module()
            attn.spectrum = s
            self.blocks.append(attn)


def test_support_and_range_of_a_known_function():
    delta = torch.linspace(0, 128, 4097, dtype=torch.float64)
    f = torch.relu(1 - delta.view(-1, 1) / torch.tensor([10.0, 20.0], dtype=torch.float64))
    assert plots.support_radius(delta, f) == pytest.approx(19.8, abs=0.05)  # |f| >= 1% of max 1
    assert plots.rpe_range(19.8, 128.0) == 25.0  # 1.25 x 19.8 = 24.75, rounded up
    assert plots.rpe_range(19.8, 22.0) == 22.0  # never beyond the extent
    assert plots.support_radius(delta, torch.zeros(4097, 2)) == 0.0 and plots.rpe_range(0.0, 128.0) == 128.0


@pytest.mark.parametrize("causal", [True, False])
def test_rpe_plot_shows_where_f_matters_and_the_whole_range(tmp_path, causal):
    model = _Model(_Triangle([10.0, 20.0]), _Triangle([5.0, 12.0]))
    fig = plots.plot_rpe_functions(model, str(tmp_path / "rpe.png"), extent=128.0, causal=causal, task="lm")
    assert (tmp_path / "rpe.png").exists()
    top, bottom = fig.axes[:2], fig.axes[2:4]
    for ax in top:  # f's support ends at 19.8 tokens: 0..25 (or -25..25), not 0..128
        assert ax.get_xlim() == ((0.0, 25.0) if causal else (-25.0, 25.0))
        assert ax.get_xlabel() == "Δ (tokens)"
    for ax in bottom:
        assert ax.get_xlim() == ((0.0, 128.0) if causal else (-128.0, 128.0))
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["head 0", "head 1"]


def test_rpe_plot_of_a_function_that_never_vanishes_keeps_the_whole_range(tmp_path):
    fig = plots.plot_rpe_functions(_Model(_Triangle([1e6, 2e6])), str(tmp_path / "rpe.png"), extent=64.0, causal=True)
    assert len(fig.axes) == 1 and fig.axes[0].get_xlim() == (0.0, 64.0)
    assert plots.plot_rpe_functions(torch.nn.Linear(2, 2), str(tmp_path / "none.png"), extent=8.0, causal=True) is None
    assert not (tmp_path / "none.png").exists()


def test_rpe_heatmaps_zoom_and_label_axes_and_colour_bar(tmp_path):
    model = _Model(_Triangle([2.0, 3.0], pos_dim=3))
    fig = plots.plot_rpe_functions(model, str(tmp_path / "rpe.png"), extent=10.0, causal=False, task="molecule")
    maps = [ax for ax in fig.axes if ax.images]
    bars = [ax for ax in fig.axes if not ax.images]
    assert len(maps) == 2 and len(bars) == 1
    for ax in maps:  # support 2.97 Å -> 1.25 x 2.97 rounded up to 4
        assert ax.get_xlim() == (-4.0, 4.0) and ax.get_ylim() == (-4.0, 4.0)
        assert ax.get_xlabel() == "Δ₁ (Å)"
    assert "Δ₂ (Å)" in maps[0].get_ylabel()
    assert bars[0].get_ylabel() == "f(Δ)"
    assert maps[0].images[0].get_array().shape[0] >= 100  # not a coarse 30-pixel map


def test_comparison_plot_has_units_and_writes_nothing_without_data(tmp_path):
    curves = {"a": [[(10, 30.0), (20, 9.0)], [(10, 25.0), (20, 8.0)]], "b": [[(10, 12.0), (20, 7.0)]], "c": []}
    fig = plots.plot_comparison(curves, str(tmp_path / "ppl.png"), metric="ppl")
    (ax,) = fig.axes
    shown, _ = _tick_values(ax)
    assert min(shown) <= 7.0 and max(shown) >= 30.0
    assert "per token" in ax.get_ylabel() and "step" in ax.get_xlabel()
    assert plots.plot_comparison({"a": [], "b": [[]]}, str(tmp_path / "none.png"), metric="accuracy") is None
    assert not (tmp_path / "none.png").exists()
