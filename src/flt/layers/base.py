"""What every attention layer shares: projections, argument checks, positions, q/k scaling.

All layers take ``x [B, N, dim]``, positions ``pos [B, N, P]`` (or ``[N, P]``; token indices
by default when ``P = 1``) and ``key_padding_mask [B, N]`` (bool, True marks a padded key
that no query may attend to, the convention of ``torch.nn.MultiheadAttention``).

Options enter a layer in one of two ways. :meth:`AttentionBase.from_options` takes the
flat options of presets and the command line (``near_field=16``): it checks them once,
against the signature that lists them (:func:`flt._signatures.check_options`; for
``**spectrum_options`` the spectrum's too), so a misspelt option or a value of the wrong
type is reported by name, and refuses sizes too large for memory before anything is
allocated; then it builds the layer. A model builds its layers with
:meth:`AttentionBase.from_checked_options`, from options checked once where they entered
(:func:`flt.models.build_attention`, which takes :class:`flt.options.CheckedOptions` as
checked), not once per layer. Each class states its own memory estimate
(:meth:`AttentionBase.parameter_values`, :meth:`AttentionBase.forward_values`), which
:func:`check_attention_memory` compares with the limit of :mod:`flt._limits`. A constructor called directly
checks its own arguments (its parts check theirs, :mod:`flt.layers.rules` their combinations).
:meth:`AttentionBase.prepare` checks the input of every forward call: rank, feature size,
at least one token, and the dtype and device of the layer's parameters (metadata only: no
host synchronisation).

A layer is its projections plus a core: ``to_qkv`` and ``to_out`` here, and ``layer.core``, a
:class:`CoreBase` that holds every learned part of the mechanism (spectrum, feature map, tables,
q/k scaling, near set, redraw schedule) and computes on queries, keys and values ``[B, H, N,
D]``. A layer class names its core's class (``core_class``) and writes no constructor: the
one here builds the projections and then the core from the layer's keywords, so a
mechanism's parts are written once, in its core's signature (which ``inspect.signature`` of
the layer class and the option checks read). The layer's ``forward``, ``reference``, ``exact``, ``prefill`` and ``step`` check ``x``,
project, call the core's method of the same name and project out;
:class:`flt.functional.AttentionCore` runs a core on the caller's own projections. The parts
a user reads are attributes of each layer class (:class:`OfCore`: ``layer.spectrum`` is
``layer.core.spectrum``);
everything else is read on ``layer.core``. State dicts keep the core's tensors under ``core.``
(``attn.core.spectrum.mu``); a file saved before cores existed (``attn.spectrum.mu``) is
upgraded where it is loaded (:mod:`flt.layers.upgrade`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar, overload

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from flt._checks import (
    check_dim,
    check_positions,
    check_positive_int,
    check_tensor,
    compiling,
    shown,
)
from flt._dtype import compute_dtype
from flt._limits import FLOAT_BYTES, check_memory
from flt._signatures import check_options, constructor_options

#: Arguments of every :data:`flt.ATTENTION` constructor that the caller (the model) sets:
#: not options.
ATTENTION_ARGUMENTS = ("dim", "heads", "pos_dim", "causal", "device", "dtype")

#: ``layer.double()`` etc.: how to cast a layer to a dtype, for the dtype error.
_CASTS = {torch.float64: "double", torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat16"}


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()


@overload
def batch_shared(pos: torch.Tensor) -> torch.Tensor: ...
@overload
def batch_shared(pos: None) -> None: ...
def batch_shared(pos: torch.Tensor | None) -> torch.Tensor | None:
    """``pos [B, N, P]`` as ``[1, N, P]`` when every sequence of the batch has the same
    positions (token indices, patch grids) and they need no gradient, so that a term of
    positions alone is computed once, not ``B`` times; otherwise ``pos`` unchanged. Under
    ``torch.compile`` (where comparing the rows would break the graph) ``pos`` unchanged."""
    if (
        pos is not None and pos.shape[0] > 1 and not pos.requires_grad and not compiling()
        and (pos.stride(0) == 0 or torch.equal(pos, pos[:1].expand_as(pos)))
    ):
        return pos[:1]
    return pos


def regular_step(pos: torch.Tensor | None) -> torch.Tensor | None:
    """The spacing ``s`` (a 0-d tensor) when ``pos [1, N, 1]`` is ``p_0 + s * n`` with
    every consecutive difference exactly equal (token indices), so that a term of the
    offsets between nearby tokens is the same for every query and can be computed once;
    otherwise None. None as well when ``pos`` needs a gradient, and under
    ``torch.compile`` (where comparing the differences would break the graph)."""
    if pos is None or pos.ndim != 3 or pos.shape[0] != 1 or pos.shape[2] != 1 or pos.shape[1] < 2:
        return None
    if pos.requires_grad or compiling():
        return None
    d = pos[0, 1:, 0] - pos[0, :-1, 0]
    return d[0] if torch.equal(d, d[:1].expand_as(d)) else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Prepared:
    """Projected inputs of one forward call."""

    q: torch.Tensor  # [B, H, N, D]
    k: torch.Tensor  # [B, H, N, D]
    v: torch.Tensor  # [B, H, N, D]
    pos: torch.Tensor  # [B or 1, N, P]
    pad: torch.Tensor | None  # [B, N] bool, True = padded key


#: Values per head and pair of tokens that an O(N^2) path forms (:meth:`CoreBase.pairwise_values`).
PAIR_VALUES_PER_HEAD = 4


def token_positions(length: int, like: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Token indices ``offset .. offset + length - 1`` as positions ``[1, length, 1]`` in the
    compute dtype of ``like``: the default positions when ``P = 1``."""
    idx = torch.arange(offset, offset + length, device=like.device, dtype=compute_dtype(like))
    return idx.view(1, length, 1)


class CoreBase(nn.Module):
    """A mechanism without projections: its learned parts, computing on queries, keys and values.

    Every method takes ``q [B, H, N, D]``, ``k [B, H, N, D]``, ``v [B, H, N, Dv]``, checked
    positions ``pos [B|1, N, P]`` (floating) and ``pad [B, N]`` (bool, True marks a padded key,
    or None) and returns ``[B, H, N, Dv]``: :meth:`forward` (the estimator), :meth:`reference`
    (the same computation by its ``O(N^2)`` formula), :meth:`exact` (what it estimates), and,
    for causal cores of mechanisms that decode, :meth:`prefill` and :meth:`step` with their
    decoding state. The layer (:class:`AttentionBase`) or :class:`flt.functional.AttentionCore`
    checks the inputs; a core trusts them.
    """

    #: Causal cores of this mechanism decode token by token (:meth:`step`, :meth:`prefill`).
    supports_decoding: bool = False

    def __init__(self, heads: int, head_dim: int, *, pos_dim: int = 1, causal: bool = False) -> None:
        super().__init__()
        check_positive_int("heads", heads)
        check_positive_int("head_dim", head_dim)
        check_positive_int("pos_dim", pos_dim)
        self.heads, self.head_dim, self.pos_dim, self.causal = heads, head_dim, pos_dim, bool(causal)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                  pad: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def exact(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              pad: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                pad: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """``(out [B, H, N, Dv], state)``: the causal attention of a prompt and the state
        :meth:`step` continues from."""
        raise ValueError(f"{type(self).__name__} does not decode: it has no prefill()")

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any, pos: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """One token (``q, k [B, H, 1, D]``, ``v [B, H, 1, Dv]``, ``pos [B|1, 1, P]``) from
        ``state`` (None to start): ``(out [B, H, 1, Dv], state)``."""
        raise ValueError(f"{type(self).__name__} does not decode: it has no step()")

    def check_decoding(self, what: str) -> None:
        """Refuse ``prefill``/``step`` (``what``) on a core that is not causal."""
        if not self.causal:
            raise ValueError(f"{what}() decodes causal attention; build the layer with causal=True")

    def check_prefill(self, pad: torch.Tensor | None) -> None:
        """Refuse a prefill this core cannot do, before any input is projected."""
        self.check_decoding("prefill")

    def step_offset(self, state: Any) -> int:
        """How many tokens ``state`` has seen (0 for None): the next token's default position.
        Refuses a core that is not causal; a core whose states differ in kind (FLT's band)
        also refuses a state that is not its own, while this default reads ``state.position``
        of whatever it is given."""
        self.check_decoding("step")
        return 0 if state is None else int(state.position)

    def pairwise_values(self, batch: int, length: int) -> int:
        """Values of the largest tensors that :meth:`exact` and :meth:`reference` form over
        ``batch`` sequences of ``length`` tokens, for :func:`flt._limits.check_memory`
        before they are formed: the logits, the weights, a positional term and a temporary,
        ``4 B H N^2`` (cores whose relative term costs more per pair add it)."""
        return PAIR_VALUES_PER_HEAD * batch * self.heads * length * length

    def padding_mask_matrix(self, pad: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """``[B, 1, 1, N]`` 0/1 multiplicative mask of valid keys for the exact references."""
        if pad is None:
            return None
        return (~pad).to(dtype)[:, None, None, :]


def check_layer_options(cls: type, options: dict, *, reserved: tuple[str, ...] = ()) -> None:
    """Check flat ``options`` of the layer class ``cls`` against the signature that lists
    them (:func:`flt._signatures.check_options`), reported against its registry name
    (``attention 'flt': unknown option 'numfreq'; ...``). ``reserved`` names the arguments
    the caller sets itself (the command line reserves :data:`ATTENTION_ARGUMENTS`)."""
    name = cls.__dict__.get("registry_name")  # a subclass of a registered layer is not that entry
    owner = f"attention {name!r}" if name else cls.__name__
    check_options(owner, cls, options, arguments=ATTENTION_ARGUMENTS, reserved=reserved)


def size(value: object, fallback: int = 0) -> int:
    """A size option's value in a memory estimate: a positive int, else ``fallback`` (the
    constructor reports anything else)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else fallback


def spectrum_option(cls: type[AttentionBase], options: dict, name: str) -> Any:
    """An option of the spectrum a layer of class ``cls`` builds (its ``spectrum`` option or
    default), for a memory estimate; None when there is none."""
    if name in options:
        return options[name]
    from flt.relative.spectra import SPECTRA

    spectrum = cls.option(options, "spectrum")
    if not (isinstance(spectrum, str) and spectrum in SPECTRA):
        return None
    spectrum_class: type = SPECTRA[spectrum]
    param = constructor_options(spectrum_class).params.get(name)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


def spectrum_values(cls: type[AttentionBase], options: dict, *, heads: int, pos_dim: int) -> int:
    """Values of a layer's spectrum beyond its frequencies: a neural spectrum's MLP of
    ``hidden`` units per head (and the near set's), ``2 H hidden (hidden + P + 3)``."""
    hidden = size(spectrum_option(cls, options, "hidden"))
    return 2 * heads * hidden * (hidden + max(pos_dim, 1) + 3)


def check_attention_memory(cls: type[AttentionBase], options: dict, *, dim: int, heads: int, pos_dim: int = 1,
                           device: torch.device | str | None = None) -> None:
    """Refuse an attention layer of class ``cls`` whose parameters and buffers alone
    (:meth:`AttentionBase.parameter_values`) exceed the limit (a ``num_features`` or
    ``num_frequencies`` of 10^9), before its constructor allocates them. Non-int sizes are
    left to the constructor's own checks."""
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (dim, heads, pos_dim)):
        return
    values = cls.parameter_values(options, dim=dim, heads=heads, pos_dim=pos_dim)
    name = cls.__dict__.get("registry_name")
    sizes = "".join(f", {k}={v}" for k, v in options.items() if k in cls.size_options)
    check_memory(f"attention {repr(name) if name else cls.__name__} (dim={dim}, heads={heads}{sizes})",
                 values * FLOAT_BYTES, device=device, hint="make these sizes smaller")


#: Arguments of a core's constructor that its layer sets itself: the layer's
#: :data:`ATTENTION_ARGUMENTS` (``head_dim`` from ``dim``), and ``feature_dim``, the input
#: size of a kernel core's feature map, which a core subclass sets (FLT's logit coupling).
CORE_ARGUMENTS = ("heads", "head_dim", "pos_dim", "causal", "feature_dim", "device", "dtype")


def layer_signature(cls: type[AttentionBase]) -> inspect.Signature | None:
    """The signature of the layer class ``cls``: ``(dim, heads, *, pos_dim, causal, <the
    keyword arguments of its core_class's constructor>, device, dtype)``, read from the
    core, where the parts are written once. None for a class without a core class."""
    core = getattr(cls, "core_class", None)
    if core is None:
        return None
    own = list(inspect.signature(AttentionBase.__init__).parameters.values())[1:-1]  # self and **parts out
    parts = [p for p in inspect.signature(core).parameters.values() if p.name not in cls.core_arguments]
    return inspect.Signature([*own[:4], *parts, *own[4:]], return_annotation=None)


class _LayerSignature:
    """``inspect.signature`` of a layer class (:func:`layer_signature`); an instance's is that
    of its ``__call__``, as for any module."""

    def __get__(self, obj: object, owner: type[AttentionBase]) -> inspect.Signature | None:
        if obj is not None:
            raise AttributeError("__signature__")
        return layer_signature(owner)


_Part = TypeVar("_Part")


class OfCore(Generic[_Part]):
    """A read-only attribute of a layer that is its core's attribute of the same name: the
    parts users read on the layer (``layer.spectrum`` is ``layer.core.spectrum``), declared
    on the layer class with their type and what they are,
    ``spectrum = OfCore[Spectrum]("The far term f.")``. Everything else is read on ``layer.core``."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> OfCore[_Part]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _Part: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.core, self.name)  # type: ignore[attr-defined]

    def __set__(self, obj: object, value: object) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self.name} is its core's; set it on layer.core")


#: A layer class's own type, so that ``FLTAttention.from_options(...)`` is an FLTAttention.
_Layer = TypeVar("_Layer", bound="AttentionBase")


class AttentionBase(nn.Module):
    """Input/output projections and input validation shared by the attention layers, around
    ``self.core``, an instance of the class's :attr:`core_class` (a :class:`CoreBase`) built
    by :meth:`__init__`. ``heads``, ``head_dim``, ``pos_dim`` and ``causal`` are the layer's
    and its core's alike; the core's parts are read on ``layer.core``, or through the
    attributes a layer class declares for them (:class:`OfCore`, ``FLTAttention.spectrum``).
    """

    #: The layer's key in :data:`flt.layers.ATTENTION` (set by each registered class, beside
    #: its definition; the registry is built from it).
    registry_name: ClassVar[str | None] = None
    #: Submodules that add no part to the names of draws and generators
    #: (:func:`flt.layers.draws.stable_named_modules`): those names seed fixed draws and key
    #: saved random states, and stay what they were before the core existed.
    unnamed_submodules: ClassVar[tuple[str, ...]] = ("core",)
    #: The function of :mod:`flt.layers.flat` that lists the class's flat options and turns
    #: them into its constructor's arguments (its parts); None: the constructor's keywords.
    flat_builder: ClassVar[Callable[..., dict[str, Any]] | None] = None
    #: The mechanism: the class of ``self.core``, whose constructor's keyword arguments (its
    #: parts) are the layer's beside :data:`ATTENTION_ARGUMENTS`.
    core_class: ClassVar[type[CoreBase]]
    #: The arguments of :attr:`core_class` that the layer sets, not parts.
    core_arguments: ClassVar[tuple[str, ...]] = CORE_ARGUMENTS
    #: ``inspect.signature(cls)``: the layer's arguments with its core's parts.
    __signature__ = _LayerSignature()
    #: Causal layers of this class decode (:meth:`step`); instances copy their core's.
    supports_decoding: bool = False
    core: CoreBase

    #: The options that size a layer of this class, named in memory errors
    #: (:func:`check_attention_memory`, :func:`flt.models.memory.check_model_memory`).
    size_options: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def option(cls, options: dict, name: str, default: Any = None) -> Any:
        """``options[name]``, else the default its class gives it (its flat builder's or its
        constructor's), else ``default``: the value a memory estimate reads."""
        if name in options:
            return options[name]
        klass: type = cls
        param = constructor_options(klass).params.get(name)
        return default if param is None or param.default is inspect.Parameter.empty else param.default

    @classmethod
    def takes_spectrum_options(cls, options: dict) -> bool:
        """Whether a layer of this class with flat ``options`` builds a spectrum, and so takes
        a spectrum's options (``length_scale``, ...): a class whose flat options forward
        ``**spectrum_options``; a layer may ask more of its other options."""
        klass: type = cls
        return constructor_options(klass).forwarded == "spectrum_options"

    @classmethod
    def parameter_values(cls, options: dict, *, dim: int, heads: int, pos_dim: int = 1) -> int:
        """Values held by one layer of this class with flat ``options`` (a closed-form
        estimate, :mod:`flt._limits`): here the projections, ``4 dim^2 + dim``; each
        mechanism adds its own."""
        return 4 * dim * dim + dim

    @classmethod
    def activation_values(cls, options: dict, *, batch: int, heads: int, length: int, head_dim: int,
                          training: bool) -> int:
        """Values of the largest tensors of one layer's forward pass over ``batch`` sequences
        of ``length`` tokens (:meth:`forward_values`), twice that when ``training`` (what
        backward keeps)."""
        return cls.forward_values(options, batch=batch, heads=heads, length=length, head_dim=head_dim) * (2 if training else 1)

    @classmethod
    def forward_values(cls, options: dict, *, batch: int, heads: int, length: int, head_dim: int) -> int:
        """Values of the largest tensors of one forward pass: here the attention weights
        ``B H N N``; a linear mechanism states its own."""
        return batch * heads * length * length

    @classmethod
    def from_options(cls: type[_Layer], dim: int, heads: int, **options: Any) -> _Layer:
        """The layer from flat options (those of presets and ``--attn-opt``), checked once:
        names and types (:func:`check_layer_options`, the same check as the command line's),
        then built by :meth:`from_checked_options`."""
        check_layer_options(cls, options)
        return cls.from_checked_options(dim, heads, **options)

    @classmethod
    def from_checked_options(cls: type[_Layer], dim: int, heads: int, **options: Any) -> _Layer:
        """The layer from flat options already checked where they entered (the command line,
        :func:`flt.models.build_attention`), so that a model of many layers does not check
        the same options once per layer: sizes too large for memory (a ``num_features`` of
        10^9) are refused before anything is allocated, then :meth:`_from_options` builds it.
        Unchecked options fail as the builder's own arguments do (an unknown name as a
        Python ``TypeError``): call :meth:`from_options` with options of your own."""
        check_attention_memory(cls, options, dim=dim, heads=heads, pos_dim=options.get("pos_dim", 1),
                               device=options.get("device"))
        return cls._from_options(dim, heads, **options)

    @classmethod
    def _from_options(cls: type[_Layer], dim: int, heads: int, **options: Any) -> _Layer:
        """Build from checked flat options: the constructor's arguments that the class's
        :attr:`flat_builder` makes of them, else the options themselves."""
        if cls.flat_builder is None:
            return cls(dim, heads, **options)
        return cls(**cls.flat_builder(dim, heads, **options))

    def __init__(self, dim: int, heads: int, *, pos_dim: int = 1, causal: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, **parts: Any) -> None:
        """The projections, then ``self.core``: :attr:`core_class` with ``heads``, ``head_dim =
        dim // heads``, ``pos_dim``, ``causal``, ``device``, ``dtype`` and the ``parts`` (the
        keyword arguments of the core's constructor, which the class's signature lists)."""
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("heads", heads)
        check_positive_int("pos_dim", pos_dim)
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        # Before nn.Linear allocates: dim = 2**40 would overflow its size, 2**16 ask for 48 GiB.
        # A layer on the meta device allocates nothing.
        if str(device) != "meta":
            check_memory(f"{type(self).__name__}(dim={dim}, heads={heads}): its projections", (4 * dim * dim + dim) * FLOAT_BYTES,
                         device=device, hint="make dim smaller")
        self.dim, self.heads, self.head_dim, self.pos_dim, self.causal = dim, heads, dim // heads, pos_dim, bool(causal)
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False, **fk)
        self.to_out = nn.Linear(dim, dim, **fk)
        self.core = self.core_class(heads, dim // heads, pos_dim=pos_dim, causal=causal, **fk, **parts)
        self.supports_decoding = self.core.supports_decoding

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, N, dim]``: the core's estimator between the projections."""
        p = self.prepare(x, pos, key_padding_mask)
        return self.finish(self.core(p.q, p.k, p.v, p.pos, p.pad), x)

    def reference(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The same computation by the core's O(N^2) formula (the fast path's reference)."""
        p = self.prepare(x, pos, key_padding_mask)
        self.check_pairwise_memory("reference", p)
        return self.finish(self.core.reference(p.q, p.k, p.v, p.pos, p.pad), x)

    def exact(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The O(N^2) attention the core estimates, with the same parameters. Refused
        (:class:`flt._limits.MemoryLimitError`) before anything of size ``N^2`` is formed
        when its estimate (:meth:`CoreBase.pairwise_values`) exceeds the memory limit."""
        p = self.prepare(x, pos, key_padding_mask)
        self.check_pairwise_memory("exact", p)
        return self.finish(self.core.exact(p.q, p.k, p.v, p.pos, p.pad), x)

    def check_pairwise_memory(self, method: str, p: Prepared) -> None:
        """Refuse an O(N^2) ``method`` whose tensors cannot fit (``FLT_MEMORY_LIMIT``, else
        the device's free memory): N = 200,000 tokens would ask for hundreds of GB.
        Backward keeps about as much again when the parameters take gradients."""
        B, N = p.q.shape[0], p.q.shape[2]
        values = self.core.pairwise_values(B, N)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (p.q, p.k, p.v)):
            values *= 2
        check_memory(f"{type(self).__name__}.{method}() on {B} sequence(s) of N = {N:,} tokens ({B * N * N:,} pairs)",
                     values * FLOAT_BYTES, device=p.q.device,
                     hint="use forward() (linear in N), or fewer tokens or sequences; under torch.no_grad() it needs half")

    def prefill(self, x: torch.Tensor, pos: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """The causal forward over a prompt that also returns the decoding state (``causal=True`` only).

        Args:
            x: ``[B, N, dim]``; pos: ``[B, N, P]``, ``[N, P]`` or None (token indices).
            key_padding_mask: ``[B, N]`` bool (True marks padding) or None: the kernel
                mechanisms leave padded keys out of the outputs and of the state (a
                left-padded batch of prompts decodes as each prompt alone).

        Returns:
            ``(y [B, N, dim], state)``: ``y`` is ``forward(x, pos, key_padding_mask)`` and
            ``state`` the one :meth:`step` would hold after the ``N`` tokens (the core's
            ``prefill``), so :meth:`step` continues the sequence.
        """
        self.core.check_prefill(key_padding_mask)
        p = self.prepare(x, pos, key_padding_mask)
        out, state = self.core.prefill(p.q, p.k, p.v, p.pos, p.pad)
        return self.finish(out, x), state

    def step(self, x: torch.Tensor, state: Any = None, pos: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """Decode one token (``causal=True`` only).

        Args:
            x: ``[B, dim]``, the next token.
            state: the state returned by the previous call or by :meth:`prefill` (``None`` to start).
            pos: ``[B, P]`` or ``[P]``; defaults to the token index for ``P = 1``.

        Returns:
            ``(y [B, dim], state)``: feeding a sequence token by token gives the outputs of
            ``forward`` with ``causal=True`` (the core's ``step``).
        """
        offset = self.core.step_offset(state)
        x_seq, pos_seq = self.step_input(x, pos, offset)
        p = self.prepare(x_seq, pos_seq, None)
        out, state = self.core.step(p.q, p.k, p.v, state, p.pos)
        return self.finish(out, x_seq).squeeze(1), state

    def default_positions(self, length: int, like: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if self.pos_dim != 1:
            raise ValueError(f"pos is required when pos_dim = {self.pos_dim} (token indices only serve P = 1)")
        return token_positions(length, like, offset)

    def step_input(self, x: torch.Tensor, pos: torch.Tensor | None, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Check one decoding step's ``x [B, dim]`` and ``pos [B, P] | [P] | None`` and return
        them as a one-token sequence: ``(x [B, 1, dim], pos [B|1, 1, P])``, the position
        defaulting to the token index ``offset`` (``P = 1``)."""
        check_tensor("x", x, ndim=2, layout="[B, dim]")
        if pos is None:
            return x.unsqueeze(1), self.default_positions(1, x, offset=offset)
        check_tensor("pos", pos, ndim=(1, 2), layout="[B, P] or [P]")
        return x.unsqueeze(1), pos.reshape(-1, 1, pos.shape[-1])

    def prepare(self, x: torch.Tensor, pos: torch.Tensor | None, key_padding_mask: torch.Tensor | None) -> Prepared:
        check_tensor("x", x, ndim=3, layout="[B, N, dim]")
        check_dim("x", x, -1, self.dim, "feature size")
        B, N, _ = x.shape
        if N == 0:
            raise ValueError(f"x has no tokens (N = 0, shape {tuple(x.shape)}); attention needs at least one token per sequence")
        self.check_input_dtype_and_device(x)
        if pos is None:
            pos = self.default_positions(N, x)
        else:
            pos = check_positions("pos", pos, batch=B, length=N, pos_dim=self.pos_dim)
        pad = None
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
                raise TypeError("key_padding_mask must be a bool tensor [B, N] (True marks padding)")
            if tuple(key_padding_mask.shape) != (B, N):
                raise ValueError(f"key_padding_mask must have shape [B, N] = {(B, N)}, got {tuple(key_padding_mask.shape)}")
            pad = key_padding_mask
        q, k, v = rearrange(self.to_qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        return Prepared(q, k, v, pos, pad)

    def check_input_dtype_and_device(self, x: torch.Tensor) -> None:
        """Require ``x`` on the device and (outside autocast) in the dtype of the layer's
        parameters, with a message that says how to fix it."""
        weight = self.to_qkv.weight
        if x.device != weight.device and weight.device.type != "meta":
            raise ValueError(
                f"x is on {x.device} but the layer's parameters are on {weight.device}; move the input (x.to({str(weight.device)!r})) "
                f"or the layer (layer.to({str(x.device)!r}))"
            )
        if x.dtype != weight.dtype and not _autocast_enabled(x.device.type):
            cast = _CASTS.get(x.dtype)
            layer = f"layer.{cast}()" if cast else f"layer.to(torch.{_dtype_name(x.dtype)})"
            raise TypeError(
                f"x has dtype {_dtype_name(x.dtype)} but the layer's parameters are {_dtype_name(weight.dtype)}; "
                f"cast the input (x.to(torch.{_dtype_name(weight.dtype)})) or the layer ({layer})"
            )

    def finish(self, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``[B, H, N, Dv] -> [B, N, dim]`` in the input dtype, through the output projection."""
        return self.to_out(rearrange(out.to(like.dtype), "b h n d -> b n (h d)"))


class QKScaling(nn.Module):
    """Scale queries and keys so that the kernel is ``exp(x_q . x_k)``.

    Without normalisation ``x = q / D^(1/4)`` (the softmax kernel ``exp(q.k / sqrt(D))``).
    With ``qk_norm=True``, ``x = sqrt(t_h) q / |q|`` with a learned temperature ``t_h`` per
    head: the logits are ``t_h cos(q, k)``, bounded, which keeps FAVOR+'s variance
    (exponential in ``|x|^2``) under control whatever the scale of the projections.
    """

    def __init__(self, heads: int, head_dim: int, *, qk_norm: bool, temperature: float = 1.0, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.head_dim, self.qk_norm = head_dim, bool(qk_norm)
        if self.qk_norm:
            if not temperature > 0:
                raise ValueError(f"temperature must be positive, got {shown(temperature)}")
            self.log_temperature = nn.Parameter(torch.full((heads,), math.log(temperature), device=device, dtype=dtype))
        else:
            self.register_parameter("log_temperature", None)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.qk_norm:
            s = self.head_dim**-0.25
            return q * s, k * s
        cdt = compute_dtype(q)
        root = torch.exp(0.5 * self.log_temperature.to(cdt)).view(1, -1, 1, 1)
        return F.normalize(q.to(cdt), dim=-1) * root, F.normalize(k.to(cdt), dim=-1) * root

