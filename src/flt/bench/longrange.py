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

``--molecules`` times QM9's SchNet (``flt train qm9 --model schnet``: width 64, three
interaction blocks, ``--mol-cutoff`` 5 Angstrom) alone and with each block of
:data:`MOLECULE_BLOCKS`, on ``--batches`` batches of ``--batch-size`` training molecules
(the qm9pack set, or ``--qm9-path``), the same way: one JSON line with the median seconds
per step, the ratios to SchNet and their ranges over every (repetition, batch).
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

#: The blocks timed on QM9's SchNet (``--molecules``), by label: the QM9 runs' options.
MOLECULE_BLOCKS: dict[str, dict[str, Any]] = {
    "radial": {"frequencies": "radial"},
    "radial, shared radii": {"frequencies": "radial", "shared": True},
    "grid": {"frequencies": "grid"},
    "exact radial": {"frequencies": "radial", "exact": True},
}


def _learned(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its blocks' ``W_o`` moved off zero, so a timed block has learned."""
    for name, p in model.named_parameters():
        if name.endswith("out.weight"):  # W_o starts at zero
            torch.nn.init.normal_(p, std=0.01)
    return model


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
        found[label] = _learned(ParticleSchNet(dim=dim, depth=depth, cutoff=cutoff, longrange=options))
    return found


def molecule_models(*, dim: int, depth: int, cutoff: float,
                    blocks: dict[str, dict[str, Any]]) -> dict[str, torch.nn.Module]:
    """``{"schnet": QM9's SchNet, label: the same with that block once before the readout, ...}``,
    all with the same seed: the small preset's model config (``flt train qm9 --model
    schnet[+lr]``, target ``mu``: a mean readout) at this width, depth and cutoff."""
    from flt.models import replace_fields
    from flt.tasks.qm9 import QM9Task, small

    preset = small().model
    found: dict[str, torch.nn.Module] = {}
    for label, options in {"schnet": None, **blocks}.items():
        config = replace_fields(preset, encoder="schnet" if options is None else "schnet+lr", dim=dim, depth=depth,
                                cutoff=cutoff, readout="mean", longrange=options or {})
        torch.manual_seed(0)
        found[label] = _learned(QM9Task.build_model(config))
    return found


def molecule_batches(path: str | None, count: int, batch_size: int) -> list[tuple[torch.Tensor, ...]]:
    """The first ``count`` batches of ``batch_size`` QM9 training molecules (``path``: a CSV or
    xyz folder; None: the qm9pack set) as ``(z, pos, key_padding_mask)``."""
    from flt.data import collate_molecules
    from flt.data.qm9 import load_qm9

    train = load_qm9(path, target="mu", num_train=count * batch_size, num_valid=1, num_test=1).train
    batches = [collate_molecules([train[i] for i in range(b * batch_size, (b + 1) * batch_size)]) for b in range(count)]
    return [(b.z, b.pos, b.key_padding_mask) for b in batches]


def time_step(model: torch.nn.Module, *inputs: torch.Tensor) -> float:
    """Wall seconds of one forward and backward (parameter gradients) on one batch."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(*inputs).square().mean().backward()
    return time.perf_counter() - start


def summary(times: dict[str, list[float]]) -> dict[str, Any]:
    """Median seconds per model, and each other model's median ratio to ``"schnet"`` over the
    paired repetitions with its range."""
    ratios = {label: sorted(t / b for b, t in zip(times["schnet"], times[label], strict=True))
              for label in times if label != "schnet"}
    return {"seconds": {label: round(statistics.median(t), 4) for label, t in times.items()},
            "ratio_to_schnet": {label: round(statistics.median(r), 3) for label, r in ratios.items()},
            "ratio_range": {label: [round(r[0], 3), round(r[-1], 3)] for label, r in ratios.items()}}


def molecules(args: argparse.Namespace) -> None:
    """``--molecules``: QM9's SchNet alone and with each block, on real molecules, one JSON line."""
    blocks = {label: MOLECULE_BLOCKS[label] for label in (args.only or MOLECULE_BLOCKS)}
    built = molecule_models(dim=args.dim, depth=args.depth or 3, cutoff=args.mol_cutoff, blocks=blocks)
    batches = molecule_batches(args.qm9_path, args.batches, args.batch_size)
    for model in built.values():
        time_step(model, *batches[0])  # warm-up
    times: dict[str, list[float]] = {label: [] for label in built}
    for _ in range(args.repeats):
        for batch in batches:
            for label, model in built.items():
                times[label].append(time_step(model, *batch))
    atoms = statistics.mean(float((~pad).sum()) / pad.shape[0] for _, _, pad in batches)
    print(json.dumps({"molecules": args.batch_size, "batches": args.batches, "mean_atoms": round(atoms, 2),
                      "threads": args.threads, "repeats": args.repeats, **summary(times)}), flush=True)


def exponent(n1: int, t1: float, n2: int, t2: float) -> float:
    """``log(t2 / t1) / log(n2 / n1)``: the power of ``N`` the time grows with between two sizes."""
    return math.log(t2 / t1) / math.log(n2 / n1)


def _positive(text: str) -> int:
    """An argparse type: a positive integer."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384], help="particles per cloud")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=None, help="interaction blocks (default: 2, or 3 with --molecules)")
    parser.add_argument("--cutoff", type=float, default=2.0, help="SchNet's cutoff in mean spacings")
    parser.add_argument("--exact-max", type=int, default=4096, help="largest N of the exact O(N^2) block")
    parser.add_argument("--wide", type=float, default=6.0,
                        help="also time SchNet alone with this cutoff (mean spacings; 0: not), the control whose cutoff covers most of a box")
    parser.add_argument("--only", nargs="+", default=None,
                        help=f"block labels to time (default: all of {list(BLOCKS)}, or with --molecules of {list(MOLECULE_BLOCKS)})")
    parser.add_argument("--molecules", action="store_true", help="time QM9's SchNet and its blocks on QM9 batches instead")
    parser.add_argument("--qm9-path", default=None, help="with --molecules: a QM9 CSV or xyz folder (default: the qm9pack set)")
    parser.add_argument("--batch-size", type=_positive, default=32, help="with --molecules: molecules per batch")
    parser.add_argument("--batches", type=_positive, default=8, help="with --molecules: distinct batches, each timed every repetition")
    parser.add_argument("--mol-cutoff", type=float, default=5.0, help="with --molecules: SchNet's cutoff in Angstrom")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory(True)
    unknown = set(args.only or ()) - set(MOLECULE_BLOCKS if args.molecules else BLOCKS)
    if unknown:
        parser.error(f"--only: unknown block label(s) {sorted(unknown)}")
    if args.molecules:
        molecules(args)
        return
    blocks = {label: BLOCKS[label] for label in (args.only or BLOCKS)}
    built = models(dim=args.dim, depth=args.depth or 2, cutoff=args.cutoff, blocks=blocks, wide=args.wide or None)
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
        for label, t in times.items():
            medians[label][n] = statistics.median(t)
        # the wide SchNet's ratio too: its cost against the base
        print(json.dumps({"N": n, "threads": args.threads, "repeats": args.repeats, **summary(times)}), flush=True)
    exponents = {}
    for label, by_n in medians.items():
        sizes = sorted(by_n)
        if len(sizes) >= 2:
            exponents[label] = round(exponent(sizes[0], by_n[sizes[0]], sizes[-1], by_n[sizes[-1]]), 3)
    print(json.dumps({"exponent": exponents, "from": min(args.n), "to": {label: max(b) for label, b in medians.items() if b}}))


if __name__ == "__main__":
    main()
