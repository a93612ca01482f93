"""The benchmark and search figures read right: tick labels that do not overlap, labelled
axes, and no bars that start near the data (which makes tiny differences look large)."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


@pytest.fixture
def figures(monkeypatch):
    """Every figure saved during the test, kept for inspection after it is closed."""
    from matplotlib.figure import Figure

    saved = []
    real = Figure.savefig

    def savefig(self, *args, **kwargs):
        saved.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _overlaps(fig, ax) -> list[tuple[str, str]]:
    """Pairs of visible x tick labels (major and minor) of ``ax`` whose boxes intersect."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # a closed figure keeps only a bare canvas
    canvas.draw()
    renderer = canvas.get_renderer()
    labels = [t for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True) if t.get_visible() and t.get_text()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
    return [(a, b) for i, (a, box_a) in enumerate(boxes) for b, box_b in boxes[i + 1:] if box_a.overlaps(box_b)]


def test_bench_approx_png_x_tick_labels_do_not_overlap(tmp_path, figures):
    from flt.bench.approx import AttentionError, MaskError
    from flt.bench.convergence import plot_convergence

    sizes = (8, 16, 32, 64, 128, 256, 512, 1024)
    masks = [MaskError(name, "iid", 1, R, 1 / R**0.5, 0.5 / R**0.5) for name in ("gaussian", "local") for R in sizes]
    sweeps = {"vs_m": [AttentionError("logit", False, m, 128, 1 / m**0.5) for m in (16, 32, 64, 128, 256, 512, 1024, 2048)],
              "vs_R": [AttentionError("logit", False, 2048, R, 1 / R**0.5) for R in (4, 8, 16, 32, 64, 128, 256)]}
    plot_convergence(masks, sweeps, tmp_path / "approx.png")
    fig, = figures
    for ax in fig.axes:
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert labels and all(text.isdigit() for text in labels), labels  # the sizes, as plain integers
        assert not [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()]
        assert not _overlaps(fig, ax), (ax.get_title(), _overlaps(fig, ax))


def test_approx_masks_png_has_a_y_label(tmp_path, figures):
    from flt.bench.approx import plot_masks

    plot_masks(tmp_path / "masks.png", names=["gaussian", "local"], R=8)
    fig, = figures
    assert "f(offset)" in fig.axes[0].get_ylabel()


def test_search_png_shows_removals_as_points_not_bars_cut_off_near_the_data(tmp_path, figures):
    from matplotlib.collections import PathCollection
    from matplotlib.patches import Rectangle

    from flt.search.plots import plot_search

    removed = {"flt": 0.3611, "performer": 0.3924, "softmax": 0.3507}
    result = {"task": "image", "metric": "accuracy",
              "candidates": [{"label": label} for label in removed],
              "slots": [{"layer": 0, "metric": 0.3958, "removed": removed, "chosen": "softmax", "magnitude": "softmax",
                         "alpha": {"flt": 0.3, "performer": 0.35, "softmax": 0.35}}],
              "alpha_end": [[0.3, 0.35, 0.35]]}
    plot_search(result, str(tmp_path / "search.png"))
    fig, = figures
    top, bottom = fig.axes[0], fig.axes[1]
    # The metric panel's y axis starts near the data, so it holds no bars: points on stems.
    assert top.get_ylim()[0] > 0.3
    assert not [p for p in top.patches if isinstance(p, Rectangle)]
    points = [float(y) for c in top.collections if isinstance(c, PathCollection) for _, y in c.get_offsets()]
    assert sorted(points) == sorted(removed.values())
    # The weights panel keeps its bars, which start at 0.
    assert bottom.get_ylim()[0] == 0 and all(p.get_y() == 0 for p in bottom.patches if isinstance(p, Rectangle))
