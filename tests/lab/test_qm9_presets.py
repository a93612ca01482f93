"""QM9 beyond the gap: the targets the presets document (``--data-opt target=...``), their
units and readouts, and the ``medium`` preset on the full training set."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from flt.commands.train import preset_listing
from flt.data.qm9 import QM9_TRAIN, QM9_VALID, TARGETS
from flt.tasks import change_data, get_preset
from flt.tasks.qm9 import QM9Task, medium, small

#: The targets besides the gap that the presets document, and the readout each gets.
TARGET_READOUTS = {"U0": "sum", "mu": "mean", "alpha": "sum", "r2": "sum", "gap": "mean"}


def test_the_small_and_medium_presets_document_each_target_with_the_loaders_unit():
    for make in (small, medium):
        assert "--data-opt target=U0" in " ".join((make.__doc__ or "").split())
    doc = " ".join((small.__doc__ or "").split())
    for name in ("U0", "mu", "alpha", "r2"):
        assert f"{name}`` ({TARGETS[name].unit}" in doc


def test_medium_is_the_small_model_on_the_full_training_set_and_lists_its_measured_time():
    small_preset, preset = get_preset("qm9", "small", "flt"), get_preset("qm9", "medium", "flt")
    # The step time measured on small applies: the same model and batch.
    assert preset.model == small_preset.model and preset.run.batch_size == small_preset.run.batch_size
    assert preset.data["num_train"] == QM9_TRAIN and preset.data["num_valid"] == QM9_VALID
    assert preset.data["num_test"] == 10_831
    doc = " ".join((medium.__doc__ or "").split())
    assert f"{preset.run.steps:,} steps" in doc and f"{preset.run.steps * preset.run.batch_size // QM9_TRAIN} epochs" in doc
    listing = preset_listing("qm9")
    block = listing[listing.index("\nmedium\n"):listing.index("\nbase\n")]
    flat = " ".join(block.split())
    # measured end to end now, with its metric: no estimate left in the listing
    assert "min end to end" in flat and "test MAE 0.1246" in flat and "not measured" not in flat
    assert f"budget: {preset.run.steps} steps of 32" in flat


@pytest.fixture
def all_targets_csv(tmp_path):
    rng = np.random.default_rng(0)
    columns = [TARGETS[t].column for t in TARGET_READOUTS]
    path = tmp_path / "qm9.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["Elements", "XYZ_Ang", *columns])
        for _ in range(40):
            atoms = list(rng.choice(["H", "C", "N", "O"], size=int(rng.integers(3, 7))))
            xyz = rng.normal(scale=1.5, size=(len(atoms), 3))
            w.writerow(["[" + ",".join(f"'{a}'" for a in atoms) + "]",
                        "[" + ",".join("[" + ",".join(f"{c:.5f}" for c in p) + "]" for p in xyz) + "]",
                        *(f"{v:.5f}" for v in rng.uniform(0.1, 2.0, len(columns)))])
    return str(path)


@pytest.mark.parametrize("target", sorted(TARGET_READOUTS))
def test_each_documented_target_loads_in_its_unit_with_its_readout(all_targets_csv, target):
    data = change_data("qm9", {"num_train": 24, "num_valid": 8, "num_test": 8}, {"target": target})
    task = QM9Task(path=all_targets_csv, **data)
    assert task.target_unit == TARGETS[target].unit
    assert task.configure(get_preset("qm9", "smoke").model).readout == TARGET_READOUTS[target]
    assert f"in {TARGETS[target].unit}" in (task.report(None, None) or "")  # type: ignore[arg-type]
