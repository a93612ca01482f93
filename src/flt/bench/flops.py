"""The FLOP model behind the "x floor" column of ``flt bench speed``.

Only matrix products are counted (a multiply-add is 2 FLOPs); elementwise work
(exponentials, scaling, the positional features ``a(r)``) is left out, so the floor is the
time the products would take at the float32 matmul throughput measured in the same run.
``x floor = median time / (model FLOPs / matmul FLOP/s)``: 1 means the layer ran as fast
as its products alone could.

Per batch element and head, with ``N`` tokens, head width ``D``, ``m`` random features,
``2R`` spectral features and model width ``d = H * D``:

* projections (q, k, v, out): ``4 * 2 N d^2`` per batch element;
* FAVOR+ feature maps of queries and keys: ``2 * 2 N m D_in`` with ``D_in = D + 2R`` for the
  logit coupling (``[x, a(r)]``) and ``D`` otherwise; learned ``hedgehog`` features
  (``W [m/2, D]``, each half a softmax of ``+-W x``): ``2 * 2 N (m/2) D``;
* linear attention state and read-out (the value block carries one more column, the
  denominator): ``2 * 2 N m (D + 1)``; the multiplicative (Kronecker) coupling contracts
  ``2R`` times more, ``2 * 2 N 2R m (D + 1)``;
* causal, chunked in blocks of ``C`` tokens (``flt.ops.linear.causal_chunk_size``, the op's
  default): the in-block products ``2 N C (m' + D + 1)`` with ``m' = m`` (logit) or
  ``m + 2R`` (multiplicative); the scan over chunk states is not counted;
* near sets of ``k`` keys per query (``near_neighbors = k``, or ``near_field = w`` with
  ``k = 2w + 1``): exact scores ``2 N k D``, the features' estimate on the same pairs
  ``2 N k m`` and both weighted sums of values ``2 * 2 N k (D + 1)``;
* exact softmax: ``2 N^2 D`` for the scores and as much for the values (halved when causal).

Backward: every product costs twice its forward FLOPs (gradients of both operands) except
the random feature maps, whose projection is a buffer: once (learned maps: twice, their
weight gets a gradient). ``fwd+bwd`` is forward + backward.

Each attention mechanism states its own model (:data:`flt.layers.registry.COSTS`, beside its
registry entry); the op-level variants' models are here (:data:`OP_FLOPS`).
"""

from __future__ import annotations

from flt.bench.variants import SHAPES, VARIANTS
from flt.layers.registry import forward_flops


def kronecker_flops(options: dict, *, batch: int, heads: int, length: int, head_dim: int, causal: bool) -> dict[str, float]:
    """Forward FLOPs of the op ``flt_attention`` with the multiplicative (Kronecker)
    coupling: features are its inputs, so no projections and no feature maps."""
    from flt.ops.linear import causal_chunk_size

    bhn, D = batch * heads * length, head_dim
    m, two_r = options["num_features"], 2 * options["num_frequencies"]
    parts: dict[str, float] = {"state and read-out": 2 * 2 * bhn * two_r * m * (D + 1)}
    if causal:
        parts["in-chunk products"] = 2 * bhn * causal_chunk_size(m, two_r, D) * (m + two_r + D + 1)
    return parts


#: The op-level variants' FLOP models (``Variant(kind="op")``), under the op the variant names.
OP_FLOPS = {"kronecker": kronecker_flops}


def forward_parts(variant: str, shape: str, N: int, causal: bool) -> dict[str, float] | None:
    """Forward FLOPs of one layer call by part, or None for a variant without a model: an
    attention layer asks its mechanism (:func:`flt.layers.registry.forward_flops`), an op
    its entry in :data:`OP_FLOPS`; a peer has none."""
    v = VARIANTS[variant]
    s = SHAPES[shape]
    if v.kind == "layer":
        return forward_flops(v.mechanism, v.kwargs, batch=s.B, heads=s.H, length=N, head_dim=s.D, causal=causal)
    op = OP_FLOPS.get(v.mechanism) if v.kind == "op" else None
    return None if op is None else op(v.kwargs, batch=s.B, heads=s.H, length=N, head_dim=s.D, causal=causal)


def model_flops(variant: str, shape: str, N: int, mode: str, causal: bool) -> float | None:
    """Model FLOPs of one timed call (``mode`` ``"fwd"`` or ``"fwd+bwd"``), or None."""
    parts = forward_parts(variant, shape, N, causal)
    if parts is None:
        return None
    fwd = float(sum(parts.values()))
    if mode == "fwd":
        return fwd
    if mode != "fwd+bwd":
        raise ValueError(f"mode must be 'fwd' or 'fwd+bwd', got {mode!r}")
    bwd = sum(f if name == "feature maps" else 2 * f for name, f in parts.items())
    return fwd + bwd


def floor_ratio(median_s: float, flops: float | None, ceiling_gflops: float | None) -> float | None:
    """``median_s`` over the time the model's FLOPs take at the ceiling (None when unknown)."""
    if not flops or not ceiling_gflops:
        return None
    return median_s / (flops / (ceiling_gflops * 1e9))
