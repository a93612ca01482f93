"""Sizes read from files, and the O(N^2) paths and sizes of the library, are checked
against the memory limit (``FLT_MEMORY_LIMIT``) before anything is allocated, and the
refusal names the file or the call and the limit."""

from __future__ import annotations

import io
import os
import pickle
import struct
import tarfile
import time
import zipfile

import numpy as np
import pytest
import torch

from flt._limits import MemoryLimitError
from flt.data.errors import DataError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def limit(monkeypatch):
    def set_limit(text: str) -> None:
        monkeypatch.setenv("FLT_MEMORY_LIMIT", text)
    return set_limit


# -- files ------------------------------------------------------------------------------


def _sparse(path, size: int):
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def test_a_sparse_20_gb_text_file_is_refused_before_it_is_read(tmp_path, limit):
    from flt.data.text import load_text_files

    limit("1G")
    path = _sparse(tmp_path / "big.txt", 20 * 2**30)
    start = time.perf_counter()
    with pytest.raises(MemoryLimitError, match=r"text file .*big.txt \(20 GiB on disk\) needs about .*FLT_MEMORY_LIMIT"):
        load_text_files(path, require_utf8=False)
    assert time.perf_counter() - start < 10  # nothing was read
    (tmp_path / "small.txt").write_bytes(b"abcdefghij" * 100)
    assert len(load_text_files(tmp_path / "small.txt").train) == 900


@pytest.mark.parametrize("loader", ["edges", "listops", "qm9csv", "pyg", "ase"])
def test_every_text_loader_checks_the_file_size_first(tmp_path, limit, loader):
    from flt.data.listops import read_tsv
    from flt.data.qm9 import read_qm9_csv
    from flt.graphs.data import load_edge_list, load_pyg

    limit("10M")
    names = {"edges": "e.txt", "listops": "l.tsv", "qm9csv": "q.csv", "pyg": "g.pt", "ase": "s.xyz"}
    path = _sparse(tmp_path / names[loader], 2**30)
    if loader == "ase":
        pytest.importorskip("ase")
        from flt.data.molecules import load_ase
    call = {"edges": lambda: load_edge_list(path), "listops": lambda: read_tsv(path), "qm9csv": lambda: read_qm9_csv(path, ["mu"]),
            "pyg": lambda: load_pyg(path), "ase": lambda: load_ase(path)}[loader]
    with pytest.raises(MemoryLimitError, match=rf"{names[loader]} \(1 GiB on disk\) needs about .* FLT_MEMORY_LIMIT"):
        call()


def test_a_pickle_declaring_15_gb_is_refused_without_allocating_it(tmp_path):
    from flt.data.images import safe_unpickle

    # Protocol 4: BINBYTES8 with a length of 15 GiB, and 3 bytes behind it.
    path = tmp_path / "big.pkl"
    path.write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 15 * 2**30) + b"abc.")
    with pytest.raises(DataError, match=r"big.pkl is truncated or corrupt: expected 16106127360 bytes in a bytes8, but only 4 remain"):
        safe_unpickle(path)
    # A frame declaring more than the file holds.
    path.write_bytes(b"\x80\x04\x95" + struct.pack("<Q", 2**40) + b"K\x01.")
    with pytest.raises(DataError, match=r"big.pkl is truncated or corrupt: a frame declares 1,099,511,627,776 bytes"):
        safe_unpickle(path)
    path.write_bytes(pickle.dumps({"a": [1, 2, 3]}, protocol=4))
    assert safe_unpickle(path) == {"a": [1, 2, 3]}


def test_cifar_labels_of_shared_nested_references_are_refused_before_numpy_expands_them(tmp_path, limit):
    from flt.data.images import _read_cifar_batch

    limit("1G")
    labels: list = [0]
    for _ in range(30):  # 2^30 labels once expanded, a few hundred bytes of pickle
        labels = [labels, labels]
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": labels}, protocol=2))
    assert os.path.getsize(path) < 7000
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"data_batch_1: 'labels' must be a list of integers, one per image"):
        _read_cifar_batch(str(path), 10)
    assert time.perf_counter() - start < 10
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1, 2, 3]}, protocol=2))
    with pytest.raises(DataError, match=r"2 images but 3 labels"):
        _read_cifar_batch(str(path), 10)


def test_cifar_batches_too_large_for_memory_are_refused_by_their_sizes(tmp_path, limit):
    from flt.data.images import (
        CIFAR10_META,
        CIFAR10_TEST_BATCH,
        CIFAR10_TRAIN_BATCHES,
        load_cifar10,
    )

    (tmp_path / CIFAR10_META).write_bytes(pickle.dumps({b"label_names": [b"a", b"b"]}, protocol=2))
    for name in (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH):
        _sparse(tmp_path / name, 2**30)
    limit("4G")
    with pytest.raises(MemoryLimitError, match=r"CIFAR-10 directory .* \(6 batch files of 6,442,450,944 bytes\) needs about 84 GiB"):
        load_cifar10(tmp_path)


def test_an_xyz_properties_entry_of_a_billion_columns_is_refused_before_ase_reads_it(tmp_path):
    pytest.importorskip("ase")
    from flt.data.molecules import load_ase

    path = tmp_path / "p.xyz"
    path.write_text("1\nProperties=species:S:1:pos:R:1000000000 energy=1.0\nH 0 0 0\n")
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"p.xyz, line 2: frame 0 declares 1,000,000,001 columns per atom line \(Properties=\)"):
        load_ase(path)
    assert time.perf_counter() - start < 30
    path.write_text('1\nProperties="species:S:1:pos:R:3" energy=1.5\nH 0 0 0\n1\nProperties=species:S:1:pos:R:3 energy=2.0\nH 0 0 1\n')
    assert load_ase(path).y.tolist() == [1.5, 2.0]


def test_a_tar_member_is_sized_from_its_header_before_it_is_read(tmp_path, limit):
    from flt.data.qm9 import read_qm9

    limit("1M")
    path = tmp_path / "qm9.tar"
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("big.xyz")
        info.size = 2**20
        tar.addfile(info, io.BytesIO(b" " * 2**20))
    with pytest.raises(MemoryLimitError, match=r"QM9 xyz file .*qm9.tar:big.xyz \(1,048,576 bytes in the archive\) needs"):
        read_qm9(path, ["mu"])


# -- the library ------------------------------------------------------------------------


def test_readme_example_1s_exact_is_refused_under_a_2g_limit(limit):
    from flt import FLTAttention

    layer = FLTAttention(dim=256, heads=4, pos_dim=2, relative="gaussian_mixture", coupling="logit")
    x, pos = torch.randn(8, 1024, 256), torch.rand(8, 1024, 2)
    limit("2G")
    with pytest.raises(MemoryLimitError, match=r"FLTAttention.exact\(\) on 8 sequence\(s\) of N = 1,024 tokens .* needs about "
                                               r"6.\d+ GiB, more than the 2 GiB of FLT_MEMORY_LIMIT; use forward\(\)"):
        layer.exact(x, pos)
    with torch.no_grad(), pytest.raises(MemoryLimitError, match=r"needs about 3.\d+ GiB"):
        layer.exact(x, pos)
    with pytest.raises(MemoryLimitError, match=r"FLTAttention.reference\(\)"):
        layer.reference(x, pos)
    # What fits is computed as before.
    assert layer.exact(x[:1, :64], pos[:1, :64]).shape == (1, 64, 256)


@pytest.mark.parametrize("name", ["softmax", "performer", "toeplitz", "flt"])
def test_exact_on_200000_tokens_is_refused_before_it_allocates(name, limit):
    from flt.layers import ATTENTION

    limit("64G")
    layer = ATTENTION[name](32, 2)
    with pytest.raises(MemoryLimitError, match=r"exact\(\) on 1 sequence\(s\) of N = 200,000 tokens \(40,000,000,000 pairs\)"):
        layer.exact(torch.randn(1, 200_000, 32))


def test_the_exact_estimate_covers_what_exact_forms():
    """The estimate is an upper bound of the largest pairwise tensor exact() forms."""
    from flt import FLTAttention

    layer = FLTAttention(dim=32, heads=4, pos_dim=2)
    B, N = 2, 64
    # The mask f of every pair and head, [B, H, N, N], is one of the tensors it forms.
    assert layer.core.pairwise_values(B, N) >= 4 * B * 4 * N * N + B * N * N * (2 + 5 * 4 * 4)


@pytest.mark.parametrize("dim", [2**40, 2**16])
def test_a_layer_whose_projections_cannot_fit_is_refused_in_its_constructor(dim, limit):
    from flt.layers import ATTENTION

    limit("8G")
    for cls in ATTENTION.values():
        with pytest.raises(MemoryLimitError, match=rf"\(dim={dim}, heads=4\): its projections needs about .*make dim smaller"):
            cls(dim, 4)
    assert ATTENTION["flt"](64, 4) is not None


@pytest.mark.parametrize("cache", ["molecules", "qm9", "listops"])
def test_a_cache_whose_npy_header_declares_more_than_it_holds_is_refused_unread(tmp_path, cache):
    from flt.data import listops, molecules, qm9

    path = tmp_path / "c.npz"
    params, z = io.BytesIO(), io.BytesIO()
    np.save(params, np.asarray("p"))
    np.save(z, np.zeros(4, np.int64))
    # z's header declares 2^40 values (8 TiB) over the 32 bytes of data it holds; the
    # header is padded with spaces to a multiple of 64 bytes, which absorb the longer shape.
    raw = z.getvalue()
    old, new = b"'shape': (4,), }", b"'shape': (1099511627776,), }"
    cut = raw.index(old)
    end = raw.index(b"\n", cut)
    raw = raw[:cut] + new + raw[cut + len(old):end][len(new) - len(old):] + raw[end:]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("params.npy", params.getvalue())
        archive.writestr("z.npy", raw)
    read = {"molecules": lambda: molecules._load_cache(str(path), "p"), "qm9": lambda: qm9._read_cache(str(path), "p"),
            "listops": lambda: listops._cached(str(path), "p", lambda: None)}[cache]
    start_time = time.perf_counter()
    with pytest.raises(DataError, match=r"c.npz is corrupt: its member z.npy declares 8,796,093,022,208 bytes but holds"):
        read()
    assert time.perf_counter() - start_time < 10


def test_a_layer_on_the_meta_device_is_not_refused_by_the_machines_memory(limit):
    from flt import FLTAttention

    limit("1M")
    layer = FLTAttention(2**14, 4, device="meta")
    assert layer.to_qkv.weight.device.type == "meta"


def test_nbody_options_that_overflow_float32_positions_are_refused():
    from flt.data.nbody import generate_clouds

    with pytest.raises(ValueError, match=r"density=1e-300, .* give positions beyond float32's range"):
        generate_clouds(2, 8, seed=0, split="train", density=1e-300)
    assert torch.isfinite(generate_clouds(2, 8, seed=0, split="train").pos).all()


def test_flt_parts_that_cannot_fit_are_refused_before_the_core_allocates(limit):
    from flt import FLTAttention
    from flt.layers.parts import FavorPlus

    limit("8G")
    with pytest.raises(MemoryLimitError, match=r"FLTAttention's parts \(heads=4, pos_dim=1099511627776, .*make these sizes smaller"):
        FLTAttention(64, 4, pos_dim=2**40)
    with pytest.raises(MemoryLimitError, match=r"num_features=68719476736"):
        FLTAttention(64, 4, features=FavorPlus(num_features=2**36))
    assert FLTAttention(64, 4, pos_dim=3).pos_dim == 3


def test_each_mechanism_states_its_own_estimate_over_its_own_options():
    """A mechanism's estimate reads its own options: every size it names in errors is one of
    its flat options (or, ``hidden``, of a spectrum it may build), and a size it does not
    take changes nothing; a larger size it takes raises its estimate."""
    import inspect

    from flt import ATTENTION
    from flt._signatures import constructor_options
    from flt.layers import flat
    from flt.relative.spectra import SPECTRA

    spectrum_options = {name for cls in SPECTRA.values() for name in constructor_options(cls).params}
    for name, cls in ATTENTION.items():
        own = set(constructor_options(cls).params)
        assert own == set(inspect.signature(getattr(flat, name)).parameters) - {"spectrum_options"}
        assert set(cls.size_options) <= own | spectrum_options, name
        base = cls.parameter_values({}, dim=32, heads=4, pos_dim=2)
        assert base > 4 * 32 * 32  # more than the projections
        for size in cls.size_options:
            if size in own and isinstance(constructor_options(cls).params[size].default, int):
                grown = {size: 4 * constructor_options(cls).params[size].default + 64}
                values = (cls.parameter_values(grown, dim=32, heads=4, pos_dim=2),
                          cls.activation_values(grown, batch=2, heads=4, length=600, head_dim=8, training=False))
                assert values != (base, cls.activation_values({}, batch=2, heads=4, length=600, head_dim=8, training=False)), (name, size)
