"""``separation``: the Coulomb energy of two charged clusters (:mod:`flt.data.separation`),
trained at separations up to ``train_max`` and tested beyond it: a test that a distance
cutoff cannot pass, since past ``2 R + cutoff`` a cutoff model predicts no interaction.

The model is ``nbody``'s per-particle model (:class:`~flt.tasks.nbody.NBodyTask`'s config
class and builder, so every ``--model`` and ``--attention`` of ``nbody`` works here).
``target="potential"`` (the default) trains its outputs on each particle's potential, as
``nbody`` does, and the predicted energy is ``sum_i q_i out_i / 2``; ``target="energy"``
trains the sum of the outputs on the energy, one number per system (the usual protocol of
machine-learned potentials; it learns more slowly: docs/separation.md). The predicted
interaction energy is ``E(A + B) - E(A) - E(B)``, each cluster run alone through the model.

Data options (generated, nothing downloaded): ``cluster_particles`` (``n`` per cluster,
default 16), ``num_train`` (4096 systems), ``num_valid`` (128), ``num_test`` (512),
``seed``, ``train_max`` (largest training separation between the clusters' centres, in
mean spacings; default 10), ``test_max`` (largest validation and test separation, 20),
``max_charge`` (largest net charge of a cluster, 4), ``softening`` (1 spacing),
``target`` (``"potential"`` or ``"energy"``). Validation and test systems alternate
inside and beyond the training range.

Metrics, each over the systems inside the training range and, with ``_beyond``, over those
beyond it: ``mae`` (the headline: MAE of the total energy inside the training range, which
is what a run's learning rate is chosen on), ``int_mae`` (MAE of the predicted interaction
energy), and ``loss`` (the training objective: MSE of the standardised target, inside
only). Energies in Coulomb units: charges ``+-1``, distances in mean spacings. After
training, ``separation.png`` in the run directory plots predicted against true interaction
energy over the separation. docs/separation.md describes the task.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flt._checks import check_choice
from flt._io import atomic_savefig, new_figure
from flt.baselines.particles import ParticleConfig
from flt.data.separation import (
    Pairs,
    cluster_radius,
    interaction_energy,
    min_separation,
    move_apart,
    separation_splits,
)
from flt.models import replace_fields
from flt.tasks.base import Presets, Task, epoch_indices, eval_slices, mechanism_options, shard
from flt.tasks.nbody import NBodyTask
from flt.tasks.preset import Preset, RunConfig

#: ``(pos [B, 2n, 3], charge [B, 2n], potential [B, 2n], energy [B], interaction [B], beyond [B] bool)``.
PairBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
#: What the model's per-particle outputs are trained on (``target``): the energy, as their
#: sum, or each particle's potential, the energy being ``sum_i q_i out_i / 2``.
TARGETS = ("energy", "potential")

#: Where the metrics are summed: the systems inside the training range, and beyond it.
GROUPS = {"inside": "", "beyond": "_beyond"}
#: The plot's file in the run directory, and how many test systems it sweeps over the separation.
PLOT_NAME, SWEPT_SYSTEMS, SWEEP_POINTS = "separation.png", 3, 48


def smoke(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train separation --preset smoke``: 30 steps of 4 systems of two clusters of 8
    particles, width 32, one layer, target ``potential``. About 20 s for the whole command,
    mostly start-up (measured: 23 s and 25 ms per step with FLT, seed 0, ``--threads 1``,
    on the 2-core VM at a load average of 6 from other jobs); valid mae 3.9, int_mae 0.29
    (nothing learned in 30 steps: it is for tests)."""
    # nbody's config class, whichever it is, so that the preset builds nbody's models.
    model = SeparationTask.config(dim=32, depth=1, heads=2, **mechanism_options(SeparationTask, attention, posenc))
    run = RunConfig(steps=30, batch_size=4, lr=3e-3, warmup_steps=5, eval_every=15, checkpoint_every=15, log_every=5)
    data = {"cluster_particles": 8, "num_train": 64, "num_valid": 8, "num_test": 8}
    return Preset(SeparationTask.name, model, run, data)


def small(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train separation --preset small``: 2 layers, width 64, 4 heads, 2000 steps of
    16 systems of two clusters of 16 particles (4096 training systems, about 8 epochs),
    target ``potential``, separations up to 10 spacings in training and up to 20 in
    validation and test. About 2.5 min of steps with ``--model schnet`` (cutoff 2;
    measured: 72 ms per step, ``--threads 1``, load average about 4 from other jobs), test
    interaction MAE 0.83 inside the training range and 0.43 beyond; with the long-range
    block (``--model schnet+lr``, ``longrange={"frequencies": "coulomb", "heads": 1}``) 7 min
    (0.21 s per step), 0.024 inside and 0.13 beyond (seed 1); with its fixed tail and damped
    corrections (``{"frequencies": "coulomb", "heads": 1, "alpha": 0.3, "num_radii": 4,
    "width": 0.05, "quadrature": null, "amplitude": 0}``) about 30 min (0.87-0.97 s per step,
    another training beside it), 0.027 inside and 0.009 beyond (five seeds; docs/longrange.md)."""
    model = SeparationTask.config(dim=64, depth=2, heads=4, **mechanism_options(SeparationTask, attention, posenc))
    run = RunConfig(steps=2000, batch_size=16, lr=3e-3, warmup_steps=100, eval_every=500, checkpoint_every=500,
                    log_every=50, eval_batch_size=64, draw_gap_batches=2)
    return Preset(SeparationTask.name, model, run, {})


class SeparationTask(Task[PairBatch, ParticleConfig]):
    """Coulomb energy of two charged clusters, inside and beyond the training separations
    (MAE, lower is better)."""

    name = "separation"
    description = "Coulomb energy of two charged clusters, trained up to a separation and tested beyond it; bundled data: generated"
    # nbody's model, whatever nbody builds: the same config (saved under nbody's key) and builder.
    config, model, config_key = NBodyTask.config, NBodyTask.model, NBodyTask.name
    metric, higher_is_better, unit = "mae", False, "systems"
    compare_metrics = ("int_mae", "mae_beyond", "int_mae_beyond")
    options = ("cluster_particles", "num_train", "num_valid", "num_test", "seed", "train_max", "test_max", "max_charge",
               "softening", "target")
    bundled_options = options
    dataset = staticmethod(separation_splits)
    presets: ClassVar[Presets] = {"smoke": smoke, "small": small}
    attention_defaults, posenc_defaults, shortcuts = NBodyTask.attention_defaults, NBodyTask.posenc_defaults, NBodyTask.shortcuts
    axes: ClassVar[dict[str, str]] = {
        "loss": "MSE, standardised training target (unitless)", "mae": "energy MAE, inside the training range (Coulomb units)",
        "int_mae": "interaction-energy MAE, inside the training range (Coulomb units)",
        "mae_beyond": "energy MAE, beyond the training range (Coulomb units)",
        "int_mae_beyond": "interaction-energy MAE, beyond the training range (Coulomb units)",
        "offset": "mean particle spacings"}

    @classmethod
    def build_model(cls, config: Any, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> nn.Module:
        """``nbody``'s model of ``config`` (:meth:`NBodyTask.build_model`)."""
        return NBodyTask.build_model(config, device=device, dtype=dtype)

    @classmethod
    def attention_options(cls, attention: str, defaults: dict[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
        """``nbody``'s (:meth:`NBodyTask.attention_options`)."""
        return NBodyTask.attention_options(attention, defaults, chosen)

    def __init__(self, *, cluster_particles: int = 16, num_train: int = 4096, num_valid: int = 128, num_test: int = 512,
                 seed: int = 0, train_max: float = 10.0, test_max: float = 20.0, max_charge: int = 4,
                 softening: float = 1.0, target: str = "potential") -> None:
        check_choice("target", target, TARGETS)
        splits = separation_splits(cluster_particles=cluster_particles, num_train=num_train, num_valid=num_valid,
                                   num_test=num_test, seed=seed, train_max=train_max, test_max=test_max,
                                   max_charge=max_charge, softening=softening)
        self.train, self.valid, self.test = splits.train, splits.valid, splits.test
        self.train_max, self.test_max, self.min_separation = float(train_max), float(test_max), min_separation(cluster_particles)
        self.softening = float(softening)
        # The widest system: both balls at the largest separation.
        self.side = self.test_max + 2.0 * cluster_radius(cluster_particles)
        self.target = target
        # The training loss standardises what it compares: energies per system, or
        # potentials per particle.
        trained = self.train.energy if target == "energy" else self.train.potential
        self.loss_mean, self.loss_std = float(trained.double().mean()), float(trained.double().std())
        if not self.loss_std > 0:
            self.loss_std = 1.0
        # The model's per-particle output scale: for energies, N outputs of spread
        # std / sqrt(N) sum to the energies' spread.
        n = self.train.num_particles if target == "energy" else 1
        self.target_mean, self.target_std = self.loss_mean / n, self.loss_std / math.sqrt(n)

    def configure(self, cfg: ParticleConfig) -> ParticleConfig:
        return replace_fields(cfg, target_mean=self.target_mean, target_std=self.target_std)

    def train_batch(self, step: int, batch_size: int, seed: int, rank: int, world: int) -> PairBatch:
        idx = epoch_indices(len(self.train), batch_size, seed, step)[shard(batch_size, rank, world)]
        return _batch(self.train, idx)

    def batch_items(self, batch: PairBatch) -> int:
        return batch[3].numel()

    def _trained(self, out: torch.Tensor, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prediction, target)`` of the training loss, standardised: per system
        (``target="energy"``) or per particle (``"potential"``), from the outputs ``out``."""
        _, _, potential, energy, _, _ = batch
        pred, true = (out.sum(-1), energy) if self.target == "energy" else (out, potential)
        return (pred.float() - self.loss_mean) / self.loss_std, (true.float() - self.loss_mean) / self.loss_std

    def loss(self, model: nn.Module, batch: PairBatch) -> torch.Tensor:
        pos, charge = batch[0], batch[1]
        return F.mse_loss(*self._trained(model(charge, pos), batch))

    def _batches(self, pairs: Pairs, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[PairBatch]:
        for sl in eval_slices(len(pairs), batch_size, max_batches, rank, world):
            yield _batch(pairs, sl)

    def eval_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[PairBatch]:
        return self._batches(self.valid, batch_size, max_batches, rank, world)

    def test_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[PairBatch]:
        return self._batches(self.test, batch_size, max_batches, rank, world)

    def eval_sums(self, model: nn.Module, batch: PairBatch) -> dict[str, float]:
        pos, charge, _, energy, interaction, beyond = batch
        out = model(charge, pos)
        pred, pred_int = predict(model, charge, pos, self.target, out=out)
        err, int_err = pred.double() - energy.double(), pred_int.double() - interaction.double()
        # The training loss's squared error per system (the mean over its particles for potentials).
        trained, true = self._trained(out, batch)
        sq = ((trained.double() - true.double()) ** 2).reshape(len(energy), -1).mean(-1)
        sums = {}
        # Every key, even with no system in a group, so that processes agree on the keys.
        for group, suffix in GROUPS.items():
            mask = beyond if group == "beyond" else ~beyond
            sums.update({f"sq{suffix}": float(sq[mask].sum()), f"abs{suffix}": float(err[mask].abs().sum()),
                         f"int_abs{suffix}": float(int_err[mask].abs().sum()), f"count{suffix}": float(mask.sum())})
        return sums

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        out = {}
        for suffix in GROUPS.values():
            count = sums.get(f"count{suffix}", 0.0)
            if count > 0:  # a capped evaluation may hold no system beyond the range
                out.update({f"mae{suffix}": sums[f"abs{suffix}"] / count, f"int_mae{suffix}": sums[f"int_abs{suffix}"] / count})
                if not suffix:
                    out["loss"] = sums["sq"] / count
        return out

    def rpe_extent(self, cfg: ParticleConfig) -> tuple[float, bool]:
        return math.ceil(self.side), False

    def longest_sequence(self, cfg: ParticleConfig) -> int:
        return self.valid.num_particles

    def report(self, model: nn.Module, device: torch.device) -> str | None:
        return (f"separations: training {self.min_separation:.2f} to {self.train_max:g} spacings, beyond up to "
                f"{self.test_max:g}; energies in Coulomb units (charges +-1, distances in mean spacings)")

    def plots(self, model: nn.Module, out_dir: str) -> list[str]:
        """``separation.png``: predicted and true interaction energy over the separation
        (:func:`plot_separation`)."""
        plot_separation(model, self, os.path.join(out_dir, PLOT_NAME))
        return [PLOT_NAME]


def _batch(pairs: Pairs, idx: torch.Tensor | slice) -> PairBatch:
    return pairs.pos[idx], pairs.charge[idx], pairs.potential[idx], pairs.energy[idx], pairs.interaction[idx], pairs.beyond[idx]


def energy_of(out: torch.Tensor, charge: torch.Tensor, target: str) -> torch.Tensor:
    """The energy ``[B]`` that per-particle outputs ``out [B, N]`` trained on ``target``
    mean: their sum (``"energy"``), or ``sum_i q_i out_i / 2`` (``"potential"``)."""
    return out.sum(-1) if target == "energy" else 0.5 * (charge * out).sum(-1)


def predict(model: nn.Module, charge: torch.Tensor, pos: torch.Tensor, target: str = "energy", *,
            out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(energy [B], interaction [B])`` predicted by a per-particle ``model`` trained on
    ``target`` for systems ``charge [B, 2n], pos [B, 2n, 3]`` of two clusters (the first
    ``n`` particles, then the last): the energy of its outputs (:func:`energy_of`; ``out``,
    the outputs on the whole systems if already computed), and that energy less each
    cluster's run alone."""
    n = pos.shape[1] // 2
    energy = energy_of(model(charge, pos) if out is None else out, charge, target)
    alone = energy_of(model(charge[:, :n], pos[:, :n]), charge[:, :n], target) \
        + energy_of(model(charge[:, n:], pos[:, n:]), charge[:, n:], target)
    return energy, energy - alone


@torch.no_grad()
def interaction_sweep(model: nn.Module, task: SeparationTask, systems: int = SWEPT_SYSTEMS,
                      points: int = SWEEP_POINTS) -> dict[str, Any]:
    """The first ``systems`` test systems moved to ``points`` separations from the smallest
    to ``test_max``: ``{"separation": [points], "true": [systems, points], "pred": [systems,
    points], "charges": [(Q_A, Q_B)] }`` (tensors on the CPU, float64 truth)."""
    test = task.test
    systems = min(systems, len(test))
    device = next(model.parameters()).device
    grid = torch.linspace(task.min_separation, task.test_max, points, dtype=torch.float64)
    n = test.cluster_particles
    pos = test.pos[:systems].double().repeat_interleave(points, 0)
    charge = test.charge[:systems].repeat_interleave(points, 0)
    moved = move_apart(pos, test.direction[:systems].double().repeat_interleave(points, 0),
                       test.separation[:systems].double().repeat_interleave(points, 0), grid.repeat(systems))
    true = interaction_energy(moved[:, :n], charge[:, :n], moved[:, n:], charge[:, n:], task.softening)
    was_training = model.training
    model.eval()
    try:
        _, pred = predict(model, charge.to(device), moved.float().to(device), task.target)
    finally:
        model.train(was_training)
    charges = [(int(test.charge[k, :n].sum()), int(test.charge[k, n:].sum())) for k in range(systems)]
    return {"separation": grid, "true": true.view(systems, points), "pred": pred.double().cpu().view(systems, points),
            "charges": charges}


@torch.no_grad()
def split_interactions(model: nn.Module, task: SeparationTask, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(true, predicted)`` interaction energies ``[S]`` of the test systems (CPU)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        preds = [predict(model, charge.to(device), pos.to(device), task.target)[1].double().cpu()
                 for pos, charge, *_ in task._batches(task.test, batch_size, None, 0, 1)]
    finally:
        model.train(was_training)
    return task.test.interaction.double(), torch.cat(preds)


def plot_separation(model: nn.Module, task: SeparationTask, path: str) -> None:
    """Write ``path`` (PNG, atomically): left, the interaction energy of a few test systems
    moved from the smallest separation to ``test_max``, true and predicted by ``model``;
    right, predicted against true interaction energy of every test system, inside and
    beyond the training range. Needs matplotlib."""
    sweep = interaction_sweep(model, task)
    true, pred = split_interactions(model, task)
    beyond = task.test.beyond
    fig = new_figure(10, 4.0)
    ax1, ax2 = fig.subplots(1, 2)
    grid = sweep["separation"].numpy()
    for k, (qa, qb) in enumerate(sweep["charges"]):
        ax1.plot(grid, sweep["true"][k].numpy(), color=f"C{k}", lw=1.2, label=f"Q_A={qa:+d}, Q_B={qb:+d}")
        ax1.plot(grid, sweep["pred"][k].numpy(), color=f"C{k}", lw=1.2, ls="--")
    ax1.axvline(task.train_max, color="0.4", ls=":", lw=1)
    ax1.annotate("training range ends", (task.train_max, 0.02), xycoords=("data", "axes fraction"), fontsize=7,
                 rotation=90, ha="right", va="bottom", color="0.3")
    ax1.axhline(0.0, color="0.7", lw=0.6)
    ax1.set(xlabel="separation of the clusters' centres (mean spacings)", ylabel="interaction energy (Coulomb units)",
            title="test systems moved apart (solid: true, dashed: predicted)")
    ax1.legend(fontsize=7)
    for mask, label, color in ((~beyond, f"inside (d <= {task.train_max:g})", "C0"), (beyond, "beyond", "C3")):
        ax2.scatter(true[mask].numpy(), pred[mask].numpy(), s=5, alpha=0.6, color=color, label=label)
    lo, hi = float(torch.cat([true, pred]).min()), float(torch.cat([true, pred]).max())
    ax2.plot([lo, hi], [lo, hi], color="0.5", lw=0.8, ls="--")
    ax2.set(xlabel="true interaction energy (Coulomb units)", ylabel="predicted interaction energy",
            title="every test system")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.suptitle(f"separation: interaction energy, {len(task.test)} test systems")
    atomic_savefig(fig, path)
