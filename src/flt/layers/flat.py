"""The flat options of presets and the command line, turned into each layer's parts.

One function per mechanism, from the flat vocabulary (``num_features``, ``near_field``,
``relative_bias``, ``max_distance``, ...) to the keyword arguments of its layer's
constructor (``features``, ``settings``, ``relative``, ``near``, ``relative_options``):
the signature of each function is the list of the mechanism's options that
:func:`flt._signatures.check_options` checks names and types against, and its body the one
place that knows how those names become parts. A layer names its function as
``flat_builder`` (:meth:`flt.layers.base.AttentionBase.from_options` calls it); a layer
without one takes its constructor's keywords as its options.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from flt._checks import check_choice, check_nonnegative_int, check_positive_float
from flt.layers.near import Band, Neighbors
from flt.layers.parts import COUPLINGS, Term, kernel_parts
from flt.layers.rules import Facts, check_rules
from flt.ops.softmax import BACKENDS
from flt.ops.toeplitz import DEFAULT_BLOCK_SIZE, DEFAULT_DENSE_BELOW
from flt.relative.base import RelativeTerm
from flt.relative.spectra import SPECTRA, Spectrum
from flt.relative.tables import DEFAULT_TABLE_SCALE

__all__ = ["flt", "performer", "softmax", "toeplitz"]


def performer(dim: int, heads: int, *, pos_dim: int = 1, causal: bool = False, num_features: int = 256,
              feature_map: str = "favor+", qk_norm: bool | None = None, temperature: float = 1.0, orthogonal: bool = True,
              redraw_interval: int | None = None, seed: int | None = None, rope: bool = False, rope_base: float = 10000.0,
              chunk_size: int | None = None, backend: str = "torch", device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> dict[str, Any]:
    """:class:`flt.layers.performer.PerformerAttention`'s arguments: ``num_features``,
    ``feature_map``, ``qk_norm``, ``temperature``, ``orthogonal``, ``seed`` make the features
    part; ``rope``, ``rope_base``, ``chunk_size``, ``backend``, ``redraw_interval`` the settings."""
    features, settings = kernel_parts(feature_map=feature_map, num_features=num_features, orthogonal=orthogonal, seed=seed,
                                      qk_norm=qk_norm, temperature=temperature, rope=rope, rope_base=rope_base,
                                      chunk_size=chunk_size, backend=backend, redraw_interval=redraw_interval)
    return {"dim": dim, "heads": heads, "pos_dim": pos_dim, "causal": causal, "features": features, "settings": settings,
            "device": device, "dtype": dtype}


def toeplitz(dim: int, heads: int, *, pos_dim: int = 1, causal: bool = False, max_distance: int = 512,
             table_scale: float = DEFAULT_TABLE_SCALE, learn_table_scale: bool = True, fft_dtype: torch.dtype | None = None,
             block_size: int = DEFAULT_BLOCK_SIZE, dense_below: int = DEFAULT_DENSE_BELOW, num_features: int = 256,
             feature_map: str = "favor+", qk_norm: bool | None = None, temperature: float = 1.0, orthogonal: bool = True,
             redraw_interval: int | None = None, seed: int | None = None, rope: bool = False, rope_base: float = 10000.0,
             chunk_size: int | None = None, backend: str = "torch", device: torch.device | str | None = None,
             dtype: torch.dtype | None = None) -> dict[str, Any]:
    """:class:`flt.layers.toeplitz.ToeplitzAttention`'s arguments: the feature and settings
    options as :func:`performer`, the table's and the FFT's as the constructor."""
    parts = performer(dim, heads, pos_dim=pos_dim, causal=causal, num_features=num_features, feature_map=feature_map,
                      qk_norm=qk_norm, temperature=temperature, orthogonal=orthogonal, redraw_interval=redraw_interval,
                      seed=seed, rope=rope, rope_base=rope_base, chunk_size=chunk_size, backend=backend, device=device,
                      dtype=dtype)
    return {**parts, "max_distance": max_distance, "table_scale": table_scale, "learn_table_scale": learn_table_scale,
            "fft_dtype": fft_dtype, "block_size": block_size, "dense_below": dense_below}


def flt(
    dim: int,
    heads: int,
    *,
    pos_dim: int = 1,
    spectrum: str = "gaussian_mixture",
    coupling: str = "logit",
    num_features: int = 256,
    num_frequencies: int = 32,
    causal: bool = False,
    feature_map: str = "favor+",
    qk_norm: bool | None = None,
    temperature: float = 1.0,
    orthogonal: bool = True,
    redraw_interval: int | None = None,
    seed: int | None = None,
    spectrum_seed: int | None = None,
    rope: bool = False,
    rope_base: float = 10000.0,
    chunk_size: int | None = None,
    near_field: int = 0,
    near_neighbors: int = 0,
    near_relative: str | None = None,
    near_relative_options: dict | None = None,
    far_field: bool | Literal["near", "constant", "positive"] = True,
    check_condition: bool = True,
    backend: str = "torch",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **spectrum_options: Any,
) -> dict[str, Any]:
    """:class:`flt.layers.flt.FLTAttention`'s arguments: ``num_features``, ``feature_map``,
    ``orthogonal``, ``seed`` (the feature map's), ``qk_norm``, ``temperature`` make the
    features part; ``spectrum``, ``num_frequencies``, ``spectrum_seed`` (the spectrum's own
    ``seed``) and ``**spectrum_options`` the far term; ``near_field`` (``w >= 1``: a band; 0
    off) or ``near_neighbors`` (``k >= 1``: the nearest keys; 0 off), with ``near_relative``
    and ``near_relative_options`` as its term, the near set; ``rope``, ``rope_base``,
    ``chunk_size``, ``backend``, ``redraw_interval``, ``check_condition`` the settings."""
    check_choice("coupling", coupling, COUPLINGS)
    check_choice("spectrum", spectrum, SPECTRA)
    check_nonnegative_int("near_field", near_field, "the band half-width w in tokens; 0 = off")
    check_nonnegative_int("near_neighbors", near_neighbors, "k nearest keys in position space; 0 = off")
    # The rules that only flat options can break (two near sets, a term without a set).
    check_rules(Facts(features=feature_map, coupling=coupling, near_field=near_field, near_neighbors=near_neighbors,
                      near_term=near_relative, near_term_options=near_relative_options is not None,
                      far_field=far_field, causal=causal, backend=backend, spectrum_term=True))
    features, settings = kernel_parts(feature_map=feature_map, num_features=num_features, orthogonal=orthogonal, seed=seed,
                                      qk_norm=qk_norm, temperature=temperature, rope=rope, rope_base=rope_base,
                                      chunk_size=chunk_size, backend=backend, redraw_interval=redraw_interval,
                                      check_condition=check_condition)
    if spectrum_seed is not None:
        spectrum_options["seed"] = spectrum_seed
    relative = Term(spectrum, num_frequencies=num_frequencies, **spectrum_options)
    term = None if near_relative is None else Term(near_relative, **(near_relative_options or {}))
    near = Band(near_field, term) if near_field else Neighbors(near_neighbors, term) if near_neighbors else None
    return {"dim": dim, "heads": heads, "pos_dim": pos_dim, "causal": causal, "relative": relative, "features": features,
            "near": near, "coupling": coupling, "far_field": far_field, "settings": settings, "device": device, "dtype": dtype}


def softmax(
    dim: int,
    heads: int,
    *,
    pos_dim: int = 1,
    causal: bool = False,
    relative_bias: str | RelativeTerm | None = None,
    max_distance: int = 128,
    num_buckets: int | None = None,
    table_scale: float = DEFAULT_TABLE_SCALE,
    learn_table_scale: bool = True,
    alibi_unit: float = 1.0,
    alibi_learnable: bool = False,
    spectrum: str = "gaussian_mixture",
    coupling: str = "logit",
    num_frequencies: int = 32,
    relative_options: dict | None = None,
    rope: bool = False,
    rope_base: float = 10000.0,
    backend: str = "sdpa",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **spectrum_options: Any,
) -> dict[str, Any]:
    """:class:`flt.layers.softmax.SoftmaxAttention`'s arguments: the options of the built-in
    terms become ``relative_options`` (``max_distance``, ``num_buckets``, ``table_scale``,
    ``learn_table_scale`` for the tables, ``alibi_unit``, ``alibi_learnable`` for ALiBi,
    ``spectrum``, ``num_frequencies`` and ``**spectrum_options`` for
    ``relative_bias="spectrum"``). Options of the other terms are accepted and unused, so a
    preset's options survive an override of ``relative_bias``."""
    from flt.relative import RELATIVE

    if not isinstance(relative_bias, RelativeTerm):
        check_choice("relative_bias", relative_bias, (None, "spectrum", *(n for n in RELATIVE if n not in SPECTRA)))
    check_choice("backend", backend, BACKENDS)
    check_choice("coupling", coupling, COUPLINGS)
    is_spectrum = relative_bias == "spectrum" or isinstance(relative_bias, Spectrum)
    check_rules(Facts(coupling=coupling, relative=relative_bias, spectrum_term=is_spectrum, pos_dim=pos_dim,
                      spectrum_options=tuple(spectrum_options), flat_relative_options=relative_options is not None))
    check_positive_float("alibi_unit", alibi_unit)
    if not isinstance(alibi_learnable, bool):
        raise TypeError(f"alibi_learnable must be a bool, got {type(alibi_learnable).__name__}")
    options = relative_options
    if relative_bias in ("t5", "clipped"):
        options = {"max_distance": max_distance, "table_scale": table_scale, "learn_scale": learn_table_scale}
        if relative_bias == "t5":
            options["num_buckets"] = num_buckets
    elif relative_bias == "alibi":
        options = {"unit": alibi_unit, "learnable": alibi_learnable}
    elif relative_bias == "spectrum":
        options = {"spectrum": spectrum, "num_frequencies": num_frequencies, **spectrum_options}
    return {"dim": dim, "heads": heads, "pos_dim": pos_dim, "causal": causal, "relative_bias": relative_bias,
            "relative_options": options, "coupling": coupling, "rope": rope, "rope_base": rope_base, "backend": backend,
            "device": device, "dtype": dtype}
