"""The qm9 task: the CSV and qm9pack loaders (units, reference energies, split, errors),
every model's forward, and a smoke run through the CLI."""

from __future__ import annotations

import csv
import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from flt.baselines.atom_graphs import radius_graph
from flt.baselines.longrange import blocks_of
from flt.baselines.qm9 import QM9Config, QM9Regressor
from flt.cli import main
from flt.data import DataError, MissingDataError, collate_molecules
from flt.data.qm9 import HARTREE_MEV, TARGETS, load_qm9pack, read_qm9_csv, split_qm9
from flt.layers.longrange import LongRangeBlock
from flt.tasks import TASKS, get_preset
from flt.tasks.qm9 import QM9Task

pytestmark = pytest.mark.usefixtures("one_thread")

#: Per-element energies (hartree) the test data is made from, and its elements.
REFERENCE_AU = {"H": -0.5, "C": -37.8, "N": -54.5, "O": -75.0, "F": -99.7}
Z = {"H": 1, "C": 6, "N": 7, "O": 8, "F": 9}
HEADER = ["XYZ_file", "Elements", "XYZ_Ang", "Dipole_debye", "HOMO_LUMO_gap_au", "InternalEnergy_0K_au"]


def _molecules(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        atoms = list(rng.choice(list(REFERENCE_AU), size=int(rng.integers(3, 9))))
        xyz = rng.normal(scale=1.5, size=(len(atoms), 3))
        u0 = sum(REFERENCE_AU[a] for a in atoms) + 0.001 * rng.normal()
        out.append({"XYZ_file": f"m{i}.xyz", "Elements": "[" + ",".join(f"'{a}'" for a in atoms) + "]",
                    "XYZ_Ang": "[" + ",".join("[" + ",".join(f"{c:.6f}" for c in p) + "]" for p in xyz) + "]",
                    "Dipole_debye": f"{rng.uniform(0, 4):.4f}", "HOMO_LUMO_gap_au": f"{rng.uniform(0.2, 0.4):.4f}",
                    "InternalEnergy_0K_au": f"{u0:.6f}"})
    return out


def _write(path, rows, header=HEADER):
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=header, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return str(path)


@pytest.fixture
def qm9_csv(tmp_path):
    rows = _molecules(120)
    return _write(tmp_path / "qm9.csv", rows), rows


def test_the_csv_loader_reads_atoms_and_converts_to_the_fields_units(qm9_csv):
    path, rows = qm9_csv
    table = read_qm9_csv(path, ["gap", "mu", "U0"])
    assert len(table) == len(rows) and table.offsets[-1] == len(table.z)
    first = rows[0]
    atoms = [s.strip("'") for s in first["Elements"].strip("[]").split(",")]
    assert table.z[: len(atoms)].tolist() == [Z[a] for a in atoms]
    assert table.pos.dtype == np.float32 and table.pos.shape == (len(table.z), 3)
    assert table.target("gap")[0] == pytest.approx(float(first["HOMO_LUMO_gap_au"]) * 27211.386245988)
    assert table.target("mu")[0] == pytest.approx(float(first["Dipole_debye"]))  # Debye stay Debye
    assert table.target("U0")[0] == pytest.approx(float(first["InternalEnergy_0K_au"]) * HARTREE_MEV)
    assert {t.unit for t in TARGETS.values()} == {"meV", "D", "a0^3", "a0^2", "cal/(mol K)"} and len(TARGETS) == 12


def test_reference_energies_are_fitted_on_training_molecules_and_subtracted(qm9_csv):
    path, _ = qm9_csv
    task = QM9Task(path=path, target="U0", num_train=80, num_valid=20, num_test=20)
    refs = dict(zip(task.elements, task.atom_references))
    for symbol, energy in REFERENCE_AU.items():
        assert refs[Z[symbol]] == pytest.approx(energy * HARTREE_MEV, abs=10.0)  # meV, from 0.001 Ha of noise
    # What is left is the noise (0.001 Ha = 27 meV), not the ~10^6 meV of the total energy.
    assert task.target_std < 40 and abs(task.train.y.double().mean()) < 20
    gap = QM9Task(path=path, target="gap", num_train=80, num_valid=20, num_test=20)
    assert not gap.atom_references.any() and gap.train.y.mean() > 5000  # no reference for the gap


def test_the_split_is_a_seeded_permutation_and_a_smaller_training_set_keeps_validation_and_test():
    train, valid, test = split_qm9(130_831, 110_000, 10_000, None, 0)
    assert (len(train), len(valid), len(test)) == (110_000, 10_000, 10_831)
    assert len(np.unique(np.concatenate([train, valid, test]))) == 130_831
    small_train, small_valid, small_test = split_qm9(130_831, 10_000, 10_000, 10_831, 0)
    assert set(small_train) <= set(train) and np.array_equal(small_valid, valid) and np.array_equal(small_test, test)
    again = split_qm9(130_831, 110_000, 10_000, None, 0)
    assert all(np.array_equal(a, b) for a, b in zip(again, (train, valid, test)))
    assert not np.array_equal(split_qm9(130_831, 110_000, 10_000, None, 1)[1], valid)
    with pytest.raises(ValueError, match=r"need more molecules than the 100"):
        split_qm9(100, 90, 10, 5, 0)


def test_the_task_split_is_deterministic(qm9_csv):
    path, _ = qm9_csv
    a = QM9Task(path=path, num_train=60, num_valid=20, num_test=20, split_seed=3)
    b = QM9Task(path=path, num_train=60, num_valid=20, num_test=20, split_seed=3)
    c = QM9Task(path=path, num_train=60, num_valid=20, num_test=20, split_seed=4)
    assert torch.equal(a.valid.y, b.valid.y) and torch.equal(a.test.pos, b.test.pos) and torch.equal(a.train.z, b.train.z)
    assert not torch.equal(a.valid.y, c.valid.y)


@pytest.mark.parametrize(("column", "value", "message"), [
    ("XYZ_Ang", "[[0.1,0.2],[0.3,0.4,0.5]]", r"line 3, column 'XYZ_Ang': expected \d+ finite"),
    ("XYZ_Ang", "[[0.1,oops,0.2]]", r"line 3, column 'XYZ_Ang': not a list of \[x,y,z\] numbers"),
    ("Elements", "['C','Xx','H']", r"line 3, column 'Elements': unknown element symbols \['Xx'\]"),
    ("HOMO_LUMO_gap_au", "n/a", r"line 3, column 'HOMO_LUMO_gap_au': not a number"),
])
def test_a_malformed_row_names_its_file_line_and_column(tmp_path, column, value, message):
    rows = _molecules(4)
    rows[1][column] = value
    path = _write(tmp_path / "bad.csv", rows)
    with pytest.raises(DataError, match=message) as info:
        read_qm9_csv(path, ["gap"])
    assert path in str(info.value)


def test_a_missing_column_is_named(tmp_path):
    path = _write(tmp_path / "no-gap.csv", _molecules(4), [h for h in HEADER if h != "HOMO_LUMO_gap_au"])
    with pytest.raises(DataError, match=r"lacks the columns \['HOMO_LUMO_gap_au'\]"):
        read_qm9_csv(path, ["gap"])
    assert len(read_qm9_csv(path, ["mu"])) == 4  # only the columns a target needs are read
    with pytest.raises(ValueError, match=r"target must be one of \['mu', 'alpha'"):
        read_qm9_csv(path, ["energy"])


def test_without_qm9pack_the_error_names_the_extra(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "qm9pack" else real(name, *a))
    with pytest.raises(MissingDataError, match=r"qm9pack.*not installed.*\[qm9\]"):
        load_qm9pack(tmp_path)


@pytest.mark.slow
def test_the_qm9pack_set_parses_and_is_read_back_from_its_cache(tmp_path, monkeypatch):
    if importlib.util.find_spec("qm9pack") is None:
        pytest.skip("qm9pack is not installed (the qm9 extra)")
    table = load_qm9pack(tmp_path)
    assert len(table) == 130_831 and int(np.diff(table.offsets).max()) == 29
    assert set(np.unique(table.z).tolist()) == {1, 6, 7, 8, 9}
    assert table.z[:5].tolist() == [6, 1, 1, 1, 1]  # methane first
    assert table.target("gap")[0] == pytest.approx(0.5048 * HARTREE_MEV) and table.target("alpha")[0] == pytest.approx(13.21)
    monkeypatch.setattr("flt.data.qm9.read_qm9_csv", lambda *a: pytest.fail("the cache was not used"))
    cached = load_qm9pack(tmp_path)
    assert np.array_equal(cached.z, table.z) and np.array_equal(cached.values, table.values)


def test_the_plain_torch_radius_graph_is_every_close_pair_of_one_molecule():
    pos = torch.randn(9, 3) * 3
    batch = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    edges, dist = radius_graph(pos, batch, cutoff=4.0)
    expected = {(i, j) for i in range(9) for j in range(9)
                if i != j and batch[i] == batch[j] and float((pos[i] - pos[j]).norm()) < 4.0}
    assert set(map(tuple, edges.t().tolist())) == expected and len(expected) == edges.shape[1]
    assert torch.allclose(dist, (pos[edges[0]] - pos[edges[1]]).norm(dim=-1))


MODELS = [
    {"encoder": "transformer", "attention": "flt"},
    {"encoder": "transformer", "attention": "flt", "attention_options": {
        "spectrum": "gaussian", "coupling": "logit", "feature_map": "favor+", "near_neighbors": 4}},
    {"encoder": "transformer", "attention": "softmax"},
    {"encoder": "transformer", "attention": "performer"},
    {"encoder": "schnet"},
    {"encoder": "schnet+lr", "longrange": {"frequencies": "radial"}, "longrange_placement": "each"},
    {"encoder": "transformer+lr", "attention": "softmax", "longrange": {"content": "elu", "normalised": True}},
]


def _batch(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        k = int(torch.randint(3, 10, (1,), generator=g))
        samples.append((torch.randint(1, 10, (k,), generator=g), torch.randn(k, 3, generator=g) * 1.5, torch.tensor(0.0)))
    return collate_molecules(samples), samples


def _model(fields, *, seed=None):
    preset = get_preset("qm9", "smoke", fields.get("attention", "flt"))
    options = fields.get("attention_options", preset.model.attention_options)
    cfg = QM9Config(**{**preset.model.__dict__, **fields, "attention_options": options, "readout": "sum",
                       "target_mean": 5.0, "target_std": 2.0})
    if seed is not None:
        torch.manual_seed(seed)
    model = QM9Task.build_model(cfg).eval()
    # A fresh block is the identity (W_o = 0); give it something to add.
    for block in blocks_of(model):
        torch.nn.init.normal_(block.out.weight, std=0.2)
    return model


@pytest.mark.parametrize("fields", MODELS, ids=lambda f: f["encoder"] + "-" + f.get("attention", "") + (
    "-logit" if "attention_options" in f else ""))
def test_every_model_maps_a_padded_batch_to_one_value_per_molecule_whatever_the_padding(fields):
    model = _model(fields)
    batch, samples = _batch()
    with torch.no_grad():
        out = model(batch.z, batch.pos, batch.key_padding_mask)
        # Each molecule alone (no padding) gives the same value, and atom order does not matter.
        alone = torch.stack([model(z[None], p[None], torch.zeros(1, len(z), dtype=torch.bool))[0] for z, p, _ in samples])
        z, p, _ = samples[0]
        perm = torch.randperm(len(z))
        permuted = model(z[perm][None], p[perm][None], torch.zeros(1, len(z), dtype=torch.bool))[0]
    assert out.shape == (5,) and torch.isfinite(out).all()
    assert torch.allclose(out, alone, atol=1e-4)
    assert torch.allclose(permuted, alone[0], atol=1e-4)


def test_schnet_is_rotation_invariant_and_refuses_exact():
    model = _model({"encoder": "schnet"})
    batch, _ = _batch()
    q, _ = torch.linalg.qr(torch.randn(3, 3))
    with torch.no_grad():
        assert torch.allclose(model(batch.z, batch.pos, batch.key_padding_mask),
                              model(batch.z, batch.pos @ q.T, batch.key_padding_mask), atol=1e-4)
    with pytest.raises(ValueError, match="exact=True is the transformer's"):
        model(batch.z, batch.pos, batch.key_padding_mask, exact=True)


@pytest.mark.parametrize(("encoder", "inside", "per_block"), [
    ("schnet", "interactions", 1), ("transformer", "trunk.blocks", 1),
    pytest.param("dimenet++", "output_blocks", 1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("placement", ["readout", "each"])
def test_a_fresh_block_leaves_the_base_model_unchanged_and_sits_where_placed(encoder, inside, per_block, placement):
    """The +lr model built from the same seed computes what its base model does (the block
    starts as the identity), with one block before the readout or one per block."""
    fields = {"attention": "softmax"} if encoder == "transformer" else {}
    base = _model({**fields, "encoder": encoder}, seed=3)
    lr_name = {"schnet": "schnet+lr", "transformer": "transformer+lr", "dimenet++": "dimenet++lr"}[encoder]
    preset = get_preset("qm9", "smoke", fields.get("attention", "flt"))
    cfg = QM9Config(**{**preset.model.__dict__, **fields, "encoder": lr_name, "readout": "sum", "target_mean": 5.0,
                       "target_std": 2.0, "longrange_placement": placement})
    torch.manual_seed(3)
    with_block = QM9Task.build_model(cfg).eval()
    batch, _ = _batch()
    with torch.no_grad():
        assert torch.allclose(with_block(batch.z, batch.pos, batch.key_padding_mask),
                              base(batch.z, batch.pos, batch.key_padding_mask), atol=1e-6)
    wrapped = [name for name, m in with_block.named_modules() if isinstance(m, LongRangeBlock)]
    depth = cfg.depth + (1 if encoder == "dimenet++" else 0)  # DimeNet++ has one more output block than blocks
    assert len(wrapped) == (depth if placement == "each" else 1) * per_block
    assert all(inside in name for name in wrapped)


def test_the_block_reaches_beyond_the_cutoff_and_its_exact_sum_is_its_fast_sum():
    """SchNet at a 1 Angstrom cutoff sees nothing of an atom 8 Angstrom away; with the block
    the prediction moves with that atom. ``exact=True`` (the O(N^2) sum of the same discrete
    kernel) gives the fast path's value."""
    z = torch.tensor([[6, 1]])
    near, far = torch.tensor([[[0.0, 0, 0], [8.0, 0, 0]]]), torch.tensor([[[0.0, 0, 0], [9.0, 0, 0]]])
    pad = torch.zeros(1, 2, dtype=torch.bool)
    for encoder, moves in (("schnet", False), ("schnet+lr", True)):
        model = _model({"encoder": encoder, "cutoff": 1.0}, seed=0)
        with torch.no_grad():
            a, b = model(z, near, pad), model(z, far, pad)
        assert bool((a - b).abs().max() > 1e-4) == moves, encoder
    with torch.no_grad():
        assert torch.allclose(model(z, near, pad, exact=True), model(z, near, pad), atol=1e-5)


@pytest.mark.parametrize(("fields", "message"), [
    ({"encoder": "schnet", "longrange": {"frequencies": "grid"}}, "encoder='schnet' has none"),
    ({"encoder": "schnet+lr", "longrange_placement": "middle"}, "longrange_placement"),
    ({"encoder": "schnet+lr", "longrange": {"dim": 8}}, "longrange: dim is set by the model"),
    ({"encoder": "schnet+lr", "longrange": "grid"}, r"longrange must be dict\[str, typing.Any\]"),
])
def test_bad_long_range_fields_are_refused_with_their_name(fields, message):
    with pytest.raises((ValueError, TypeError), match=message):
        QM9Config(**fields)


def test_long_range_options_reach_the_block():
    cfg = QM9Config(encoder="schnet+lr", dim=16, depth=2, heads=2, longrange={"frequencies": "grid", "frequency_cutoff": 0.5})
    from flt.models import config_kwargs

    (block,) = blocks_of(QM9Regressor(**config_kwargs(cfg)))
    assert block.frequency_set == "grid" and block.kernel.frequency_cutoff == 0.5 and block.heads == 2


def test_the_readout_follows_the_target_unless_given(qm9_csv):
    path, _ = qm9_csv
    cfg = get_preset("qm9", "smoke").model
    assert QM9Task(path=path, target="gap", num_train=60, num_valid=20, num_test=20).configure(cfg).readout == "mean"
    u0 = QM9Task(path=path, target="U0", num_train=60, num_valid=20, num_test=20)
    assert u0.configure(cfg).readout == "sum"
    assert u0.configure(QM9Config(**{**cfg.__dict__, "readout": "mean"})).readout == "mean"
    assert "qm9" in TASKS and QM9Task.shortcuts["model"][1] == "encoder"


@pytest.mark.cli
@pytest.mark.usefixtures("isolated_cli")
# DimeNet++ is slow only to build: sympy derives its Bessel basis in about 9 s of CPU.
@pytest.mark.parametrize("model", ["transformer", "schnet", "schnet+lr", pytest.param("dimenet++", marks=pytest.mark.slow),
                                   pytest.param("dimenet++lr", marks=pytest.mark.slow)])
def test_a_smoke_run_through_the_cli_reports_validation_and_test_mae(qm9_csv, tmp_path, model, capsys):
    path, _ = qm9_csv
    out = tmp_path / "run"
    code = main(["train", "qm9", "--preset", "smoke", "--model", model, "--data", path, "--data-opt", "num_train=64",
                 "--data-opt", "num_valid=16", "--data-opt", "num_test=16", "--steps", "6", "--run-opt", "eval_every=3",
                 "--out-dir", str(out), "--no-progress", "--no-plots"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == "mae" and {"mae", "rmse", "loss"} <= set(summary["final"]) == set(summary["test"])
    assert summary["test_mae"] == summary["test"]["mae"] and math.isfinite(summary["test_mae"])
    # meV of a gap spread over 0.2-0.4 Ha: hundreds to thousands, not hartree or eV.
    assert 100 < summary["final"]["mae"] < 5000
    assert ("draw_gap" in summary) == (model == "transformer")  # the +lr models' discrete block draws nothing
    assert "target gap in meV" in capsys.readouterr().out
    # The saved run reloads (SchNet's shared filter network is saved under one name) and scores the same.
    from flt.commands.evaluate import evaluate_run

    assert evaluate_run(str(out), split="test", draws=0, exact=False)["own"] == pytest.approx(summary["test_mae"], rel=1e-6)


def _xyz_text(index: int, atoms, xyz, gap_au: float, u0_au: float) -> str:
    """One molecule in QM9's extended-xyz layout (properties on line 2, Mulliken charges,
    then frequencies, SMILES and InChI, which the reader skips)."""
    props = [157.7, 157.7, 157.7, 0.0, 13.21, -0.3877, 0.1171, gap_au, 35.36, 0.044749, u0_au, -40.47, -40.47, -40.49, 6.469]
    lines = [str(len(atoms)), "gdb %d\t" % index + "\t".join(repr(p) for p in props)]
    lines += [f"{a}\t{p[0]:.10f}\t{p[1]:.10f}\t{p[2]:.6e}\t-0.5357707".replace("e", "*^") for a, p in zip(atoms, xyz)]
    lines += ["1341.307\t1341.3284\t3151.7078", "C\tC", "InChI=1S/CH4/h1H4\tInChI=1S/CH4/h1H4"]
    return "\n".join(lines) + "\n"


def _write_xyz_folder(folder, rows):
    """The CSV rows as one xyz file each, written in reverse order of their index."""
    folder.mkdir()
    for i, row in reversed(list(enumerate(rows))):
        atoms = [s.strip("'") for s in row["Elements"].strip("[]").split(",")]
        xyz = np.array([float(v) for v in row["XYZ_Ang"].replace("[", "").replace("]", "").split(",")]).reshape(-1, 3)
        text = _xyz_text(i + 1, atoms, xyz, float(row["HOMO_LUMO_gap_au"]), float(row["InternalEnergy_0K_au"]))
        (folder / f"dsgdb9nsd_{i + 1:06d}.xyz").write_text(text)
    return folder


def test_the_original_xyz_files_give_the_same_table_as_the_csv(tmp_path, qm9_csv):
    from flt.data.qm9 import read_qm9

    path, rows = qm9_csv
    rows = rows[:12]
    folder = _write_xyz_folder(tmp_path / "xyz", rows)
    csv_table = read_qm9_csv(_write(tmp_path / "few.csv", rows), ["gap", "U0"])
    xyz_table = read_qm9(folder, ["gap", "U0"])
    assert np.array_equal(xyz_table.z, csv_table.z) and np.array_equal(xyz_table.offsets, csv_table.offsets)
    np.testing.assert_allclose(xyz_table.pos, csv_table.pos, atol=1e-6)  # the z column went through '*^'
    np.testing.assert_allclose(xyz_table.values, csv_table.values, rtol=1e-12)
    # A tar archive of the same files, read without extracting it, and a single file.
    import tarfile

    archive = tmp_path / "qm9.tar.bz2"
    with tarfile.open(archive, "w:bz2") as tar:
        tar.add(folder, arcname="dsgdb9nsd")
    np.testing.assert_array_equal(read_qm9(archive, ["gap"]).target("gap"), xyz_table.target("gap"))
    one = read_qm9(folder / "dsgdb9nsd_000003.xyz", ["gap"])
    assert len(one) == 1 and one.target("gap")[0] == pytest.approx(csv_table.target("gap")[2])


def test_a_malformed_xyz_file_is_named_with_its_line(tmp_path, qm9_csv):
    from flt.data.qm9 import read_qm9

    _, rows = qm9_csv
    folder = _write_xyz_folder(tmp_path / "xyz", rows[:3])
    bad = folder / "dsgdb9nsd_000002.xyz"
    lines = bad.read_text().splitlines()
    lines[3] = "Xx 0.0 0.0 0.0 0.0"
    bad.write_text("\n".join(lines))
    with pytest.raises(DataError, match=r"dsgdb9nsd_000002\.xyz, line 4: unknown element symbol 'Xx'"):
        read_qm9(folder, ["gap"])
    lines[1] = "gdb 2 1.0 2.0"
    bad.write_text("\n".join(lines))
    with pytest.raises(DataError, match=r"line 2: expected 'gdb INDEX' and 15 properties"):
        read_qm9(folder, ["gap"])
    (folder / "copy.xyz").write_text((folder / "dsgdb9nsd_000001.xyz").read_text())
    bad.unlink()
    with pytest.raises(DataError, match="more than once: \\[1\\]"):
        read_qm9(folder, ["gap"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no .xyz files"):
        read_qm9(empty, ["gap"])


def test_the_task_trains_from_xyz_files(tmp_path, qm9_csv):
    _, rows = qm9_csv
    folder = _write_xyz_folder(tmp_path / "xyz", rows)
    task = QM9Task(path=str(folder), target="gap", num_train=80, num_valid=20, num_test=20)
    assert len(task.train.y) == 80 and task.target_std > 0


def test_the_molecule_bench_times_schnet_and_each_block_on_qm9_batches(qm9_csv, capsys):
    from flt.bench import longrange

    path, _ = qm9_csv
    longrange.main(["--molecules", "--qm9-path", path, "--batches", "2", "--batch-size", "4", "--repeats", "2",
                    "--dim", "8", "--depth", "1", "--only", "radial", "exact radial"])
    (line,) = [json.loads(out) for out in capsys.readouterr().out.splitlines()]
    assert line["molecules"] == 4 and line["batches"] == 2 and set(line["seconds"]) == {"schnet", "radial", "exact radial"}
    assert 3 <= line["mean_atoms"] <= 8  # the test molecules have 3-8 atoms
    for label in ("radial", "exact radial"):
        lo, hi = line["ratio_range"][label]
        assert 0 < lo <= line["ratio_to_schnet"][label] <= hi
    with pytest.raises(SystemExit):
        longrange.main(["--molecules", "--qm9-path", path, "--only", "coulomb"])  # a particle block's label
    with pytest.raises(SystemExit):
        longrange.main(["--molecules", "--qm9-path", path, "--batches", "0"])
    assert "--batches: must be a positive integer, got 0" in capsys.readouterr().err


def test_the_molecule_bench_times_the_models_qm9_trains():
    from flt.bench import longrange

    built = longrange.molecule_models(dim=64, depth=3, cutoff=5.0, blocks={"radial": {"frequencies": "radial"}})
    # the small preset's SchNet and SchNet + block (the parameter counts of docs/longrange.md's QM9 runs)
    assert [sum(p.numel() for p in m.parameters()) for m in built.values()] == [68_033, 76_545]


def test_the_molecule_bench_builds_the_qm9_models_with_learned_blocks():
    from flt.bench import longrange

    built = longrange.molecule_models(dim=8, depth=1, cutoff=5.0, blocks=longrange.MOLECULE_BLOCKS)
    assert set(built) == {"schnet", *longrange.MOLECULE_BLOCKS}
    assert blocks_of(built["schnet"]) == []
    for label, options in longrange.MOLECULE_BLOCKS.items():
        (block,) = blocks_of(built[label])
        assert block.frequency_set == options["frequencies"] and block.exact == options.get("exact", False)
        assert block.out.weight.abs().sum() > 0  # timed as a block that has learned, not the identity
