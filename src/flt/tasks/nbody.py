"""``nbody``: per-particle regression of the screened-Coulomb (Yukawa) potential of random
3-D clouds of charges (:mod:`flt.data.nbody`); a task where long-range relative position
must matter: the exact contribution of the 15 nearest particles explains 73% of the
target's variance, and no absolute position tells anything (docs/nbody.md).

Data options (all generated, nothing downloaded): ``num_particles`` (``N`` of the training
clouds, even; default 256), ``eval_particles`` (``N`` of the validation and test clouds;
default ``num_particles``; ``flt evaluate RUN --data-opt eval_particles=1024`` measures a
trained run on larger clouds at the same density, i.e. a larger box), ``num_train``,
``num_valid``, ``num_test`` (clouds per split), ``seed``, ``layout`` (``"uniform"`` in a
box or ``"blobs"``, four Gaussian blobs whose density varies), ``density`` (particles per
unit volume: the mean spacing is 1 at the default 1.0), ``screening`` (``lambda``, default
3 spacings; the box side is 6.3 at ``N = 256``), ``softening`` (default 1 spacing).
``--data-opt screening=none`` is the bare softened Coulomb potential (docs/nbody.md).
``mixed_particles`` (``N`` of a second pool of training clouds, even; default none) and
``mixed_train`` (clouds in it, default ``num_train // 4``): every other training step draws
its batch from that pool, so a model sees offsets of a larger box while training (the
normalisation of the target stays the first pool's).

Metric: ``nmse``, the normalised MSE ``sum (pred - y)^2 / sum (y - mean)^2`` with the
training mean (``1 - R^2``; predicting the mean gives 1), lower is better; ``rel_mae``
likewise with absolute errors. ``loss`` is the MSE of the standardised target. The test
split is evaluated once, after training (``summary.json``'s ``test``), and chooses nothing.

Models (``--model``, ``ParticleConfig.encoder``; built by
:func:`flt.baselines.particles.particle_model`): ``transformer`` (the default, with any
``--attention``), ``schnet`` (a per-particle SchNet from torch_geometric's blocks, radius
graph at ``cutoff`` mean spacings, ``--model-opt cutoff=3``), and both with the long-range
block, ``transformer+lr`` and ``schnet+lr`` (``--model-opt longrange='{"frequencies":
"grid"}'``, ``--model-opt longrange_placement=each``; docs/longrange.md).

Attention averages, the target is a sum: the values are averaged with weights ``f K``;
in a neutral cloud a mask ``f = g + c`` makes the average proportional to the sum (see
:mod:`flt.data.nbody`), so a model needs no count channel, and none is given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flt._checks import check_positive_int
from flt.baselines.particles import (
    PARTICLE_ENCODERS,
    ParticleConfig,
    ParticleRegressor,
    particle_model,
)
from flt.data.nbody import (
    Clouds,
    box_side,
    check_cloud_size,
    cloud_splits,
    generate_clouds,
    yukawa_potential,
)
from flt.models import replace_fields
from flt.models.memory import check_model_memory
from flt.tasks.base import (
    Presets,
    Shortcuts,
    Task,
    epoch_indices,
    eval_slices,
    mechanism_options,
    shard,
)
from flt.tasks.preset import Preset, RunConfig

#: ``(pos [B, N, 3], charge [B, N], y [B, N])``.
CloudBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: Distance bands of :meth:`NBodyTask.error_breakdown`, in mean spacings.
BREAKDOWN_EDGES = (0.0, 2.0, 3.0, 4.0, 6.0, 8.0, 11.0, 16.0, math.inf)

#: One mask family for every row that has one: a mixture of 4 Gaussians centred at 0
#: (nonnegative, radial per component) with lengths spread from 1 to 16 spacings, enough to
#: draw ``exp(-r / 3) / sqrt(r^2 + 1)`` plus a near-constant term. FLT in the FLT paper's
#: multiplicative coupling ``f(r_i - r_j) phi(q_i).phi(k_j)`` with FAVOR+ features (the
#: feature map the near-set controls need, ``near_neighbors``); softmax with the same mask
#: family multiplying its exact weights (the O(N^2) reference); Performer with FLT's features.
MASK = {"spectrum": "gaussian_mixture", "coupling": "multiplicative", "components": 4, "length_scale": 1.0,
        "length_spread": 16.0}
ATTENTION_DEFAULTS: dict[str, dict[str, Any]] = {
    "flt": {**MASK, "num_features": 16, "num_frequencies": 64, "sampler": "qmc"},
    "performer": {"num_features": 16},
    "softmax": {"relative_bias": "spectrum", **MASK},
}
POSENC_DEFAULTS: dict[str, dict[str, Any]] = {"shifted_basis": {"domain": [-8.0, 8.0]}, "fourier": {"gamma": 2.0}}


def smoke(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train nbody --preset smoke``: 30 steps of 2 clouds of 128 particles, width 32,
    one layer. About 15 s (mostly start-up); nmse about 1 (nothing learned in 30 steps: it
    is for tests)."""
    model = ParticleConfig(dim=32, depth=1, heads=2, **mechanism_options(NBodyTask, attention, posenc))
    run = RunConfig(steps=30, batch_size=2, lr=3e-3, warmup_steps=5, eval_every=15, checkpoint_every=15, log_every=5)
    data = {"num_particles": 128, "num_train": 16, "num_valid": 4, "num_test": 4}
    return Preset(NBodyTask.name, model, run, data)


def small(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train nbody --preset small``: 2 layers, width 64, 4 heads, 400 steps of 4 clouds
    of 256 particles (1024 training clouds, generated in seconds). About 8 to 25 min for FLT
    and 30 min for exact softmax on a 2-core VM shared by 6 to 15 jobs (1.2 to 3.3 and 4
    s/step); not timed on an idle machine. Test nmse (docs/nbody.md, seeds 1-3): exact softmax with the same mask
    0.012 +- 0.001, the 16-nearest cutoff 0.149 +- 0.008, FLT with the far field only
    0.466 +- 0.053 at lr 3e-3 (0.87 +- 0.20 at 1e-2, two seeds of three learned nothing),
    Performer 0.996; FLT with the 16-nearest near set, a far field floored at 2 spacings
    (``min_length``) and fixed draws (``--run-opt redraw_interval=0``) 0.111 +- 0.009 at its
    selected lr 1e-2 (0.067 +- 0.025 at 3e-3; 0.089 +- 0.033 re-run at 3e-3 on later code);
    FLT with learned frequencies and no near set (``--attention flt:spectrum=discrete --run-opt
    redraw_interval=0``) 0.030 +- 0.001 at its selected lr 3e-3, exact softmax with that
    discrete term 0.026 +- 0.001."""
    model = ParticleConfig(dim=64, depth=2, heads=4, **mechanism_options(NBodyTask, attention, posenc))
    run = RunConfig(steps=400, batch_size=4, lr=3e-3, warmup_steps=20, eval_every=200, checkpoint_every=200,
                    log_every=20, eval_batch_size=8, draw_gap_batches=1)
    return Preset(NBodyTask.name, model, run, {})


def _dipole_term(pos: torch.Tensor, charge: torch.Tensor) -> torch.Tensor:
    """``(r_i - c).D [S, N]`` per cloud, ``c`` its centre and ``D = sum_j q_j (r_j - c)``:
    ``sum_j q_j |r_i - r_j|^2 = -2 (r_i - c).D + sum_j q_j |r_j - c|^2`` in a neutral cloud:
    the response of an ``r^2`` kernel, less a constant per cloud."""
    centred = pos - pos.mean(1, keepdim=True)
    dipole = (charge[..., None] * centred).sum(1, keepdim=True)
    return (centred * dipole).sum(-1)


class NBodyTask(Task[CloudBatch, ParticleConfig]):
    """Per-particle Yukawa potential of neutral 3-D clouds (normalised MSE, lower is better)."""

    name = "nbody"
    description = "per-particle screened-Coulomb potential of random 3-D charge clouds; bundled data: generated"
    config, model = ParticleConfig, ParticleRegressor
    metric, higher_is_better, compare_metrics, unit = "nmse", False, ("rel_mae",), "particles"
    options = ("num_particles", "eval_particles", "num_train", "num_valid", "num_test", "seed", "layout", "density",
               "screening", "softening", "mixed_particles", "mixed_train")
    bundled_options = options
    dataset = staticmethod(cloud_splits)
    presets: ClassVar[Presets] = {"smoke": smoke, "small": small}
    attention_defaults, posenc_defaults = ATTENTION_DEFAULTS, POSENC_DEFAULTS
    axes: ClassVar[dict[str, str]] = {"loss": "MSE, standardised target (unitless)", "nmse": "normalised MSE (1 - R^2)",
                                      "rel_mae": "MAE / mean |y - mean|", "offset": "mean particle spacings"}
    shortcuts: ClassVar[Shortcuts] = {"model": ("model", "encoder", f"the model, one of {', '.join(PARTICLE_ENCODERS)} (--model-opt encoder=)")}

    def __init__(self, *, num_particles: int = 256, eval_particles: int | None = None, num_train: int = 1024,
                 num_valid: int = 32, num_test: int = 32, seed: int = 0, layout: str = "uniform", density: float = 1.0,
                 screening: float | None = 3.0, softening: float = 1.0, mixed_particles: int | None = None,
                 mixed_train: int | None = None) -> None:
        splits = cloud_splits(num_particles=num_particles, eval_particles=eval_particles, num_train=num_train,
                              num_valid=num_valid, num_test=num_test, seed=seed, layout=layout, density=density,
                              screening=screening, softening=softening)
        self.train, self.valid, self.test = splits.train, splits.valid, splits.test
        self.mixed: Clouds | None = None
        if mixed_particles is None:
            if mixed_train is not None:
                raise ValueError(f"mixed_train ({mixed_train!r}) needs mixed_particles, the size of the second pool's clouds")
        else:
            check_cloud_size("mixed_particles", mixed_particles)
            if mixed_particles == num_particles:
                raise ValueError(f"mixed_particles ({mixed_particles}) must differ from num_particles: the mixed pool "
                                 f"would repeat the first training clouds")
            if mixed_train is None:
                mixed_train = max(1, num_train // 4)
            check_positive_int("mixed_train", mixed_train)
            self.mixed = generate_clouds(mixed_train, mixed_particles, seed=seed, split="train", layout=layout,
                                         density=density, screening=screening, softening=softening)
        self.side = box_side(max(num_particles, mixed_particles or 0), density)
        self.screening, self.softening = screening, softening
        self.spacing = float(density) ** (-1 / 3)
        y = self.train.y.double()
        self.target_mean, self.target_std = float(y.mean()), float(y.std())

    @classmethod
    def build_model(cls, config: Any, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> nn.Module:
        """The model ``config.encoder`` names (:func:`flt.baselines.particles.particle_model`)."""
        if not isinstance(config, ParticleConfig):
            raise TypeError(f"task {cls.name!r} builds from ParticleConfig, got {type(config).__name__}")
        check_model_memory(config, batch=1, length=1, training=False, device=device, purpose="building")
        return particle_model(config, device=device, dtype=dtype)

    def configure(self, cfg: ParticleConfig) -> ParticleConfig:
        return replace_fields(cfg, target_mean=self.target_mean, target_std=self.target_std, spacing=self.spacing)

    def train_batch(self, step: int, batch_size: int, seed: int, rank: int, world: int) -> CloudBatch:
        """(1-based) step ``step``'s batch: from the first pool, or on even steps from the
        ``mixed`` pool when there is one (each pool in its own shuffled epochs)."""
        pool, index = self.train, step
        if self.mixed is not None:
            pool, index = (self.train, (step + 1) // 2) if step % 2 else (self.mixed, step // 2)
            if pool is self.mixed and len(pool) < batch_size:
                raise ValueError(f"mixed_train ({len(pool)} clouds) must be at least the batch size ({batch_size})")
        idx = epoch_indices(len(pool), batch_size, seed, index)[shard(batch_size, rank, world)]
        return pool.pos[idx], pool.charge[idx], pool.y[idx]

    def batch_items(self, batch: CloudBatch) -> int:
        return batch[2].numel()

    def loss(self, model: nn.Module, batch: CloudBatch) -> torch.Tensor:
        pos, charge, y = batch
        pred = model(charge, pos)
        return F.mse_loss((pred.float() - self.target_mean) / self.target_std, (y.float() - self.target_mean) / self.target_std)

    def _batches(self, clouds: Clouds, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[CloudBatch]:
        for sl in eval_slices(len(clouds), batch_size, max_batches, rank, world):
            yield clouds.pos[sl], clouds.charge[sl], clouds.y[sl]

    def eval_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[CloudBatch]:
        return self._batches(self.valid, batch_size, max_batches, rank, world)

    def test_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[CloudBatch]:
        return self._batches(self.test, batch_size, max_batches, rank, world)

    def eval_sums(self, model: nn.Module, batch: CloudBatch) -> dict[str, float]:
        pos, charge, y = batch
        y = y.double()
        err = model(charge, pos).double() - y
        centred = y - self.target_mean
        return {"sq": float((err**2).sum()), "abs": float(err.abs().sum()), "var": float((centred**2).sum()),
                "dev": float(centred.abs().sum()), "count": float(err.numel())}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["sq"] / sums["count"] / self.target_std**2, "nmse": sums["sq"] / sums["var"],
                "rel_mae": sums["abs"] / sums["dev"]}

    def error_breakdown(self, model: nn.Module, batches: Iterable[CloudBatch],
                        edges: Sequence[float] = BREAKDOWN_EDGES) -> dict[str, Any]:
        """Where ``model``'s error on ``batches`` lies by distance (``flt evaluate --breakdown``).

        The target splits into bands of the pairs' distance, ``y_i = sum_b y_ib`` (``edges``
        in mean spacings, :func:`flt.data.nbody.yukawa_potential`). The error ``e = pred -
        y`` is fitted by least squares as ``c_0 + sum_b c_b y_ib``: ``c_b`` is the model's
        relative error on band ``b``'s contribution (``-0.1``: 10% too weak there, as a
        kernel that falls too fast would be), and the nmse left after removing that fit is
        the error no per-band gain explains (the bands' empty on small clouds get 0).
        ``dipole_share`` is the part of the squared error that ``kappa (r_i - c).D`` fits
        (``c`` the cloud's centre, ``D = sum_j q_j (r_j - c)`` its dipole), no constant: most
        of what a kernel with an ``r^2`` part (``a + b r^2`` over the training box) adds on a
        larger box, the rest being a constant per cloud.
        Returns ``{"edges", "nmse", "nmse_left", "dipole_share", "bands": [{"low", "high",
        "share", "coef"}]}``, ``share`` the band's variance over the target's, an unbounded
        last edge as None."""
        bounds = [float(e) * self.spacing for e in edges]
        width = len(bounds)  # B bands and a constant
        xtx, xte = torch.zeros(width, width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64)
        ete = var = dd = de = 0.0
        with torch.inference_mode():
            for pos, charge, y in batches:
                err = (model(charge, pos).double() - y.double()).flatten().cpu()
                bands = yukawa_potential(pos.cpu(), charge.cpu(), self.screening, self.softening, edges=bounds)
                x = torch.cat([bands.reshape(-1, width - 1), torch.ones(err.numel(), 1, dtype=torch.float64)], -1)
                xtx += x.T @ x
                xte += x.T @ err
                ete += float(err @ err)
                dip = _dipole_term(pos.cpu().double(), charge.cpu().double()).flatten()
                dd, de = dd + float(dip @ dip), de + float(dip @ err)
                var += float(((y.double() - self.target_mean) ** 2).sum())
        count = float(xtx[-1, -1])  # the constant column: sums of the bands in the last row, of squares on the diagonal
        if not count:
            raise ValueError("error_breakdown needs at least one batch")
        # Bands with no pair (beyond a small box) are zero columns: fit the others, give those 0.
        used = torch.diagonal(xtx) > 0
        coef = torch.zeros(width, dtype=torch.float64)
        coef[used] = torch.linalg.lstsq(xtx[used][:, used], xte[used][:, None], driver="gelsd").solution.flatten()
        left = max(ete - 2 * float(coef @ xte) + float(coef @ xtx @ coef), 0.0)  # |e - X c|^2
        band_var = torch.diagonal(xtx)[:-1] / count - (xtx[-1, :-1] / count) ** 2
        shown = [float(e) if math.isfinite(e) else None for e in edges]  # JSON has no infinity
        return {"edges": shown, "nmse": ete / var, "nmse_left": left / var,
                "dipole_share": (de * de / dd) / ete if dd > 0 and ete > 0 else 0.0,
                "bands": [{"low": lo, "high": hi, "share": float(v) / (var / count), "coef": float(c)}
                          for lo, hi, v, c in zip(shown[:-1], shown[1:], band_var, coef[:-1], strict=True)]}

    def rpe_extent(self, cfg: ParticleConfig) -> tuple[float, bool]:
        return math.ceil(self.side), False

    def longest_sequence(self, cfg: ParticleConfig) -> int:
        return self.valid.num_particles

    def step_shape(self, cfg: ParticleConfig, batch_size: int) -> tuple[int, int | None]:
        """The largest clouds a step or an evaluation holds: the mixed pool's too."""
        mixed = 0 if self.mixed is None else self.mixed.num_particles
        return batch_size, max(self.valid.num_particles, self.train.num_particles, mixed)
