"""``flt train`` with one diagnostic change to the near sets of FLT layers.

The controls of docs/results.md ("Why the catalysis near set trains worse"): the command
line is ``flt train``'s, after a comma-separated list of changes:

* ``frozen``: ``f_near`` stays at its initial 0 (its parameters get no gradient), so the
  near set only makes ``f`` exact on its pairs.
* ``clamp``: the near set's exact mask is ``max(f + f_near, 0)``: ``f_near`` is learnt
  but cannot make a near pair's weight negative.
* ``gradlog``: no change to the model; every 10th step appends to the JSON-lines file
  ``$GRADLOG`` the gradient norm before clipping (``pre_clip``), each layer's spectrum
  (``f``) and ``f_near`` gradient norms (also before clipping) and their amplitudes.

    GRADLOG=/tmp/grad.jsonl PYTHONPATH=src python scripts/near_set_variants.py clamp,gradlog \\
        train molecule --preset small --seed 0 --lr 2e-3 --threads 1 --no-plots \\
        --attention flt:near_neighbors=16 --out-dir runs/mol-near16-clamp

The changes patch :class:`flt.layers.flt.FLTAttention` in this process only; a run's saved
config does not record them, so ``flt evaluate`` of a ``clamp`` run measures the unclamped
layer.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from flt.cli import main
from flt.layers.flt import FLTAttention

CHANGES = ("frozen", "clamp", "gradlog")


def grad_norm(params) -> float:
    grads = [p.grad.norm() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0


def apply(changes: set[str]) -> None:
    layers: list[FLTAttention] = []
    build = FLTAttention.__init__

    def init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        layers.append(self)
        if "frozen" in changes and self.near_spectrum is not None:
            self.near_spectrum.requires_grad_(False)

    FLTAttention.__init__ = init
    if "clamp" in changes:
        near_mask = FLTAttention.near_mask
        FLTAttention.near_mask = lambda self, delta: near_mask(self, delta).clamp_min(0.0)
    if "gradlog" in changes:
        log_gradients(layers, os.environ["GRADLOG"])


def log_gradients(layers: list[FLTAttention], path: str) -> None:
    """Record the norms before ``flt train`` clips them (``torch.nn.utils.clip_grad_norm_``),
    write them at every 10th optimizer step."""
    log = open(path, "w")  # noqa: SIM115 (open for the whole run)
    clip, step = torch.nn.utils.clip_grad_norm_, torch.optim.AdamW.step
    seen = {"steps": 0}

    def clip_and_record(*args, **kwargs):
        seen["spectrum"] = [grad_norm(layer.spectrum.parameters()) for layer in layers]
        seen["near"] = [grad_norm(layer.near_spectrum.parameters()) if layer.near_spectrum is not None else 0.0 for layer in layers]
        total = clip(*args, **kwargs)
        seen["pre_clip"] = float(total)
        return total

    def step_and_write(self, *args, **kwargs):
        seen["steps"] += 1
        if seen["steps"] % 10 == 0:
            with torch.no_grad():
                row = {"step": seen["steps"], "pre_clip": seen.get("pre_clip"), "spectrum": seen.get("spectrum"),
                       "near": seen.get("near"),
                       "f_amplitude": [[round(float(a), 3) for a in layer.spectrum.amplitude] for layer in layers],
                       "f_near_amplitude": [[round(float(a), 3) for a in layer.near_spectrum.amplitude]
                                            if layer.near_spectrum is not None else [] for layer in layers]}
            log.write(json.dumps(row) + "\n")
            log.flush()
        return step(self, *args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = clip_and_record
    torch.optim.AdamW.step = step_and_write


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(f"usage: near_set_variants.py CHANGES train TASK [flt train options]; CHANGES from {', '.join(CHANGES)}")
    chosen = set(sys.argv[1].split(","))
    if not chosen <= set(CHANGES):
        sys.exit(f"unknown change(s) {sorted(chosen - set(CHANGES))}; known: {', '.join(CHANGES)}")
    apply(chosen)
    sys.exit(main(sys.argv[2:]))
