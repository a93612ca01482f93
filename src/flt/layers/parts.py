"""The parts an attention layer is built from: kernel features, relative terms and settings.

:class:`flt.layers.flt.FLTAttention` is its projections plus a core (``layer.core``, a
:class:`flt.layers.flt.FLTCore`) made of these parts::

    FLTAttention(64, 4, features=FavorPlus(num_features=128, seed=0),
                 relative=Term("local", num_frequencies=16, seed=1),
                 near=Band(16, term="clipped"), settings=Settings(chunk_size=64))

Each part is a small frozen value with its own options, checked when it is made (types
from its annotations, ranges by its own checks); the rules about combining parts are in
:mod:`flt.layers.rules`. The near sets, :class:`flt.layers.near.Band` and
:class:`flt.layers.near.Neighbors`, are parts too. ``FLTAttention.from_options`` turns the
flat option names of presets and the command line (``num_features``, ``near_field``, ...)
into these parts. The core keeps them (``layer.core.kernel``, ``layer.core.near``,
``layer.core.settings``) with the modules they build (``layer.core.spectrum``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from flt._checks import check_positive_int, shown
from flt._signatures import check_fields
from flt.layers.features import FeatureMap

#: How FLT combines its relative term with the kernel: added to the logits, or multiplying
#: the kernel's weights (softmax's spectrum term takes the same two).
COUPLINGS = ("logit", "multiplicative")

if TYPE_CHECKING:
    import torch

    from flt.relative.base import RelativeTerm


class Term:
    """A relative term of :data:`flt.relative.RELATIVE` by name and options, built when
    the layer that holds it is (on the layer's device, for its heads and positions).

    ``Term("local", num_frequencies=16, seed=1)``; a layer also takes the term itself, a
    :class:`flt.relative.RelativeTerm` module built beforehand.
    """

    def __init__(self, name: str, **options: Any) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Term: name must be a string (a key of flt.relative.RELATIVE), got {shown(name)} ({type(name).__name__})")
        self.name, self.options = name, dict(options)

    def with_defaults(self, **defaults: Any) -> Term:
        """This term with ``defaults`` for the options it does not set."""
        return Term(self.name, **{**defaults, **self.options})

    def build(self, *, heads: int, pos_dim: int, causal: bool = False, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> RelativeTerm:
        """The :class:`flt.relative.RelativeTerm` module (:func:`flt.relative.build_relative`)."""
        from flt.relative import build_relative

        return build_relative(self.name, heads=heads, pos_dim=pos_dim, causal=causal, device=device, dtype=dtype, **self.options)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Term) and (self.name, self.options) == (other.name, other.options)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"Term({self.name!r}{args})"


# -- kernel features ---------------------------------------------------------------------


@dataclass(frozen=True)
class Features:
    """Kernel features ``phi`` with ``phi(x).phi(y)`` estimating a kernel of the scaled
    queries and keys (:class:`flt.layers.features.FeatureMap` is the module they build).

    Every kind takes ``qk_norm`` (L2-normalise queries and keys, with a learned temperature
    starting at ``temperature``; on by default for FAVOR+, whose variance grows
    exponentially with ``|q|^2``) and ``seed`` (seeds the map's draws, and the layer's own
    redraw schedule; ``None``: torch's global generator).
    """

    kind: ClassVar[str]
    #: The map has weights of its own (``[m/2, D]`` for ``hedgehog``): the FLOP model of
    #: :mod:`flt.layers.registry` counts it as two products instead of a fixed projection.
    learned: ClassVar[bool] = False
    qk_norm: bool = False
    temperature: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.temperature > 0:
            raise ValueError(f"{type(self).__name__}: temperature must be positive, got {shown(self.temperature)}")
        if "num_features" in {f.name for f in fields(self)}:
            check_positive_int("num_features", getattr(self, "num_features", None))  # the kinds with the field

    def map_options(self) -> dict:
        """The options of the feature map these features build (:meth:`build`): its kind,
        size, draws and seed, and the scaling's ``qk_norm`` and ``temperature``."""
        return {"feature_map": self.kind, "num_features": getattr(self, "num_features", 256),
                "orthogonal": getattr(self, "orthogonal", True), "seed": self.seed,
                "qk_norm": self.qk_norm, "temperature": self.temperature}

    def build(self, dim: int, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> FeatureMap:
        """The feature map for inputs of size ``dim``."""
        o = self.map_options()
        return FeatureMap(dim, o["num_features"], kind=self.kind, orthogonal=o["orthogonal"], seed=self.seed,
                          device=device, dtype=dtype)


@dataclass(frozen=True)
class FavorPlus(Features):
    """FAVOR+ positive random features (Performer): an unbiased estimate of ``exp(x.y)``;
    ``num_features`` random projections, orthogonal blocks by default."""

    kind: ClassVar[str] = "favor+"
    qk_norm: bool = True
    num_features: int = 256
    orthogonal: bool = True


@dataclass(frozen=True)
class ReLUFeatures(Features):
    """ReLU random features, estimating the arc-cosine kernel."""

    kind: ClassVar[str] = "relu"
    num_features: int = 256
    orthogonal: bool = True


@dataclass(frozen=True)
class EluFeatures(Features):
    """``elu(x) + 1``, deterministic, ``m = D`` (linear transformers)."""

    kind: ClassVar[str] = "elu"


@dataclass(frozen=True)
class TaylorFeatures(Features):
    """The second-order Taylor expansion of ``exp(x.y)``, deterministic, ``m = 1 + D + D(D+1)/2``."""

    kind: ClassVar[str] = "taylor"


@dataclass(frozen=True)
class Hedgehog(Features):
    """``[softmax(W x), softmax(-W x)]`` with a learned ``W [m/2, D]`` (``num_features = m``, even)."""

    kind: ClassVar[str] = "hedgehog"
    learned: ClassVar[bool] = True
    num_features: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_features % 2:
            raise ValueError(f"num_features must be even for feature_map='hedgehog' (two softmax halves), got {self.num_features}")


#: Every kind of kernel features, by the name ``feature_map`` takes.
FEATURES: dict[str, type[Features]] = {cls.kind: cls for cls in (FavorPlus, ReLUFeatures, EluFeatures, TaylorFeatures, Hedgehog)}


def features_from(kind: str, *, num_features: int = 256, orthogonal: bool = True, seed: int | None = None,
                  qk_norm: bool | None = None, temperature: float = 1.0) -> Features:
    """The features part of the flat options (``feature_map="relu"``, ``num_features``, ...):
    the options a kind does not take are dropped (``num_features`` of ``"elu"``), and
    ``qk_norm=None`` is the kind's default."""
    from flt._checks import check_choice

    check_choice("feature_map", kind, FEATURES)
    cls = FEATURES[kind]
    given: dict[str, Any] = {"num_features": num_features, "orthogonal": orthogonal, "seed": seed, "temperature": temperature}
    if qk_norm is not None:
        given["qk_norm"] = qk_norm
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in given.items() if k in names})


# -- settings ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """How a kernel layer runs, apart from what it computes.

    Args:
        rope, rope_base: also rotate queries and keys by RoPE at the same positions.
        chunk_size: block size of the chunked computations (None: chosen from the shapes).
        backend: ``"torch"``, ``"triton"`` or ``"triton-split"`` (:data:`flt.layers.kernel.KERNEL_BACKENDS`).
        redraw_interval: redraw the layer's draws every this many training forward calls
            (None: never; ``flt train`` redraws by ``RunConfig.redraw_interval`` instead).
        check_condition: warn when rounding can change the multiplicative coupling's
            outputs (:meth:`flt.layers.flt.FLTCore.check_conditioning`).
    """

    rope: bool = False
    rope_base: float = 10000.0
    chunk_size: int | None = None
    backend: str = "torch"
    redraw_interval: int | None = None
    check_condition: bool = True

    def __post_init__(self) -> None:
        check_fields(self)


def check_kernel_parts(features: Any, settings: Any) -> None:
    """``features`` is a :class:`Features` and ``settings`` a :class:`Settings` (``TypeError``
    naming the argument otherwise; their own values were checked when they were made)."""
    for name, value, kind, what in (("features", features, Features, "a flt.layers.parts.Features (e.g. FavorPlus())"),
                                    ("settings", settings, Settings, "a flt.layers.parts.Settings")):
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be {what}, got {shown(value)} ({type(value).__name__})")


def kernel_parts(*, feature_map: str = "favor+", num_features: int = 256, orthogonal: bool = True, seed: int | None = None,
                 qk_norm: bool | None = None, temperature: float = 1.0, rope: bool = False, rope_base: float = 10000.0,
                 chunk_size: int | None = None, backend: str = "torch", redraw_interval: int | None = None,
                 check_condition: bool = True) -> tuple[Features, Settings]:
    """The features and settings parts of a kernel layer's flat options (what the
    flat builders of FLT, Performer and Toeplitz share, :mod:`flt.layers.flat`)."""
    features = features_from(feature_map, num_features=num_features, orthogonal=orthogonal, seed=seed,
                             qk_norm=qk_norm, temperature=temperature)
    settings = Settings(rope=rope, rope_base=rope_base, chunk_size=chunk_size, backend=backend,
                        redraw_interval=redraw_interval, check_condition=check_condition)
    return features, settings
