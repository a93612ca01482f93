"""The attention registry: one constructor signature, one forward signature.

``ATTENTION[name](dim, heads, *, pos_dim=1, causal=False, device=None, dtype=None, **options)``
builds a module with ``forward(x [B, N, dim], pos=None, key_padding_mask=None) -> [B, N, dim]``
and ``reference(...)``, the same computation by the O(N^2) reference (what benchmarks check
before timing). Layers that decode token by token (a constant-size state for the kernel
mechanisms, a KV cache for causal softmax) have ``supports_decoding = True``,
``step(x [B, dim], state=None, pos=None) -> (y, state)`` and ``prefill(x [B, N, dim],
pos=None) -> (y, state)``, the causal forward over a prompt with the state after it.
The same dict drives the CLI choices, the benchmarks and the test parametrisation.

Options are checked against the constructor's signature whenever an entry is built
(:class:`flt.layers.base.AttentionBase`, :func:`flt.options.check_attention_options`): an
unknown name is reported against the registry name with the valid options (the layer's
and, for ``**spectrum_options``, its spectrum's) and the closest match; a value of the
wrong type names the option and the expected type. A new entry needs nothing more than
annotated keyword parameters.
"""

from __future__ import annotations

from flt.layers.flt import FLTAttention
from flt.layers.performer import PerformerAttention
from flt.layers.softmax import SoftmaxAttention
from flt.layers.toeplitz import ToeplitzAttention

ATTENTION: dict[str, type] = {
    "softmax": SoftmaxAttention,
    "performer": PerformerAttention,
    "toeplitz": ToeplitzAttention,
    "flt": FLTAttention,
}
