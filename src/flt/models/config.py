"""Model configurations: frozen dataclasses, one per task.

A config never reaches into a module: :func:`flt.models.build_model` turns it into the
constructor arguments of the model class registered for its task. Fields that depend on
the data (vocabulary size, number of classes, target statistics) are filled in by the
training task with :func:`dataclasses.replace` before the model is built, so a saved
config rebuilds the same model.

Every config names its attention mechanism (a key of :data:`flt.ATTENTION`) and its
absolute positional encoding (a key of :data:`flt.posenc.POSENC`), with free-form option
dicts forwarded to their constructors. A config does not know which task trains it: the
tasks name their configs (:attr:`flt.tasks.Task.config`), and their saved form with the
task's key is :func:`flt.tasks.config_to_dict`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from flt._checks import check_choice, check_positive_int
from flt.options import check_fields

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

READOUTS = ("mean", "sum")
POOLINGS = ("mean", "cls")


def _check_trunk(cfg: TrunkConfig) -> None:
    """Checks shared by every config: every field's type (a bool is not a number), sizes,
    options as dicts, names as strings."""
    check_fields(cfg)
    for name in ("dim", "depth", "heads"):
        check_positive_int(name, getattr(cfg, name))
    if cfg.dim % cfg.heads:
        raise ValueError(f"dim ({cfg.dim}) must be divisible by heads ({cfg.heads})")
    if isinstance(cfg.mlp_ratio, bool) or not isinstance(cfg.mlp_ratio, (int, float)) or not 0 < cfg.mlp_ratio < math.inf:
        raise ValueError(f"mlp_ratio must be a positive finite number, got {cfg.mlp_ratio!r}")
    if isinstance(cfg.dropout, bool) or not isinstance(cfg.dropout, (int, float)) or not 0 <= cfg.dropout < 1:
        raise ValueError(f"dropout must lie in [0, 1), got {cfg.dropout!r}")
    for name in ("attention", "posenc"):
        if not isinstance(getattr(cfg, name), str):
            raise TypeError(f"{name} must be a registry name (str), got {getattr(cfg, name)!r}")
    for name in ("attention_options", "posenc_options"):
        if not isinstance(getattr(cfg, name), dict):
            raise TypeError(f"{name} must be a dict of keyword arguments, got {type(getattr(cfg, name)).__name__}")


@dataclass(frozen=True)
class TrunkConfig:
    """The fields every model config shares: the Transformer trunk (width, depth, heads,
    MLP ratio, dropout) and its mechanisms, an attention of :data:`flt.ATTENTION` and an
    absolute encoding of :data:`flt.posenc.POSENC` with their option dicts. A task's config
    subclasses it, adds its own fields and may redeclare a default (``dim``, ...)."""

    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 2.0
    dropout: float = 0.0
    attention: str = "flt"
    attention_options: dict[str, Any] = field(default_factory=dict)
    posenc: str = "none"
    posenc_options: dict[str, Any] = field(default_factory=dict)
    #: Coordinates per position the model gives its attention (``P``), for the memory
    #: estimate made before a model is built (:mod:`flt._limits`).
    position_dims: ClassVar[int] = 1

    def __post_init__(self) -> None:
        _check_trunk(self)

    @classmethod
    def saved_fields(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """The fields of a config saved by an earlier version, as this version spells the
        same model (:func:`config_from_fields` applies it). Default: unchanged."""
        return fields


def check_layer_attention(value: object, depth: int) -> None:
    """``layer_attention``: None, or one ``{"attention": NAME, "attention_options": {...}}``
    per layer (``depth`` of them), the per-layer mechanisms ``flt train --arch`` builds."""
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or len(value) != depth:
        raise ValueError(f"layer_attention must list one mechanism per layer ({depth}), got {value!r}")
    for i, entry in enumerate(value):
        if (not isinstance(entry, dict) or set(entry) != {"attention", "attention_options"}
                or not isinstance(entry["attention"], str) or not isinstance(entry["attention_options"], dict)):
            raise ValueError(f"layer_attention[{i}] must be {{'attention': NAME, 'attention_options': {{...}}}}, got {entry!r}")


#: A dataclass's own type, so that a replaced LMConfig (or RunConfig) is one too.
_Config = TypeVar("_Config", bound="DataclassInstance")


@dataclass(frozen=True)
class LayeredConfig(TrunkConfig):
    """A trunk whose layers may each have their own mechanism: ``layer_attention`` (None:
    every layer is ``attention`` with ``attention_options``) lists one
    ``{"attention": NAME, "attention_options": {...}}`` per layer and then replaces
    ``attention`` and ``attention_options`` in every layer (``flt search`` selects it,
    ``flt train --arch`` trains it)."""

    layer_attention: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_attention(self.layer_attention, self.depth)


@dataclass(frozen=True)
class LMConfig(LayeredConfig):
    """Causal language model (pre-norm Transformer, tied input/output embeddings).

    Positions are token indices ``0 .. T-1`` (``P = 1``). ``max_len`` is the context the
    model is trained on and the window of recompute-based generation; recurrent
    generation (:meth:`flt.models.CausalLM.generate` with linear mechanisms) is not
    limited by it. ``cape`` augments the token positions during training (global shift
    and half-step local jitter, no mean-centring so that decoding sees the same positions).
    """

    vocab_size: int = 256
    max_len: int = 256
    dim: int = 128
    mlp_ratio: float = 4.0
    cape: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("vocab_size", self.vocab_size)
        check_positive_int("max_len", self.max_len)


@dataclass(frozen=True)
class ImageConfig(LayeredConfig):
    """ViT-style classifier: square patches with 2-D patch-centre positions on ``[-1, 1]^2``.

    ``pooling`` is ``"mean"`` (over patch tokens) or ``"cls"`` (a learned class token,
    placed at the image centre ``(0, 0)`` for relative mechanisms). ``cape`` applies
    :meth:`flt.posenc.CAPE.for_2d_patches` to the patch positions during training.
    """

    position_dims: ClassVar[int] = 2

    image_size: int = 8
    channels: int = 1
    num_classes: int = 10
    patch_size: int = 2
    pooling: str = "mean"
    cape: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("image_size", "channels", "num_classes", "patch_size"):
            check_positive_int(name, getattr(self, name))
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})")
        check_choice("pooling", self.pooling, POOLINGS)


@dataclass(frozen=True)
class MoleculeConfig(LayeredConfig):
    """Property regressor over atoms: element embeddings, 3-D coordinates as positions.

    Coordinates are centred on each structure's mean atom position (so the model is
    translation invariant whatever the encoding). ``readout`` pools atoms by ``"mean"``
    or ``"sum"``. ``isotropic`` ties the per-axis length scales of radial spectra
    (``gaussian``, ``matern``; ``gaussian_mixture`` with its means held at 0) so ``f``
    stays a function of ``|Delta|`` while it learns; with any other spectrum it raises. Predictions are ``target_mean + target_std * out``.
    """

    position_dims: ClassVar[int] = 3

    num_elements: int = 119
    depth: int = 3
    readout: str = "mean"
    isotropic: bool = True
    target_mean: float = 0.0
    target_std: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("num_elements", self.num_elements)
        check_choice("readout", self.readout, READOUTS)
        if not isinstance(self.isotropic, bool):
            raise TypeError(f"isotropic must be a bool, got {self.isotropic!r}")
        if not (isinstance(self.target_std, (int, float)) and math.isfinite(self.target_std) and self.target_std > 0):
            raise ValueError(f"target_std must be a positive finite number, got {self.target_std!r}")
        if not (isinstance(self.target_mean, (int, float)) and math.isfinite(self.target_mean)):
            raise ValueError(f"target_mean must be a finite number, got {self.target_mean!r}")


_Trunk = TypeVar("_Trunk", bound=TrunkConfig)


def config_from_fields(cls: type[_Trunk], fields: dict[str, Any]) -> _Trunk:
    """A ``cls`` config from its fields (:func:`dataclasses.asdict`'s inverse); unknown
    fields raise ``ValueError`` naming them; a config saved by an earlier version is read
    as this version spells the same model (:meth:`TrunkConfig.saved_fields`)."""
    upgrade = getattr(cls, "saved_fields", None)  # a task's own config need not subclass TrunkConfig
    if upgrade is not None:
        fields = upgrade(fields)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; known fields: {sorted(names)}")
    return cls(**fields)


def replace_fields(cfg: _Config, **changes: Any) -> _Config:
    """:func:`dataclasses.replace` with a clear error naming unknown fields."""
    names = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ValueError(f"unknown {type(cfg).__name__} fields {unknown}; known fields: {sorted(names)}")
    return dataclasses.replace(cfg, **changes)
