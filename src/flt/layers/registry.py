"""The attention registry: one constructor signature, one forward signature.

``ATTENTION[name](dim, heads, *, pos_dim=1, causal=False, device=None, dtype=None, **options)``
builds a module with ``forward(x [B, N, dim], pos=None, key_padding_mask=None) -> [B, N, dim]``.
Layers that can decode token by token with a constant-size state have
``supports_decoding = True`` and ``step(x [B, dim], state=None, pos=None) -> (y, state)``.
The same dict drives the CLI choices, the benchmarks and the test parametrisation.
"""

from __future__ import annotations

from flt.layers.flt import FLTAttention

ATTENTION: dict[str, type] = {
    "flt": FLTAttention,
}
