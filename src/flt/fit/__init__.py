"""Coordinate-network experiments: fit 1-D signals (rows of an image) and 2-D images with
every positional encoding, and measure why some encodings interpolate and others do not
(the stable-rank / distance-preservation trade-off; docs/fit.md, docs/math.md section 7).

``flt fit signal`` and ``flt fit image`` are the command-line front ends; images need the
``vision`` extra (scikit-image).
"""

from flt.fit.config import PRESETS, FitConfig, get_preset, row_indices
from flt.fit.core import (
    Problem,
    StackedNetwork,
    fit_problem,
    grid_coords,
    image_problem,
    psnr,
    signal_problem,
)
from flt.fit.encodings import ENCODINGS, AxisEncoding, BasicEncoding, RawCoordinates, build_encoding
from flt.fit.run import load_problem, parse_sweep, run_fit, run_sweep

__all__ = [
    "ENCODINGS",
    "PRESETS",
    "AxisEncoding",
    "BasicEncoding",
    "FitConfig",
    "Problem",
    "RawCoordinates",
    "StackedNetwork",
    "build_encoding",
    "fit_problem",
    "get_preset",
    "grid_coords",
    "image_problem",
    "load_problem",
    "parse_sweep",
    "psnr",
    "row_indices",
    "run_fit",
    "run_sweep",
    "signal_problem",
]
