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
(:func:`flt.models.build_attention`), not once per layer. A constructor called directly
checks its own arguments (its parts check theirs, :mod:`flt.layers.rules` their combinations).
:meth:`AttentionBase.prepare` checks the input of every forward call: rank, feature size,
at least one token, and the dtype and device of the layer's parameters (metadata only: no
host synchronisation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, overload

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from flt._checks import check_dim, check_positions, check_positive_int, check_tensor, compiling
from flt._dtype import compute_dtype
from flt._limits import check_attention_memory
from flt._signatures import check_options

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


def check_layer_options(cls: type, options: dict, *, reserved: tuple[str, ...] = ()) -> None:
    """Check flat ``options`` of the layer class ``cls`` against the signature that lists
    them (:func:`flt._signatures.check_options`), reported against its registry name
    (``attention 'flt': unknown option 'numfreq'; ...``). ``reserved`` names the arguments
    the caller sets itself (the command line reserves :data:`ATTENTION_ARGUMENTS`)."""
    name = cls.__dict__.get("registry_name")  # a subclass of a registered layer is not that entry
    owner = f"attention {name!r}" if name else cls.__name__
    # feature_dim: how a kernel layer subclass sizes its feature map's input; not listed.
    check_options(owner, cls, options, arguments=(*ATTENTION_ARGUMENTS, "feature_dim"), reserved=reserved)


#: A layer class's own type, so that ``FLTAttention.from_options(...)`` is an FLTAttention.
_Layer = TypeVar("_Layer", bound="AttentionBase")


class AttentionBase(nn.Module):
    """Input/output projections and input validation shared by the attention layers."""

    #: The layer's key in :data:`flt.layers.ATTENTION` (set by each registered class, beside
    #: its definition; the registry is built from it).
    registry_name: ClassVar[str | None] = None

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
        """Build from checked flat options: the constructor itself, unless a layer's parts
        need translating (``FLTAttention``, ``SoftmaxAttention``)."""
        return cls(dim, heads, **options)

    def __init__(self, dim: int, heads: int, *, pos_dim: int = 1, causal: bool = False, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("heads", heads)
        check_positive_int("pos_dim", pos_dim)
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.dim, self.heads, self.head_dim, self.pos_dim, self.causal = dim, heads, dim // heads, pos_dim, bool(causal)
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False, **fk)
        self.to_out = nn.Linear(dim, dim, **fk)

    def default_positions(self, length: int, like: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if self.pos_dim != 1:
            raise ValueError(f"pos is required when pos_dim = {self.pos_dim} (token indices only serve P = 1)")
        idx = torch.arange(offset, offset + length, device=like.device, dtype=compute_dtype(like))
        return idx.view(1, length, 1)

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

    def padding_mask_matrix(self, pad: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """``[B, 1, 1, N]`` 0/1 multiplicative mask of valid keys for the exact references."""
        if pad is None:
            return None
        return (~pad).to(dtype)[:, None, None, :]


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
                raise ValueError(f"temperature must be positive, got {temperature!r}")
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
