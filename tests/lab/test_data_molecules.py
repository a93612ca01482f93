"""Molecule data: padded batches, splits, the generated catalysis set and its cache, ASE files."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

from flt.data import (
    DataError,
    MissingDataError,
    MoleculeData,
    collate_molecules,
    split_molecules,
)


def _toy(sizes=(3, 1, 4, 2, 5)):
    rng = np.random.default_rng(0)
    zs = [rng.integers(1, 10, size=n) for n in sizes]
    ps = [rng.normal(size=(n, 3)) for n in sizes]
    return MoleculeData.from_lists(zs, ps, np.arange(len(sizes), dtype=float)), zs, ps


def test_collate_pads_and_masks():
    data, zs, ps = _toy()
    batch = collate_molecules([data[i] for i in range(len(data))])
    assert batch.z.shape == (5, 5) and batch.pos.shape == (5, 5, 3) and batch.key_padding_mask.shape == (5, 5)
    assert batch.z.dtype == torch.int64 and batch.key_padding_mask.dtype == torch.bool and batch.pos.dtype == torch.float32
    assert (~batch.key_padding_mask).sum(1).tolist() == [3, 1, 4, 2, 5]
    for i, (z, p) in enumerate(zip(zs, ps)):
        n = len(z)
        assert batch.z[i, :n].tolist() == z.tolist() and (batch.z[i, n:] == 0).all()
        assert np.allclose(batch.pos[i, :n].numpy(), p, atol=1e-6) and (batch.pos[i, n:] == 0).all()
    assert batch.y.tolist() == [0, 1, 2, 3, 4]
    loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate_molecules)
    assert [b.z.shape for b in loader] == [(2, 3), (2, 4), (1, 5)]
    with pytest.raises(ValueError):
        collate_molecules([])


def test_split_and_subset_are_consistent():
    data, zs, _ = _toy(sizes=tuple(range(1, 21)))
    s = split_molecules(data, valid_fraction=0.25, seed=3)
    assert (len(s.train), len(s.valid)) == (15, 5)
    ys = sorted(s.train.y.tolist() + s.valid.y.tolist())
    assert ys == list(range(20))  # every structure exactly once
    for part in (s.train, s.valid):
        for i in range(len(part)):
            z, _, y = part[i]
            assert z.tolist() == zs[int(y)].tolist()
    again = split_molecules(data, valid_fraction=0.25, seed=3)
    assert torch.equal(again.valid.y, s.valid.y)
    assert torch.equal(data[-1][0], data[len(data) - 1][0])
    with pytest.raises(IndexError):
        data[len(data)]


# The catalysis generator and ASE loaders need ASE.

@pytest.fixture(scope="module")
def ase():
    return pytest.importorskip("ase")


def test_generation_is_deterministic_and_prefix_stable(ase):
    from flt.data import generate_catalysis

    a = generate_catalysis(4, seed=7, relax_steps=3)
    b = generate_catalysis(4, seed=7, relax_steps=3)
    assert torch.equal(a.z, b.z) and torch.equal(a.pos, b.pos) and torch.equal(a.y, b.y)
    # Structure i depends on (seed, i) only, so a smaller set is a prefix of a larger one.
    c = generate_catalysis(2, seed=7, relax_steps=3)
    assert torch.equal(c.y, a.y[:2]) and torch.equal(c.pos, a.pos[: c.pos.shape[0]])
    d = generate_catalysis(4, seed=8, relax_steps=3)
    assert not torch.equal(d.y, a.y)
    assert (a.info["steps"] <= 3).all() and set(a.info["metal"]) <= {"Al", "Ni", "Cu", "Pd", "Ag", "Pt", "Au"}


def test_generated_target_matches_emt_reference(ase):
    """With no relaxation, y is E(slab + adsorbate) - E(clean slab) - sum of atom energies."""
    from ase import Atoms
    from ase.build import fcc100, fcc111
    from ase.calculators.emt import EMT

    from flt.data import generate_catalysis
    from flt.data.molecules import ADSORBATES, SLAB_SIZES

    data = generate_catalysis(3, seed=1, relax_steps=0)
    for i in range(len(data)):
        z, pos, y = data[i]
        metal, facet = data.info["metal"][i], data.info["facet"][i]
        build = fcc111 if facet == "111" else fcc100
        slabs = [build(metal, size=s, vacuum=6.0) for s in SLAB_SIZES]
        (slab,) = [s for s in slabs if len(s) < len(z) and np.array_equal(s.numbers, z[: len(s)].numpy())
                   and np.allclose(s.positions, pos[: len(s)].numpy(), atol=1e-4)]
        n = len(slab)
        full = slab.copy()
        full += Atoms(numbers=z[n:].numpy(), positions=pos[n:].numpy().astype(np.float64))
        full.calc = EMT()
        slab.calc = EMT()
        atoms = 0.0
        for number in z[n:].tolist():
            single = Atoms(numbers=[number])
            single.calc = EMT()
            atoms += single.get_potential_energy()
        expected = full.get_potential_energy() - slab.get_potential_energy() - atoms
        # Positions and y are stored in float32: ~1e-6 eV of rounding.
        assert abs(float(y) - expected) < 1e-4, (i, float(y), expected)
        expected_ads = [Atoms(symbol).numbers[0] for symbol, _ in ADSORBATES[data.info["adsorbate"][i]]]
        assert z[n:].tolist() == expected_ads


def test_catalysis_cache_roundtrip_and_corruption(ase, tmp_path, monkeypatch):
    import flt.data.molecules as mol

    kw = dict(num_samples=5, seed=2, relax_steps=2, cache_dir=tmp_path, progress=False)
    first = mol.load_catalysis(**kw)
    path = mol.catalysis_cache_path(5, seed=2, relax_steps=2, cache_dir=tmp_path)
    assert os.path.isfile(path) and os.listdir(tmp_path) == [os.path.basename(path)]  # no temp files left

    def fail(*args, **kwargs):
        raise AssertionError("the second call must read the cache, not regenerate")

    monkeypatch.setattr(mol, "generate_catalysis", fail)
    second = mol.load_catalysis(**kw)
    assert torch.equal(second.train.pos, first.train.pos) and torch.equal(second.valid.y, first.valid.y)
    assert list(second.train.info["adsorbate"]) == list(first.train.info["adsorbate"])
    monkeypatch.undo()

    # Other parameters, other file.
    assert mol.catalysis_cache_path(5, seed=3, relax_steps=2, cache_dir=tmp_path) != path

    good = Path(path).read_bytes()
    for bad in (good[: len(good) // 2], b"not a zip file at all", b""):
        Path(path).write_bytes(bad)
        with pytest.raises(DataError, match=os.path.basename(path)):
            mol.load_catalysis(**kw)
    with open(path, "wb") as f:
        np.save(f, np.arange(3))  # a plain .npy, not an archive
    with pytest.raises(DataError, match=os.path.basename(path)):
        mol.load_catalysis(**kw)
    fresh = mol.load_catalysis(**kw, refresh=True)
    assert torch.equal(fresh.train.y, first.train.y)
    assert Path(path).read_bytes() == good


def test_cache_with_other_parameters_is_refused(ase, tmp_path):
    import flt.data.molecules as mol

    mol.load_catalysis(num_samples=3, seed=0, relax_steps=1, cache_dir=tmp_path, progress=False)
    path = mol.catalysis_cache_path(3, seed=0, relax_steps=1, cache_dir=tmp_path)
    other = mol.catalysis_cache_path(3, seed=1, relax_steps=1, cache_dir=tmp_path)
    os.replace(path, other)
    with pytest.raises(DataError, match="other parameters"):
        mol.load_catalysis(num_samples=3, seed=1, relax_steps=1, cache_dir=tmp_path, progress=False)


def test_default_cache_dir_follows_env(ase, monkeypatch, tmp_path):
    from flt.data import catalysis_cache_path, default_cache_dir

    monkeypatch.setenv("FLT_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == os.path.join(str(tmp_path), "molecules")
    assert catalysis_cache_path(10).startswith(os.path.join(str(tmp_path), "molecules"))
    monkeypatch.delenv("FLT_CACHE_DIR")
    assert default_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "flt", "molecules")


def _frames():
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(0)
    frames = []
    for k, formula in enumerate(["H2O", "CH4", "NH3"]):
        atoms = Atoms(formula, positions=rng.normal(size=(len(Atoms(formula)), 3)))
        atoms.info["U0"] = -10.0 - k
        atoms.calc = SinglePointCalculator(atoms, energy=-1.5 * k)
        frames.append(atoms)
    return frames


def test_extxyz_loader(ase, tmp_path):
    import ase.io

    from flt.data import load_ase

    frames = _frames()
    path = tmp_path / "mols.xyz"
    ase.io.write(path, frames, format="extxyz")
    by_u0 = load_ase(path, target="U0")
    assert by_u0.y.tolist() == [-10.0, -11.0, -12.0]
    assert load_ase(path).y.tolist() == [0.0, -1.5, -3.0]  # calculator energy
    for i, atoms in enumerate(frames):
        z, pos, _ = by_u0[i]
        assert z.tolist() == atoms.numbers.tolist()
        assert np.allclose(pos.numpy(), atoms.positions, atol=1e-6)


def test_ase_db_loader(ase, tmp_path):
    import ase.db

    from flt.data import load_ase

    path = tmp_path / "my mols #1?.db"  # characters that need quoting in an SQLite URI
    with ase.db.connect(path) as db:
        for atoms in _frames():
            db.write(atoms, gap=float(-atoms.info["U0"]))
    assert load_ase(path, target="gap").y.tolist() == [10.0, 11.0, 12.0]
    assert load_ase(path, target="energy").y.tolist() == [0.0, -1.5, -3.0]
    assert load_ase(path, target="gap")[1][0].tolist() == [6, 1, 1, 1, 1]


def test_ase_loaders_bad_inputs_name_the_file(ase, tmp_path):
    import ase.db
    import ase.io

    from flt.data import load_ase

    with pytest.raises(MissingDataError, match="nothing.xyz"):
        load_ase(tmp_path / "nothing.xyz")
    with pytest.raises(FileNotFoundError, match="nothing.db"):
        load_ase(tmp_path / "nothing.db")
    assert not (tmp_path / "nothing.db").exists()  # ase.db.connect would have created it

    xyz = tmp_path / "mols.xyz"
    ase.io.write(xyz, _frames(), format="extxyz")
    with pytest.raises(DataError, match="mols.xyz.*'gap'"):
        load_ase(xyz, target="gap")
    text = xyz.read_text()
    (tmp_path / "cut.xyz").write_text(text[: len(text) // 2])
    with pytest.raises(DataError, match="cut.xyz"):
        load_ase(tmp_path / "cut.xyz")
    (tmp_path / "junk.xyz").write_text("junk\nnot xyz\n")
    with pytest.raises(DataError, match="junk.xyz"):
        load_ase(tmp_path / "junk.xyz")
    (tmp_path / "empty.xyz").write_text("")
    with pytest.raises(DataError, match="empty.xyz"):
        load_ase(tmp_path / "empty.xyz")
    frames = _frames()
    frames[1].info["U0"] = "abc"
    ase.io.write(tmp_path / "text_target.xyz", frames, format="extxyz")
    with pytest.raises(DataError, match="text_target.xyz.*U0"):
        load_ase(tmp_path / "text_target.xyz", target="U0")

    db_path = tmp_path / "mols.db"
    with ase.db.connect(db_path) as db:
        for atoms in _frames():
            db.write(atoms)
    with pytest.raises(DataError, match="mols.db.*'gap'"):
        load_ase(db_path, target="gap")
    raw = db_path.read_bytes()
    (tmp_path / "cut.db").write_bytes(raw[: len(raw) // 3])
    with pytest.raises(DataError, match="cut.db"):
        load_ase(tmp_path / "cut.db")
    (tmp_path / "junk.db").write_bytes(b"this is not sqlite" * 50)
    with pytest.raises(DataError, match="junk.db"):
        load_ase(tmp_path / "junk.db")
    (tmp_path / "empty.db").write_bytes(b"")
    with pytest.raises(DataError, match="empty.db"):
        load_ase(tmp_path / "empty.db")
    other = tmp_path / "other.db"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    before = other.read_bytes()
    with pytest.raises(DataError, match="other.db.*not an ASE database"):
        load_ase(other)
    assert other.read_bytes() == before
    with ase.db.connect(tmp_path / "none.db") as db:
        db.write(_frames()[0])
        db.delete([1])
    with pytest.raises(DataError, match="none.db.*no structures"):
        load_ase(tmp_path / "none.db")
