"""The attention registry: one constructor signature, one forward signature.

``ATTENTION[name].from_options(dim, heads, *, pos_dim=1, causal=False, device=None, dtype=None, **options)``
builds a module with ``forward(x [B, N, dim], pos=None, key_padding_mask=None) -> [B, N, dim]``
and ``reference(...)``, the same computation by the O(N^2) reference (what benchmarks check
before timing). Layers that decode token by token (a constant-size state for the kernel
mechanisms, a KV cache for causal softmax) have ``supports_decoding = True``,
``step(x [B, dim], state=None, pos=None) -> (y, state)`` and ``prefill(x [B, N, dim],
pos=None) -> (y, state)``, the causal forward over a prompt with the state after it.
The same dict drives the CLI choices, the benchmarks and the test parametrisation.

``from_options`` takes the flat options of presets and the command line and checks them
once (:func:`flt.layers.base.check_layer_options`, the same check as
:func:`flt.options.check_attention_options`): an unknown name is reported against the
registry name with the valid options (the layer's and, for ``**spectrum_options``, its
spectrum's) and the closest match; a value of the wrong type names the option and the
expected type. A new entry needs nothing more than annotated keyword parameters (or, for a
layer built from parts, a function of :mod:`flt.layers.flat` that lists them, named by its
``flat_builder``), and states its own memory estimate (``parameter_values``,
``forward_values``).

:data:`COSTS` holds, beside each entry, what the benchmarks ask of a mechanism instead of
branching on its name: whether it is exact (every call forms all ``N^2`` pairs) and its
model of the matrix-product FLOPs of one forward call (:func:`forward_flops`, the model
:mod:`flt.bench.flops` describes), or None where it has none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flt.layers.base import AttentionBase
from flt.layers.flt import FLTAttention
from flt.layers.parts import FEATURES
from flt.layers.performer import PerformerAttention
from flt.layers.softmax import SoftmaxAttention
from flt.layers.toeplitz import ToeplitzAttention


def _by_name(*classes: type[AttentionBase]) -> dict[str, type[AttentionBase]]:
    """Each class under the ``registry_name`` it declares itself (a class that inherits its
    parent's name, or has none, would silently shadow or vanish, so it is an error)."""
    entries: dict[str, type[AttentionBase]] = {}
    for cls in classes:
        name = cls.__dict__.get("registry_name")
        if not isinstance(name, str):
            raise TypeError(f"{cls.__name__}.registry_name: expected the class's own name (a str), got {name!r}")
        entries[name] = cls
    return entries


#: Each entry under the name its class declares (``registry_name``, beside its definition).
ATTENTION: dict[str, type[AttentionBase]] = _by_name(SoftmaxAttention, PerformerAttention, ToeplitzAttention, FLTAttention)


#: ``(cls, options, *, batch, heads, length, head_dim, causal) -> {part: FLOPs}``.
FlopModel = Callable[..., dict[str, float]]


def _projection_flops(*, batch: int, heads: int, length: int, head_dim: int) -> float:
    """q, k, v and out: ``4 * 2 N d^2`` per sequence, ``d = H D``."""
    d = heads * head_dim
    return 4 * 2 * batch * length * d * d


def exact_flops(cls: type[AttentionBase], options: dict, *, batch: int, heads: int, length: int, head_dim: int,
                causal: bool) -> dict[str, float]:
    """Forward FLOPs of exact attention by part: the projections, and ``2 N^2 D`` for the
    scores and as much for the values per head (halved when causal)."""
    return {"projections": _projection_flops(batch=batch, heads=heads, length=length, head_dim=head_dim),
            "scores and values": 2 * 2 * batch * heads * length * length * head_dim * (0.5 if causal else 1.0)}


def kernel_flops(cls: type[AttentionBase], options: dict, *, batch: int, heads: int, length: int, head_dim: int,
                 causal: bool) -> dict[str, float]:
    """Forward FLOPs of a kernel (linear) mechanism by part, from its flat ``options`` and the
    defaults its class gives them (:meth:`AttentionBase.option`): an option the class does not
    have (a Performer's ``coupling``, ``num_frequencies``, near set) counts as absent.
    The terms are those of :mod:`flt.bench.flops`."""
    from flt.ops.linear import causal_chunk_size

    D, bhn = head_dim, batch * heads * length
    parts: dict[str, float] = {"projections": _projection_flops(batch=batch, heads=heads, length=length, head_dim=head_dim)}
    m = cls.option(options, "num_features")
    coupling = cls.option(options, "coupling")
    two_r = 2 * (cls.option(options, "num_frequencies") or 0)
    d_in = D + two_r if coupling == "logit" else D
    if FEATURES[cls.option(options, "feature_map")].learned:  # a learned [m/2, D] map: two products
        parts["learned feature maps"] = 2 * 2 * bhn * (m // 2) * d_in
    else:
        parts["feature maps"] = 2 * 2 * bhn * m * d_in
    kron = two_r if coupling == "multiplicative" else 0
    width = two_r * m if coupling == "multiplicative" else m
    parts["state and read-out"] = 2 * 2 * bhn * width * (D + 1)
    if causal:
        parts["in-chunk products"] = 2 * bhn * causal_chunk_size(m, kron or 1, D) * (m + kron + D + 1)
    near_field = cls.option(options, "near_field") or 0
    k = cls.option(options, "near_neighbors") or (2 * near_field + 1 if near_field else 0)
    if k:
        parts["near set"] = 2 * bhn * k * (D + m + 2 * (D + 1))
    return parts


@dataclass(frozen=True)
class Cost:
    """What the benchmarks ask of a mechanism (:data:`COSTS`)."""

    #: Every forward call forms all ``N^2`` pairs of queries and keys (exact attention).
    exact: bool
    #: Its forward FLOPs by part (:func:`forward_flops`), or None: no model (the FFT of Toeplitz).
    flops: FlopModel | None = None


#: Each ``ATTENTION`` entry's :class:`Cost`, under the same name (a test holds the two to the
#: same names, so that a new mechanism states its own rather than silently getting none).
COSTS: dict[str, Cost] = {
    "softmax": Cost(exact=True, flops=exact_flops),
    "performer": Cost(exact=False, flops=kernel_flops),
    "toeplitz": Cost(exact=False),
    "flt": Cost(exact=False, flops=kernel_flops),
}


def forward_flops(name: str, options: dict[str, Any], *, batch: int, heads: int, length: int, head_dim: int,
                  causal: bool) -> dict[str, float] | None:
    """Matrix-product FLOPs of one forward call of ``ATTENTION[name]`` with flat ``options``
    over ``batch`` sequences of ``length`` tokens, by part (a multiply-add is 2 FLOPs;
    :mod:`flt.bench.flops`), or None for a mechanism without a model."""
    model = COSTS[name].flops
    if model is None:
        return None
    return model(ATTENTION[name], options, batch=batch, heads=heads, length=length, head_dim=head_dim, causal=causal)
