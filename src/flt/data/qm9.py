"""QM9 (Ramakrishnan et al., 2014, "Quantum chemistry structures and properties of 134
kilo molecules"): DFT geometries (B3LYP/6-31G(2df,p), Angstrom) of the 130,831 molecules
of up to 9 heavy atoms (C, N, O, F) that converged, with their properties.

Three sources: the ``qm9pack`` wheel (MIT licence, by one of QM9's authors; install the
``qm9`` extra), which ships the set as three CSV parts; QM9's original xyz files (a folder,
a file or a tar archive of them: :mod:`flt.data.qm9_xyz`); or any CSV with the same
columns as qm9pack's (``--data PATH``): ``Elements`` (``['C','H',...]``), ``XYZ_Ang``
(``[[x,y,z],...]``) and the column of each target read. Nothing is downloaded.

Targets (:data:`TARGETS`) are the 12 of the field (Gilmer et al., 2017; Schütt et al.,
2017) in the units results are quoted in: meV for energies and orbital energies, Debye
for the dipole moment, ``a0^3`` for the polarizability, ``a0^2`` for ``<R^2>`` and
cal/(mol K) for the heat capacity. The qm9pack set is parsed once and cached as ``.npz``
(no pickles) keyed by the package's version (:func:`load_qm9pack`).
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flt._io import atomic_write

from ._files import check_file_size, check_float32, load_npz, open_regular
from .errors import DataError, MissingDataError
from .molecules import MAX_COORDINATE, MoleculeData, default_cache_dir
from .qm9_xyz import is_xyz_source, iter_xyz_texts, parse_xyz_molecule

#: meV per hartree (CODATA 2018).
HARTREE_MEV = 27211.386245988
#: Bumped when the parser or the cache layout changes, so old caches are not read.
FORMAT_VERSION = 1
#: Element symbols by atomic number (QM9 holds H, C, N, O and F; a CSV may hold up to Ar).
SYMBOLS = ("H", "He", "Li", "Be", "B", "C", "N", "O", "F", "Ne", "Na", "Mg", "Al", "Si", "P", "S", "Cl", "Ar")
ATOMIC_NUMBER = {s: i + 1 for i, s in enumerate(SYMBOLS)}
#: The qm9pack CSV parts, in molecule order.
QM9PACK_PARTS = ("qm9_part1.csv", "qm9_part2.csv", "qm9_part3.csv")
#: Molecules of the full set, and the usual training and validation sizes (the rest, 10,831, is the test set).
QM9_MOLECULES, QM9_TRAIN, QM9_VALID = 130_831, 110_000, 10_000


@dataclass(frozen=True)
class Target:
    """One property: its CSV column, its unit, the factor from the column's unit to it,
    whether per-element reference energies are subtracted, and whether it grows with the
    molecule (a sum over atoms; otherwise a mean is the natural readout)."""

    column: str
    unit: str
    scale: float
    atomref: bool
    extensive: bool


TARGETS: dict[str, Target] = {
    "mu": Target("Dipole_debye", "D", 1.0, False, False),
    "alpha": Target("Polarizability_bohr3", "a0^3", 1.0, False, True),
    "homo": Target("HOMO_au", "meV", HARTREE_MEV, False, False),
    "lumo": Target("LUMO_au", "meV", HARTREE_MEV, False, False),
    "gap": Target("HOMO_LUMO_gap_au", "meV", HARTREE_MEV, False, False),
    "r2": Target("R2_bohr2", "a0^2", 1.0, False, True),
    "zpve": Target("ZPVE_au", "meV", HARTREE_MEV, False, True),
    "U0": Target("InternalEnergy_0K_au", "meV", HARTREE_MEV, True, True),
    "U": Target("InternalEnergy_298K_au", "meV", HARTREE_MEV, True, True),
    "H": Target("Enthalphy_298K_au", "meV", HARTREE_MEV, True, True),  # qm9pack's spelling
    "G": Target("GibbsFreeEnergy_298K_au", "meV", HARTREE_MEV, True, True),
    "Cv": Target("Heatcapacity_Cv_cal_mol_K", "cal/(mol K)", 1.0, False, True),
}


def check_target(name: str) -> Target:
    """``TARGETS[name]`` with an error listing the names."""
    if name not in TARGETS:
        raise ValueError(f"target must be one of {list(TARGETS)}, got {name!r}")
    return TARGETS[name]


@dataclass(frozen=True)
class QM9Table:
    """Molecules stored flat: ``z [A]`` int64, ``pos [A, 3]`` float32 (Angstrom),
    ``offsets [M + 1]`` (molecule ``i`` is atoms ``offsets[i]:offsets[i + 1]``) and
    ``values [M, T]`` float64, one column per name in ``targets`` in its field unit."""

    z: np.ndarray
    pos: np.ndarray
    offsets: np.ndarray
    values: np.ndarray
    targets: tuple[str, ...]

    def __len__(self) -> int:
        return self.values.shape[0]

    def target(self, name: str) -> np.ndarray:
        """Column ``[M]`` of target ``name``."""
        if name not in self.targets:
            raise ValueError(f"target {name!r} was not read; this table holds {list(self.targets)}")
        return self.values[:, self.targets.index(name)]

    def counts(self, elements: Sequence[int] | np.ndarray) -> np.ndarray:
        """``[M, len(elements)]`` float64: how many atoms of each element every molecule has."""
        mol = np.repeat(np.arange(len(self)), np.diff(self.offsets))
        out = np.zeros((len(self), len(elements)))
        for j, e in enumerate(elements):
            np.add.at(out[:, j], mol[self.z == e], 1.0)
        return out


def _parse_elements(text: str, where: str) -> list[int]:
    symbols = [s.strip().strip("'\"") for s in text.strip().strip("[]").split(",")]
    if not symbols or symbols == [""]:
        raise DataError(f"{where}: no atoms in {text[:60]!r}")
    unknown = [s for s in symbols if s not in ATOMIC_NUMBER]
    if unknown:
        raise DataError(f"{where}: unknown element symbols {unknown[:5]} (known: {', '.join(SYMBOLS)})")
    return [ATOMIC_NUMBER[s] for s in symbols]


def _parse_xyz(text: str, atoms: int, where: str) -> np.ndarray:
    try:
        flat = np.array(text.replace("[", "").replace("]", "").split(","), dtype=np.float64)
    except ValueError:
        raise DataError(f"{where}: not a list of [x,y,z] numbers: {text[:60]!r}") from None
    if flat.size != 3 * atoms or not np.isfinite(flat).all():
        raise DataError(f"{where}: expected {atoms} finite [x,y,z] triples (one per element), got {flat.size} numbers")
    if flat.size and np.abs(flat).max() > MAX_COORDINATE:
        atom = int(np.abs(flat).argmax()) // 3
        raise DataError(f"{where}: atom {atom} lies at {flat[3 * atom:3 * atom + 3].tolist()} Å, beyond the "
                        f"{MAX_COORDINATE:g} Å that any molecule spans")
    return flat.reshape(atoms, 3)


def read_qm9_csv(paths: str | os.PathLike | Sequence[str | os.PathLike], targets: Sequence[str]) -> QM9Table:
    """Parse QM9 CSV files (read in order and concatenated) into a :class:`QM9Table`.

    Only the columns ``Elements``, ``XYZ_Ang`` and those of ``targets`` are read; the
    others may be absent. A missing column, or a row whose elements, coordinates or target
    cannot be parsed, raises :class:`DataError` naming the file, the line and the column.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    specs = [check_target(t) for t in targets]
    zs: list[int] = []
    pos: list[np.ndarray] = []
    counts: list[int] = []
    values: list[list[float]] = []
    for path in paths:
        path = os.fspath(path)
        # utf-8-sig: a byte-order mark (Excel writes one) is not part of the first column's name.
        with open_regular(path, "QM9 CSV file", encoding="utf-8-sig", newline="") as fh:
            size = os.fstat(fh.fileno()).st_size
            check_file_size(path, size, "QM9 CSV file", bytes_per_byte=CSV_BYTES_PER_BYTE)
            reader = csv.reader(fh)
            try:
                # csv's default field limit (131,072 characters) refuses a molecule of a few
                # thousand atoms; no field can be longer than the file.
                with _field_size_limit(size):
                    _read_csv_rows(reader, path, specs, zs, pos, counts, values)
            except csv.Error as e:
                raise DataError(f"QM9 CSV file {path}, line {reader.line_num}: not valid CSV ({e})") from None
    if not counts:
        raise DataError(f"QM9 CSV files {[os.fspath(p) for p in paths]} hold no molecules")
    return QM9Table(
        z=np.asarray(zs, dtype=np.int64), pos=np.concatenate(pos).astype(np.float32),
        offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        values=np.asarray(values, dtype=np.float64).reshape(len(counts), len(specs)), targets=tuple(targets),
    )


#: Bytes each byte of a QM9 CSV costs once parsed: a Python float (about 32 bytes with its
#: list entry) for each coordinate of 8 or more characters, then float64 arrays.
CSV_BYTES_PER_BYTE = 4


@contextlib.contextmanager
def _field_size_limit(size: int) -> Iterator[None]:
    """csv's field limit raised to ``size`` (at least) while reading one file, then restored."""
    old = csv.field_size_limit()
    csv.field_size_limit(max(old, min(size, sys.maxsize)))
    try:
        yield
    finally:
        csv.field_size_limit(old)


def _read_csv_rows(reader: Any, path: str, specs: list[Target], zs: list[int], pos: list[np.ndarray],
                   counts: list[int], values: list[list[float]]) -> None:
    """Append the molecules of one QM9 CSV (``reader`` at its start) to the lists."""
    header = next(reader, None)
    if header is None:
        raise DataError(f"QM9 CSV file {path} is empty (expected a header row)")
    wanted = ["Elements", "XYZ_Ang", *(s.column for s in specs)]
    missing = [c for c in wanted if c not in header]
    if missing:
        raise DataError(f"QM9 CSV file {path} lacks the columns {missing} (it has {header[:8]}{' ...' if len(header) > 8 else ''})")
    cols = [header.index(c) for c in wanted]
    for row in reader:
        if not row:
            continue
        where = f"{path}, line {reader.line_num}"
        if len(row) != len(header):
            raise DataError(f"{where}: {len(row)} fields, the header has {len(header)}")
        z = _parse_elements(row[cols[0]], f"{where}, column 'Elements'")
        xyz = _parse_xyz(row[cols[1]], len(z), f"{where}, column 'XYZ_Ang'")
        vals = []
        for spec, c in zip(specs, cols[2:], strict=True):
            try:
                v = float(row[c])
            except ValueError:
                raise DataError(f"{where}, column {spec.column!r}: not a number: {row[c][:40]!r}") from None
            if not np.isfinite(v):
                raise DataError(f"{where}, column {spec.column!r}: not finite: {row[c]!r}")
            # In the unit the targets are used in, and in float32, which they become.
            vals.append(check_float32(v * spec.scale, f"{where}, column {spec.column!r} (in {spec.unit})"))
        zs.extend(z)
        pos.append(xyz)
        counts.append(len(z))
        values.append(vals)


def read_qm9_xyz(path: str | os.PathLike, targets: Sequence[str]) -> QM9Table:
    """Parse QM9's original xyz files (a folder, one file or a tar archive: see
    :mod:`flt.data.qm9_xyz`) into a :class:`QM9Table`, molecules in the order of their
    index; a malformed file raises :class:`DataError` naming it and the line."""
    specs = {t: check_target(t).scale for t in targets}
    molecules = [parse_xyz_molecule(text, list(targets), where, ATOMIC_NUMBER, specs) for where, text in iter_xyz_texts(path)]
    molecules.sort(key=lambda m: m[0])
    indices = [m[0] for m in molecules]
    if len(set(indices)) != len(indices):
        repeated = sorted({i for i in indices if indices.count(i) > 1})[:5]
        raise DataError(f"QM9 xyz data {path} holds molecule indices more than once: {repeated}")
    counts = [len(m[1]) for m in molecules]
    return QM9Table(
        z=np.asarray([a for m in molecules for a in m[1]], dtype=np.int64),
        pos=np.concatenate([m[2] for m in molecules]).astype(np.float32),
        offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        values=np.asarray([m[3] for m in molecules], dtype=np.float64).reshape(len(molecules), len(specs)),
        targets=tuple(targets),
    )


def read_qm9(path: str | os.PathLike, targets: Sequence[str]) -> QM9Table:
    """QM9 from ``path``: original xyz files (a folder, an ``.xyz`` file, a tar archive) or a CSV."""
    return read_qm9_xyz(path, targets) if is_xyz_source(path) else read_qm9_csv(path, targets)


def qm9pack_folder() -> tuple[str, str]:
    """``(data folder, version)`` of the installed qm9pack, found without importing it
    (its import needs ``pkg_resources`` and pandas, which reading the CSVs does not)."""
    spec = importlib.util.find_spec("qm9pack")
    if spec is None or not spec.submodule_search_locations:
        from flt._extras import install_hint

        raise MissingDataError(f"the QM9 data ships in the qm9pack package, which is not installed: {install_hint('qm9')} "
                               "(or give a CSV of the same columns with --data PATH)")
    folder = os.path.join(next(iter(spec.submodule_search_locations)), "data")
    return folder, importlib.metadata.version("qm9pack")


def qm9pack_cache_path(version: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Where :func:`load_qm9pack` keeps the parsed set of qm9pack ``version``."""
    folder = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(_cache_params(version).encode()).hexdigest()[:12]
    return os.path.join(folder, f"qm9-v{FORMAT_VERSION}-qm9pack{version}-{digest}.npz")


def _cache_params(version: str) -> str:
    return json.dumps({"format_version": FORMAT_VERSION, "qm9pack": version, "targets": list(TARGETS),
                       "units": [t.unit for t in TARGETS.values()]}, sort_keys=True)


def load_qm9pack(cache_dir: str | os.PathLike | None = None) -> QM9Table:
    """Every molecule of the installed qm9pack with all 12 targets, parsed once (about a
    minute) and then read from the ``.npz`` cache (:func:`qm9pack_cache_path`)."""
    folder, version = qm9pack_folder()
    path = qm9pack_cache_path(version, cache_dir)
    params = _cache_params(version)
    if os.path.exists(path):
        return _read_cache(path, params)
    table = read_qm9_csv([os.path.join(folder, p) for p in QM9PACK_PARTS], list(TARGETS))
    arrays: dict[str, Any] = {"params": np.asarray(params), "z": table.z.astype(np.int8), "pos": table.pos, "offsets": table.offsets,
              "values": table.values}
    atomic_write(path, lambda f: np.savez(f, **arrays), binary=True)
    return table


def _read_cache(path: str, params: str) -> QM9Table:
    fix = "delete that file and run again to parse the qm9pack CSVs anew"
    arrays = load_npz(path, "cached QM9 set", fix)
    missing = [k for k in ("params", "z", "pos", "offsets", "values") if k not in arrays]
    if missing:
        raise DataError(f"cached QM9 set {path} lacks arrays {missing}; {fix}")
    if str(arrays["params"]) != params:
        raise DataError(f"cached QM9 set {path} was made with other parameters ({arrays['params']}); {fix}")
    return QM9Table(z=arrays["z"].astype(np.int64), pos=arrays["pos"], offsets=arrays["offsets"], values=arrays["values"],
                    targets=tuple(TARGETS))


def split_qm9(n: int, num_train: int, num_valid: int, num_test: int | None, seed: int) -> tuple[np.ndarray, ...]:
    """``(train, valid, test)`` index arrays of ``n`` molecules from one permutation of
    ``numpy.random.default_rng(seed)``: validation is its first ``num_valid`` entries,
    training the next ``num_train``, test the last ``num_test`` (None: every molecule
    after the training ones). On the full set the defaults give the usual 110,000 /
    10,000 / 10,831 split, and a smaller ``num_train`` (with ``num_test=10831``) trains on
    a subset of those 110,000 and keeps validation and test the same."""
    for name, value in (("num_train", num_train), ("num_valid", num_valid), ("num_test", num_test)):
        if value is None and name == "num_test":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    rest = n - num_valid
    n_test = rest - num_train if num_test is None else num_test
    if num_train + max(n_test, 0) > rest or n_test < 1:
        raise ValueError(f"num_train ({num_train}), num_valid ({num_valid}) and num_test ({num_test}) need more molecules "
                         f"than the {n} the data holds")
    perm = np.random.default_rng(seed).permutation(n)
    return perm[num_valid:num_valid + num_train], perm[:num_valid], perm[n - n_test:]


def fit_atom_references(counts: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-element reference values ``b [E]`` minimising ``|counts @ b - y|^2`` (float64
    least squares; ``counts [M, E]`` atoms of each element, ``y [M]``), so that
    ``y - counts @ b`` is the part of ``y`` that composition alone does not explain."""
    b, *_ = np.linalg.lstsq(counts.astype(np.float64), y.astype(np.float64), rcond=None)
    return b


@dataclass(frozen=True)
class QM9Splits:
    """Training, validation and test molecules of one target (``y`` in its unit, less the
    per-element references ``atom_references`` of ``elements`` when the target has them)."""

    train: MoleculeData
    valid: MoleculeData
    test: MoleculeData
    target: str
    elements: tuple[int, ...]
    atom_references: tuple[float, ...]


def _subset(table: QM9Table, idx: np.ndarray, y: np.ndarray) -> MoleculeData:
    counts = np.diff(table.offsets)[idx]
    starts = table.offsets[:-1][idx]
    atoms = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts, strict=True)])
    return MoleculeData(table.z[atoms], table.pos[atoms], np.concatenate([[0], np.cumsum(counts)]), y[idx], name="qm9")


def load_qm9(path: str | os.PathLike | None = None, *, target: str = "gap", num_train: int = QM9_TRAIN,
             num_valid: int = QM9_VALID, num_test: int | None = None, split_seed: int = 0,
             cache_dir: str | os.PathLike | None = None) -> QM9Splits:
    """The molecules of ``target`` split by :func:`split_qm9`, from ``path`` (a CSV, or
    QM9's original xyz files: :func:`read_qm9`) or (None) the installed qm9pack set. For targets with ``atomref`` the per-element
    references are fitted on the training molecules (:func:`fit_atom_references`) and
    subtracted from every split, in float64 before the targets become float32 (a total
    energy of about 10^7 meV would otherwise keep only about 1 meV of resolution)."""
    spec = check_target(target)
    table = load_qm9pack(cache_dir) if path is None else read_qm9(path, [target])
    train, valid, test = split_qm9(len(table), num_train, num_valid, num_test, split_seed)
    y = table.target(target)
    present = np.unique(table.z)
    counts = table.counts(present)
    in_train = counts[train].sum(axis=0) > 0
    # Elements the training split lacks get no reference: nothing fits one.
    elements = present[in_train]
    refs = np.zeros(len(elements))
    if spec.atomref:
        refs = fit_atom_references(counts[train][:, in_train], y[train])
        y = y - counts[:, in_train] @ refs
    return QM9Splits(_subset(table, train, y), _subset(table, valid, y), _subset(table, test, y), target,
                     tuple(int(e) for e in elements), tuple(float(b) for b in refs))
