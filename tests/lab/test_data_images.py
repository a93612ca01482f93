"""Image data: bundled digits, CIFAR-10 batches (safe unpickling) and image folders."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from flt.data import DataError, MissingDataError, load_cifar10, load_image_folder, safe_unpickle, split_indices


def test_split_indices_disjoint_complete_and_seeded():
    tr, va = split_indices(101, 0.2, seed=5)
    assert len(va) == 20 and len(tr) == 81
    assert np.intersect1d(tr, va).size == 0
    assert np.array_equal(np.sort(np.concatenate([tr, va])), np.arange(101))
    tr2, va2 = split_indices(101, 0.2, seed=5)
    assert np.array_equal(tr, tr2) and np.array_equal(va, va2)
    assert not np.array_equal(va, split_indices(101, 0.2, seed=6)[1])
    with pytest.raises(ValueError):
        split_indices(1, 0.5, 0)
    with pytest.raises(ValueError):
        split_indices(10, 1.0, 0)


def test_digits_split_shapes_and_normalisation():
    pytest.importorskip("sklearn")
    from flt.data import load_digits

    s = load_digits()
    assert (len(s.train), len(s.valid)) == (1438, 359)
    assert s.train.images.shape == (1438, 1, 8, 8) and s.train.images.dtype == torch.float32
    assert s.train.labels.dtype == torch.int64 and s.train.num_classes == 10
    assert set(s.train.labels.tolist()) == set(range(10))
    # Standardised with train statistics: train is centred and scaled, valid roughly so.
    assert abs(float(s.train.images.mean())) < 1e-5 and abs(float(s.train.images.std()) - 1) < 1e-3
    # Undoing the standardisation gives back grey levels k / 16.
    raw = s.valid.images * s.std + s.mean
    assert torch.allclose(raw * 16, (raw * 16).round(), atol=1e-4)
    again = load_digits()
    assert torch.equal(again.train.images, s.train.images) and torch.equal(again.valid.labels, s.valid.labels)
    # The two splits are the dataset's images, with no image in both.
    from sklearn.datasets import load_digits as sk_load

    flat = sk_load().images.reshape(1797, -1)
    tr, va = split_indices(1797, 0.2, 0)
    assert np.allclose((s.train.images * s.std + s.mean).reshape(1438, -1).numpy() * 16, flat[tr], atol=1e-4)
    assert np.intersect1d(tr, va).size == 0


def _cifar_dir(tmp_path, protocol=2, sizes=(4, 3, 2, 4, 3), n_test=5):
    """A miniature CIFAR-10 python directory in the real layout; returns (root, images, labels)."""
    rng = np.random.default_rng(0)
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({b"num_cases_per_batch": 10000, b"label_names": names, b"num_vis": 3072}, f, protocol=protocol)
    all_x, all_y = [], []
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name, n in zip(files, list(sizes) + [n_test]):
        x = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, size=n)]
        batch = {b"batch_label": name.encode(), b"labels": y, b"data": x,
                 b"filenames": [f"img{i}.png".encode() for i in range(n)]}
        with open(root / name, "wb") as f:
            pickle.dump(batch, f, protocol=protocol)
        all_x.append(x)
        all_y.append(y)
    return root, all_x, all_y


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_fake_batches(tmp_path, protocol):
    root, xs, ys = _cifar_dir(tmp_path, protocol=protocol)
    s = load_cifar10(root)
    assert s.train.images.shape == (16, 3, 32, 32) and s.valid.images.shape == (5, 3, 32, 32)
    assert s.train.class_names[:3] == ("airplane", "automobile", "bird") and s.train.num_classes == 10
    assert s.train.labels.tolist() == sum(ys[:5], []) and s.valid.labels.tolist() == ys[5]
    raw = (s.train.images * s.std.view(1, 3, 1, 1) + s.mean.view(1, 3, 1, 1)) * 255
    expected = np.concatenate(xs[:5]).reshape(16, 3, 32, 32).astype(np.float32)
    assert np.allclose(raw.numpy(), expected, atol=1e-3)
    # The folder that contains cifar-10-batches-py is accepted too.
    assert torch.equal(load_cifar10(tmp_path).valid.images, s.valid.images)


class _RunsShell:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_rejected_without_running(tmp_path):
    marker = tmp_path / "pwned"
    root, _, _ = _cifar_dir(tmp_path)
    evil = {b"data": np.zeros((1, 3072), np.uint8), b"labels": [0], b"x": _RunsShell(marker)}
    with open(root / "data_batch_3", "wb") as f:
        pickle.dump(evil, f, protocol=2)
    with pytest.raises(DataError, match="data_batch_3.*system"):
        load_cifar10(root)
    with pytest.raises(DataError, match="system"):
        safe_unpickle(root / "data_batch_3")
    assert not marker.exists()
    # Sanity check that the payload is live: plain pickle.load would have run it.
    with open(root / "data_batch_3", "rb") as f:
        pickle.load(f, encoding="bytes")
    assert marker.exists()


def test_object_arrays_are_rejected(tmp_path):
    path = tmp_path / "obj.pkl"
    with open(path, "wb") as f:
        pickle.dump({"a": np.array([1, "x"], dtype=object)}, f)
    with pytest.raises(DataError, match="obj.pkl"):
        safe_unpickle(path)


def test_safe_unpickle_plain_data(tmp_path):
    path = tmp_path / "ok.pkl"
    value = {"a": [1, 2.5, "s", b"b"], "arr": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int64(3)}
    with open(path, "wb") as f:
        pickle.dump(value, f, protocol=2)
    out = safe_unpickle(path)
    assert out["a"] == [1, 2.5, "s", b"b"] and out["n"] == 3
    assert np.array_equal(out["arr"], value["arr"]) and out["arr"].dtype == np.float32


def _rewrite(path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda r: os.remove(r / "data_batch_4"), "data_batch_4"),
        (lambda r: os.remove(r / "batches.meta"), "batches.meta"),
        (lambda r: (r / "data_batch_2").write_bytes((r / "data_batch_2").read_bytes()[:500]), "data_batch_2.*truncated"),
        (lambda r: (r / "test_batch").write_bytes(b"\x80\x02garbage that is not a pickle"), "test_batch"),
        (lambda r: _rewrite(r / "data_batch_1", {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}), "data_batch_1.*3072"),
        (lambda r: _rewrite(r / "data_batch_1", {b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}), "data_batch_1.*uint8"),
        (lambda r: _rewrite(r / "data_batch_5", {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}), "data_batch_5.*labels"),
        (lambda r: _rewrite(r / "data_batch_5", {b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]}), "data_batch_5.*labels"),
        (lambda r: _rewrite(r / "data_batch_5", {b"data": np.zeros((1, 3072), np.uint8), b"labels": [1.5]}), "data_batch_5.*labels"),
        (lambda r: _rewrite(r / "data_batch_5", {b"labels": [1]}), "data_batch_5.*'data'"),
        (lambda r: _rewrite(r / "data_batch_5", [1, 2, 3]), "data_batch_5.*dict"),
        (lambda r: _rewrite(r / "batches.meta", {b"label_names": []}), "batches.meta"),
    ],
)
def test_cifar10_bad_inputs_name_the_file(tmp_path, damage, match):
    root, _, _ = _cifar_dir(tmp_path)
    damage(root)
    with pytest.raises(DataError, match=match):
        load_cifar10(root)


def test_cifar10_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_cifar10(tmp_path / "nowhere")


def _png(path, array):
    from PIL import Image

    Image.fromarray(array).save(path)


def _image_folder(root, classes=("cat", "dog"), per_class=3, hw=(5, 4)):
    rng = np.random.default_rng(1)
    arrays = {}
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            arr = rng.integers(0, 256, size=(*hw, 3), dtype=np.uint8)
            _png(root / c / f"{i}.png", arr)
            arrays[(c, i)] = arr
    return arrays


def test_image_folder_loads_and_splits(tmp_path):
    pytest.importorskip("PIL")
    arrays = _image_folder(tmp_path / "train")
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image, ignored")
    s = load_image_folder(tmp_path / "train", valid_fraction=1 / 3, seed=0)
    assert s.train.class_names == ("cat", "dog")
    assert (len(s.train), len(s.valid)) == (4, 2)
    assert s.train.images.shape == (4, 3, 5, 4) and s.train.labels.dtype == torch.int64
    # Pixels survive: undo the standardisation and compare with the written PNGs.
    every = torch.cat([s.train.images, s.valid.images]) * s.std.view(1, 3, 1, 1) + s.mean.view(1, 3, 1, 1)
    tr, va = split_indices(6, 1 / 3, 0)
    order = [("cat", 0), ("cat", 1), ("cat", 2), ("dog", 0), ("dog", 1), ("dog", 2)]
    expected = np.stack([arrays[order[i]].transpose(2, 0, 1) for i in np.concatenate([tr, va])]) / 255
    assert np.allclose(every.numpy(), expected, atol=1e-5)
    assert torch.equal(torch.cat([s.train.labels, s.valid.labels]), torch.tensor([order[i][0] == "dog" for i in np.concatenate([tr, va])]).long())


def test_image_folder_valid_dir_grey_and_resize(tmp_path):
    pytest.importorskip("PIL")
    _image_folder(tmp_path / "train")
    _image_folder(tmp_path / "val", classes=("dog",), per_class=2)
    s = load_image_folder(tmp_path / "train", tmp_path / "val", channels=1, size=(8, 6))
    assert s.train.images.shape == (6, 1, 8, 6) and s.valid.images.shape == (2, 1, 8, 6)
    assert s.valid.labels.tolist() == [1, 1]


def test_image_folder_bad_inputs_name_the_path(tmp_path):
    pytest.importorskip("PIL")
    with pytest.raises(MissingDataError, match="missing"):
        load_image_folder(tmp_path / "missing")
    (tmp_path / "flat").mkdir()
    with pytest.raises(DataError, match="flat.*no class"):
        load_image_folder(tmp_path / "flat")

    _image_folder(tmp_path / "a")
    (tmp_path / "a" / "empty_class").mkdir()
    with pytest.raises(DataError, match="empty_class"):
        load_image_folder(tmp_path / "a")

    _image_folder(tmp_path / "b")
    (tmp_path / "b" / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not really a png")
    with pytest.raises(DataError, match="broken.png"):
        load_image_folder(tmp_path / "b")

    _image_folder(tmp_path / "c")
    good = (tmp_path / "c" / "dog" / "0.png").read_bytes()
    (tmp_path / "c" / "dog" / "truncated.png").write_bytes(good[: len(good) // 2])
    with pytest.raises(DataError, match="truncated.png"):
        load_image_folder(tmp_path / "c")

    _image_folder(tmp_path / "d")
    _png(tmp_path / "d" / "dog" / "big.png", np.zeros((7, 7, 3), np.uint8))
    with pytest.raises(DataError, match="big.png.*size"):
        load_image_folder(tmp_path / "d")
    assert load_image_folder(tmp_path / "d", size=(5, 4)).train.images.shape[1:] == (3, 5, 4)

    _image_folder(tmp_path / "e_train")
    _image_folder(tmp_path / "e_val", classes=("cow",), per_class=1)
    with pytest.raises(DataError, match="cow"):
        load_image_folder(tmp_path / "e_train", tmp_path / "e_val")
