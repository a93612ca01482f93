"""Cost of the long-range block on a per-particle SchNet, timed in one process:
``python -m flt.bench.longrange``.

The block's cost targets are relative to its base model: the training step (forward and
backward of one cloud) of the `nbody` SchNet with a 2-spacing cutoff, alone and with a
block, at the same ``N``, and how each step grows with ``N`` (docs/longrange.md, "Cost").
Models are timed with interleaved repetitions (base, block, base, block, ...) after one
warm-up call each; a ratio is the median of the per-repetition ratios, and the exponent
between two sizes is ``log(t2 / t1) / log(N2 / N1)`` of the medians. Clouds are uniform at
unit density, as `nbody`'s. The exact O(N^2) block (the same kernel summed pair by pair)
runs only up to ``--exact-max``.

Each line of output is one JSON object: ``N``, the median seconds per model, each block's
median ratio to the base and its range; a last line gives the exponents.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from flt.perf import keep_freed_memory

#: The blocks timed by default, by label: options of :class:`flt.layers.LongRangeBlock`.
BLOCKS: dict[str, dict[str, Any]] = {
    "radial": {"frequencies": "radial", "neutral": True},
    "radial, shared radii": {"frequencies": "radial", "neutral": True, "shared": True},
    "radial, shared radii, rule per call": {"frequencies": "radial", "neutral": True, "shared": True, "quadrature": None},
    "radial, shared radii, order 16": {"frequencies": "radial", "neutral": True, "shared": True, "quadrature": 16},
    "radial, 16 shared radii, rule per call": {"frequencies": "radial", "neutral": True, "shared": True,
                                               "quadrature": None, "num_radii": 16},
    "radial, rule per call": {"frequencies": "radial", "neutral": True, "quadrature": None},
    "coulomb": {"frequencies": "coulomb", "heads": 1, "neutral": True},
    "coulomb reach=32": {"frequencies": "coulomb", "heads": 1, "neutral": True, "reach": 32.0},
    "exact radial": {"frequencies": "radial", "neutral": True, "exact": True},
    "radial, 16 shared radii, mesh": {"frequencies": "radial", "neutral": True, "shared": True, "num_radii": 16,
                                      "engine": "mesh"},
    "coulomb alpha=0.5 tail alone, mesh": {"frequencies": "coulomb", "heads": 4, "neutral": True, "alpha": 0.5,
                                           "num_radii": 0, "engine": "mesh"},
    "coulomb alpha=0.5 tail alone, mesh, value_dim=4": {"frequencies": "coulomb", "heads": 4, "neutral": True,
                                                         "alpha": 0.5, "num_radii": 0, "engine": "mesh", "value_dim": 4},
    "coulomb alpha=0.5, mesh": {"frequencies": "coulomb", "heads": 1, "neutral": True, "alpha": 0.5,
                                "num_radii": 4, "width": 0.05, "amplitude": 0.0, "engine": "mesh"},
}


def models(*, dim: int, depth: int, cutoff: float, blocks: dict[str, dict[str, Any]],
           wide: float | None = None) -> dict[str, torch.nn.Module]:
    """``{"schnet": base, label: base with that block, ...}``, all with the same seed, and
    ``"schnet cutoff=W"``, the base model with the cutoff ``wide``, when given."""
    from flt.baselines.particles import ParticleSchNet

    found: dict[str, torch.nn.Module] = {}
    if wide is not None:
        torch.manual_seed(0)
        found[f"schnet cutoff={wide:g}"] = ParticleSchNet(dim=dim, depth=depth, cutoff=wide)
    for label, options in {"schnet": None, **blocks}.items():
        torch.manual_seed(0)
        model = ParticleSchNet(dim=dim, depth=depth, cutoff=cutoff, longrange=options)
        for name, p in model.named_parameters():
            if name.endswith("out.weight"):  # W_o starts at zero; time a block that has learned
                torch.nn.init.normal_(p, std=0.01)
        found[label] = model
    return found


def time_step(model: torch.nn.Module, charge: torch.Tensor, pos: torch.Tensor) -> float:
    """Wall seconds of one forward and backward (parameter gradients) on one batch."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(charge, pos).square().mean().backward()
    return time.perf_counter() - start


def exponent(n1: int, t1: float, n2: int, t2: float) -> float:
    """``log(t2 / t1) / log(n2 / n1)``: the power of ``N`` the time grows with between two sizes."""
    return math.log(t2 / t1) / math.log(n2 / n1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384], help="particles per cloud")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--cutoff", type=float, default=2.0, help="SchNet's cutoff in mean spacings")
    parser.add_argument("--exact-max", type=int, default=4096, help="largest N of the exact O(N^2) block")
    parser.add_argument("--wide", type=float, default=6.0,
                        help="also time SchNet alone with this cutoff (mean spacings; 0: not), the control whose cutoff covers most of a box")
    parser.add_argument("--only", nargs="+", default=None, help=f"block labels to time (default: all of {list(BLOCKS)})")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory(True)
    blocks = {label: BLOCKS[label] for label in (args.only or BLOCKS)}
    built = models(dim=args.dim, depth=args.depth, cutoff=args.cutoff, blocks=blocks, wide=args.wide or None)
    medians: dict[str, dict[int, float]] = {label: {} for label in built}
    for n in args.n:
        g = torch.Generator().manual_seed(n)
        pos = torch.rand(1, n, 3, generator=g) * n ** (1 / 3)
        charge = (torch.arange(n) % 2 * 2 - 1).float()[torch.randperm(n, generator=g)][None]
        here = {label: m for label, m in built.items() if not (label.startswith("exact") and n > args.exact_max)}
        for model in here.values():
            time_step(model, charge, pos)  # warm-up
        times: dict[str, list[float]] = {label: [] for label in here}
        for _ in range(args.repeats):
            for label, model in here.items():
                times[label].append(time_step(model, charge, pos))
        ratios = {label: sorted(t / b for b, t in zip(times["schnet"], times[label], strict=True))
                  for label in here if label != "schnet"}  # the wide SchNet's too: its cost against the base
        for label, t in times.items():
            medians[label][n] = statistics.median(t)
        print(json.dumps({
            "N": n, "threads": args.threads, "repeats": args.repeats,
            "seconds": {label: round(statistics.median(t), 4) for label, t in times.items()},
            "ratio_to_schnet": {label: round(statistics.median(r), 3) for label, r in ratios.items()},
            "ratio_range": {label: [round(r[0], 3), round(r[-1], 3)] for label, r in ratios.items()},
        }), flush=True)
    exponents = {}
    for label, by_n in medians.items():
        sizes = sorted(by_n)
        if len(sizes) >= 2:
            exponents[label] = round(exponent(sizes[0], by_n[sizes[0]], sizes[-1], by_n[sizes[-1]]), 3)
    print(json.dumps({"exponent": exponents, "from": min(args.n), "to": {label: max(b) for label, b in medians.items() if b}}))


if __name__ == "__main__":
    main()
