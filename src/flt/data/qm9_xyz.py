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

from ._files import check_file_memory, check_float32, read_regular, regular_files
from .errors import DataError, require_file
from .molecules import MAX_COORDINATE

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
    values = [check_float32(_number(fields[XYZ_FIELD[t]], f"{where}, line 2, property {t!r}") * scale[t],
                            f"{where}, line 2, property {t!r} (in its target unit)") for t in targets]
    z, pos = [], []
    for k in range(n):
        atom = lines[2 + k].split()
        line = f"{where}, line {3 + k}"
        if len(atom) < 4:
            raise DataError(f"{line}: expected 'ELEMENT x y z [charge]', got {lines[2 + k][:60]!r}")
        if atom[0] not in atomic_number:
            raise DataError(f"{line}: unknown element symbol {atom[0]!r}")
        z.append(atomic_number[atom[0]])
        xyz = [_number(c, line) for c in atom[1:4]]
        if max(map(abs, xyz)) > MAX_COORDINATE:
            raise DataError(f"{line}: the atom lies at {xyz} Å, beyond the {MAX_COORDINATE:g} Å that any molecule spans")
        pos.append(xyz)
    return index, z, np.asarray(pos, dtype=np.float64), values


#: Bytes each byte of an xyz file costs once read and parsed: its text, then a Python
#: float (about 32 bytes) for each number of a few characters.
XYZ_BYTES_PER_BYTE = 10


def _decode(data: bytes, where: str) -> str:
    """UTF-8 text of one file, a byte-order mark dropped (editors on Windows write one)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def iter_xyz_texts(path: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """``(where, text)`` of every ``.xyz`` file in a folder, a tar archive, or the one file at ``path``."""
    if os.path.isdir(path):
        names = regular_files(os.fspath(path), (".xyz",), "QM9 xyz file")
        if not names:
            raise DataError(f"QM9 xyz folder {path} holds no .xyz files")
        for full in names:
            yield full, _decode(read_regular(full, "QM9 xyz file", bytes_per_byte=XYZ_BYTES_PER_BYTE), full)
        return
    path = require_file(path, "QM9 xyz file or archive")
    if os.fspath(path).lower().endswith(".xyz"):
        yield os.fspath(path), _decode(read_regular(path, "QM9 xyz file", bytes_per_byte=XYZ_BYTES_PER_BYTE), path)
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
                where = f"{path}:{member.name}"
                # The size comes from the member's header: checked before it is read.
                check_file_memory(where, member.size * XYZ_BYTES_PER_BYTE, "QM9 xyz file",
                                  detail=f"{member.size:,} bytes in the archive")
                handle = archive.extractfile(member)
                assert handle is not None  # a regular file (member.isfile())
                yield where, _decode(handle.read(), where)
    if not found:
        raise DataError(f"QM9 archive {path} holds no .xyz files")
