"""The attention registry: one constructor signature, one forward signature.

``ATTENTION[name](dim, heads, *, pos_dim=1, causal=False, device=None, dtype=None, **options)``
builds a module with ``forward(x [B, N, dim], pos=None, key_padding_mask=None) -> [B, N, dim]``
and ``reference(...)``, the same computation by the O(N^2) reference (what benchmarks check
before timing). Layers that decode token by token with a constant-size state have
``supports_decoding = True`` and ``step(x [B, dim], state=None, pos=None) -> (y, state)``.
The same dict drives the CLI choices, the benchmarks and the test parametrisation.
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
