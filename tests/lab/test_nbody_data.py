"""The bare-Coulomb variant of ``nbody`` (``screening=none``): its potential, how the data
option is spelled on the command line, and the values it refuses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flt.cli import main
from flt.data.nbody import box_side, cloud_splits, generate_clouds
from flt.options import parse_assignments
from flt.tasks import change_data, load_task


def _bare_coulomb(pos: np.ndarray, charge: np.ndarray, softening: float) -> np.ndarray:
    n = len(charge)
    y = np.zeros(n)
    for i in range(n):
        for j in range(n):
            if i != j:
                y[i] += charge[j] / math.sqrt(float(np.sum((pos[i] - pos[j]) ** 2)) + softening**2)
    return y


@pytest.mark.parametrize("screening", [None, math.inf])
@pytest.mark.parametrize("softening", [0.5, 1.0])
def test_unscreened_clouds_hold_the_bare_softened_coulomb_potential(screening, softening):
    clouds = generate_clouds(2, 12, seed=3, split="test", screening=screening, softening=softening)
    for k in range(2):
        expected = _bare_coulomb(clouds.pos[k].double().numpy(), clouds.charge[k].double().numpy(), softening)
        np.testing.assert_allclose(clouds.y[k].double().numpy(), expected, rtol=1e-5, atol=1e-6)
    screened = generate_clouds(2, 12, seed=3, split="test", screening=3.0, softening=softening)
    assert not np.allclose(screened.y.numpy(), clouds.y.numpy())  # the same clouds, another potential


def test_screening_none_is_reachable_from_the_command_line_spelling():
    changes = parse_assignments(["screening=none"], "--data-opt")
    data = change_data("nbody", {"num_particles": 8, "num_train": 2, "num_valid": 1, "num_test": 1}, changes)
    assert data["screening"] is None
    task = load_task("nbody", data)
    expected = _bare_coulomb(task.train.pos[0].double().numpy(), task.train.charge[0].double().numpy(), 1.0)
    np.testing.assert_allclose(task.train.y[0].double().numpy(), expected, rtol=1e-5, atol=1e-6)
    # JSON's Infinity is a number, and the same potential
    infinite = load_task("nbody", change_data("nbody", data, parse_assignments(["screening=Infinity"], "--data-opt")))
    np.testing.assert_array_equal(infinite.train.y.numpy(), task.train.y.numpy())


def test_larger_unscreened_clouds_keep_the_density():
    splits = cloud_splits(num_particles=16, eval_particles=64, num_train=2, num_valid=2, num_test=2, screening=None,
                          density=0.5)
    assert splits.train.num_particles == 16 and splits.test.num_particles == 64
    for clouds in (splits.train, splits.test):
        side = box_side(clouds.num_particles, 0.5)
        assert float(clouds.pos.min()) >= 0 and float(clouds.pos.max()) <= side
        assert clouds.num_particles / side**3 == pytest.approx(0.5)


@pytest.mark.parametrize(("value", "error", "message"), [
    (0.0, ValueError, r"screening must be a positive finite number, or none \(or inf\)"),
    (-2.0, ValueError, r"screening must be a positive finite number, or none \(or inf\)"),
    (-math.inf, ValueError, r"screening must be a positive finite number, or none \(or inf\)"),
    (math.nan, ValueError, r"screening must be a positive finite number, or none \(or inf\)"),
    (True, TypeError, r"option 'screening' must be a number or None \(null\), got True"),
    ("inf", TypeError, r"option 'screening' must be a number or None \(null\), got 'inf'"),
])
def test_bad_screening_values_are_refused_with_their_name(value, error, message):
    with pytest.raises(error, match=message):
        load_task("nbody", {"num_particles": 8, "num_train": 2, "num_valid": 1, "num_test": 1, "screening": value})


@pytest.mark.cli
@pytest.mark.parametrize(("value", "message"), [
    ("-1", "screening must be a positive finite number, or none (or inf)"),
    ("inf", "option 'screening' must be a number or None (null), got 'inf'"),
])
def test_the_cli_refuses_a_bad_screening_with_one_line_and_status_2(tmp_path, capsys, value, message):
    code = main(["train", "nbody", "--preset", "smoke", "--out-dir", str(tmp_path / "run"), "--no-progress", "--no-plots",
                 "--data-opt", f"screening={value}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err
