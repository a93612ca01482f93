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
"""

from __future__ import annotations

from flt.layers.base import AttentionBase
from flt.layers.flt import FLTAttention
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
