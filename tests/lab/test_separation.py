"""``separation``: two charged clusters, their exact Coulomb energy, the separation ranges of
the splits, the task's interaction metrics and plot, and a smoke run through the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from flt.cli import main
from flt.data.separation import (
    cluster_radius,
    coulomb_energy,
    generate_pairs,
    interaction_energy,
    min_separation,
    move_apart,
)
from flt.tasks import TASKS, config_from_dict, config_to_dict, get_preset, load_task
from flt.tasks.nbody import NBodyTask
from flt.tasks.separation import SeparationTask, interaction_sweep, plot_separation, predict

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"cluster_particles": 6, "num_train": 8, "num_valid": 6, "num_test": 6}


def _pair_sum(pos: np.ndarray, charge: np.ndarray, softening: float, pairs=None) -> float:
    """``sum q_i q_j / sqrt(r^2 + s^2)`` over ``pairs`` (default: every ``i < j``), one by one."""
    n = len(charge)
    pairs = pairs if pairs is not None else [(i, j) for i in range(n) for j in range(i + 1, n)]
    return sum(charge[i] * charge[j] / math.sqrt(float(np.sum((pos[i] - pos[j]) ** 2)) + softening**2) for i, j in pairs)


@pytest.mark.parametrize("softening", [0.0, 0.7])
def test_the_energies_are_the_pair_by_pair_float64_sums(softening):
    pairs = generate_pairs(4, 5, seed=2, split="valid", max_charge=3, softening=softening)
    n = 5
    for k in range(4):
        pos, charge = pairs.pos[k].double().numpy(), pairs.charge[k].double().numpy()
        across = [(i, j) for i in range(n) for j in range(n, 2 * n)]
        assert float(pairs.energy[k]) == pytest.approx(_pair_sum(pos, charge, softening), rel=1e-6, abs=1e-6)
        assert float(pairs.energy_a[k]) == pytest.approx(_pair_sum(pos[:n], charge[:n], softening), rel=1e-6, abs=1e-6)
        assert float(pairs.energy_b[k]) == pytest.approx(_pair_sum(pos[n:], charge[n:], softening), rel=1e-6, abs=1e-6)
        assert float(pairs.interaction[k]) == pytest.approx(_pair_sum(pos, charge, softening, across), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(pairs.energy - pairs.energy_a - pairs.energy_b, pairs.interaction, rtol=0, atol=1e-5)
    for k in range(4):
        pos, charge = pairs.pos[k].double().numpy(), pairs.charge[k].double().numpy()
        others = [[(i, j) for j in range(2 * n) if j != i] for i in range(2 * n)]
        phi = [sum(charge[j] / math.sqrt(float(np.sum((pos[i] - pos[j]) ** 2)) + softening**2) for _, j in o)
               for i, o in enumerate(others)]
        np.testing.assert_allclose(pairs.potential[k].double().numpy(), phi, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(0.5 * (pairs.charge * pairs.potential).sum(1), pairs.energy, rtol=0, atol=1e-5)


def test_generation_is_a_function_of_the_seed_split_and_index():
    a = generate_pairs(5, 6, seed=1, split="test")
    b = generate_pairs(3, 6, seed=1, split="test")
    for name in ("pos", "charge", "energy", "interaction", "separation", "beyond"):
        assert torch.equal(getattr(a, name)[:3], getattr(b, name))
    assert not torch.equal(generate_pairs(3, 6, seed=2, split="test").pos, b.pos)
    assert not torch.equal(generate_pairs(3, 6, seed=1, split="valid").pos, b.pos)


def test_the_splits_respect_the_separation_ranges_and_the_clusters_their_balls():
    task = SeparationTask(cluster_particles=8, num_train=64, num_valid=16, num_test=16, train_max=7.0, test_max=12.0,
                          max_charge=4)
    d_min = min_separation(8)
    assert d_min == pytest.approx(2 * cluster_radius(8) + 1)
    train = task.train.separation
    assert float(train.min()) >= d_min and float(train.max()) <= 7.0 and not bool(task.train.beyond.any())
    for split in (task.valid, task.test):
        inside, beyond = split.separation[0::2], split.separation[1::2]
        assert float(inside.min()) >= d_min and float(inside.max()) <= 7.0
        assert float(beyond.min()) > 7.0 and float(beyond.max()) <= 12.0
        assert torch.equal(split.beyond, torch.arange(len(split)) % 2 == 1)
    for split in (task.train, task.test):
        n = split.cluster_particles
        half = 0.5 * split.separation[:, None, None] * split.direction[:, None, :]
        for cluster, centre in ((split.pos[:, :n], -half), (split.pos[:, n:], half)):
            assert float((cluster - centre).norm(dim=-1).max()) <= cluster_radius(n) + 1e-5
        nets = torch.cat([split.charge[:, :n].sum(1), split.charge[:, n:].sum(1)])
        assert float(nets.abs().max()) <= 4 and bool((nets % 2 == 0).all())
        assert set(split.charge.unique().tolist()) == {-1.0, 1.0}


def test_the_interaction_falls_off_as_the_product_of_the_net_charges_over_the_distance():
    pairs = generate_pairs(6, 8, seed=4, split="train", max_charge=4, softening=1.0)
    n = 8
    qa, qb = pairs.charge[:, :n].double().sum(1), pairs.charge[:, n:].double().sum(1)
    assert bool((qa * qb != 0).any())
    residuals = []
    for d in (1e2, 1e3, 1e4):
        moved = move_apart(pairs.pos.double(), pairs.direction.double(), pairs.separation.double(),
                           torch.full((6,), d, dtype=torch.float64))
        e_int = interaction_energy(moved[:, :n], pairs.charge[:, :n], moved[:, n:], pairs.charge[:, n:], 1.0)
        assert float(e_int.abs().max()) <= 16.0 / d * 1.1  # -> 0
        residuals.append(float((d * e_int - qa * qb).abs().max()))  # d E_int -> Q_A Q_B, the dipoles' part as 1 / d
    assert residuals[0] < 0.5 and residuals[1] < residuals[0] / 5 and residuals[2] < residuals[1] / 5
    # Moving the clusters apart changes neither one: their own energies stay.
    moved = move_apart(pairs.pos.double(), pairs.direction.double(), pairs.separation.double(),
                       torch.full((6,), 50.0, dtype=torch.float64))
    torch.testing.assert_close(coulomb_energy(moved[:, :n], pairs.charge[:, :n], 1.0).float(), pairs.energy_a)


@pytest.mark.parametrize(("options", "message"), [
    ({"train_max": 3.0}, r"train_max must be a finite number > 3\.\d+"),
    ({"train_max": 8.0, "test_max": 8.0}, r"test_max must be a finite number > 8"),
    ({"max_charge": 7}, r"max_charge must be an integer from 0 to cluster_particles \(6\), got 7"),
    ({"softening": -1.0}, r"softening must be a finite number >= 0"),
    ({"cluster_particles": 0}, r"cluster_particles must be a positive integer"),
    ({"num_test": 0}, r"num_test must be a positive integer"),
    ({"target": "force"}, r"target must be one of"),
])
def test_bad_data_options_are_refused_with_their_name(options, message):
    with pytest.raises(ValueError, match=message):
        SeparationTask(**{**TINY, **options})


def test_unknown_and_mistyped_data_options_are_named():
    with pytest.raises(ValueError, match=r"unknown data options for 'separation': \['screening'\]"):
        load_task("separation", {"screening": 3.0})
    with pytest.raises(TypeError, match=r"option 'max_charge' must be an int"):
        load_task("separation", {**TINY, "max_charge": 2.5})


class _Oracle(nn.Module):
    """Exact per-particle outputs for ``target``: the softened potential ``phi_i`` of the
    others (``"potential"``), or ``q_i phi_i / 2`` (``"energy"``: the outputs sum to the
    exact energy), of any subset of the particles."""

    def __init__(self, softening: float, target: str = "potential") -> None:
        super().__init__()
        self.softening, self.target = softening, target
        self.unused = nn.Parameter(torch.zeros(()))

    def forward(self, charge: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        r = torch.cdist(pos.double(), pos.double())
        g = 1.0 / torch.sqrt(r * r + self.softening**2) * (1 - torch.eye(pos.shape[1], dtype=torch.float64))
        phi = (g @ charge.double()[..., None])[..., 0]
        return phi if self.target == "potential" else 0.5 * charge.double() * phi


class _Local(nn.Module):
    """Per-particle outputs that see no other particle: a model whose cutoff is below every gap."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.3))

    def forward(self, charge: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.w * charge


@torch.no_grad()
@pytest.mark.parametrize("target", ["potential", "energy"])
def test_the_metrics_are_zero_for_the_exact_outputs_and_the_interaction_for_a_model_that_sees_nothing_across(target):
    task = SeparationTask(**TINY, target=target)
    batch = next(task.test_batches(6, None, 0, 1))
    exact = task.metrics(task.eval_sums(_Oracle(1.0, target), batch))
    assert set(exact) == {"loss", "mae", "int_mae", "mae_beyond", "int_mae_beyond"}
    assert all(v == pytest.approx(0.0, abs=1e-5) for v in exact.values())
    assert float(task.loss(_Oracle(1.0, target), task.train_batch(1, 4, 0, 0, 1))) == pytest.approx(0, abs=1e-8)
    # The exact outputs of the other target are wrong for this one: the loss sees it.
    other = "energy" if target == "potential" else "potential"
    assert task.metrics(task.eval_sums(_Oracle(1.0, other), batch))["loss"] > 1e-3
    _, pred_int = predict(_Local(), batch[1], batch[0], target)
    torch.testing.assert_close(pred_int, torch.zeros(6), rtol=0, atol=1e-6)  # up to rounding
    local = task.metrics(task.eval_sums(_Local(), batch))
    inside, beyond = task.test.interaction[0::2], task.test.interaction[1::2]
    assert local["int_mae"] == pytest.approx(float(inside.abs().mean()), rel=1e-5)
    assert local["int_mae_beyond"] == pytest.approx(float(beyond.abs().mean()), rel=1e-5)
    # A batch of one system inside the range gives the inside metrics only.
    one = next(task.test_batches(1, 1, 0, 1))
    assert set(task.metrics(task.eval_sums(_Local(), one))) == {"loss", "mae", "int_mae"}


def test_the_plot_is_written_and_its_sweep_is_the_exact_interaction_for_the_exact_model(tmp_path):
    pytest.importorskip("matplotlib")
    task = SeparationTask(**TINY)
    sweep = interaction_sweep(_Oracle(1.0), task, systems=2, points=5)
    assert sweep["separation"][0] == pytest.approx(task.min_separation) and sweep["separation"][-1] == pytest.approx(20.0)
    torch.testing.assert_close(sweep["pred"], sweep["true"], rtol=1e-5, atol=1e-5)
    path = tmp_path / "separation.png"
    assert task.plots(_Local(), str(tmp_path)) == ["separation.png"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot_separation(_Oracle(1.0), task, str(path))  # over an existing file
    assert not [p for p in tmp_path.iterdir() if p.name != "separation.png"]  # no temporary left


def test_the_task_trains_nbodys_model_and_saves_it_under_nbodys_key():
    assert TASKS["separation"] is SeparationTask
    assert SeparationTask.config is NBodyTask.config and SeparationTask.shortcuts == NBodyTask.shortcuts
    assert SeparationTask.attention_defaults is NBodyTask.attention_defaults
    defaults = NBodyTask.attention_defaults["softmax"]
    assert SeparationTask.attention_options("softmax", defaults, {"relative_bias": "t5"}) == \
        NBodyTask.attention_options("softmax", defaults, {"relative_bias": "t5"})
    preset = get_preset("separation", "smoke", "softmax")
    saved = config_to_dict(preset.model)
    assert saved["task"] == "nbody" and config_from_dict(saved) == preset.model
    model = SeparationTask.build_model(SeparationTask(**TINY).configure(preset.model))
    assert isinstance(model, type(NBodyTask.build_model(preset.model)))


@pytest.mark.cli
@pytest.mark.usefixtures("isolated_cli")
def test_the_smoke_preset_trains_through_the_cli_and_writes_the_separation_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    code = main(["train", "separation", "--preset", "smoke", "--steps", "4", "--run-opt", "eval_every=2",
                 "--data-opt", "num_train=16", "--out-dir", str(out), "--no-progress"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "separation" and summary["metric"] == "mae"
    for split in ("final", "test"):
        assert set(summary[split]) == {"loss", "mae", "int_mae", "mae_beyond", "int_mae_beyond"}
        assert all(math.isfinite(v) for v in summary[split].values())
    assert (out / "separation.png").read_bytes()[:4] == b"\x89PNG"
    from flt.commands.evaluate import evaluate_run

    assert evaluate_run(str(out), split="test", draws=0, exact=False)["own"] == pytest.approx(summary["test"]["mae"], rel=1e-6)
