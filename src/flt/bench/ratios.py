"""Cost of FLT's near sets relative to plain FLT, timed in one process: ``python -m flt.bench.ratios``.

The speed targets of the near sets are ratios to plain FLT with the same ``m`` and ``R``
(docs/performance.md, "Near sets"): the banded estimator (``near_field=w``, causal text)
and the nearest-keys estimator (``near_neighbors=k`` on random 3-D points). A ratio is
only meaningful when both layers see the same machine state, so the layers of a
comparison are timed in one process with interleaved repetitions (plain, near set, plain,
near set, ...) after one warm-up call each, and the ratio is the median of the
per-repetition ratios. Freed memory is kept for reuse as in ``flt bench speed``
(:func:`flt.perf.keep_freed_memory`; ``--allocator default`` turns that off). On a machine shared with other jobs the spread of those ratios is
printed next to it; it is not a substitute for an idle machine.

Each line of output is one JSON object: the comparison, ``N``, the median fwd+bwd seconds
of each layer, the median ratio and its range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from flt import FLTAttention
from flt.perf import keep_freed_memory


def comparisons(n: int, *, dim: int, heads: int, m: int, R: int, width: int, k: int, seed: int = 0) -> dict:
    """``{name: (inputs, {label: layer})}``: the near-set layers next to plain FLT with the
    same ``m`` and ``R``; ``inputs`` is ``(x [1, N, dim], pos or None)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, dim, generator=g)
    points = torch.rand(1, n, 3, generator=g) * (n ** (1 / 3))  # unit density: about 1 point per unit cube
    common: dict[str, Any] = {"num_features": m, "num_frequencies": R, "seed": seed}
    return {
        f"band{width}/plain causal": ((x, None), {
            "plain": FLTAttention.from_options(dim, heads, causal=True, **common),
            f"near_field={width}": FLTAttention.from_options(dim, heads, causal=True, near_field=width, **common),
        }),
        f"near{k}/plain 3-D points": ((x, points), {
            "plain": FLTAttention.from_options(dim, heads, pos_dim=3, **common),
            f"near_neighbors={k}": FLTAttention.from_options(dim, heads, pos_dim=3, near_neighbors=k, **common),
        }),
    }


def time_fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, pos: torch.Tensor | None) -> float:
    """Wall seconds of one ``layer(x, pos)`` forward and backward (input gradient included)."""
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    layer(x, pos).sum().backward()
    return time.perf_counter() - start


def interleaved(layers: dict, x: torch.Tensor, pos: torch.Tensor | None, repeats: int) -> dict:
    """Seconds per repetition of every layer, the layers taking turns within a repetition."""
    for layer in layers.values():  # warm-up
        time_fwd_bwd(layer, x, pos)
    times: dict[str, list[float]] = {label: [] for label in layers}
    for _ in range(repeats):
        for label, layer in layers.items():
            times[label].append(time_fwd_bwd(layer, x, pos))
    return times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[16384], help="sequence lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--num-features", type=int, default=256)
    parser.add_argument("--num-frequencies", type=int, default=32)
    parser.add_argument("--near-field", type=int, default=16)
    parser.add_argument("--near-neighbors", type=int, default=8)
    parser.add_argument("--only", default=None, help="run only comparisons whose name contains this")
    parser.add_argument("--allocator", choices=("keep", "default"), default="keep",
                        help="keep: freed memory kept for reuse, as flt bench speed does (flt.perf.keep_freed_memory)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory(args.allocator == "keep")
    for n in args.n:
        found = comparisons(n, dim=args.dim, heads=args.heads, m=args.num_features, R=args.num_frequencies,
                            width=args.near_field, k=args.near_neighbors)
        for name, ((x, pos), layers) in found.items():
            if args.only and args.only not in name:
                continue
            times = interleaved(layers, x, pos, args.repeats)
            base, near = times.values()
            ratios = sorted(b / a for a, b in zip(base, near, strict=True))
            print(json.dumps({
                "comparison": name, "N": n, "threads": args.threads, "repeats": args.repeats,
                "seconds": {label: round(statistics.median(t), 4) for label, t in times.items()},
                "ratio": round(statistics.median(ratios), 3), "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
            }), flush=True)


if __name__ == "__main__":
    main()
