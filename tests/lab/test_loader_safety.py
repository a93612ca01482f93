"""Data loaders open regular files only, keep the numbers they read within float32, and
report a malformed file as one line that names it (never a hang or a traceback)."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import sys

import numpy as np
import pytest
import torch

from flt.data.errors import DataError

pytestmark = pytest.mark.usefixtures("one_thread")

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")


@contextlib.contextmanager
def deadline(seconds: int = 20):
    """Fail instead of hanging: before the fix, opening a FIFO blocked forever."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s (blocked on a FIFO?)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _image_folder(root, n: int = 3):
    Image = pytest.importorskip("PIL.Image")
    for c in ("a", "b"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("RGB", (4, 4), (i * 40, 0, 0)).save(root / c / f"{i}.png")
    return root


# -- regular files only, wherever a loader lists a folder ------------------------------


@needs_fifo
def test_a_fifo_named_like_an_image_is_refused_by_name_not_opened(tmp_path):
    from flt.data.images import load_image_folder

    root = _image_folder(tmp_path / "img")
    os.mkfifo(root / "a" / "zz.png")
    with deadline(), pytest.raises(DataError, match=r"zz.png is a FIFO \(named pipe\), not a regular file"):
        load_image_folder(root)


def test_a_directory_named_like_an_image_is_refused_by_name(tmp_path):
    from flt.data.images import load_image_folder

    root = _image_folder(tmp_path / "img")
    (root / "b" / "more.PNG").mkdir()
    with pytest.raises(DataError, match=r"more.PNG is a directory, not a regular file"):
        load_image_folder(root)
    (root / "b" / "more.PNG").rmdir()
    assert len(load_image_folder(root).train) + len(load_image_folder(root).valid) == 6


@needs_fifo
def test_a_fifo_in_a_qm9_xyz_folder_or_a_source_tree_is_refused(tmp_path):
    from flt.data.pysource import load_python_source
    from flt.data.qm9 import read_qm9

    (tmp_path / "xyz").mkdir()
    os.mkfifo(tmp_path / "xyz" / "a.xyz")
    with deadline(), pytest.raises(DataError, match=r"a.xyz is a FIFO"):
        read_qm9(tmp_path / "xyz", ["gap"])
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    for i in range(30):
        (src / f"m{i}.py").write_text("x = 1\n" * 20)
    os.mkfifo(src / "pkg" / "zz.py")
    with deadline(), pytest.raises(DataError, match=r"pkg/zz.py is a FIFO"):
        load_python_source(root=src)


@needs_fifo
@pytest.mark.parametrize("loader", ["text", "listops", "edges", "pyg", "ase", "pickle", "qm9csv"])
def test_every_file_loader_refuses_a_fifo_given_as_its_file(tmp_path, loader):
    path = tmp_path / {"listops": "basic_train.tsv", "pyg": "g.pt", "ase": "s.xyz", "qm9csv": "q.csv"}.get(loader, "f")
    os.mkfifo(path)
    from flt.data.images import safe_unpickle
    from flt.data.listops import read_tsv
    from flt.data.qm9 import read_qm9_csv
    from flt.data.text import load_text_files
    from flt.graphs.data import load_edge_list, load_pyg

    call = {"text": lambda: load_text_files(path), "listops": lambda: read_tsv(path), "edges": lambda: load_edge_list(path),
            "pyg": lambda: load_pyg(path), "pickle": lambda: safe_unpickle(path), "qm9csv": lambda: read_qm9_csv(path, ["mu"]),
            "ase": lambda: __import__("flt.data.molecules", fromlist=["load_ase"]).load_ase(path)}[loader]
    if loader == "ase":
        pytest.importorskip("ase")
    with deadline(), pytest.raises(DataError, match=r"not a regular file"):
        call()


@needs_fifo
def test_a_fifo_in_a_listops_folder_is_named_as_a_fifo(tmp_path):
    from flt.data.listops import load_listops_tsv

    (tmp_path / "basic_train.tsv").write_text("Source\tTarget\n[MIN 3 4 ]\t3\n")
    os.mkfifo(tmp_path / "basic_val.tsv")
    with deadline(), pytest.raises(DataError, match=r"basic_val.tsv is a FIFO \(named pipe\), not a regular file"):
        load_listops_tsv(tmp_path)


@pytest.mark.cli
@needs_fifo
def test_flt_train_on_an_image_folder_with_a_fifo_exits_2_with_one_line(tmp_path, isolated_cli, capsys):
    from flt.cli import main

    root = _image_folder(tmp_path / "img", n=4)
    os.mkfifo(root / "b" / "trap.jpg")
    with deadline(120):
        code = main(["train", "image", "--preset", "smoke", "--no-progress", "--threads", "1", "--data", str(root),
                     "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "trap.jpg is a FIFO" in err


# -- numbers within float32, the precision they are used in ----------------------------


def _qm9_rows(n: int = 6):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_qm9 import _molecules

    return _molecules(n)


def _write_csv(path, rows, header=None):
    from test_qm9 import HEADER

    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=header or HEADER, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return str(path)


@pytest.mark.parametrize("column,value,target,match", [
    ("Dipole_debye", "1e308", "mu", r"line 4, column 'Dipole_debye' \(in D\): 1e\+308 does not fit float32"),
    ("Dipole_debye", "-3.5e38", "mu", r"line 4, column 'Dipole_debye' \(in D\): -3.5e\+38 does not fit float32"),
    # Finite in float64 in hartree, beyond float32 once in meV (times 27211).
    ("HOMO_LUMO_gap_au", "1e35", "gap", r"line 4, column 'HOMO_LUMO_gap_au' \(in meV\): 2.72114e\+39 does not fit float32"),
])
def test_a_qm9_csv_target_beyond_float32_names_file_line_and_column(tmp_path, column, value, target, match):
    from flt.data.qm9 import read_qm9_csv

    rows = _qm9_rows()
    rows[2][column] = value
    with pytest.raises(DataError, match=r"q.csv, " + match):
        read_qm9_csv(_write_csv(tmp_path / "q.csv", rows), [target])


def test_qm9_coordinates_of_1e300_are_refused_naming_the_file(tmp_path):
    from flt.data.qm9 import read_qm9, read_qm9_csv

    rows = _qm9_rows()
    xyz = rows[2]["XYZ_Ang"]
    rows[2]["XYZ_Ang"] = "[[1e300" + xyz[xyz.index(","):]
    with pytest.raises(DataError, match=r"q.csv, line 4, column 'XYZ_Ang': atom 0 lies at \[1e\+300"):
        read_qm9_csv(_write_csv(tmp_path / "q.csv", rows), ["mu"])
    (tmp_path / "x").mkdir()
    props = " ".join(["1.0"] * 15)
    (tmp_path / "x" / "a.xyz").write_text(f"2\ngdb 1 {props}\nC 0 0 0 0\nH 0 1e300 0 0\n1 2\nC\nInChI\n")
    with pytest.raises(DataError, match=r"a.xyz, line 4: the atom lies at \[0.0, 1e\+300, 0.0\]"):
        read_qm9(tmp_path / "x", ["mu"])
    (tmp_path / "x" / "a.xyz").write_text(f"2\ngdb 1 {props.replace('1.0', '1e308')}\nC 0 0 0 0\nH 0 1 0 0\n1 2\nC\nInChI\n")
    with pytest.raises(DataError, match=r"a.xyz, line 2, property 'mu' \(in its target unit\): 1e\+308 does not fit float32"):
        read_qm9(tmp_path / "x", ["mu"])


@pytest.mark.parametrize("energy", ["1e300", "-1e39"])
def test_an_ase_energy_beyond_float32_is_refused_naming_the_file(tmp_path, energy):
    pytest.importorskip("ase")
    from flt.data.molecules import load_ase

    path = tmp_path / "e.xyz"
    path.write_text(f"2\nenergy=1.0\nH 0 0 0\nH 0 0 0.7\n2\nenergy={energy}\nH 0 0 0\nH 0 0 0.7\n")
    with pytest.raises(DataError, match=rf"e.xyz: structure 1 property 'energy': {float(energy):g}".replace("+", r"\+")):
        load_ase(path)


def test_molecule_data_refuses_values_that_overflow_float32():
    from flt.data.molecules import MoleculeData

    with pytest.raises(ValueError, match=r"molecule data m.xyz: structure 1 has targets that are not finite in float32"):
        MoleculeData.from_lists([[1], [1, 1]], [[[0, 0, 0]], [[0, 0, 0], [0, 0, 1]]], [1.0, 1e300], name="m.xyz")
    with pytest.raises(ValueError, match=r"structure 1 has positions that are not finite in float32"):
        MoleculeData.from_lists([[1], [1, 1]], [[[0, 0, 0]], [[0, 0, 0], [0, 0, 1e300]]], [1.0, 2.0], name="m.xyz")


@pytest.mark.cli
def test_a_qm9_target_of_1e308_no_longer_trains_to_an_infinite_mae(tmp_path, isolated_cli, capsys):
    from flt.cli import main

    rows = _qm9_rows(40)
    rows[5]["Dipole_debye"] = "1e308"
    path = _write_csv(tmp_path / "q.csv", rows)
    code = main(["train", "qm9", "--preset", "smoke", "--no-progress", "--threads", "1", "--data", path,
                 "--data-opt", "target=mu", "--data-opt", "num_train=20", "--data-opt", "num_valid=8",
                 "--data-opt", "num_test=8", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "q.csv, line 7, column 'Dipole_debye'" in err and "does not fit float32" in err
    assert not (tmp_path / "run" / "summary.json").exists()


# -- encodings and parsers --------------------------------------------------------------


BOM = b"\xef\xbb\xbf"


def test_a_byte_order_mark_is_accepted_by_every_text_loader(tmp_path):
    from flt.data.listops import read_tsv
    from flt.data.qm9 import read_qm9, read_qm9_csv
    from flt.graphs.data import load_edge_list

    # Elements first: with a BOM the first column's name was '\ufeffElements', not found.
    header = ["Elements", "XYZ_Ang", "Dipole_debye"]
    path = _write_csv(tmp_path / "q.csv", _qm9_rows(), header)
    plain = read_qm9_csv(path, ["mu"])
    (tmp_path / "q.csv").write_bytes(BOM + (tmp_path / "q.csv").read_bytes())
    np.testing.assert_array_equal(read_qm9_csv(path, ["mu"]).values, plain.values)
    (tmp_path / "l.tsv").write_bytes(BOM + b"Source\tTarget\n( ( [MAX 1 2 ) ] )\t2\n")
    assert read_tsv(tmp_path / "l.tsv").labels.tolist() == [2]
    (tmp_path / "e.txt").write_bytes(BOM + b"0 1\n1 2\n")
    assert load_edge_list(tmp_path / "e.txt").num_edges == 2
    (tmp_path / "x").mkdir()
    props = " ".join(["1.0"] * 15)
    (tmp_path / "x" / "a.xyz").write_bytes(BOM + f"2\ngdb 1 {props}\nC 0 0 0 0\nH 0 1 0 0\n1 2\nC\nInChI\n".encode())
    assert len(read_qm9(tmp_path / "x", ["mu"])) == 1


def test_a_csv_field_longer_than_csvs_default_limit_is_read(tmp_path):
    from flt.data.qm9 import read_qm9_csv

    rows = _qm9_rows()
    rows[1]["XYZ_file"] = "x" * 200_000  # a column not read, longer than csv's 131,072
    table = read_qm9_csv(_write_csv(tmp_path / "q.csv", rows), ["mu"])
    assert len(table) == 6
    assert csv.field_size_limit() == 131_072  # restored


@pytest.mark.parametrize("text", ["CRYSTAL\n", "ATOMS\n", "ANIMSTEPS 2\nATOMS 1\nH 0 0 0\n", "PRIMCOORD\n1 1\nH 0 0 0\n",
                                  "BEGIN_BLOCK_DATAGRID_3D\n"])
def test_a_malformed_xsf_file_is_one_data_error_naming_it(tmp_path, text):
    pytest.importorskip("ase")
    from flt.data.molecules import load_ase

    path = tmp_path / "bad.xsf"
    path.write_text(text)
    with pytest.raises(DataError, match=r"cannot read structure file .*bad.xsf: \w+") as info:
        load_ase(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("make", [
    lambda: torch.tensor([[0, 1], [1, 2]], dtype=torch.complex64),
    lambda: torch.tensor([[0, 1], [1, 2]]).to_sparse(),
])
def test_a_complex_or_sparse_edge_index_is_refused_naming_the_file(tmp_path, make):
    from flt.graphs.data import Graph, canonical_edges, load_pyg

    path = tmp_path / "g.pt"
    torch.save({"edge_index": make()}, path)
    with pytest.raises(DataError, match=r"g.pt: edge_index must be"):
        load_pyg(path)
    with pytest.raises(TypeError, match=r"edges must"):
        canonical_edges(make().T if make().layout == torch.strided else make(), 3)
    with pytest.raises(ValueError, match=r"labels must be an integer tensor"):
        Graph(3, torch.tensor([[0, 1]]), labels=torch.zeros(3, dtype=torch.complex64))


@pytest.mark.parametrize("source,problem", [
    ("[MAX 1 2 ] ]", r"token 5 \(']'\) comes after the end of the expression"),
    ("[MAX 1 [MIN 2 3", r"2 operation\(s\) left open"),
    ("] [MAX 1 2 ]", r"token 1 is a '\]' that closes no operation"),
    ("1 [MAX 1 2 ]", r"token 1 \('1'\) lies outside any operation"),
])
def test_listops_rows_with_unbalanced_brackets_are_refused_with_file_and_line(tmp_path, source, problem):
    from flt.data.listops import read_tsv

    path = tmp_path / "l.tsv"
    path.write_text(f"Source\tTarget\n[MIN 3 4 ]\t3\n{source}\t2\n")
    with pytest.raises(DataError, match=rf"l.tsv:3: the source expression is not well formed: {problem}"):
        read_tsv(path)
    path.write_text("Source\tTarget\n[MIN 3 4 ]\t3\n7\t7\n")
    assert read_tsv(path).labels.tolist() == [3, 7]


def test_an_array_target_is_named_on_one_line(tmp_path):
    pytest.importorskip("ase")
    from flt.data.molecules import load_ase

    path = tmp_path / "a.xyz"
    path.write_text('2\nenergy="1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"\nH 0 0 0\nH 0 0 0.7\n')
    with pytest.raises(DataError, match=r"a.xyz: structure 0 property 'energy' must be one finite number") as info:
        load_ase(path)
    assert "\n" not in str(info.value)


def test_a_tensor_given_as_a_size_is_quoted_on_one_line():
    from flt import ATTENTION, FLTAttention

    big = torch.arange(40).reshape(4, 10)
    for cls in ATTENTION.values():
        with pytest.raises(ValueError, match=r"dim must be a positive integer, got tensor\(\[\[ 0, 1, 2,.*\.\.\.$") as info:
            cls(big, 2)
        assert "\n" not in str(info.value)
    for option in ("num_features", "coupling", "chunk_size"):
        with pytest.raises(TypeError, match=rf"option '{option}' must be .*, got tensor\(\[\[") as info:
            FLTAttention.from_options(64, 4, **{option: big})
        assert "\n" not in str(info.value)
