"""The ``nbody`` task: generated charge clouds, their Yukawa targets, the per-particle
model, the test split in ``summary.json`` and length generalisation through ``flt evaluate``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from flt.baselines.particles import ParticleRegressor
from flt.cli import main
from flt.commands.evaluate import evaluate_run
from flt.data.nbody import box_side, generate_clouds, yukawa_potential
from flt.tasks import get_preset, load_task
from flt.tasks.nbody import NBodyTask

pytestmark = pytest.mark.usefixtures("one_thread")


def _brute_force(pos: np.ndarray, charge: np.ndarray, screening: float, softening: float) -> np.ndarray:
    """The potential by the definition, pair by pair, in float64."""
    n = len(charge)
    y = np.zeros(n)
    for i in range(n):
        for j in range(n):
            if i != j:
                r = math.dist(pos[i], pos[j])
                y[i] += charge[j] * math.exp(-r / screening) / math.sqrt(r * r + softening * softening)
    return y


@pytest.mark.parametrize("softening", [0.0, 1.0])
def test_the_target_is_the_brute_force_sum(softening):
    clouds = generate_clouds(3, 10, seed=5, split="valid", screening=2.5, softening=softening)
    for k in range(3):
        pos, charge = clouds.pos[k].double().numpy(), clouds.charge[k].double().numpy()
        expected = _brute_force(pos, charge, 2.5, softening)
        # pos is stored in float32, the target was computed from the float64 draw: float32 rounding only.
        np.testing.assert_allclose(clouds.y[k].double().numpy(), expected, rtol=1e-4, atol=1e-5)


def test_generation_is_a_function_of_the_seed_split_and_index():
    a = generate_clouds(4, 16, seed=1, split="train")
    b = generate_clouds(4, 16, seed=1, split="train")
    assert torch.equal(a.pos, b.pos) and torch.equal(a.charge, b.charge) and torch.equal(a.y, b.y)
    first = generate_clouds(2, 16, seed=1, split="train")
    assert torch.equal(first.pos, a.pos[:2])  # a split's first clouds do not depend on its size
    assert not torch.equal(generate_clouds(4, 16, seed=2, split="train").pos, a.pos)
    assert not torch.equal(generate_clouds(4, 16, seed=1, split="test").pos, a.pos)


@pytest.mark.parametrize("layout", ["uniform", "blobs"])
def test_clouds_are_neutral_and_at_the_requested_density(layout):
    clouds = generate_clouds(8, 64, seed=0, split="train", layout=layout, density=0.5)
    assert clouds.pos.shape == (8, 64, 3) and clouds.charge.shape == clouds.y.shape == (8, 64)
    assert torch.all(clouds.charge.sum(1) == 0) and set(clouds.charge.unique().tolist()) == {-1.0, 1.0}
    if layout == "uniform":
        side = box_side(64, 0.5)
        assert float(clouds.pos.min()) >= 0 and float(clouds.pos.max()) <= side


@pytest.mark.parametrize(("options", "message"), [
    ({"num_particles": 7}, r"num_particles must be an even number >= 2"),
    ({"eval_particles": 0}, r"eval_particles must be a positive integer"),
    ({"num_test": 0}, r"num_test must be a positive integer"),
    ({"layout": "ring"}, r"layout must be one of"),
    ({"screening": 0.0}, r"screening must be a positive finite number"),
    ({"softening": -1.0}, r"softening must be a non-negative finite number"),
    ({"density": float("inf")}, r"density must be a positive finite number"),
])
def test_bad_data_options_are_refused_with_their_name(options, message):
    small = {"num_particles": 8, "num_train": 2, "num_valid": 1, "num_test": 1}
    with pytest.raises(ValueError, match=message):
        NBodyTask(**{**small, **options})


def test_unknown_data_options_name_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown data options for 'nbody': \['particles'\]; known: "):
        load_task("nbody", {"particles": 8})


def test_the_model_is_permutation_equivariant_and_translation_invariant():
    torch.manual_seed(0)
    p = get_preset("nbody", "smoke", "softmax")
    model = NBodyTask.build_model(p.model).eval()
    clouds = generate_clouds(2, 32, seed=0, split="train")
    out = model(clouds.charge, clouds.pos)
    perm = torch.randperm(32)
    torch.testing.assert_close(model(clouds.charge[:, perm], clouds.pos[:, perm]), out[:, perm], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model(clouds.charge, clouds.pos + 3.0), out, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"charges must be \+1 or -1"):
        model(clouds.charge * 2, clouds.pos)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nbody") / "run"
    torch.set_num_threads(1)
    assert main(["train", "nbody", "--preset", "smoke", "--out-dir", str(out), "--no-progress", "--no-plots"]) == 0
    return str(out), json.loads((out / "summary.json").read_text())


@pytest.mark.cli
def test_the_smoke_preset_reports_valid_and_test_metrics(smoke_run):
    _, summary = smoke_run
    assert summary["task"] == "nbody" and summary["metric"] == "nmse"
    for split in ("final", "test"):
        assert set(summary[split]) == {"loss", "nmse", "rel_mae"} and all(math.isfinite(v) for v in summary[split].values())
    assert summary["test"] != summary["final"]  # other clouds


@pytest.mark.cli
def test_flt_evaluate_scores_larger_clouds_and_the_test_split(smoke_run):
    path, summary = smoke_run
    same = evaluate_run(path, draws=0, exact=False, split="test")
    assert same["own"] == pytest.approx(summary["test"]["nmse"], rel=1e-6)
    one = evaluate_run(path, draws=0, exact=False, split="test", batch_size=1)
    assert one["own"] == pytest.approx(summary["test"]["nmse"], rel=1e-5)
    larger = evaluate_run(path, draws=1, exact=True, data_options={"eval_particles": 512})
    assert larger["data"] == {"eval_particles": 512}
    assert all(math.isfinite(larger[k]) for k in ("own", "exact")) and larger["own"] != summary["final"]["nmse"]
    with pytest.raises(ValueError, match=r"eval_particles must be an even number"):
        evaluate_run(path, data_options={"eval_particles": 513})


def test_the_per_particle_model_predicts_in_target_units():
    model = ParticleRegressor(dim=8, depth=1, heads=2, mlp_ratio=2.0, dropout=0.0, attention="performer",
                              attention_options={"num_features": 8}, posenc="none", posenc_options={},
                              target_mean=3.0, target_std=2.0)
    torch.nn.init.zeros_(model.head.weight)
    torch.nn.init.zeros_(model.head.bias)
    charge = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    assert torch.equal(model(charge, torch.randn(1, 4, 3)), torch.full((1, 4), 3.0))


def _particle_model(encoder: str, seed: int = 0, **fields):
    """The smoke preset's model as ``encoder``, built from ``seed``; its blocks' ``W_o`` moved off zero."""
    from flt.baselines.longrange import blocks_of
    from flt.models import replace_fields

    cfg = replace_fields(get_preset("nbody", "smoke").model, encoder=encoder, **fields)
    torch.manual_seed(seed)
    model = NBodyTask.build_model(cfg).eval()
    for block in blocks_of(model):
        torch.nn.init.normal_(block.out.weight, std=0.2)
    return model


@pytest.mark.parametrize("encoder", ["schnet", "schnet+lr", "transformer+lr"])
def test_every_particle_model_is_permutation_equivariant_and_translation_invariant(encoder):
    model = _particle_model(encoder, longrange={"frequencies": "radial"} if encoder == "schnet+lr" else {})
    clouds = generate_clouds(2, 32, seed=0, split="train")
    with torch.no_grad():
        out = model(clouds.charge, clouds.pos)
        perm = torch.randperm(32)
        torch.testing.assert_close(model(clouds.charge[:, perm], clouds.pos[:, perm]), out[:, perm], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(clouds.charge, clouds.pos + 3.0), out, rtol=1e-4, atol=1e-5)
    assert out.shape == (2, 32)
    with pytest.raises(ValueError, match=r"charges must be \+1 or -1"):
        model(clouds.charge * 2, clouds.pos)


def test_schnet_with_a_radial_block_is_rotation_invariant_exactly_on_its_exact_path():
    model = _particle_model("schnet+lr", longrange={"frequencies": "radial"})
    plain = _particle_model("schnet")
    clouds = generate_clouds(1, 32, seed=0, split="train")
    q, _ = torch.linalg.qr(torch.randn(3, 3))
    with torch.no_grad():
        torch.testing.assert_close(plain(clouds.charge, clouds.pos @ q.T), plain(clouds.charge, clouds.pos), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(clouds.charge, clouds.pos @ q.T, exact=True), model(clouds.charge, clouds.pos, exact=True),
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="this SchNet has no block"):
        plain(clouds.charge, clouds.pos, exact=True)


def test_a_fresh_block_leaves_schnet_unchanged_and_the_cutoff_is_in_mean_spacings():
    from flt.models import replace_fields

    clouds = generate_clouds(1, 32, seed=0, split="train")
    cfg = replace_fields(get_preset("nbody", "smoke").model, encoder="schnet")
    torch.manual_seed(0)
    plain = NBodyTask.build_model(cfg).eval()
    torch.manual_seed(0)
    fresh = NBodyTask.build_model(replace_fields(cfg, encoder="schnet+lr", longrange_placement="each")).eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(clouds.charge, clouds.pos), plain(clouds.charge, clouds.pos))
    task = NBodyTask(num_particles=16, num_train=2, num_valid=2, num_test=2, density=8.0)
    configured = task.configure(replace_fields(cfg, cutoff=3.0))
    assert configured.spacing == pytest.approx(0.5)
    assert NBodyTask.build_model(configured).radius == pytest.approx(1.5)  # 3 spacings of 0.5


def test_the_block_sees_beyond_schnets_cutoff():
    """Two particles 6 spacings apart, a 2-spacing cutoff: SchNet's prediction for one does not
    move when the other moves away; with the block it does."""
    charge = torch.tensor([[1.0, -1.0]])
    near, far = torch.tensor([[[0.0, 0, 0], [6.0, 0, 0]]]), torch.tensor([[[0.0, 0, 0], [7.0, 0, 0]]])
    for encoder, moves in (("schnet", False), ("schnet+lr", True)):
        model = _particle_model(encoder)
        with torch.no_grad():
            assert bool((model(charge, near) - model(charge, far)).abs().max() > 1e-4) == moves, encoder


@pytest.mark.parametrize(("fields", "message"), [
    ({"encoder": "mace"}, "encoder"),
    ({"encoder": "schnet", "longrange": {"frequencies": "grid"}}, "encoder='schnet' has none"),
    ({"encoder": "schnet", "cutoff": 0.0}, "cutoff must be a positive finite number"),
])
def test_bad_particle_model_fields_are_refused_with_their_name(fields, message):
    from flt.models import replace_fields

    with pytest.raises((ValueError, TypeError), match=message):
        replace_fields(get_preset("nbody", "smoke").model, **fields)


def test_particle_model_is_the_one_builder():
    from flt.baselines.particles import PARTICLE_MODELS, ParticleSchNet, particle_model
    from flt.models import replace_fields

    cfg = get_preset("nbody", "smoke").model
    assert isinstance(particle_model(cfg), ParticleRegressor) and isinstance(NBodyTask.build_model(cfg), ParticleRegressor)
    assert isinstance(particle_model(replace_fields(cfg, encoder="schnet+lr")), ParticleSchNet)
    assert set(PARTICLE_MODELS) == {"transformer", "schnet", "transformer+lr", "schnet+lr"}
    with pytest.raises(TypeError, match="particle_model builds from a ParticleConfig"):
        particle_model(object())


@pytest.mark.cli
@pytest.mark.usefixtures("isolated_cli")
def test_schnet_with_a_grid_block_trains_through_the_cli_and_scores_larger_clouds(tmp_path):
    out = tmp_path / "run"
    code = main(["train", "nbody", "--preset", "smoke", "--model", "schnet+lr", "--model-opt",
                 'longrange={"frequencies": "grid", "frequency_cutoff": 0.5}', "--steps", "4", "--run-opt", "eval_every=2",
                 "--out-dir", str(out), "--no-progress", "--no-plots"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["test"]["nmse"])
    larger = evaluate_run(str(out), draws=0, exact=False, data_options={"eval_particles": 256})
    assert math.isfinite(larger["own"]) and larger["own"] != summary["final"]["nmse"]


def test_the_exact_control_is_an_option_of_the_block():
    """``longrange={"exact": true}`` trains the O(N^2) sum of the same kernel: the same
    predictions as the fast path for a discrete kernel, and as ``exact=True`` at call time."""
    fast = _particle_model("schnet+lr", seed=1)
    exact = _particle_model("schnet+lr", seed=1, longrange={"exact": True})
    clouds = generate_clouds(1, 32, seed=0, split="train")
    with torch.no_grad():
        torch.testing.assert_close(exact(clouds.charge, clouds.pos), fast(clouds.charge, clouds.pos), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fast(clouds.charge, clouds.pos, exact=True), exact(clouds.charge, clouds.pos))


@pytest.mark.parametrize(("clouds", "particles", "spread", "cutoff"), [(3, 11, 2.0, 2.5), (2, 300, 4.0, 1.0), (1, 50, 0.1, 5.0)])
def test_the_cloud_radius_graph_is_every_close_pair_of_one_cloud(clouds, particles, spread, cutoff):
    """The cell list against every pair's distance (and against the molecule task's radius
    graph): the same ordered pairs, sorted by i then j, the same distances and gradients."""
    from flt.baselines.atom_graphs import radius_graph
    from flt.baselines.particles import cloud_radius_graph

    torch.manual_seed(0)
    pos = (torch.randn(clouds, particles, 3, dtype=torch.float64) * spread).requires_grad_()
    flat = pos.reshape(-1, 3)
    same_cloud = torch.arange(clouds).repeat_interleave(particles)
    dist = (flat[:, None] - flat[None]).norm(dim=-1)
    close = (dist < cutoff) & (same_cloud[:, None] == same_cloud[None]) & ~torch.eye(len(flat), dtype=torch.bool)
    expected = close.nonzero().t()  # row-major: sorted by i then j
    edges, d = cloud_radius_graph(pos, cutoff)
    assert torch.equal(edges, expected)
    reference = (flat[expected[0]] - flat[expected[1]]).norm(dim=-1)
    torch.testing.assert_close(d, reference)
    (grad,), (ref_grad,) = torch.autograd.grad(d.sum(), pos), torch.autograd.grad(reference.sum(), pos)
    torch.testing.assert_close(grad, ref_grad)
    molecule, _ = radius_graph(flat.detach(), same_cloud, cutoff)
    assert set(map(tuple, edges.t().tolist())) == set(map(tuple, molecule.t().tolist()))


@pytest.mark.cli
@pytest.mark.usefixtures("isolated_cli")
def test_an_unknown_block_option_is_a_usage_error_before_any_data(tmp_path, capsys):
    code = main(["train", "nbody", "--preset", "smoke", "--model", "schnet+lr", "--model-opt",
                 'longrange={"frequencies": "grid", "num_frequencies": 8}', "--out-dir", str(tmp_path / "run")])
    assert code == 2
    assert "got unknown num_frequencies" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_input_block_sums_charges_and_sees_beyond_the_cutoff():
    """longrange_placement=input: one block on the embedded charges, before the first
    interaction; a fresh one changes nothing, a trained one sees past the cutoff, and the
    model stays invariant to translations and permutations. The qm9 models refuse it."""
    from flt.baselines.longrange import blocks_of
    from flt.models import replace_fields

    clouds = generate_clouds(1, 32, seed=0, split="train")
    cfg = replace_fields(get_preset("nbody", "smoke").model, encoder="schnet")
    torch.manual_seed(0)
    plain = NBodyTask.build_model(cfg).eval()
    torch.manual_seed(0)
    fresh = NBodyTask.build_model(replace_fields(cfg, encoder="schnet+lr", longrange_placement="input",
                                                 longrange={"neutral": True})).eval()
    assert fresh.input_block is not None and blocks_of(fresh) == [fresh.input_block]
    with torch.no_grad():
        torch.testing.assert_close(fresh(clouds.charge, clouds.pos), plain(clouds.charge, clouds.pos))
    model = _particle_model("schnet+lr", longrange_placement="input", longrange={"neutral": True})
    charge = torch.tensor([[1.0, -1.0]])
    near, far = torch.tensor([[[0.0, 0, 0], [6.0, 0, 0]]]), torch.tensor([[[0.0, 0, 0], [7.0, 0, 0]]])
    with torch.no_grad():
        assert bool((model(charge, near) - model(charge, far)).abs().max() > 1e-4)
        out = model(clouds.charge, clouds.pos)
        torch.testing.assert_close(model(clouds.charge, clouds.pos + 5.0), out, rtol=1e-4, atol=1e-5)
        perm = torch.randperm(32)
        torch.testing.assert_close(model(clouds.charge[:, perm], clouds.pos[:, perm]), out[:, perm], rtol=1e-4, atol=1e-5)
    from flt.baselines.qm9 import QM9Config

    with pytest.raises(ValueError, match="longrange_placement='input'.*nbody SchNet only"):
        from flt.tasks.qm9 import QM9Task

        QM9Task.build_model(QM9Config(encoder="schnet+lr", dim=16, depth=2, heads=2, longrange_placement="input"))


def test_the_cell_list_refuses_clouds_too_wide_for_its_keys():
    from flt.baselines.particles import cloud_radius_graph

    pos = torch.zeros(2, 3, 3)
    pos[:, 1] = 1e7
    with pytest.raises(ValueError, match="cell keys of 2 clouds would overflow int64"):
        cloud_radius_graph(pos, 0.5)


def test_only_the_schnet_takes_the_input_placement_and_configs_say_so():
    from flt.models import replace_fields

    cfg = get_preset("nbody", "smoke").model
    assert replace_fields(cfg, encoder="schnet+lr", longrange_placement="input").longrange_placement == "input"
    with pytest.raises(ValueError, match="longrange_placement='input'.*nbody SchNet only"):
        replace_fields(cfg, encoder="transformer+lr", longrange_placement="input")


def test_the_bands_of_the_potential_add_up_to_it_and_split_pairs_by_distance():
    clouds = generate_clouds(3, 32, seed=0, split="test", screening=None)
    whole = yukawa_potential(clouds.pos, clouds.charge, None, 1.0)
    bands = yukawa_potential(clouds.pos, clouds.charge, None, 1.0, edges=[0.0, 1.5, 3.0, math.inf])
    assert bands.shape == (3, 32, 3) and bands.dtype == torch.float64
    torch.testing.assert_close(bands.sum(-1), whole, rtol=0, atol=1e-12)
    # two charges 2.5 apart: each one's potential is the other's, in the middle band only
    pos, charge = torch.tensor([[[0.0, 0, 0], [2.5, 0, 0]]]), torch.tensor([[1.0, -1.0]])
    two = yukawa_potential(pos, charge, 3.0, 0.5, edges=[0.0, 1.5, 3.0, math.inf])
    g = math.exp(-2.5 / 3.0) / math.sqrt(2.5**2 + 0.25)
    torch.testing.assert_close(two, torch.tensor([[[0.0, -g, 0.0], [0.0, g, 0.0]]], dtype=torch.float64))
    for edges in ([1.0], [0.0, 2.0, 2.0], [-1.0, 2.0], [0.0, float("nan")]):
        with pytest.raises(ValueError, match=r"edges must be at least two increasing distances"):
            yukawa_potential(pos, charge, 3.0, 0.5, edges=edges)


class _BandGains(torch.nn.Module):
    """A model whose error is known: each band of the exact potential times its gain, plus an offset."""

    def __init__(self, edges: list[float], gains: list[float], offset: float) -> None:
        super().__init__()
        self.edges, self.gains, self.offset = edges, torch.tensor(gains, dtype=torch.float64), offset

    def forward(self, charge: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        bands = yukawa_potential(pos, charge, None, 1.0, edges=self.edges)
        return (bands * self.gains).sum(-1) + self.offset


def test_the_error_breakdown_recovers_each_bands_relative_error():
    task = NBodyTask(num_particles=64, num_train=2, num_valid=4, num_test=2, screening=None)
    edges = [0.0, 2.0, 4.0, math.inf]
    batches = [(task.valid.pos[i:i + 2], task.valid.charge[i:i + 2], task.valid.y[i:i + 2]) for i in (0, 2)]
    parts = task.error_breakdown(_BandGains(edges, [1.0, 0.9, 1.25], 0.5), batches, edges=edges)
    assert [(b["low"], b["high"]) for b in parts["bands"]] == [(0.0, 2.0), (2.0, 4.0), (4.0, None)]
    assert [b["coef"] for b in parts["bands"]] == pytest.approx([0.0, -0.1, 0.25], abs=1e-6)
    assert parts["nmse_left"] == pytest.approx(0.0, abs=1e-8) and parts["nmse"] > 0.01
    y = task.valid.y.double()
    err = _BandGains(edges, [1.0, 0.9, 1.25], 0.5)(task.valid.charge, task.valid.pos) - y
    assert parts["nmse"] == pytest.approx(float((err**2).sum() / ((y - task.target_mean) ** 2).sum()), rel=1e-6)
    assert 0 <= parts["dipole_share"] < 0.5  # band gains are not a dipole field
    # a kernel with an r^2 part: on a neutral cloud its error is the dipole term plus a constant per cloud
    class Quadratic(torch.nn.Module):
        def __init__(self, constant: bool) -> None:
            super().__init__()
            self.constant = constant

        def forward(self, charge: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            pos, charge = pos.double(), charge.double()
            r2 = torch.cdist(pos, pos) ** 2
            centred = pos - pos.mean(1, keepdim=True)
            extra = torch.einsum("snm,sm->sn", r2, charge) if self.constant else \
                -2 * (centred * (charge[..., None] * centred).sum(1, keepdim=True)).sum(-1)
            return yukawa_potential(pos, charge, None, 1.0) + 0.01 * extra
    assert task.error_breakdown(Quadratic(False), batches, edges=edges)["dipole_share"] == pytest.approx(1.0, abs=1e-9)
    assert 0.5 < task.error_breakdown(Quadratic(True), batches, edges=edges)["dipole_share"] < 1.0
    # bands with no pair (a 64-particle box is 4 wide, its offsets below 7) get 0 and leave the fit exact
    wide = [0.0, 2.0, 4.0, 8.0, 16.0, math.inf]
    empty = task.error_breakdown(_BandGains(wide, [1.0, 0.8, 1.0, 1.0, 1.0], 0.2), batches, edges=wide)
    assert [b["coef"] for b in empty["bands"]] == pytest.approx([0.0, -0.2, 0.0, 0.0, 0.0], abs=1e-6)
    assert empty["nmse_left"] == pytest.approx(0.0, abs=1e-8) and empty["nmse"] > 0.01
    with pytest.raises(ValueError, match=r"error_breakdown needs at least one batch"):
        task.error_breakdown(_BandGains(edges, [1.0, 1.0, 1.0], 0.0), [], edges=edges)
    with pytest.raises(ValueError, match=r"edges must be at least two increasing distances"):
        task.error_breakdown(_BandGains(edges, [1.0, 1.0, 1.0], 0.0), batches, edges=[0.0, 4.0, 2.0])
    # the error of a model that is exact is nothing to split
    exact = task.error_breakdown(_BandGains(edges, [1.0, 1.0, 1.0], 0.0), batches, edges=edges)
    assert exact["nmse"] == pytest.approx(0.0, abs=1e-10) and all(abs(b["coef"]) < 1e-6 for b in exact["bands"])


def test_a_mixed_pool_gives_every_other_step_larger_clouds():
    task = NBodyTask(num_particles=16, num_train=8, num_valid=2, num_test=2, mixed_particles=64, mixed_train=4)
    sizes = [task.train_batch(step, 2, 0, 0, 1)[0].shape[1] for step in range(1, 7)]
    assert sizes == [16, 64, 16, 64, 16, 64]
    assert len(task.mixed) == 4 and task.side == pytest.approx(4.0)
    # every mixed cloud of one epoch comes once; the first pool's order is its own
    seen = torch.cat([task.train_batch(step, 2, 0, 0, 1)[0] for step in (2, 4)])
    assert len({tuple(p[0].tolist()) for p in seen}) == 4
    assert task.longest_sequence(None) == 16 and task.step_shape(None, 2) == (2, 64)  # validation clouds; memory: the largest
    with pytest.raises(ValueError, match=r"mixed_train \(4 clouds\) must be at least the batch size \(8\)"):
        task.train_batch(2, 8, 0, 0, 1)
    plain = NBodyTask(num_particles=16, num_train=8, num_valid=2, num_test=2)
    assert plain.mixed is None and plain.train_batch(3, 2, 0, 0, 1)[0].shape[1] == 16
    torch.testing.assert_close(task.train_batch(3, 2, 0, 0, 1)[0], plain.train_batch(2, 2, 0, 0, 1)[0])


@pytest.mark.parametrize(("options", "message"), [
    ({"mixed_particles": 9}, r"mixed_particles must be an even number >= 2"),
    ({"mixed_particles": 0}, r"mixed_particles must be a positive integer"),
    ({"mixed_particles": 16, "mixed_train": 0}, r"mixed_train must be a positive integer"),
    ({"mixed_train": 4}, r"mixed_train \(4\) needs mixed_particles"),
    ({"mixed_particles": 8}, r"mixed_particles \(8\) must differ from num_particles"),
])
def test_bad_mixed_options_are_refused_with_their_name(options, message):
    with pytest.raises(ValueError, match=message):
        NBodyTask(num_particles=8, num_train=2, num_valid=1, num_test=1, **options)


@pytest.mark.cli
def test_flt_evaluate_breakdown_prints_the_bands(smoke_run, capsys, tmp_path):
    path, _ = smoke_run
    out = tmp_path / "res.json"
    assert main(["evaluate", path, "--split", "test", "--draws", "0", "--no-exact", "--breakdown", "--no-progress",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "error by the pairs' distance" in printed and "[16, inf)" in printed and "a dipole field" in printed
    parts = json.loads(out.read_text())["breakdown"]
    assert [b["low"] for b in parts["bands"]] == [0, 2, 3, 4, 6, 8, 11, 16]
    assert 0 <= parts["nmse_left"] <= parts["nmse"]


@pytest.mark.cli
def test_a_smaller_evaluation_batch_scores_the_same_clouds(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "nbody", "--preset", "smoke", "--out-dir", str(out), "--no-progress", "--no-plots",
                 "--run-opt", "steps=2", "--run-opt", "draw_gap_batches=1"]) == 0
    two = evaluate_run(str(out), draws=0, exact=False, split="test")  # one batch of the run's 2 clouds
    one = evaluate_run(str(out), draws=0, exact=False, split="test", batch_size=1)
    assert one["own"] == pytest.approx(two["own"], rel=1e-5)
    first = evaluate_run(str(out), draws=0, exact=False, split="test", batch_size=1, max_batches=1)
    assert first["own"] != pytest.approx(two["own"], rel=1e-3)  # one cloud of the two is another number
