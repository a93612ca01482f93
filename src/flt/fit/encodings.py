"""Coordinate encodings for the fits: every entry of :data:`flt.POSENC`, plus ``raw`` and
``basic``, with separable (per-axis) and tensor-product variants in ``P >= 2``.

Every encoding maps coordinates ``[B, N, P]`` in ``[0, 1)^P`` to features ``[B, N, D]``:

    raw     x itself (D = P)
    basic   [sin 2 pi x_p, cos 2 pi x_p] per axis (D = 2P)
    NAME    POSENC[NAME](D, P, **options), e.g. shifted_basis (Gaussian, triangle, impulse,
            square, sine or random Fourier features; docs/math.md section 7) or fourier
            (learnable Fourier features, trained with the network)

Axes (``P >= 2``):

    joint    the encoding of the P-d coordinates as the registry defines it (the shifted
             bases embed each axis with D/P centres and concatenate; rff and fourier draw
             frequencies in R^P)
    concat   P independent 1-D encodings of D/P features each, concatenated (separable)
    product  P independent 1-D encodings of D^(1/P) features each, combined by their outer
             product: the full P-d grid of basis functions (D must be a P-th power)
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import cast

import torch
from torch import nn

from flt.posenc import POSENC
from flt.posenc._common import check_abs_positions, compute_dtype


class RawCoordinates(nn.Module):
    """The coordinates themselves: ``[B, N, P] -> [B, N, P]`` (``dim`` must equal ``P``)."""

    def __init__(self, dim: int, pos_dim: int = 1, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if dim != pos_dim:
            raise ValueError(f"the raw encoding has dim = P = {pos_dim}, got dim = {dim}")
        self.dim, self.pos_dim, self.out_dtype = dim, pos_dim, dtype

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        check_abs_positions("pos", pos, self.pos_dim)
        return pos.to(self.out_dtype or pos.dtype)


class BasicEncoding(nn.Module):
    """One period per axis: ``[sin 2 pi x_p, cos 2 pi x_p]_p``, ``[B, N, P] -> [B, N, 2P]``."""

    def __init__(self, dim: int, pos_dim: int = 1, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if dim != 2 * pos_dim:
            raise ValueError(f"the basic encoding has dim = 2P = {2 * pos_dim}, got dim = {dim}")
        self.dim, self.pos_dim, self.out_dtype = dim, pos_dim, dtype

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        check_abs_positions("pos", pos, self.pos_dim)
        angle = 2.0 * math.pi * pos.to(compute_dtype(pos))
        return torch.cat((angle.sin(), angle.cos()), dim=-1).to(self.out_dtype or pos.dtype)


#: Encodings whose size is fixed by P: name -> D for a given P.
FIXED_DIM = {"raw": lambda p: p, "basic": lambda p: 2 * p}
#: Every encoding a fit can use: the registry's and the two coordinate-only ones.
ENCODINGS: dict[str, type[nn.Module]] = {**POSENC, "raw": RawCoordinates, "basic": BasicEncoding}
AXES = ("joint", "concat", "product")


def check_encoding(name: str, options: dict, *, flag: str = "--posenc") -> None:
    """Check the name and options of an encoding; errors name ``flag`` and suggest the
    closest valid name."""
    if name not in ENCODINGS:
        close = difflib.get_close_matches(name, list(ENCODINGS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{flag} must be one of {', '.join(ENCODINGS)}, got {name!r}{hint}")
    if name in FIXED_DIM:
        if options:
            raise ValueError(f"{flag} {name!r} takes no options, got {', '.join(sorted(options))}")
        return
    from flt.options import POSENC_ARGUMENTS, check_posenc_options

    check_posenc_options(name, options, reserved=POSENC_ARGUMENTS)


def default_dim(name: str, pos_dim: int, dim: int | None, axes: str = "joint") -> int:
    """``dim`` for the encoding: fixed by ``P`` (and, for ``axes="product"``, by the
    product of the axes' sizes) for raw and basic, where a different ``dim`` is an error;
    else ``dim`` (256 when None)."""
    if name in FIXED_DIM:
        fixed = FIXED_DIM[name](1) ** pos_dim if axes == "product" else FIXED_DIM[name](pos_dim)
        if dim is not None and dim != fixed:
            raise ValueError(f"--dim: the {name} encoding has {fixed} features for P = {pos_dim}, got {dim}")
        return fixed
    return 256 if dim is None else dim


def _build_one(name: str, dim: int, pos_dim: int, options: dict, seed: int, dtype: torch.dtype | None) -> nn.Module:
    cls = ENCODINGS[name]
    kwargs = dict(options)
    if "generator" in inspect.signature(cls.__init__).parameters:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    # Encodings that draw from the global generator (learnable Fourier features) get the same seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(dim, pos_dim, dtype=dtype, **kwargs)


class AxisEncoding(nn.Module):
    """P independent 1-D encodings of the axes, concatenated or multiplied out.

    Shapes: ``forward(pos [B, N, P]) -> [B, N, dim]``, ``dim = sum`` of the axis sizes
    (``concat``) or their product (``product``).
    """

    def __init__(self, axes: list[nn.Module], combine: str):
        super().__init__()
        if combine not in ("concat", "product"):
            raise ValueError(f"combine must be 'concat' or 'product', got {combine!r}")
        self.axes, self.combine = nn.ModuleList(axes), combine
        self.pos_dim = len(axes)
        sizes = [cast(int, a.dim) for a in axes]  # every encoding declares its width as .dim
        self.dim = sum(sizes) if combine == "concat" else math.prod(sizes)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        check_abs_positions("pos", pos, self.pos_dim)
        parts = [enc(pos[..., p : p + 1]) for p, enc in enumerate(self.axes)]
        if self.combine == "concat":
            return torch.cat(parts, dim=-1)
        out = parts[0]
        for part in parts[1:]:
            out = (out.unsqueeze(-1) * part.unsqueeze(-2)).flatten(-2)
        return out


def build_encoding(name: str, dim: int, pos_dim: int, options: dict, *, axes: str = "joint", seed: int = 0, dtype: torch.dtype | None = None) -> nn.Module:
    """The encoding ``name`` with ``dim`` features in total for ``P = pos_dim``.

    ``axes`` (see the module docstring) must be ``joint`` when ``P = 1``. Random draws
    (rff frequencies, learnable Fourier initialisation) come from ``seed`` (axis ``p`` of a
    separable encoding from ``seed + p``), never from the caller's global generator.
    """
    check_encoding(name, options)
    if axes not in AXES:
        raise ValueError(f"--axes must be one of {', '.join(AXES)}, got {axes!r}")
    if axes == "joint" or pos_dim == 1:
        return _build_one(name, dim, pos_dim, options, seed, dtype)
    if name in FIXED_DIM:
        if FIXED_DIM[name](1) == 1 and axes == "product":
            raise ValueError(f"--axes product of the {name} encoding is the single feature x_1 x_2 ...; use joint or concat")
        per_axis = FIXED_DIM[name](1)
    elif axes == "concat":
        if dim % pos_dim:
            raise ValueError(f"--dim = {dim} must be divisible by P = {pos_dim} for --axes concat")
        per_axis = dim // pos_dim
    else:
        per_axis = round(dim ** (1.0 / pos_dim))
        if per_axis**pos_dim != dim:
            raise ValueError(f"--dim = {dim} must be a {pos_dim}-th power for --axes product (e.g. {per_axis**pos_dim})")
    return AxisEncoding([_build_one(name, per_axis, 1, options, seed + p, dtype) for p in range(pos_dim)], axes)


def axis_encoding(encoder: nn.Module, name: str, options: dict, *, seed: int = 0, dtype: torch.dtype | None = None) -> nn.Module:
    """A 1-D encoding whose diagnostics stand for ``encoder``'s: itself when ``P = 1``, its
    first axis when separable, else the same encoding built for ``P = 1`` with ``dim / P``
    features (for the shifted bases exactly the per-axis embedding)."""
    if isinstance(encoder, AxisEncoding):
        return encoder.axes[0]
    pos_dim = cast(int, encoder.pos_dim)  # declared by every encoding, as .dim
    if pos_dim == 1:
        return encoder
    if name in FIXED_DIM:
        return _build_one(name, FIXED_DIM[name](1), 1, options, seed, dtype)
    return _build_one(name, max(cast(int, encoder.dim) // pos_dim, 2), 1, options, seed, dtype)
