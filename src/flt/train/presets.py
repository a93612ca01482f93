"""Presets: ``PRESETS[task][name](attention, posenc) -> Preset``.

Every preset states its command, its run time and the metric it reaches with FLT (the
default mechanism, seed 0), measured with ``--threads 1`` on a 2-core VM that other jobs
shared (torch 2.13 CPU; wall time of the whole command, data loading included). On that
busy machine two torch threads were often many times slower than one (OpenMP threads
waiting for a descheduled peer); on an idle 2-core laptop two threads are faster.
Metrics are deterministic for a seed on one machine. ``smoke`` runs in seconds (tests,
CI), ``small`` in a few minutes, ``base`` is larger.

Since training redraws the random features every step by default (``RunConfig.redraw_interval``,
:mod:`flt.train.drawgap`), metrics are on the fixed evaluation draw; numbers below that
say "one fixed draw" were measured before that default (``--run-opt redraw_interval=0``
reproduces them) and hold on that draw only, not on fresh draws or with exact attention.

Mechanism options. A mechanism is chosen by name; options that only make sense for a
given mechanism and task live in :data:`ATTENTION_DEFAULTS` and :data:`POSENC_DEFAULTS`,
keyed by name, and a user's ``--attn-opt`` / ``--posenc-opt`` override them. Names
without an entry get no options, so mechanisms added to :data:`flt.ATTENTION` later work
with every preset unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flt.models.config import ImageConfig, LMConfig, MoleculeConfig
from flt.train.config import Preset, RunConfig

#: Per task, options for mechanisms by name. FLT: local windows for text (its natural
#: spectrum: "attend to the last w tokens"), a 2-D Gaussian mixture for patches, a radial
#: Gaussian with the multiplicative coupling for atoms (rotation invariant with tied
#: lengths, exactly translation invariant on the fast path). Text and patches start with
#: a locality bias (``amplitude=1``, ``f(0) = 1`` decaying with distance) rather than
#: ``f = 0``: on the digits it reached 94% instead of 88% accuracy in the same 600 steps. The other linear mechanisms
#: get FLT's number of random features; softmax gets a relative bias that works for the
#: task's positions (T5 buckets for text, ALiBi on Euclidean distances otherwise). FLT's
#: exact counterpart is ``softmax`` with ``relative_bias=spectrum`` and FLT's spectrum options.
#: Text uses the banded estimator (``near_field=16``, docs/math.md section 5.1): the strong
#: local windows a language model learns are exact inside the band instead of inflating
#: FAVOR+'s variance; on the small preset it took validation ppl from 6.55 to 4.09 (seed 0,
#: one fixed draw), 4.135 with redraws every step.
ATTENTION_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "lm": {
        "flt": {"spectrum": "local", "num_features": 64, "num_frequencies": 16, "amplitude": 1.0, "near_field": 16},
        "performer": {"num_features": 64},
        "toeplitz": {"num_features": 64, "max_distance": 256},
        "softmax": {"relative_bias": "t5"},
    },
    "image": {
        "flt": {"spectrum": "gaussian_mixture", "num_features": 64, "num_frequencies": 16, "length_scale": 0.25,
                "amplitude": 1.0},
        "performer": {"num_features": 64},
        # ALiBi's slopes are per token: measure distances in patch spacings, 2 / grid = 0.5
        # for the 8x8 digits in 2x2 patches (pass 2 / grid for other images).
        "softmax": {"relative_bias": "alibi", "alibi_unit": 0.5},
    },
    "molecule": {
        "flt": {"spectrum": "gaussian", "coupling": "multiplicative", "num_features": 64, "num_frequencies": 32,
                "length_scale": 3.0},
        "performer": {"num_features": 64},
        "softmax": {"relative_bias": "alibi"},
    },
}

#: Per task, options for absolute encodings whose defaults assume another position range.
POSENC_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "lm": {"shifted_basis": {"domain": [0.0, 256.0]}},
    "image": {"shifted_basis": {"domain": [-1.0, 1.0]}},
    "molecule": {"shifted_basis": {"domain": [-10.0, 10.0]}},
}


def mechanism_options(task: str, attention: str, posenc: str, **overrides) -> dict[str, Any]:
    """``attention_options`` and ``posenc_options`` for a model config of ``task``."""
    return {
        "attention": attention,
        "attention_options": dict(ATTENTION_DEFAULTS[task].get(attention, {})),
        "posenc": posenc,
        "posenc_options": dict(POSENC_DEFAULTS[task].get(posenc, {})),
        **overrides,
    }


def lm_smoke(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train lm --preset smoke``: 40 steps of a 2-layer byte model on 200 kB of the
    Python docs. About 8 s; validation ppl 26 (bpb 4.7)."""
    model = LMConfig(dim=64, depth=2, heads=2, max_len=64, **mechanism_options("lm", attention, posenc))
    run = RunConfig(steps=40, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=20, eval_batches=4,
                    checkpoint_every=20, log_every=5)
    return Preset("lm", model, run, {"max_bytes": 200_000})


def lm_small(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train lm --preset small``: 4 layers, width 128, context 128 bytes, 800 steps
    of 16 windows on the Python docs corpus (1.9 MB train, 0.29 MB valid). FLT with
    ``near_field=16`` and redraws every step (seed 0, 2 threads, a 2-core VM partly shared
    with another job): About 13 min (13 min 25 s), 0.62 s/step; validation ppl 4.135 (bpb 2.048) on the
    whole validation split; draw gap on all of it: fresh draws 4.145 +- 0.012, exact 4.105.
    The draw gap now runs on the first 32 validation batches (it took 3.5 of those minutes
    on the whole split). Plain FLT (one fixed draw, no near field): about 5 min, ppl 6.55."""
    model = LMConfig(dim=128, depth=4, heads=4, max_len=128, **mechanism_options("lm", attention, posenc))
    run = RunConfig(steps=800, batch_size=16, lr=3e-3, warmup_steps=50, eval_every=100, eval_batches=16,
                    checkpoint_every=100, log_every=10, draw_gap_batches=32)
    return Preset("lm", model, run, {})


def lm_base(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train lm --preset base``: 6 layers, width 192, context 256 bytes, 2000 steps
    of 16 windows. About 1 h (3689 s); validation ppl 3.23 (bpb 1.69)."""
    model = LMConfig(dim=192, depth=6, heads=6, max_len=256, **mechanism_options("lm", attention, posenc))
    run = RunConfig(steps=2000, batch_size=16, lr=2e-3, warmup_steps=100, eval_every=250, eval_batches=16,
                    checkpoint_every=250, log_every=20, draw_gap_batches=32)
    return Preset("lm", model, run, {})


def image_smoke(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train image --preset smoke``: 60 steps on the 8x8 digits (2x2 patches).
    About 10 s; validation accuracy 0.33 (draw gap: fresh draws 0.26, exact 0.28; trained on
    one fixed draw: 0.56 on it, 0.16 on fresh draws)."""
    model = ImageConfig(dim=32, depth=2, heads=2, patch_size=2, **mechanism_options("image", attention, posenc))
    run = RunConfig(steps=60, batch_size=32, lr=3e-3, warmup_steps=5, eval_every=30, checkpoint_every=30, log_every=5)
    return Preset("image", model, run, {})


def image_small(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train image --preset small``: 4 layers, width 64, 2x2 patches (16 tokens),
    1000 steps of 64 digits (about 45 epochs). About 90 s; validation accuracy 0.975.

    CAPE (``--model-opt cape=true``) hurt here: 94% instead of 98% after 600 steps; its
    scaling by up to 1.4 changes every relative distance the spectrum sees."""
    model = ImageConfig(dim=64, depth=4, heads=4, patch_size=2, **mechanism_options("image", attention, posenc))
    run = RunConfig(steps=1000, batch_size=64, lr=3e-3, warmup_steps=50, eval_every=200, checkpoint_every=200, log_every=20)
    return Preset("image", model, run, {})


def image_base(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train image --preset base``: 6 layers, width 128, 2x2 patches, class token,
    3000 steps of 64 digits. About 10 min; validation accuracy 0.986.
    With ``--data DIR`` it trains on CIFAR-10 or an image folder instead (and takes longer)."""
    model = ImageConfig(dim=128, depth=6, heads=4, patch_size=2, pooling="cls", **mechanism_options("image", attention, posenc))
    run = RunConfig(steps=3000, batch_size=64, lr=1e-3, warmup_steps=150, eval_every=500, checkpoint_every=500, log_every=20)
    return Preset("image", model, run, {})


def molecule_smoke(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train molecule --preset smoke``: 60 steps on 160 generated structures with
    unrelaxed EMT energies (generated in about 3 s on first use, then cached).
    About 9 s; validation MAE 1.9 eV (predicting the mean: 1.9 eV)."""
    model = MoleculeConfig(dim=32, depth=2, heads=2, **mechanism_options("molecule", attention, posenc))
    run = RunConfig(steps=60, batch_size=16, lr=3e-3, warmup_steps=5, eval_every=30, checkpoint_every=30, log_every=5)
    return Preset("molecule", model, run, {"num_samples": 160, "relax_steps": 0, "valid_fraction": 0.2})


def molecule_small(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train molecule --preset small``: 3 layers, width 64, 800 steps of 32 on 1000
    generated catalysis structures (adsorption energies after at most 30 EMT relaxation
    steps; generating them takes about 1 min on first use, then they are cached).
    About 1 min; validation MAE 0.67 eV (draw gap: fresh draws 0.69 +- 0.06, exact 0.65;
    predicting the mean: 1.96 eV). Trained on one fixed draw: 0.25 eV on that draw, 3.4 eV
    on fresh draws and with exact attention."""
    model = MoleculeConfig(dim=64, depth=3, heads=4, **mechanism_options("molecule", attention, posenc))
    run = RunConfig(steps=800, batch_size=32, lr=2e-3, warmup_steps=50, eval_every=100, checkpoint_every=100, log_every=10)
    return Preset("molecule", model, run, {"num_samples": 1000})


def molecule_base(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train molecule --preset base``: 4 layers, width 128, 2000 steps of 32 on the
    default 2000 structures (about 2 min to generate once). About 6 min; validation
    MAE 0.16 eV (predicting the training mean: 2.22 eV)."""
    model = MoleculeConfig(dim=128, depth=4, heads=8, **mechanism_options("molecule", attention, posenc))
    run = RunConfig(steps=2000, batch_size=32, lr=1e-3, warmup_steps=100, eval_every=250, checkpoint_every=250, log_every=20)
    return Preset("molecule", model, run, {})


PRESETS: dict[str, dict[str, Callable[..., Preset]]] = {
    "lm": {"smoke": lm_smoke, "small": lm_small, "base": lm_base},
    "image": {"smoke": image_smoke, "small": image_small, "base": image_base},
    "molecule": {"smoke": molecule_smoke, "small": molecule_small, "base": molecule_base},
}


def get_preset(task: str, name: str, attention: str = "flt", posenc: str = "none") -> Preset:
    """``PRESETS[task][name](attention, posenc)`` with clear errors for unknown names."""
    if task not in PRESETS:
        raise ValueError(f"task must be one of {sorted(PRESETS)}, got {task!r}")
    if name not in PRESETS[task]:
        raise ValueError(f"preset must be one of {sorted(PRESETS[task])}, got {name!r}")
    return PRESETS[task][name](attention, posenc)
