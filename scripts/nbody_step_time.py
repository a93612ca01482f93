"""Time one training step (forward + backward) of the ``nbody`` model per mechanism, as a
ratio to a reference mechanism, in one process.

    python scripts/nbody_step_time.py [--particles 4096] [--repeats 7] [--threads 1] \\
        [--attention 'flt:near_neighbors=16:...'] [--reference softmax]

The model is the ``small`` preset's (2 layers, width 64, 4 heads) with the task's default
options for each mechanism, updated by the options of ``--attention`` (the syntax of
``flt train --attention``); one cloud of ``--particles`` particles at unit density, batch
1. Repetitions are interleaved (one step of every mechanism per round, after one untimed
round), so a change in the machine's load hits every mechanism alike; the ratio is the
median over rounds of the per-round ratio. On a shared machine the absolute times mean
little; the ratio is what the script is for (re-run it on an idle machine to report).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from flt.data.nbody import generate_clouds
from flt.options import parse_attention
from flt.tasks import get_preset
from flt.tasks.base import mechanism_options
from flt.tasks.nbody import NBodyTask

DEFAULT_FLT = ('flt:near_neighbors=16:min_length=2:length_scale=2.5:length_spread=8:near_relative=gaussian_mixture:'
               'near_relative_options={"length_scale":0.5,"length_spread":4.0}')


def nbody_model(entry: str) -> torch.nn.Module:
    """The ``small`` preset's model with the mechanism and options of ``entry``."""
    name, options = parse_attention(entry)
    config = get_preset("nbody", "small", attention=name).model
    mech = mechanism_options(NBodyTask, name, "none")
    mech["attention_options"].update(options)
    return NBodyTask.build_model(dataclasses.replace(config, **mech))


def step_seconds(model: torch.nn.Module, charge: torch.Tensor, pos: torch.Tensor, y: torch.Tensor) -> float:
    """Wall time of one forward + backward pass (gradients cleared first, not timed)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = torch.nn.functional.mse_loss(model(charge, pos), y)
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--particles", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (after one untimed round)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--attention", action="append", help=f"mechanism to time (repeatable; default: {DEFAULT_FLT})")
    p.add_argument("--reference", default="softmax", help="the mechanism the others are divided by (default softmax)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    entries = [*(args.attention or [DEFAULT_FLT]), args.reference]
    models = [nbody_model(e).train() for e in entries]
    cloud = generate_clouds(1, args.particles, seed=0, split="test")
    charge, pos, y = cloud.charge, cloud.pos.float(), cloud.y.float()
    times: list[list[float]] = [[] for _ in entries]
    for r in range(args.repeats + 1):
        for i, model in enumerate(models):
            t = step_seconds(model, charge, pos, y)
            if r:
                times[i].append(t)
    print(f"nbody small model, N = {args.particles}, batch 1, {args.threads} thread(s), {args.repeats} interleaved rounds; "
          f"forward + backward, seconds (median) and ratio to {args.reference!r} (median of per-round ratios)")
    ref = times[-1]
    for entry, ts in zip(entries, times):
        ratio = statistics.median(t / r for t, r in zip(ts, ref))
        print(f"{statistics.median(ts):8.3f} s  ratio {ratio:6.3f}  {entry}")


if __name__ == "__main__":
    main()
