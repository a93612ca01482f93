"""Approximation accuracy: spectral masks against their exact f, FLT against exact attention.

Everything here is measured live in float64 from the library's own exact references;
nothing is a stored number. Used by ``flt approx`` and ``flt bench approx``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch

from flt._io import atomic_savefig
from flt.layers import FLTAttention
from flt.layers.near import Neighbors
from flt.ops import favor_plus_features, gaussian_orthogonal_random_matrix
from flt.relative.spectra import SAMPLERS, SPECTRA
from flt.relative.spectra.local import LocalSpectrum

F64 = torch.float64


@dataclass(frozen=True)
class MaskError:
    spectrum: str
    sampler: str
    pos_dim: int
    R: int
    max_error: float  # mean over seeds of max_Delta |f^(Delta) - f(Delta)| / |f(0)|
    rms_error: float  # mean over seeds of the RMS over Delta, same normalisation


@dataclass(frozen=True)
class AttentionError:
    coupling: str
    causal: bool
    m: int
    R: int
    rel_error: float  # |FLT(x) - exact(x)| / |exact(x)|, mean over seeds


@dataclass(frozen=True)
class KernelScaleError:
    setting: str
    D: int
    m: int
    sq_norm: float  # |x|^2 fed to the exponential
    rel_error: float  # relative error of the row-normalised attention matrix


def offsets(pos_dim: int, extent: float = 32.0, points: int = 257) -> torch.Tensor:
    """Evaluation offsets ``[K, P]``: a line through the origin along the diagonal."""
    line = torch.linspace(-extent, extent, points, dtype=F64)
    return line.unsqueeze(-1).expand(points, pos_dim) / math.sqrt(pos_dim)


def mask_errors(
    names: Sequence[str] | None = None, samplers: Sequence[str] = SAMPLERS, Rs: Sequence[int] = (8, 32, 128, 512, 1024),
    pos_dims: Sequence[int] = (1,), seeds: Sequence[int] = (0, 1, 2), heads: int = 2
) -> list[MaskError]:
    """``max |a.c - f|`` over offsets for every spectrum, sampler and R (relative to f(0))."""
    rows = []
    for name in names or sorted(SPECTRA):
        for pos_dim in pos_dims:
            delta = offsets(pos_dim)
            for sampler in samplers:
                if sampler == "orthogonal" and pos_dim == 1:
                    continue  # one axis: orthogonal blocks are iid draws
                for R in Rs:
                    mx, rms = [], []
                    for seed in seeds:
                        spec = SPECTRA[name](heads=heads, pos_dim=pos_dim, num_frequencies=R, sampler=sampler, seed=seed).double()
                        with torch.no_grad():
                            f = spec.mask(delta)
                            err = (spec.estimate(delta) - f) / spec.mask(torch.zeros(1, pos_dim, dtype=F64)).abs().clamp_min(1e-12)
                        mx.append(err.abs().max().item())
                        rms.append(err.square().mean().sqrt().item())
                    rows.append(MaskError(name, sampler, pos_dim, R, sum(mx) / len(mx), sum(rms) / len(rms)))
    return rows


def attention_errors(settings: Sequence[tuple[int, int]] = ((64, 8), (256, 32), (1024, 128)), *, N: int = 65, dim: int = 32,
                     heads: int = 2, seeds: Sequence[int] = (0, 1)) -> list[AttentionError]:
    """Relative error of ``FLTAttention.forward`` against ``FLTAttention.exact``."""
    rows = []
    for coupling in ("logit", "multiplicative"):
        for causal in (False, True):
            for m, R in settings:
                errs = []
                for seed in seeds:
                    torch.manual_seed(seed)
                    layer = FLTAttention.from_options(dim, heads, coupling=coupling, num_features=m, num_frequencies=R, causal=causal, amplitude=0.5, length_scale=4.0).double()
                    x = torch.randn(2, N, dim, dtype=F64)
                    with torch.no_grad():
                        exact = layer.exact(x)
                        errs.append(((layer(x) - exact).norm() / exact.norm()).item())
                rows.append(AttentionError(coupling, causal, m, R, sum(errs) / len(errs)))
    return rows


@dataclass(frozen=True)
class FidelityError:
    estimator: str
    amplitude: float  # f(0) of the local mask
    m: int
    R: int
    rel_error: float  # |forward(x) - exact(x)| / |exact(x)|, mean over seeds


#: Estimators of a strong local mask, as FLTAttention options. ``where`` says which spectrum
#: carries the mask: the far-field ``spectrum`` (random features) or the ``near_spectrum``
#: (exact inside the band).
FIDELITY_ESTIMATORS: dict[str, tuple[dict[str, Any], str]] = {
    "concat (logit, no band)": ({"coupling": "logit"}, "spectrum"),
    "band w=8, mask in f_near": ({"coupling": "logit", "near_field": 8}, "near_spectrum"),
    "band w=16, mask in f_near": ({"coupling": "logit", "near_field": 16}, "near_spectrum"),
    "band w=16, mask in f (far)": ({"coupling": "logit", "near_field": 16}, "spectrum"),
    # The multiplicative mask is f itself (any amplitude cancels in the ratio): a local
    # window's signed importance weights make row sums cancel.
    "multiplicative, local f": ({"coupling": "multiplicative"}, "spectrum"),
}


def _set_local_amplitude(spectrum: LocalSpectrum, amplitude: float) -> None:
    """Make a local spectrum's ``f(0)`` equal ``amplitude`` in every head, split evenly over
    its windows (window shapes unchanged)."""
    with torch.no_grad():
        spectrum.amplitude.fill_(1.0)
        zero = torch.zeros(1, spectrum.pos_dim, dtype=spectrum.amplitude.dtype)
        w, tau = spectrum.half_widths(), spectrum.smoothings()
        peak = torch.erf(w / (math.sqrt(2) * tau)).prod(-1)  # f_c(0) / a_c, [H, W]
        spectrum.amplitude.copy_(amplitude / spectrum.windows / peak)
        assert torch.allclose(spectrum.mask(zero)[0], torch.full_like(spectrum.mask(zero)[0], amplitude))


def fidelity_errors(amplitudes: Sequence[float] = (0.0, 1.0, 2.0, 3.5, 5.0), settings: Sequence[tuple[int, int]] = ((64, 16), (256, 32)),
                    *, estimators: Sequence[str] | None = None, N: int = 256, dim: int = 128, heads: int = 2,
                    seeds: Sequence[int] = (0, 1)) -> list[FidelityError]:
    """Relative error of ``FLTAttention.forward`` against ``exact`` for a local mask of
    growing ``f(0)`` (four smoothed windows of half-widths 1..16 tokens), default qk-norm,
    random inputs, 1-D token positions. The multiplicative coupling's mask is the local
    ``f`` itself; its amplitude cancels in the normalisation."""
    rows = []
    for label in estimators or FIDELITY_ESTIMATORS:
        options, where = FIDELITY_ESTIMATORS[label]
        for amplitude in amplitudes:
            for m, R in settings:
                errs = []
                for seed in seeds:
                    torch.manual_seed(seed)
                    layer = FLTAttention.from_options(dim, heads, spectrum="local", num_features=m, num_frequencies=R, **options).double()
                    if amplitude > 0 and options["coupling"] == "logit":
                        _set_local_amplitude(getattr(layer, where), amplitude)
                    x = torch.randn(2, N, dim, dtype=F64)
                    with torch.no_grad():
                        exact = layer.exact(x)
                        errs.append(((layer(x) - exact).norm() / exact.norm()).item())
                rows.append(FidelityError(label, amplitude, m, R, sum(errs) / len(errs)))
    return rows


@dataclass(frozen=True)
class SpatialFidelityError:
    positions: str  # the point set (POINT_SETS)
    estimator: str  # a key of SPATIAL_ESTIMATORS
    amplitude: float  # f(0) of the Gaussian bump
    m: int
    R: int
    rel_error: float  # |forward(x) - exact(x)| / |exact(x)|, mean over seeds
    full_mask_error: float | None  # the same against softmax(x_q.x_k + f) with f on every pair (logit only)


def _random_cube(n: int, pos_dim: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` uniform points at unit density (a cube of side ``n^(1/P)``)."""
    return torch.rand(n, pos_dim, generator=generator, dtype=F64) * n ** (1 / pos_dim)


def _grid(side: int) -> torch.Tensor:
    """A ``side x side`` grid of unit spacing: image patches."""
    axis = torch.arange(side, dtype=F64)
    return torch.stack(torch.meshgrid(axis, axis, indexing="ij"), dim=-1).reshape(-1, 2)


#: Point sets of the spatial sweep, ``name -> (P, fn(generator) -> [N, P])``, all at unit
#: spacing, so a bump of length 1 reaches a few neighbours on every axis.
POINT_SETS = {
    "3-D random, N=64": (3, lambda g: _random_cube(64, 3, g)),
    "3-D random, N=256": (3, lambda g: _random_cube(256, 3, g)),
    "2-D grid 16x16": (2, lambda g: _grid(16)),
}

#: Estimators of a strong Gaussian bump on point sets, as FLTAttention options, and the
#: spectrum that carries the bump (as in FIDELITY_ESTIMATORS).
SPATIAL_ESTIMATORS: dict[str, tuple[dict[str, Any], str]] = {
    "concat (logit, no near set)": ({"coupling": "logit"}, "spectrum"),
    "multiplicative, gaussian f": ({"coupling": "multiplicative"}, "spectrum"),
    "k=8 nearest, mask in f_near": ({"coupling": "logit", "near_neighbors": 8}, "near_spectrum"),
    "k=16 nearest, mask in f_near": ({"coupling": "logit", "near_neighbors": 16}, "near_spectrum"),
    "k=32 nearest, mask in f_near": ({"coupling": "logit", "near_neighbors": 32}, "near_spectrum"),
    "k=16 nearest, mask in f (far)": ({"coupling": "logit", "near_neighbors": 16}, "spectrum"),
    # The multiplicative coupling's far field estimates f (amplitude 1, the bump's length
    # or three times it); the bump is added in f_near on the 16 nearest keys.
    "multiplicative k=16, bump in f_near": ({"coupling": "multiplicative", "near_neighbors": 16}, "near_spectrum"),
    "multiplicative k=16, bump in f_near, f 3x broader": ({"coupling": "multiplicative", "near_neighbors": 16, "far_length": 3.0},
                                                          "near_spectrum"),
    # Deterministic kernel features leave only f to estimate; 256 QMC frequencies (the
    # catalysis preset's form; these rows use their own R whatever the setting's).
    "multiplicative, elu features, 256 QMC": ({"coupling": "multiplicative", "feature_map": "elu", "sampler": "qmc",
                                               "num_frequencies": 256}, "spectrum"),
    "multiplicative, hedgehog features, 256 QMC": ({"coupling": "multiplicative", "feature_map": "hedgehog", "sampler": "qmc",
                                                    "num_frequencies": 256}, "spectrum"),
}


def spatial_fidelity_errors(amplitudes: Sequence[float] = (0.0, 1.0, 2.0, 3.5, 5.0), settings: Sequence[tuple[int, int]] = ((256, 32),),
                            *, point_sets: Sequence[str] | None = None, estimators: Sequence[str] | None = None,
                            length_scale: float = 1.0, dim: int = 128, heads: int = 2,
                            seeds: Sequence[int] = (0, 1)) -> list[SpatialFidelityError]:
    """Relative error of ``FLTAttention.forward`` against ``exact`` for a Gaussian bump
    ``f(Delta) = f(0) exp(-|Delta|^2 / 2 l^2)`` on 2-D and 3-D point sets (default qk-norm,
    random inputs, batch 2 on the same points).

    ``full_mask_error`` compares with the bump on every pair, which a near set holds only
    on its k nearest keys: it adds the truncation of the mask to the estimation error (for
    the concatenation it equals ``rel_error``; None for the multiplicative coupling, whose
    target is another attention)."""
    rows = []
    for set_name in point_sets or POINT_SETS:
        pos_dim, make = POINT_SETS[set_name]
        for label in estimators or SPATIAL_ESTIMATORS:
            options, where = SPATIAL_ESTIMATORS[label]
            options = dict(options)
            far_length = options.pop("far_length", 1.0)
            own_R = options.pop("num_frequencies", None)
            for amplitude in amplitudes:
                for m, R in settings:
                    R = own_R or R
                    errs, full_errs = [], []
                    for seed in seeds:
                        torch.manual_seed(seed)
                        pos = make(torch.Generator().manual_seed(seed))
                        layer = FLTAttention.from_options(dim, heads, pos_dim=pos_dim, spectrum="gaussian", length_scale=length_scale,
                                             num_features=m, num_frequencies=R, **options).double()
                        with torch.no_grad():
                            getattr(layer.core, where).amplitude.fill_(amplitude if options["coupling"] == "logit" else max(amplitude, 1e-3))
                            cast(torch.Tensor, layer.core.spectrum.log_length).add_(math.log(far_length))  # the gaussian spectrum's
                        x = torch.randn(2, pos.shape[0], dim, dtype=F64)
                        with torch.no_grad():
                            out, exact = layer(x, pos), layer.exact(x, pos)
                            errs.append(((out - exact).norm() / exact.norm()).item())
                            if options["coupling"] == "logit":
                                # The near spectrum on every pair when it holds the bump, on none otherwise.
                                near = layer.core.near
                                every = None if near is None or where != "near_spectrum" else Neighbors(pos.shape[0], near.term)
                                layer.core.near = every
                                try:
                                    full = layer.exact(x, pos)
                                finally:
                                    layer.core.near = near
                                full_errs.append(((out - full).norm() / full.norm()).item())
                    full_error = sum(full_errs) / len(full_errs) if full_errs else None
                    rows.append(SpatialFidelityError(set_name, label, amplitude, m, R, sum(errs) / len(errs), full_error))
    return rows


def kernel_scale_errors(D: int = 64, ms: Sequence[int] = (256, 4096), N: int = 256,
                        temperatures: Sequence[float] = (1.0, 2.0, 4.0)) -> list[KernelScaleError]:
    """FAVOR+ error for raw unit-variance q, k (``|x|^2 = sqrt(D)``) and for L2-normalised
    q, k with temperature t (``|x|^2 = t``): why FAVOR+-based layers normalise by default."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, N, D, generator=gen, dtype=F64)
    unit = torch.nn.functional.normalize
    cases = [("raw q/D^(1/4), unit-variance q, k", q / D**0.25, k / D**0.25, math.sqrt(D))]
    cases += [(f"L2-normalised, temperature {t:g}", unit(q, dim=-1) * t**0.5, unit(k, dim=-1) * t**0.5, t) for t in temperatures]
    rows = []
    for m in ms:
        w = gaussian_orthogonal_random_matrix(m, D, generator=gen, dtype=F64)
        for label, xq, xk, sq in cases:
            fq, _ = favor_plus_features(xq, w)
            fk, sk = favor_plus_features(xk, w)
            est = fq @ (fk * torch.exp(sk - sk.max()).unsqueeze(-1)).T
            est = est / est.sum(-1, keepdim=True)
            exact = torch.softmax(xq @ xk.T, dim=-1)
            rows.append(KernelScaleError(label, D, m, sq, ((est - exact).norm() / exact.norm()).item()))
    return rows


def markdown_table(rows: Sequence, columns: Sequence[str] | None = None) -> str:
    """Render dataclass rows as a markdown table."""
    if not rows:
        return "(no rows)"
    data = [asdict(r) for r in rows]
    columns = columns or list(data[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(d[c]) for c in columns) + " |" for d in data]
    return "\n".join(lines)


def mask_error_pivot(rows: list[MaskError]) -> str:
    """One line per (spectrum, sampler, P), one column per R: the max error."""
    Rs = sorted({r.R for r in rows})
    keys = sorted({(r.spectrum, r.sampler, r.pos_dim) for r in rows})
    table = {(r.spectrum, r.sampler, r.pos_dim, r.R): r.max_error for r in rows}
    lines = ["| spectrum | sampler | P | " + " | ".join(f"R={R}" for R in Rs) + " |", "|---|---|---|" + "---|" * len(Rs)]
    for key in keys:
        lines.append("| " + " | ".join(map(str, key)) + " | " + " | ".join(f"{table[(*key, R)]:.3g}" for R in Rs) + " |")
    return "\n".join(lines)


def plot_masks(path: str | os.PathLike, names: Sequence[str] | None = None, R: int = 64, extent: float = 32.0) -> None:
    """Save a PNG with, per spectrum, the exact f of head 0 against its R-frequency estimate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = names or sorted(SPECTRA)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 2.8), squeeze=False)
    delta = offsets(1, extent, 401)
    for ax, name in zip(axes[0], names, strict=True):
        spec = SPECTRA[name](heads=1, pos_dim=1, num_frequencies=R, seed=0).double()
        with torch.no_grad():
            ax.plot(delta[:, 0], spec.mask(delta)[:, 0], label="exact f", lw=2)
            for sampler, style in (("iid", "--"), ("qmc", ":")):
                est = SPECTRA[name](heads=1, pos_dim=1, num_frequencies=R, sampler=sampler, seed=0).double()
                est.load_state_dict({k: v for k, v in spec.state_dict().items() if k != "eps"}, strict=False)
                ax.plot(delta[:, 0], est.estimate(delta)[:, 0], style, label=f"a.c, {sampler}")
        ax.set_title(f"{name} (R={R})")
        ax.set_xlabel("offset")
    axes[0][0].legend(fontsize=7)
    axes[0][0].set_ylabel("f(offset): exact and a.c")
    fig.tight_layout()
    atomic_savefig(fig, os.fspath(path), dpi=110)
    plt.close(fig)
