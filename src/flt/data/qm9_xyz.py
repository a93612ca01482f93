"""QM9 in its original form: one extended-xyz file per molecule (``dsgdb9nsd_000001.xyz``
...), as a folder, a single file or a ``.tar`` / ``.tar.bz2`` archive of them, read without
extracting anything.

Each file holds, line by line: the atom count ``n``; ``gdb INDEX`` followed by the 15
properties (rotational constants A, B, C, then mu, alpha, homo, lumo, gap, <R^2>, zpve, U0,
U, H, G, Cv, in hartree, Debye, a0^3, a0^2 and cal/(mol K)); ``n`` atom lines (element,
x, y, z in Angstrom, Mulliken charge); then frequencies, SMILES and InChI, which are not
read. Numbers may be written in Mathematica's ``1.5*^-6`` form. Molecules come out in the
order of their index, so a split by :func:`flt.data.qm9.split_qm9` does not depend on the
order the files were listed in.

Every file given is read: the 3,054 molecules that QM9's authors flag as failing their
geometry consistency check (excluded from the qm9pack set's 130,831) are only left out if
they are not among the files.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator, Sequence

import numpy as np

from .errors import DataError, require_file

#: Position of each target's value among the whitespace-separated fields of line 2
#: (``gdb``, the index, A, B, C, then the targets in this order).
XYZ_FIELD = {"mu": 5, "alpha": 6, "homo": 7, "lumo": 8, "gap": 9, "r2": 10, "zpve": 11,
             "U0": 12, "U": 13, "H": 14, "G": 15, "Cv": 16}


def is_xyz_source(path: str | os.PathLike) -> bool:
    """Whether ``path`` names xyz data (a folder, an ``.xyz`` file or a tar archive) rather than a CSV."""
    name = os.fspath(path).lower()
    return os.path.isdir(path) or name.endswith((".xyz", ".tar", ".tar.bz2", ".tbz2", ".tar.gz", ".tgz"))


def _number(text: str, where: str) -> float:
    try:
        value = float(text.replace("*^", "e"))
    except ValueError:
        raise DataError(f"{where}: not a number: {text[:40]!r}") from None
    if not np.isfinite(value):
        raise DataError(f"{where}: not finite: {text!r}")
    return value


def parse_xyz_molecule(text: str, targets: Sequence[str], where: str, atomic_number: dict[str, int],
                       scale: dict[str, float]) -> tuple[int, list[int], np.ndarray, list[float]]:
    """``(index, atomic numbers, positions [n, 3], target values)`` of one QM9 xyz file's text;
    a malformed line raises :class:`DataError` naming ``where`` and the line."""
    lines = text.splitlines()
    if len(lines) < 3:
        raise DataError(f"{where}: {len(lines)} lines; a QM9 xyz file has the atom count, the properties and the atoms")
    try:
        n = int(lines[0].strip())
    except ValueError:
        raise DataError(f"{where}, line 1: expected the atom count, got {lines[0][:40]!r}") from None
    if n < 1 or len(lines) < n + 2:
        raise DataError(f"{where}, line 1: {n} atoms, but the file has {len(lines) - 2} lines after the properties")
    fields = lines[1].split()
    if len(fields) < 17 or fields[0] != "gdb":
        raise DataError(f"{where}, line 2: expected 'gdb INDEX' and 15 properties, got {lines[1][:60]!r}")
    index = int(_number(fields[1], f"{where}, line 2, the index"))
    values = [_number(fields[XYZ_FIELD[t]], f"{where}, line 2, property {t!r}") * scale[t] for t in targets]
    z, pos = [], []
    for k in range(n):
        atom = lines[2 + k].split()
        line = f"{where}, line {3 + k}"
        if len(atom) < 4:
            raise DataError(f"{line}: expected 'ELEMENT x y z [charge]', got {lines[2 + k][:60]!r}")
        if atom[0] not in atomic_number:
            raise DataError(f"{line}: unknown element symbol {atom[0]!r}")
        z.append(atomic_number[atom[0]])
        pos.append([_number(c, line) for c in atom[1:4]])
    return index, z, np.asarray(pos, dtype=np.float64), values


def iter_xyz_texts(path: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """``(where, text)`` of every ``.xyz`` file in a folder, a tar archive, or the one file at ``path``."""
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(".xyz"))
        if not names:
            raise DataError(f"QM9 xyz folder {path} holds no .xyz files")
        for name in names:
            full = os.path.join(path, name)
            with open(full, encoding="utf-8") as fh:
                yield full, fh.read()
        return
    path = require_file(path, "QM9 xyz file or archive")
    if os.fspath(path).lower().endswith(".xyz"):
        with open(path, encoding="utf-8") as fh:
            yield os.fspath(path), fh.read()
        return
    try:
        archive = tarfile.open(path, "r:*")  # noqa: SIM115 (closed by the `with archive` below; opened apart so only its errors read as "not an archive")
    except (tarfile.TarError, OSError) as exc:
        raise DataError(f"QM9 archive {path} cannot be read as a tar archive: {exc}") from None
    found = False
    with archive:
        for member in archive:
            if member.isfile() and member.name.endswith(".xyz"):
                found = True
                handle = archive.extractfile(member)
                assert handle is not None  # a regular file (member.isfile())
                yield f"{path}:{member.name}", handle.read().decode("utf-8")
    if not found:
        raise DataError(f"QM9 archive {path} holds no .xyz files")
