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
layer built from parts, a ``_from_options`` marked ``@flat_options`` that lists them).
"""

from __future__ import annotations

from flt.layers.flt import FLTAttention
from flt.layers.performer import PerformerAttention
from flt.layers.softmax import SoftmaxAttention
from flt.layers.toeplitz import ToeplitzAttention

#: Each entry under the name its class declares (``registry_name``, beside its definition).
ATTENTION: dict[str, type] = {cls.registry_name: cls for cls in (SoftmaxAttention, PerformerAttention, ToeplitzAttention, FLTAttention)}
